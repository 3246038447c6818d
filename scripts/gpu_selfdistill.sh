#!/usr/bin/env bash
# Self-distilled training data on one GPU: the target answers every user turn of the carried prompts (rounds: turn r
# sees the target's own answers to turns < r), greedy + sampled at T=1, with `launch/prepare_train_data.py
# selfdistill` (spd_ds/train/selfdistill.py: HF generate, static cache, compiled decode, length-sorted batches).
#
#   1. selfdistill into $SD_DIR (default runs/sd, inside the checkout: on a warm machine a rerun resumes it, and
#      reuses the compile cache; the time budget stops starting generate calls, finished answers are flushed to shards
#      as they complete);
#   2. the throughput table (printed by the command) and per-call lines in log.txt;
#   3. back in $OUT (at most 8 files of <= 15 MB): log.txt, manifest.json and the shards as sd.tar.part-NN (first
#      $MAX_PARTS parts; unpack with `cat sd.tar.part-* | tar x -C runs/sd`); the log says how to fetch further parts.
#
# Needs on the GPU machine: this repository, the SmolLM2 GGUF at $SPD_GGUF (devkit), and the prompts carried in a
# git-ignored folder, made here beforehand with (6.9 MB):
#   python launch/prepare_train_data.py export-prompts --out runs/train_data/sharegpt_prompts.jsonl.gz
# Usage (repo root):  source .devkit/on_device.sh && OUT=$OUT bash scripts/gpu_selfdistill.sh
# Knobs (env): TIME_BUDGET=420 (s from the command's start after which no generate call starts; with the last
#   call and the tar this fits one 600-s device call; a rerun on the warm machine resumes), SD_MODEL=smollm2-135m-instruct,
#   SD_DATA=runs/train_data/sharegpt_prompts.jsonl.gz, SD_DIR=runs/sd, BATCH=1024, MAX_NEW=768, CHUNK=256,
#   MIN_ALIVE=0.25, MAX_PROMPT=2048, GREEDY=1, SAMPLES=2, ATTENTION=gqa-decode (or sdpa), CACHE=static (or dynamic),
#   COMPILE=1, MAX_PARTS=3, COMPILE_CACHE=runs/compile_cache/selfdistill.bin (torch.compile artifacts: loaded when
#   carried in, rewritten and returned in $OUT: a later session can skip the first call's compile; the saving is not measured yet),
#   EXTRA_ARGS (more selfdistill flags), PYTHON.
source "$(dirname "$0")/gpu_common.sh"
TIME_BUDGET=${TIME_BUDGET:-420}
MODEL=${SD_MODEL:-smollm2-135m-instruct}
DATA=${SD_DATA:-runs/train_data/sharegpt_prompts.jsonl.gz}
SD_DIR=${SD_DIR:-runs/sd}
MAX_PARTS=${MAX_PARTS:-3}  # $OUT returns at most 8 files, 64 MiB in all: 3 x 15 MB + log, manifest, cache
COMPILE_CACHE=${COMPILE_CACHE:-runs/compile_cache/selfdistill.bin}  # carried in, rewritten, returned in $OUT
NO_COMPILE=""
[[ "${COMPILE:-1}" == 1 ]] || NO_COMPILE="--no-compile"
: > "$LOG"
say "gpu_selfdistill: $MODEL on $DATA -> $SD_DIR, budget ${TIME_BUDGET}s, batch ${BATCH:-1024}, max new ${MAX_NEW:-768}"
[[ -f "$DATA" ]] || { say "error: $DATA not found; carry runs/train_data (made by prepare_train_data.py export-prompts)"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1 | tee -a "$LOG" || true
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" 2>&1 | tee -a "$LOG"

set +e
t0=$SECONDS
timeout --signal=TERM --kill-after=20 $((TIME_BUDGET + 120)) "$PY" launch/prepare_train_data.py selfdistill \
  --model "$MODEL" --data "$DATA" --out "$SD_DIR" --time-budget "$TIME_BUDGET" \
  --batch-size "${BATCH:-1024}" --max-new-tokens "${MAX_NEW:-768}" --chunk-new-tokens "${CHUNK:-256}" \
  --min-alive "${MIN_ALIVE:-0.25}" --max-prompt-tokens "${MAX_PROMPT:-2048}" \
  --greedy "${GREEDY:-1}" --samples "${SAMPLES:-2}" --attention "${ATTENTION:-gqa-decode}" --cache "${CACHE:-static}" \
  --compile-cache "$COMPILE_CACHE" $NO_COMPILE ${EXTRA_ARGS:-} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
set -e
say "selfdistill: exit $rc in $((SECONDS - t0)) s"
if [[ -f "$COMPILE_CACHE" ]]; then
  if (( $(stat -c %s "$COMPILE_CACHE") <= 15000000 )); then
    cp "$COMPILE_CACHE" "$OUT/" && say "compile cache: $(du -h "$COMPILE_CACHE" | cut -f1) -> \$OUT (carry it back as $COMPILE_CACHE)"
  else
    say "compile cache $COMPILE_CACHE is over 15 MB: not returned (\$OUT takes files up to 16 MiB)"
  fi
fi

if [[ -f "$SD_DIR/manifest.json" ]]; then
  cp "$SD_DIR/manifest.json" "$OUT/manifest.json"
  parts_dir="$SD_DIR.parts"
  rm -rf "$parts_dir" && mkdir -p "$parts_dir"
  (cd "$SD_DIR" && tar cf - manifest.json shard-*.npz 2>/dev/null) | split -b 15000000 -d - "$parts_dir/sd.tar.part-"
  n=$(ls "$parts_dir" | wc -l)
  ls "$parts_dir" | head -n "$MAX_PARTS" | while read -r f; do cp "$parts_dir/$f" "$OUT/"; done
  say "shards: $(ls "$SD_DIR"/shard-*.npz 2>/dev/null | wc -l) files, $(du -sh "$SD_DIR" | cut -f1); $n tar part(s), first $((n < MAX_PARTS ? n : MAX_PARTS)) in \$OUT"
  if (( n > MAX_PARTS )); then
    say "more parts on this machine: in a later call, cp $parts_dir/sd.tar.part-{$(printf '%02d' "$MAX_PARTS")..$(printf '%02d' $((n - 1)))} \$OUT/"
  fi
else
  say "error: no manifest written"
  exit 1
fi
ls -la "$OUT" | tee -a "$LOG"
exit "$rc"
