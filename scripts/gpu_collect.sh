#!/usr/bin/env bash
# Bring back what a detached job on the GPU machine has written since the last call, within what one device call
# returns (at most 8 files, 16 MiB each, 64 MiB in all; more are silently left behind there): the new or changed
# files under DIR that match the patterns go into one gzip'd tar, split into parts of at most 15 MB
# ($OUT/collect_<N>.tgz.part-NN), with their list in $OUT/collect_<N>.txt.
#   OUT=$OUT bash scripts/gpu_collect.sh DIR [PATTERN...]   # PATTERN: relative to DIR, as `find -path` matches it,
#                                                            # e.g. 'heads/*/best_head/*' 'out_*/log.txt' (default '*')
# A file returned before (same path, size and modification time, listed in DIR/.collected) is not sent again; what
# does not fit this call (LIMIT_MB of files, default 56) waits for the next call, and the list says how much waits.
# Unpack here: cat collect_<N>.tgz.part-* | tar xzf - -C DEST. RESET=1 forgets what was returned.
# Exit status: 0 (also when nothing is new), 2 for a usage error.
set -uo pipefail
usage="usage: OUT=DIR bash gpu_collect.sh DIR [PATTERN...]"
[[ $# -ge 1 && -d "$1" && -n "${OUT:-}" ]] || { echo "$usage (DIR must exist, OUT must be set)" >&2; exit 2; }
[[ "${LIMIT_MB:-56}" =~ ^[0-9]+$ ]] || { echo "gpu_collect.sh: LIMIT_MB must be a whole number of MB" >&2; exit 2; }
dir=$(cd "$1" && pwd); shift
(( $# )) || set -- '*'
mkdir -p "$OUT"
seen="$dir/.collected"; [[ -n "${RESET:-}" ]] && rm -f "$seen"
touch "$seen"
n=$(( $(cat "$dir/.collect_n" 2>/dev/null || echo 0) + 1 ))
limit=$(( ${LIMIT_MB:-56} * 1000000 ))
expr=(); for p in "$@"; do expr+=(-o -path "./$p"); done
list=$(mktemp); waiting=0; waiting_bytes=0; total=0; too_large=()
# every matching file with its size and mtime, oldest first (a finished head before one still being written)
while IFS=$'\t' read -r mtime size rel; do
  key="$rel $size $mtime"
  grep -qxF -- "$key" "$seen" && continue
  if (( size > limit )); then too_large+=("$rel"); continue; fi
  if (( total + size > limit )); then waiting=$((waiting + 1)); waiting_bytes=$((waiting_bytes + size)); continue; fi
  total=$((total + size)); printf '%s\n' "$rel" >> "$list"; printf '%s\n' "$key" >> "$list.keys"
done < <(cd "$dir" && find . -type f ! -name .collected ! -name .collect_n \( -false "${expr[@]}" \) \
           -printf '%T@\t%s\t%P\n' | sort -n)
(( ${#too_large[@]} )) && echo "gpu_collect: never sent, larger than LIMIT_MB=${LIMIT_MB:-56} (split them): ${too_large[*]}"
if [[ ! -s "$list" ]]; then
  echo "gpu_collect: nothing new under $dir"; rm -f "$list" "$list.keys"; exit 0
fi
(cd "$dir" && tar czf - -T "$list") | split -b 15000000 -d - "$OUT/collect_$n.tgz.part-"
{ cat "$list"; (( waiting )) && echo "# $waiting file(s), $waiting_bytes bytes, wait for the next call"; } \
  > "$OUT/collect_$n.txt"
cat "$list.keys" >> "$seen"; echo "$n" > "$dir/.collect_n"
echo "gpu_collect: $(wc -l < "$list") file(s), $total bytes -> $OUT/collect_$n.tgz.part-* ($(ls "$OUT"/collect_$n.tgz.part-* | wc -l) part(s))$( (( waiting )) && echo "; $waiting file(s) wait for the next call")"
rm -f "$list" "$list.keys"
