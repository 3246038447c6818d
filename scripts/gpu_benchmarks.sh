#!/usr/bin/env bash
# Benchmarks (a) and (b) of docs/benchmarks.md on one node with 2 H200s, through DeepSpeed's pipeline engine;
# tables, summaries and two plots into $OUT (7 files). About 5 minutes; hard limit 8 (timeout 470 s).
#
# Needs, on the GPU machine (no network):
#   - this repository with its dependencies installed (pip install -e ".[eval]");
#   - the SmolLM2-135M-Instruct GGUF at $SPD_GGUF (spd_ds.zoo.resolve_model converts it once);
#   - the prompt sets in $SPD_EVAL_DIR (default eval_data/, materialised beforehand, e.g.
#     `python launch/prepare_eval_data.py --source-dir <a copy of the prompt sets>`, and carried along: eval_data/*/
#     is gitignored); the sets found there are used;
#   - optionally an n=2 SmolLM2 head at $SPD_HEAD (default: the shipped spd_ds/assets/heads/smollm2-135m-instruct-n2).
# Usage (repo root): source .devkit/on_device.sh && OUT=$OUT bash scripts/gpu_benchmarks.sh
#   (or OUT=/path/to/out SPD_GGUF=/path/to/smollm2.gguf bash scripts/gpu_benchmarks.sh)
# Knobs (defaults = the docs' runs): SPD_MODEL_B (random:qwen3-4b), SPD_NUM_PROMPTS (4), SPD_MAX_NEW (128),
# SPD_BENCH_OVERRIDES (extra section.key=value words, e.g. "deepspeed.backend=gloo" for a CPU dry run).
source "$(dirname "$0")/gpu_common.sh"
WORK=$(mktemp -d /tmp/spd_bench.XXXXXX)
EVAL_DIR=${SPD_EVAL_DIR:-eval_data}
SETS=()
for s in mt_bench humaneval gsm8k; do
  [[ -f "$EVAL_DIR/$s/question.jsonl" ]] && SETS+=("$s")
done
if [[ ${#SETS[@]} -eq 0 ]]; then
  echo "error: no prompt set under $EVAL_DIR (need <set>/question.jsonl); set SPD_EVAL_DIR" | tee "$LOG" >&2
  exit 2
fi
HEAD_ARGS=()
if [[ -n "${SPD_HEAD:-}" ]]; then HEAD_ARGS=(--spd-head "$SPD_HEAD"); fi

{
  echo "== $(date -u +%FT%TZ) gpu_benchmarks: sets [${SETS[*]}], head ${SPD_HEAD:-shipped n=2}"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv || true
  $PY -c "import torch, transformers, deepspeed; print('torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
  # convert the GGUF once before the ranks start (they would serialise on the cache lock anyway)
  $PY -c "from spd_ds.zoo import resolve_model; print('model dir', resolve_model('smollm2-135m-instruct'))"
} 2>&1 | tee "$LOG"

set +e
timeout 470 deepspeed --num_gpus 2 launch/benchmark.py --suite a b --out "$WORK/bench" \
  --prompt-sets "${SETS[@]}" --num-prompts "${SPD_NUM_PROMPTS:-4}" --max-new-tokens "${SPD_MAX_NEW:-128}" \
  --baseline-prompts 2 --alphas 1 0.8 0.6 --model-b "${SPD_MODEL_B:-random:qwen3-4b}" "${HEAD_ARGS[@]}" \
  "data.eval_dir=$EVAL_DIR" eval.progress=false ${SPD_BENCH_OVERRIDES:-} 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
set -e
echo "== exit status $rc" | tee -a "$LOG"

copy() { [[ -f "$1" ]] && cp "$1" "$OUT/$2" || echo "missing: $1" | tee -a "$LOG"; }
copy "$WORK/bench/benchmark.md" benchmark.md
copy "$WORK/bench/benchmark.json" benchmark.json
copy "$WORK/bench/a/summary.json" a_summary.json
copy "$WORK/bench/b/summary.json" b_summary.json
copy "$WORK/bench/a/acceptance_by_depth.png" a_acceptance_by_depth.png
copy "$WORK/bench/b/cycle_time_split.png" b_cycle_time_split.png
exit "$rc"
