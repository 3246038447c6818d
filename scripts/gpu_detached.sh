#!/usr/bin/env bash
# A command on the GPU machine that outlives the device call (each call is at most 10 minutes), waited for by later
# calls: the machine stays warm between back-to-back calls, so one long job (e.g. several heads trained one after
# the other) spans several calls without a restart.
#   bash scripts/gpu_detached.sh start NAME CMD [ARG...]   # starts CMD in its own session unless NAME still runs
#   bash scripts/gpu_detached.sh wait NAME [SECONDS]       # until NAME ends or SECONDS (default 500) pass; prints
#                                                           # the tail of its log (TAIL lines, default 15)
# State in $WORK (default /root/spd_work): NAME.pid, NAME.log, NAME.rc (CMD's exit status once it has ended).
# Results come back with scripts/gpu_collect.sh (what is new since the last call, within a call's file limits).
# The job runs in the directory it was started from: start it from a copy of the tree (cp -r . /root/spd_repo) if
# the next calls may carry a changed tree. Exit status: 0, or 2 for a usage error; `wait` says whether NAME ended.
set -uo pipefail
WORK=${WORK:-/root/spd_work}
op=${1:-}; name=${2:-}
usage="usage: gpu_detached.sh start NAME CMD [ARG...] | wait NAME [SECONDS]"
[[ -n "$op" && -n "$name" ]] || { echo "$usage" >&2; exit 2; }
[[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "gpu_detached.sh: NAME must be letters, digits, '_', '.', '-'" >&2; exit 2; }
mkdir -p "$WORK"
pidf="$WORK/$name.pid" rcf="$WORK/$name.rc" logf="$WORK/$name.log"
alive() {  # the job's wrapper is running (not a zombie) and has not written the exit status
  local pid; [[ -f "$pidf" && ! -f "$rcf" ]] || return 1
  pid=$(cat "$pidf"); kill -0 "$pid" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]]
}
case "$op" in
  start)
    shift 2
    [[ $# -gt 0 ]] || { echo "$usage" >&2; exit 2; }
    if alive; then echo "$name is still running (pid $(cat "$pidf")): not started again"; exit 0; fi
    rm -f "$rcf"
    # the exit status is written through a temporary name so that `wait` never reads a half-written file
    setsid nohup bash -c '"$@"; echo $? > "$0.tmp" && mv "$0.tmp" "$0"' "$rcf" "$@" > "$logf" 2>&1 < /dev/null &
    pid=$!; echo "$pid" > "$pidf"
    # return only once the job leads its own session: a caller killed right after cannot take it along
    for _ in $(seq 100); do [[ "$(awk '{print $6}' "/proc/$pid/stat" 2>/dev/null)" = "$pid" ]] && break; sleep 0.05; done
    echo "$name started (pid $pid, log $logf)" ;;
  wait)
    [[ "${3:-500}" =~ ^[0-9]+$ ]] || { echo "gpu_detached.sh: SECONDS must be a whole number, got '$3'" >&2; exit 2; }
    t0=$SECONDS
    while alive && (( SECONDS - t0 < ${3:-500} )); do sleep 2; done
    tail -n "${TAIL:-15}" "$logf" 2>/dev/null
    if alive; then echo "$name is still running after ${3:-500} s: wait again"
    elif [[ -f "$rcf" ]]; then echo "$name ended: exit $(cat "$rcf")"
    else echo "$name is not running and left no exit status (never started here, or killed)"; fi ;;
  *) echo "$usage" >&2; exit 2 ;;
esac
