#!/usr/bin/env bash
# The bf16 exactness check of docs/benchmarks.md (a) in one device call (2 GPUs by default; on one H200 each probe
# run of the single-GPU part took 1.5-2.5 min, the engine test ~45 s; the 2-GPU run of the new variants is untimed): the
# CUDA tests (tests/test_pipe_engine.py and tests/test_pipe_graphs.py, -k cuda), then
# scripts/diagnostics/gpu_exactness_probe.py twice: bf16 with the default model.sdpa_backends (on CUDA
# [efficient, math]: cuDNN's and flash attention left out) and bf16 with torch's own SDPA choice (all four
# backends: cuDNN on an H200), the variant whose separately captured CUDA-graph ARs parted from one another. Results
# into $OUT: log.txt, pytest.log, divergence_<variant>.md (the probe's table) and tokens.tgz (every method's tokens).
#
# Needs what scripts/gpu_benchmarks.sh needs (dependencies, $SPD_GGUF, prompt sets in $SPD_EVAL_DIR).
# Usage (repo root): source .devkit/on_device.sh && OUT=$OUT SPD_EVAL_DIR=/root/spd_data/eval_data \
#                        bash scripts/gpu_exactness_check.sh
# On one GPU (NUM_GPUS=1): the probe's single-GPU part (--single-gpu: AR_REPEATS ar_graph instances, default 4, and
# the other single-GPU runs; no pipeline) for each variant:
#   NUM_GPUS=1 PROBE_OVERRIDES=head.checkpoint=null OUT=$OUT SPD_EVAL_DIR=runs/eval_sets \
#     bash scripts/gpu_exactness_check.sh
# Knobs: VARIANTS ("bf16 torch"; also det = CUBLAS_WORKSPACE_CONFIG=:4096:8 and --deterministic, fp32,
#   math / efficient / cudnn = --sdpa-backend (that backend alone), noreduce = --no-reduced-precision,
#   cublas / cublaslt = --blas), PROBE_ARGS (extra probe options, e.g. "--num-prompts 1 --max-new-tokens 8"),
#   PROBE_OVERRIDES (section.key=value words; "deepspeed.backend=gloo" for a CPU dry run), SKIP_TESTS=1,
#   NUM_GPUS (2), AR_REPEATS.
source "$(dirname "$0")/gpu_common.sh"
EVAL_DIR=${SPD_EVAL_DIR:-eval_data}
WORK=$(mktemp -d /tmp/spd_exactness.XXXXXX)
say "gpu_exactness_check: ${NUM_GPUS:-2} GPU(s), prompt sets from $EVAL_DIR"
set +e
if [[ -z "${SKIP_TESTS:-}" ]]; then
  timeout 300 "$PY" -m pytest -q tests/test_pipe_engine.py tests/test_pipe_graphs.py -k cuda -rs > "$OUT/pytest.log" 2>&1
  say "CUDA tests: exit $? ($(tail -1 "$OUT/pytest.log"))"
fi
ONE=$([[ ${NUM_GPUS:-2} == 1 ]] && echo 1)
for v in ${VARIANTS:-bf16 torch}; do
  vars=(SPD_PROBE_VARIANT="$v") extra=() opts=()  # (the variable only labels the processes)
  [[ $v == det ]] && vars+=(CUBLAS_WORKSPACE_CONFIG=:4096:8) && opts+=(--deterministic)
  [[ $v == fp32 ]] && extra=(model.dtype=float32)
  [[ $v == torch || $v == math || $v == efficient || $v == cudnn ]] && opts+=(--sdpa-backend "$v")
  [[ $v == noreduce ]] && opts+=(--no-reduced-precision)
  [[ $v == cublas || $v == cublaslt ]] && opts+=(--blas "$v")
  if [[ -n $ONE ]]; then  # one process, no pipeline: the single-GPU AR runs only (the probe's --single-gpu)
    launch=("$PY" scripts/diagnostics/gpu_exactness_probe.py --single-gpu --ar-repeats "${AR_REPEATS:-4}")
  else
    launch=("$PY" -m deepspeed.launcher.runner --num_gpus "${NUM_GPUS:-2}" --master_port $((29500 + RANDOM % 1000))
            scripts/diagnostics/gpu_exactness_probe.py)
  fi
  env "${vars[@]}" timeout 300 "${launch[@]}" "${extra[@]}" ${PROBE_OVERRIDES:-} "${opts[@]}" \
    --out "$WORK/$v" --eval-dir "$EVAL_DIR" ${PROBE_ARGS:-} > "$WORK/$v.log" 2>&1  # overrides first: --sets takes a list
  rc=$?
  say "probe $v: exit $rc"
  if [[ -f "$WORK/$v/divergence.md" ]]; then
    cp "$WORK/$v/divergence.md" "$OUT/divergence_$v.md"
    cat "$OUT/divergence_$v.md" | tee -a "$LOG"
  else
    grep -vi warn "$WORK/$v.log" | tail -15 >> "$LOG"
  fi
done
(cd "$WORK" && tar czf "$OUT/tokens.tgz" */tokens.json 2>/dev/null)
say "gpu_exactness_check: done"
