#!/usr/bin/env bash
# Suite (c) of docs/benchmarks.md on one GPU node: SPD and PPSD speculation heads for SmolLM2-135M-Instruct at every
# n in $STAGES, trained with one recipe, then their acceptance through the reference decoder.
#
# Phases ($PHASES, default "regen train eval"; each phase reuses what the earlier ones left in $WORK, so they can
# run in separate commands on a machine that stays up):
#   regen  the target answers the first user turn of the carried ShareGPT conversations (as scripts/gpu_train_heads.sh)
#          -> $WORK/regen.jsonl.gz
#   train  for each n: an SPD head (default anchors: every stage boundary) and a PPSD head (anchors [0, e_1]: features
#          of the first stage only), same data, same hyper-parameters, same time budget ($TRAIN_SECONDS). The two
#          heads of one n train at the same time on the same GPU (equal share); n values go round-robin over the
#          GPUs, one wave of PAIRS_PER_WAVE pairs at a time. -> $WORK/heads/{spd,ppsd}_n<n>/head
#   eval   each head through launch/eval.py (reference decoder, fp32, T = 0, no baselines) on $EVAL_DEVICE (default
#          cpu, as suite (c) asks: $EVAL_THREADS threads per head, all heads at once on the node's cores; cuda =
#          round-robin over the GPUs); then the suite-(c) table -> $OUT/suite_c.md, $OUT/suite_c.json.
# Also under $OUT: log.txt, train_<variant>_n<n>.log, eval_<variant>_n<n>.log, and with COLLECT="spd_n3 ppsd_n3"
# those heads as heads.tgz.part-NN (<= 15 MB each; `cat heads.tgz.part-* | tar xz`).
#
# Needs what scripts/gpu_train_heads.sh needs (see its header), plus prepared prompt sets in $SPD_EVAL_DIR.
# Usage (repo root):  source .devkit/on_device.sh && OUT=$OUT WORK=/root/sweep bash scripts/gpu_heads_sweep.sh
# Knobs (env): STAGES="2 3 5 6", PHASES, REGEN_SECONDS=100, REGEN_FILE, TRAIN_SECONDS=90, MICRO_BATCH=8,
#   SEQ_LEN=2048, LR=1e-3, SPLIT_PAIRS=1 (the PPSD head of each n on the next GPU, not beside its SPD head),
#   NUM_PROMPTS=10 (per prompt set), MAX_NEW=128, EVAL_DEVICE=cpu, EVAL_THREADS=4, SPD_EVAL_DIR=eval_data,
#   PAIRS_PER_WAVE=NUM_GPUS (SPD/PPSD pairs trained at once; 4 with 2 GPUs trains all eight heads in one wave,
#   four to a GPU, which saves a wave's start-up time), SESSION_SECONDS (train.session_time_s: each command trains
#   at most this long, keeps the paused heads' checkpoints, and the next command with the same settings resumes them;
#   TRAIN_SECONDS=900 SESSION_SECONDS=450 trains every head for 900 s, one LR schedule, in two device commands),
#   PPSD_STAGES (the n values that also get a PPSD head; default STAGES), ONE_AT_A_TIME=1 (every head alone on GPU 0,
#   one after another: heads sharing a GPU ran at a third of the lone rate each, docs/training.md; run the script
#   detached, setsid nohup, when the whole sweep outlives a device command), SD_DIR (a folder of self-distilled shards
#   trained on too, e.g. runs/sd3), EXTRA (overrides for every head, e.g. the two-layer recipe:
#   "head.num_layers=2 head.lm_head_from_target=true head.tower_init_layer=-1 train.lr_stable_fraction=0.6").
source "$(dirname "$0")/gpu_common.sh"
STAGES=${STAGES:-"2 3 5 6"}
PHASES=${PHASES:-"regen train eval"}
REGEN_SECONDS=${REGEN_SECONDS:-100}
TRAIN_SECONDS=${TRAIN_SECONDS:-90}
DATA=${SPD_TRAIN_DATA:-runs/train_data/sharegpt6k.jsonl.gz}
MODEL=${SPD_MODEL:-smollm2-135m-instruct}
NUM_PROMPTS=${NUM_PROMPTS:-10}
MAX_NEW=${MAX_NEW:-128}
EVAL_DEVICE=${EVAL_DEVICE:-cpu}
EVAL_DIR=${SPD_EVAL_DIR:-eval_data}
WORK=${WORK:-/root/spd_sweep}
mkdir -p "$WORK/heads" "$WORK/eval"
has() { [[ " $PHASES " == *" $1 "* ]]; }
NUM_GPUS=${NUM_GPUS:-$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')}
say "gpu_heads_sweep: phases [$PHASES], stages [$STAGES], gpus $NUM_GPUS, work $WORK"
"$PY" -c "from spd_ds.zoo import resolve_model; print('model dir', resolve_model('$MODEL'))" >> "$LOG" 2>&1

# e_1 (layers of the first stage) for a uniform n-stage split of the target
e1() { "$PY" -m spd_ds.eval.collect first-stage-layers "$MODEL" "$1" | tail -1; }

REGEN=${REGEN_FILE:-$WORK/regen.jsonl.gz}
if has regen && [[ ! -f "$REGEN" ]]; then
  t0=$SECONDS
  timeout $((REGEN_SECONDS + 120)) "$PY" launch/prepare_train_data.py regenerate --model "$MODEL" --data "$DATA" \
    --out "$REGEN" --time-budget "$REGEN_SECONDS" --batch-size "${REGEN_BATCH:-256}" \
    --max-new-tokens "${REGEN_MAX_NEW:-384}" --max-prompt-tokens 512 --temperature 1.0 --sample-fraction 0.5 \
    >> "$OUT/regen.log" 2>&1 && say "regenerate: done in $((SECONDS - t0)) s" || say "regenerate: failed (see regen.log)"
fi
TRAIN_FILES="$DATA"
if [[ -f "$REGEN" ]]; then TRAIN_FILES="$REGEN,$DATA"; fi
if [[ -n "${SD_DIR:-}" ]]; then
  [[ -f "$SD_DIR/manifest.json" ]] || { say "error: SD_DIR=$SD_DIR holds no manifest.json (a selfdistill output folder)"; exit 2; }
  TRAIN_FILES="$(readlink -f "$SD_DIR"),$TRAIN_FILES"
fi
PPSD_STAGES=${PPSD_STAGES:-$STAGES}
wants_ppsd() { [[ " $PPSD_STAGES " == *" $1 "* ]]; }

train_one() {  # variant n gpu port
  local variant=$1 n=$2 gpu=$3 port=$4 anchors=()
  [[ $variant == ppsd ]] && anchors=("partition.anchors=[0,$(e1 "$n")]")
  local dir="$WORK/heads/${variant}_n$n" resume=() limit=$TRAIN_SECONDS
  if [[ -f "$dir/checkpoints/latest" ]] && grep -q '"finished": false' "$dir/train_summary.json" 2>/dev/null; then
    resume=(--resume)  # paused by SESSION_SECONDS in an earlier command: continue the same run
  elif [[ -f "$dir/head/head_config.json" ]]; then
    say "train $variant n=$n: already there"; return 0
  else
    rm -rf "$dir"
  fi
  if [[ -n "${SESSION_SECONDS:-}" ]] && (( SESSION_SECONDS < limit )); then limit=$SESSION_SECONDS; fi
  local t0=$SECONDS rc=0
  timeout $((limit + 300)) "$PY" -m deepspeed.launcher.runner --include "localhost:$gpu" --master_port "$port" \
    launch/train.py "${resume[@]}" --config launch/configs/train_smollm2_n3.yaml --deepspeed_config ds_configs/zero2.json \
    "model.name=$MODEL" "partition.num_stages=$n" "${anchors[@]}" "data.train_files=[$TRAIN_FILES]" \
    data.max_conversations=null "data.micro_batch_size=${MICRO_BATCH:-8}" "data.max_seq_length=${SEQ_LEN:-2048}" \
    "train.lr=${LR:-1e-3}" "train.max_time_s=$TRAIN_SECONDS" train.epochs=4 "train.output_dir=$dir" \
    train.save_every=1000000 train.progress=false train.log_every=10 \
    ${SESSION_SECONDS:+train.session_time_s=$SESSION_SECONDS} ${EXTRA:-} > "$OUT/train_${variant}_n$n.log" 2>&1 || rc=$?
  grep -q '"finished": false' "$dir/train_summary.json" 2>/dev/null || rm -rf "$dir/checkpoints"
  say "train $variant n=$n on gpu $gpu: exit $rc in $((SECONDS - t0)) s"
}

if has train; then
  i=0 port=$((29500 + RANDOM % 1000))
  for n in $STAGES; do
    if [[ "${ONE_AT_A_TIME:-0}" = 1 ]]; then
      train_one spd "$n" 0 "$port"
      if wants_ppsd "$n"; then train_one ppsd "$n" 0 "$port"; fi
      continue
    fi
    gpu=$((i % NUM_GPUS))
    train_one spd "$n" "$gpu" "$port" &
    if wants_ppsd "$n"; then train_one ppsd "$n" $(( ${SPLIT_PAIRS:-0} ? (gpu + 1) % NUM_GPUS : gpu )) $((port + 1)) & fi
    port=$((port + 2)) i=$((i + 1))
    if (( i % ${PAIRS_PER_WAVE:-$NUM_GPUS} == 0 )); then wait; fi
  done
  wait
fi

eval_one() {  # variant n gpu
  local variant=$1 n=$2 gpu=$3 anchors=()
  [[ $variant == ppsd ]] && anchors=("partition.anchors=[0,$(e1 "$n")]")
  local head="$WORK/heads/${variant}_n$n/head" out="$WORK/eval/${variant}_n$n"
  [[ -f "$head/head_config.json" ]] || { say "eval $variant n=$n: no head"; return 0; }
  local t0=$SECONDS rc=0
  CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=${EVAL_THREADS:-4} timeout 900 "$PY" launch/eval.py --config launch/configs/smollm2_spd.yaml \
    "head.checkpoint=$head" "partition.num_stages=$n" "${anchors[@]}" model.dtype=float32 "model.device=$EVAL_DEVICE" \
    decoding.temperature=0 "decoding.max_new_tokens=$MAX_NEW" "data.num_prompts=$NUM_PROMPTS" \
    "data.eval_dir=$EVAL_DIR" "eval.baselines=[]" eval.warmup_prompts=0 eval.progress=false eval.plots=false \
    "eval.output_dir=$out" > "$OUT/eval_${variant}_n$n.log" 2>&1 || rc=$?
  say "eval $variant n=$n on $EVAL_DEVICE $gpu: exit $rc in $((SECONDS - t0)) s"
}

if has eval; then
  i=0
  for n in $STAGES; do
    for variant in spd ppsd; do
      [[ $variant == ppsd ]] && ! wants_ppsd "$n" && continue
      eval_one "$variant" "$n" $((i % NUM_GPUS)) &
      i=$((i + 1))
    done
  done
  wait
  "$PY" -m spd_ds.eval.collect suite-c "$WORK" "$OUT" $STAGES 2>&1 | tee -a "$LOG"
fi

if [[ -n "${COLLECT:-}" ]]; then
  paths=()
  for h in $COLLECT; do [[ -d "$WORK/heads/$h" ]] && paths+=("heads/$h"); done
  if (( ${#paths[@]} )); then
    (cd "$WORK" && tar cf - "${paths[@]}" | gzip -1) | split -b 15000000 -d - "$OUT/heads.tgz.part-"
    say "collected ${paths[*]}: $(ls "$OUT"/heads.tgz.part-* | wc -l) part(s)"
  fi
fi
say "gpu_heads_sweep: done"
