#!/usr/bin/env bash
# Distributed SPD through DeepSpeed on 2 GPUs: SmolLM2-135M-Instruct, n=2 stages, co-located head, bf16.
#
# Usage (GPU machine with 2 GPUs, from a checkout; SmolLM2 GGUF at $SPD_GGUF; results to $OUT):
#     OUT=/path/to/results scripts/gpu_pipe_bench.sh
# Env knobs: MAX_NEW (128), NUM_PROMPTS (5), DTYPE (bfloat16), NGPU (2).
#
# What it runs (each a `deepspeed --num_gpus 2` launch; logs and JSON under $OUT):
#   1. spd_ds.commands.pipe_bench: SPD vs AR through the *same* pipeline (same graphed stage code and kernels) for the
#      oracle drafter at alpha 1.0 and 0.6 and for the untrained head; at T=0 the tokens must be equal (exit 1
#      otherwise). --single-ar also reports the first divergence from the single-process eager AR decoder.
#   2. the same with static caches and CUDA graphs off (eager stages), for the time split.
#   3. the user command, launch/infer.py through DeepSpeed, with eager stages (its own AR check compares with the
#      eager single-process AR decoder: must say identical) and with the default graphed stages (reported).
#   4. the CUDA-only unit test of the graph runner (tests/test_pipe_graphs.py).
# $OUT/summary.md collects the numbers; the exit status is non-zero if any equality check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f .devkit/on_device.sh ] && source .devkit/on_device.sh
: "${SPD_GGUF:?set SPD_GGUF to the SmolLM2-135M-Instruct GGUF file}"
OUT=${OUT:-runs/gpu_pipe_bench}
MAX_NEW=${MAX_NEW:-128}
NUM_PROMPTS=${NUM_PROMPTS:-5}
DTYPE=${DTYPE:-bfloat16}
NGPU=${NGPU:-2}
mkdir -p "$OUT"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPD_DS_CACHE=${SPD_DS_CACHE:-$OUT/cache}
status=0

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Convert the GGUF once before any launch (the ranks would otherwise race to do it), and record the environment.
python3 -m spd_ds.eval.collect env --model smollm2-135m-instruct > "$OUT/env.json" \
  || { echo "model/environment setup failed" >&2; exit 2; }
cat "$OUT/env.json"

COMMON=(partition.num_stages=2 head.placement=colocated "model.dtype=$DTYPE" decoding.max_length=1024
        decoding.temperature=0.0)
sets() { for x in "$@"; do printf -- '--set\n%s\n' "$x"; done; }

bench() {  # name, extra overrides...
  local name=$1; shift
  local args; mapfile -t args < <(sets "${COMMON[@]}" "$@")
  local cmd=(deepspeed --num_gpus "$NGPU" --master_port "$(free_port)" --module spd_ds.commands.pipe_bench
             --config launch/configs/smollm2_spd.yaml "${args[@]}" --max-new-tokens "$MAX_NEW"
             --num-prompts "$NUM_PROMPTS" --warmup 1 --single-ar --out "$OUT/bench_$name")
  echo "${cmd[*]}" > "$OUT/bench_$name.cmd"
  echo "== bench $name"
  if ! timeout 1200 "${cmd[@]}" > "$OUT/bench_$name.log" 2>&1; then
    echo "   FAILED (see $OUT/bench_$name.log)"; status=1
  fi
  grep '\[pipe-bench\]' "$OUT/bench_$name.log" | tail -n 1
}

bench oracle_a1 decoding.drafter=oracle decoding.oracle_alpha=1.0
bench oracle_a06 decoding.drafter=oracle decoding.oracle_alpha=0.6
bench head_untrained decoding.drafter=head head.checkpoint=null head.draft_vocab=null
bench oracle_a1_eager decoding.drafter=oracle decoding.oracle_alpha=1.0 deepspeed.static_cache=false \
  deepspeed.cuda_graphs=false

PROMPTS=(--prompt "What is the capital of France? Answer in one sentence."
         --prompt "Write a Python function that returns the n-th Fibonacci number."
         --prompt "Explain in two sentences why the sky is blue.")
infer() {  # name, extra overrides...
  local name=$1; shift
  local cmd=(deepspeed --num_gpus "$NGPU" --master_port "$(free_port)" launch/infer.py
             --config launch/configs/smollm2_spd.yaml "${COMMON[@]}" "decoding.max_new_tokens=$MAX_NEW" "$@"
             "${PROMPTS[@]}" --output "$OUT/infer_$name.jsonl")
  echo "${cmd[*]}" > "$OUT/infer_$name.cmd"
  echo "== launch/infer.py $name"
  if ! timeout 1200 "${cmd[@]}" > "$OUT/infer_$name.log" 2>&1; then
    echo "   FAILED (see $OUT/infer_$name.log)"; status=1
  fi
  grep -E 'identical to AR decoding' "$OUT/infer_$name.log" | tail -n 1
}
infer eager deepspeed.static_cache=false deepspeed.cuda_graphs=false
if ! grep -q "identical to AR decoding: \([0-9]*\)/\1 prompts" "$OUT/infer_eager.log"; then
  echo "   eager distributed SPD differs from the eager AR decoder"; status=1
fi
infer graphs   # graphed stages vs eager single-process AR: bf16 near-ties may part (reported, not failed)

echo "== CUDA graph unit test"
python3 -m pytest -q tests/test_pipe_graphs.py > "$OUT/pytest_graphs.log" 2>&1 || { echo "   FAILED"; status=1; }
tail -n 1 "$OUT/pytest_graphs.log"

python3 -m spd_ds.eval.collect pipe-bench "$OUT" > "$OUT/summary.md"
cat "$OUT/summary.md"
exit $status
