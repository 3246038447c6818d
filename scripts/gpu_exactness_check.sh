#!/usr/bin/env bash
# The open bf16 exactness question of docs/benchmarks.md (a) in one device call on 2 GPUs (about 6 minutes): the CUDA
# engine test (tests/test_pipe_engine.py -k cuda), then scripts/diagnostics/gpu_exactness_probe.py three times: bf16, bf16 under
# CUBLAS_WORKSPACE_CONFIG=:4096:8, and fp32. Results into $OUT: log.txt, pytest.log, divergence_<variant>.md (the
# probe's table) and tokens.tgz (every method's tokens per prompt).
#
# Needs what scripts/gpu_benchmarks.sh needs (dependencies, $SPD_GGUF, prompt sets in $SPD_EVAL_DIR).
# Usage (repo root): source .devkit/on_device.sh && OUT=$OUT SPD_EVAL_DIR=/root/spd_data/eval_data \
#                        bash scripts/gpu_exactness_check.sh
# Knobs: VARIANTS ("bf16 det fp32"), PROBE_ARGS (extra probe options, e.g. "--num-prompts 1 --max-new-tokens 8"),
#   PROBE_OVERRIDES (section.key=value words; "deepspeed.backend=gloo" for a CPU dry run), SKIP_TESTS=1.
source "$(dirname "$0")/gpu_common.sh"
EVAL_DIR=${SPD_EVAL_DIR:-eval_data}
WORK=$(mktemp -d /tmp/spd_exactness.XXXXXX)
say "gpu_exactness_check: variants [${VARIANTS:-bf16 det fp32}], prompt sets from $EVAL_DIR"
set +e
if [[ -z "${SKIP_TESTS:-}" ]]; then
  timeout 300 "$PY" -m pytest -q tests/test_pipe_engine.py -k cuda -rs > "$OUT/pytest.log" 2>&1
  say "CUDA engine test: exit $? ($(tail -1 "$OUT/pytest.log"))"
fi
for v in ${VARIANTS:-bf16 det fp32}; do
  vars=(SPD_PROBE_VARIANT="$v") extra=()  # (the variable only labels the processes)
  [[ $v == det ]] && vars+=(CUBLAS_WORKSPACE_CONFIG=:4096:8)
  [[ $v == fp32 ]] && extra=(model.dtype=float32)
  env "${vars[@]}" timeout 300 "$PY" -m deepspeed.launcher.runner --num_gpus "${NUM_GPUS:-2}" \
    --master_port $((29500 + RANDOM % 1000)) scripts/diagnostics/gpu_exactness_probe.py "${extra[@]}" ${PROBE_OVERRIDES:-} \
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
