#!/usr/bin/env bash
# Train the default SmolLM2-135M-Instruct speculation heads (n=2 and n=3 pipeline stages, L_s=1) on the GPU(s) of
# one node and collect them under $OUT. About 8 minutes with the defaults below (hard limit: timeouts per step).
#
#   1. regenerate: the target answers the first user turn of the carried ShareGPT conversations (batched HF
#      generate, bf16; half greedy, half sampled at T=1) for $REGEN_SECONDS;
#   2. train: for each n in $STAGES, `deepspeed launch/train.py` with launch/configs/train_smollm2_n<n>.yaml on the
#      regenerated answers + the ShareGPT conversations, for $TRAIN_SECONDS of training (the LR schedule anneals to 0
#      within that budget); heads saved in bf16 with SpeculationHead.save;
#   3. quick check: draft acceptance of each head through the reference decoder (T=0, a few prompts, bf16 GPU);
#   4. collect into $OUT (at most 7 files, about 57 MB for n=2 and n=3): log.txt, report.json (throughput, training
#      log, quick acceptance per n), heads.tgz.part-NN (<= 15 MB each; reassemble with
#      `cat heads.tgz.part-* | tar xz`, which gives heads/smollm2_n<n>/{head/,config.yaml,train_log.jsonl,...}).
#
# Needs, on the GPU machine (no network): this repository; its dependencies (deepspeed, datasets, gguf: the wheels of
# the device image; omegaconf + antlr4-python3-runtime as wheels if the image lacks them); the SmolLM2
# GGUF at $SPD_GGUF; the training conversations carried in a git-ignored folder, made here beforehand with
#   python launch/prepare_train_data.py export --limit 6000 --out runs/train_data/sharegpt6k.jsonl.gz   (9 MB)
# Usage (repo root):  source .devkit/on_device.sh && OUT=$OUT bash scripts/gpu_train_heads.sh
# Knobs (env): STAGES="2 3", REGEN_SECONDS=100 (0 = skip), REGEN_FILE (reuse answers), TRAIN_SECONDS=90,
#   SPD_TRAIN_DATA, MICRO_BATCH=8, SEQ_LEN=2048, LR=1e-3, QUICK_EVAL=1, NUM_GPUS (default: all), PYTHON.
source "$(dirname "$0")/gpu_common.sh"
STAGES=${STAGES:-"2 3"}
REGEN_SECONDS=${REGEN_SECONDS:-100}
TRAIN_SECONDS=${TRAIN_SECONDS:-90}
DATA=${SPD_TRAIN_DATA:-runs/train_data/sharegpt6k.jsonl.gz}
MICRO_BATCH=${MICRO_BATCH:-8}
SEQ_LEN=${SEQ_LEN:-2048}
LR=${LR:-1e-3}
MODEL=${SPD_MODEL:-smollm2-135m-instruct}
CONFIG_DIR=${CONFIG_DIR:-launch/configs}
WORK=${WORK:-$(mktemp -d /tmp/spd_heads.XXXXXX)}
: > "$LOG"
run() { "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; }

say "gpu_train_heads: stages [$STAGES], data $DATA, regen ${REGEN_SECONDS}s, train ${TRAIN_SECONDS}s/head, work $WORK"
[[ -f "$DATA" ]] || { say "error: $DATA not found; carry runs/train_data (made by launch/prepare_train_data.py export)"; exit 2; }
run "$PY" -m spd_ds.eval.collect env --deps || { say "error: missing dependencies (see the header of this script)"; exit 2; }
NUM_GPUS=${NUM_GPUS:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
run nvidia-smi --query-gpu=name,memory.total --format=csv || true
t0=$SECONDS
run "$PY" -c "from spd_ds.zoo import resolve_model; print('model dir', resolve_model('$MODEL'))"
say "model ready in $((SECONDS - t0)) s"

# 1. regenerate answers with the target
TRAIN_FILES="$DATA"
REGEN=${REGEN_FILE:-}
if [[ -z "$REGEN" && "$REGEN_SECONDS" -gt 0 ]]; then
  REGEN="$WORK/regen.jsonl.gz"
  t0=$SECONDS
  set +e
  run timeout $((REGEN_SECONDS + 120)) "$PY" launch/prepare_train_data.py regenerate --model "$MODEL" --data "$DATA" \
    --out "$REGEN" --time-budget "$REGEN_SECONDS" --batch-size "${REGEN_BATCH:-256}" \
    --max-new-tokens "${REGEN_MAX_NEW:-384}" --max-prompt-tokens 512 --temperature 1.0 --sample-fraction 0.5
  rc=$?
  set -e
  say "regenerate: exit $rc in $((SECONDS - t0)) s"
  [[ $rc -eq 0 && -f "$REGEN" ]] || REGEN=""
fi
[[ -n "$REGEN" ]] && TRAIN_FILES="$REGEN,$DATA"

# 2. train one head per n
PORT=$((29500 + RANDOM % 1000))
for n in $STAGES; do
  t0=$SECONDS
  set +e
  run timeout $((TRAIN_SECONDS + 240)) "$PY" -m deepspeed.launcher.runner --num_gpus "$NUM_GPUS" --master_port "$PORT" \
    launch/train.py --config "$CONFIG_DIR/train_smollm2_n$n.yaml" --deepspeed_config ds_configs/zero2.json \
    "model.name=$MODEL" "data.train_files=[$TRAIN_FILES]" data.max_conversations=null \
    "data.micro_batch_size=$MICRO_BATCH" "data.max_seq_length=$SEQ_LEN" "train.lr=$LR" \
    "train.max_time_s=$TRAIN_SECONDS" train.epochs=4 "train.output_dir=$WORK/heads/smollm2_n$n" train.save_every=1000000 \
    train.progress=false train.log_every=10
  rc=$?
  set -e
  say "train n=$n: exit $rc in $((SECONDS - t0)) s"
  PORT=$((PORT + 1))
  rm -rf "$WORK/heads/smollm2_n$n/checkpoints"  # optimizer state: not worth carrying back
done

# 3. quick acceptance check (reference decoder, T=0) and the report
set +e
quick=(); [[ ${QUICK_EVAL:-1} == 1 ]] && quick=(--quick-eval)
regen=(); [[ -n "$REGEN" ]] && regen=(--regenerated)
run timeout 180 "$PY" -m spd_ds.eval.collect heads-report "$MODEL" "$WORK" "$OUT" $STAGES "${quick[@]}" "${regen[@]}"
say "quick check: exit $?"
set -e

# 4. heads back in <= 15 MB parts
if compgen -G "$WORK/heads/smollm2_n*/head/head.safetensors" > /dev/null; then
  (cd "$WORK" && tar cf - heads | gzip -1) | split -b 15000000 -d - "$OUT/heads.tgz.part-"
  say "heads: $(ls "$OUT"/heads.tgz.part-* | wc -l) part(s); reassemble with: cat heads.tgz.part-* | tar xz"
else
  say "error: no head was trained"
  exit 1
fi
ls -la "$OUT" | tee -a "$LOG"
