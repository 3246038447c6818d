#!/usr/bin/env bash
# The CUDA-graph speculation head on the GPU machine, in one device call: its CUDA-only tests, then benchmark suite (a)
# (SmolLM2 n=2 through DeepSpeed on 2 GPUs, trained head, against ar_graph / hf_generate / ar) once with the eager
# head (head.cuda_graph=false) and once graphed (true). Results into $OUT: log.txt, pytest.log,
# benchmark_eager.md, benchmark_graph.md, a_summary_eager.json, a_summary_graph.json. About 7 minutes.
#
# Needs what scripts/gpu_benchmarks.sh needs (dependencies, $SPD_GGUF, prompt sets in $SPD_EVAL_DIR).
# Usage (repo root): source .devkit/on_device.sh && OUT=$OUT SPD_EVAL_DIR=/root/spd_data/eval_data \
#                        bash scripts/gpu_head_graph_check.sh
# Knobs: SPD_NUM_PROMPTS (4), SPD_MAX_NEW (128), SPD_HEAD (the shipped n=2 head), NUM_GPUS (2),
#   SPD_BENCH_OVERRIDES (extra section.key=value words; "deepspeed.backend=gloo" for a CPU dry run), SKIP_TESTS=1,
#   MODES ("eager graph"; "graph" for the graphed head alone).
source "$(dirname "$0")/gpu_common.sh"
EVAL_DIR=${SPD_EVAL_DIR:-eval_data}
HEAD=${SPD_HEAD:-spd_ds/assets/heads/smollm2-135m-instruct-n2}
WORK=$(mktemp -d /tmp/spd_head_graph.XXXXXX)
SETS=()
for s in mt_bench humaneval gsm8k; do
  if [[ -f "$EVAL_DIR/$s/question.jsonl" ]]; then SETS+=("$s"); fi
done
if [[ ${#SETS[@]} -eq 0 ]]; then say "error: no prompt set under $EVAL_DIR; set SPD_EVAL_DIR"; exit 2; fi
say "gpu_head_graph_check: sets [${SETS[*]}], head $HEAD"
"$PY" -c "from spd_ds.zoo import resolve_model; print('model dir', resolve_model('smollm2-135m-instruct'))" >> "$LOG" 2>&1

if [[ -z "${SKIP_TESTS:-}" ]]; then
  set +e
  timeout 240 "$PY" -m pytest -q tests/test_head_graph.py tests/test_pipe_graphs.py -rs > "$OUT/pytest.log" 2>&1
  say "CUDA tests: exit $? ($(tail -1 "$OUT/pytest.log"))"
  timeout 240 "$PY" -m pytest -q tests/test_pipe_engine.py -k cuda -rs >> "$OUT/pytest.log" 2>&1
  say "CUDA engine test (2 GPUs): exit $? ($(tail -1 "$OUT/pytest.log"))"
  set -e
fi

rc=0
for mode in ${MODES:-eager graph}; do
  flag=false; [[ $mode == graph ]] && flag=true
  set +e
  timeout 270 "$PY" -m deepspeed.launcher.runner --num_gpus "${NUM_GPUS:-2}" launch/benchmark.py \
    "head.cuda_graph=$flag" "data.eval_dir=$EVAL_DIR" eval.progress=false ${SPD_BENCH_OVERRIDES:-} \
    --suite a --out "$WORK/$mode" --spd-head "$HEAD" --prompt-sets "${SETS[@]}" \
    --num-prompts "${SPD_NUM_PROMPTS:-4}" --max-new-tokens "${SPD_MAX_NEW:-128}" --baseline-prompts 2 \
    > "$WORK/$mode.log" 2>&1
  r=$?
  set -e
  say "suite a, head.cuda_graph=$flag: exit $r"
  if [[ $r -ne 0 ]]; then rc=$r; tail -20 "$WORK/$mode.log" >> "$LOG"; fi
  grep -E "speculation head" "$WORK/$mode.log" | sort -u >> "$LOG" || true
  [[ -f "$WORK/$mode/benchmark.md" ]] && cp "$WORK/$mode/benchmark.md" "$OUT/benchmark_$mode.md" && cat "$OUT/benchmark_$mode.md"
  [[ -f "$WORK/$mode/a/summary.json" ]] && cp "$WORK/$mode/a/summary.json" "$OUT/a_summary_$mode.json"
done
exit "$rc"
