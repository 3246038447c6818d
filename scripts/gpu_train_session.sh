#!/usr/bin/env bash
# Distil SmolLM2-135M-Instruct speculation heads on one GPU over several device calls, several heads at once.
# State lives in $WORK (kept while the machine stays warm between calls): the self-distilled data, every head's run
# directory with its DeepSpeed checkpoints. Each call trains every variant for SESSION_SECONDS (train.session_time_s)
# of a run of TRAIN_SECONDS (train.max_time_s: one LR schedule over the whole run), resuming where the last call
# paused; so a run longer than one 10-minute device command is the same run as an uninterrupted one.
#
#   source .devkit/on_device.sh && OUT=$OUT VARIANTS="a:partition.num_stages=2 b:partition.num_stages=2,head.lm_head_from_target=true" \
#     REGEN_SECONDS=120 TRAIN_SECONDS=900 SESSION_SECONDS=330 bash scripts/gpu_train_session.sh
#
# A run's checkpoints stay on the machine; to keep training a head on a fresh machine, start a new run from it with
# head.checkpoint=<its best_head> in its variant (a warm start: new optimizer and LR schedule, the steps behind the
# head recorded as init_steps in train_summary.json).
#
# Knobs (env): VARIANTS ("name:override,override ..."; one training process per variant, all on GPU 0 at once;
#   a comma inside brackets stays in its override: "p3:partition.num_stages=3,partition.anchors=[0,10]"),
#   TRAIN_SECONDS, SESSION_SECONDS, SPD_TRAIN_DATA (conversations carried with the tree), REGEN_DATA (the prompts to
#   self-distil, default SPD_TRAIN_DATA), REGEN_SECONDS (0 = none;
#   self-distilled answers made once into $SD_DIR and trained on first), SD_DIR (default $WORK/selfdistill; a
#   carried folder of earlier shards, e.g. runs/sd made by scripts/gpu_selfdistill.sh, is used as it is), REGEN_ARGS,
#   EXTRA (overrides for every variant), FETCH=1 (heads back under $OUT as heads.tgz.part-NN, <= 15 MB each, and the
#   variants' torch.compile caches as compile_cache.tgz.part-NN, gzip'd, at most CACHE_RETURN_MB=45 in all; 0 = none),
#   CACHE_DIR (default runs/compile_cache: train_<variant>.bin, loaded when carried in: a fresh machine of the same
#   kind skips the FlexAttention compiles, docs/training.md "Limits"), EVAL_SETS / EVAL_PROMPTS /
#   EVAL_TOKENS / EVAL_TEMPS (suite c of every head on the node's CPU cores after training; EVAL_PROMPTS=0 = none),
#   SPD_EVAL_DIR (materialised prompt sets carried with the tree), DETACH=1 / WAIT_SECONDS / SAVE_EVERY (runs that
#   outlive the call: see step 2), PORT (first variant's port, default 29600), SEQUENTIAL=1 (without DETACH: the
#   variants one after the other, each alone on the GPU, each for up to SESSION_SECONDS).
set -uo pipefail
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the repository root: launch/train.py imports spd_ds
WORK=${WORK:-/root/spd_work}
MODEL=${SPD_MODEL:-smollm2-135m-instruct}
DATA=${SPD_TRAIN_DATA:-runs/train_data/sharegpt.jsonl.gz}
VARIANTS=${VARIANTS:-"n2:partition.num_stages=2"}
TRAIN_SECONDS=${TRAIN_SECONDS:-900}
SESSION_SECONDS=${SESSION_SECONDS:-330}
REGEN_SECONDS=${REGEN_SECONDS:-0}
EVAL_PROMPTS=${EVAL_PROMPTS:-0}
CACHE_DIR=${CACHE_DIR:-runs/compile_cache}  # torch.compile artifacts per variant: carried in, returned with FETCH=1
CACHE_RETURN_MB=${CACHE_RETURN_MB:-45}
LOG="$OUT/log.txt"
mkdir -p "$WORK/heads"
say() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
[[ "$CACHE_RETURN_MB" =~ ^(0|[1-9][0-9]*)$ ]] || {  # checked before any training: step 3 would fail only after it
  say "error: CACHE_RETURN_MB must be a whole number of MB (0 = no caches returned), got '$CACHE_RETURN_MB'"; exit 2; }
DATA=$(readlink -f "$DATA")
$PY -c "from spd_ds.zoo import resolve_model; print(resolve_model('$MODEL'))" >> "$LOG" 2>&1

# 1. self-distilled data (once per machine)
FILES="$DATA"
SD=$(readlink -m "${SD_DIR:-$WORK/selfdistill}")
if [[ "$REGEN_SECONDS" -gt 0 && ! -f "$SD/manifest.json" ]]; then
  say "self-distilling for ${REGEN_SECONDS}s"
  timeout $((REGEN_SECONDS + 180)) $PY launch/prepare_train_data.py selfdistill --model "$MODEL" --data "${REGEN_DATA:-$DATA}" \
    --out "$SD" --time-budget "$REGEN_SECONDS" --compile-cache "$CACHE_DIR/selfdistill.bin" ${REGEN_ARGS:-} 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -25 >> "$LOG"
  say "self-distill exit ${PIPESTATUS[0]}"
fi
[[ -f "$SD/manifest.json" ]] && FILES="$SD,$DATA" && cp "$SD/manifest.json" "$OUT/selfdistill_manifest.json"

# 2. every variant at once, resuming its run. DETACH=1: the runs are started in their own sessions (setsid) and outlive
# this call; the call waits WAIT_SECONDS for them (default SESSION_SECONDS), and the next call with the same command
# attaches to the runs still alive instead of starting them again (no restart, no recompile, one invocation for the
# whole run as long as the machine stays warm; checkpoints every SAVE_EVERY steps in case it is not).
# A finished run is not extended (raising TRAIN_SECONDS later does not reopen it): start a new run from its best head
# (head.checkpoint) instead.
port=${PORT:-29600}  # rendezvous port of the first variant (+1 per variant): give concurrent invocations distinct ranges
[[ "$port" =~ ^[0-9]+$ ]] || { say "error: PORT must be a port number, got '$port'"; exit 2; }
pids=()
DETACH=${DETACH:-0}
live_pid() {  # the pid of variant $1's detached run if it is still that run and alive (else removes the pid file)
  local f="$WORK/$1.pid" pid
  [[ -f "$f" ]] || return 1
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null && [[ "$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)" != Z ]] \
      && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "train.output_dir=$WORK/heads/$1 "; then
    echo "$pid"; return 0
  fi
  rm -f "$f"; return 1
}
for v in $VARIANTS; do
  name=${v%%:*}; over=${v#*:}; run="$WORK/heads/$name"
  if pid=$(live_pid "$name"); then  # in either mode: never a second trainer on a run directory
    say "attach $name (pid $pid)"; pids+=("$pid"); port=$((port + 1)); continue
  fi
  if [[ -f "$run/train_summary.json" ]] && grep -q '"finished": true' "$run/train_summary.json"; then
    say "$name finished"; port=$((port + 1)); continue
  fi
  [[ -f "$WORK/$name.log" ]] && mv "$WORK/$name.log" "$WORK/$name.log.$(date +%s)"  # keep why an earlier one ended
  resume=""; [[ -f "$run/checkpoints/latest" ]] && resume="--resume"
  say "train $name ($over) $resume"
  if [[ "$DETACH" = 1 ]]; then session="train.session_time_s=null"; save="train.save_every=${SAVE_EVERY:-500}"
  else session="train.session_time_s=$SESSION_SECONDS"; save="train.save_every=1000000"; fi
  # the variant's overrides: split at commas outside brackets (partition.anchors=[0,10] stays one override; nested
  # lists are not supported), empty pieces dropped
  split="import re, sys; [print(p) for p in re.split(r',(?![^\[]*\])', sys.argv[1]) if p]"
  mapfile -t words < <($PY -c "$split" "$over")
  set -f  # overrides like a=[x] are words, not globs
  cmd=($PY -m deepspeed.launcher.runner --num_gpus 1 --master_port $port launch/train.py
    --config launch/configs/train_smollm2_n2.yaml --deepspeed_config ds_configs/zero2.json $resume
    "model.name=$MODEL" "data.train_files=[$FILES]" data.max_conversations=null
    "train.compile_cache=$CACHE_DIR/train_$name.bin" "${words[@]}" ${EXTRA:-}
    "train.max_time_s=$TRAIN_SECONDS" "$session" train.epochs=100
    "train.output_dir=$run" "$save" train.progress=false train.log_every=25)
  set +f
  if [[ "$DETACH" = 1 ]]; then  # a hung run ends anyway (start-up and final validation included)
    setsid nohup timeout $((TRAIN_SECONDS + 600)) "${cmd[@]}" > "$WORK/$name.log" 2>&1 < /dev/null &
    echo $! > "$WORK/$name.pid"; pids+=($!)
  else
    timeout $((SESSION_SECONDS + 240)) "${cmd[@]}" > "$WORK/$name.log" 2>&1 &
    pids+=($!)
    [[ "${SEQUENTIAL:-0}" = 1 ]] && { wait $!; say "$name exit $?"; }  # alone on the GPU, one after the other
  fi
  port=$((port + 1))
done
if [[ "$DETACH" = 1 ]]; then
  t0=$SECONDS
  while (( SECONDS - t0 < ${WAIT_SECONDS:-$SESSION_SECONDS} )); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
    [[ $alive = 0 ]] && break
    sleep 5
  done
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=$((alive + 1)); done
  for v in $VARIANTS; do
    name=${v%%:*}; last=$(tail -n 1 "$WORK/heads/$name/train_log.jsonl" 2>/dev/null | cut -c1-160)
    say "$name: ${last:-no log yet}"
  done
  [[ $alive -gt 0 ]] && say "$alive run(s) still running: call again with the same command to keep waiting"
else  # children are waited for; an attached detached run (not a child) is polled until it ends
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || while kill -0 "$p" 2>/dev/null; do sleep 5; done; done
fi
RUNNING=" "  # variants still training (detached): no report, no evaluation this call; FETCH returns their best so far
for v in $VARIANTS; do
  name=${v%%:*}; run="$WORK/heads/$name"
  if live_pid "$name" > /dev/null; then RUNNING+="$name "; continue; fi
  grep -E "spd_ds.train|Error|error" "$WORK/$name.log" | tail -6 >> "$LOG"
  [[ -f "$run/train_summary.json" ]] && $PY scripts/train_report.py "$run" --name "$name" 2>&1 | tee -a "$LOG"
done

# 3. heads back (head/ and best_head/ when there, logs), <= 15 MB parts
if [[ "${FETCH:-0}" = 1 ]]; then
  # each variant's best head (by predicted acceptance) or, without validation, its last head; logs and summaries
  (cd "$WORK" && tar cf - $(for v in $VARIANTS; do n=${v%%:*}; h=heads/$n/best_head; [[ -d $h ]] || h=heads/$n/head
    ls -d $h heads/$n/best.json heads/$n/train_log.jsonl heads/$n/train_summary.json heads/$n/config.yaml 2>/dev/null; done) | gzip -1) \
    | split -b 15000000 -d - "$OUT/heads.tgz.part-"
  say "heads: $(ls "$OUT"/heads.tgz.part-* | wc -l) part(s)"
  if (( CACHE_RETURN_MB == 0 )); then  # the caller keeps them (gpu_continue_heads.sh: one per base)
    say "compile caches: kept in $CACHE_DIR, not returned (CACHE_RETURN_MB=0)"
  elif ls "$CACHE_DIR"/train_*.bin >/dev/null 2>&1; then  # gzip'd, <= 15 MB parts, at most CACHE_RETURN_MB in all
    tar cf - -C "$CACHE_DIR" $(cd "$CACHE_DIR" && ls train_*.bin) | gzip -6 > "$WORK/compile_cache.tgz"
    size=$(stat -c %s "$WORK/compile_cache.tgz")
    if (( size > CACHE_RETURN_MB * 1000000 )); then
      say "compile caches: $size bytes gzip'd, over CACHE_RETURN_MB=$CACHE_RETURN_MB: not returned"
    else
      split -b 15000000 -d "$WORK/compile_cache.tgz" "$OUT/compile_cache.tgz.part-"
      say "compile caches ($size bytes gzip'd) -> \$OUT/compile_cache.tgz.part-* (here: cat them | tar xzf - -C $CACHE_DIR; carry $CACHE_DIR)"
    fi
  fi
fi

# 4. suite (c) of each head on the node's CPU cores (fp32 reference decoder), all heads at once
if [[ "$EVAL_PROMPTS" -gt 0 ]]; then
  cores=$(nproc); jobs=0; for v in $VARIANTS; do for t in ${EVAL_TEMPS:-0}; do jobs=$((jobs + 1)); done; done
  th=$(( cores / jobs )); [[ $th -lt 1 ]] && th=1
  evals=()
  for v in $VARIANTS; do
    name=${v%%:*}; run="$WORK/heads/$name"; head="$run/best_head"; [[ -d "$head" ]] || head="$run/head"
    if [[ "$RUNNING" == *" $name "* || ! -f "$head/head_config.json" ]]; then
      say "$name: no head to evaluate yet"; continue
    fi
    n=$($PY -c "import json,sys; print(len(json.load(open('$head/head_config.json'))['partition']['stage_layers']))")
    for t in ${EVAL_TEMPS:-0}; do
      OMP_NUM_THREADS=$th CUDA_VISIBLE_DEVICES= timeout 900 $PY launch/benchmark.py --suite c --stages "$n" \
        --spd-head "$head" --num-prompts "$EVAL_PROMPTS" --max-new-tokens "${EVAL_TOKENS:-128}" \
        --prompt-sets ${EVAL_SETS:-mt_bench humaneval gsm8k} --out "$WORK/eval_${name}_T$t" \
        model.device=cpu model.dtype=float32 "decoding.temperature=$t" ${SPD_EVAL_DIR:+data.eval_dir=$SPD_EVAL_DIR} \
        > "$WORK/eval_${name}_T$t.log" 2>&1 &
      evals+=($!)
    done
  done
  for p in "${evals[@]}"; do wait "$p"; done  # not a bare wait: detached trainers are children of this shell too
  for v in $VARIANTS; do for t in ${EVAL_TEMPS:-0}; do
    name=${v%%:*}; f="$WORK/eval_${name}_T$t/benchmark.md"
    { echo "## $name T=$t"; cat "$f" 2>/dev/null || tail -5 "$WORK/eval_${name}_T$t.log"; } | tee -a "$LOG"
  done; done
fi
true
