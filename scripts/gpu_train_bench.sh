#!/usr/bin/env bash
# One device call: the CUDA training tests (FlexAttention gradients) and the before/after training-throughput table
# (scripts/bench_train.py) with a profile of the new path; results under $OUT.
#   source .devkit/on_device.sh && OUT=$OUT bash scripts/gpu_train_bench.sh
# Needs: runs/train_bench/bench1500.jsonl.gz (launch/prepare_train_data.py export --data sharegpt --limit 1500) and
# .old/ (git archive <before-commit> spd_ds launch ds_configs draft_vocab | tar -x -C .old) carried.
# Knobs: STAGES="2 4", ATTENTION="flex" (eager-teacher cells; empty: none), COMPILE_TEACHER=inductor (also a
#   compiled-teacher cell per n; empty: none),
#   TEACHER_ATTENTION="" (modes of train.teacher_attention for the compiled-teacher cells, e.g. "sdpa flex"; empty:
#   the code's default), STEPS=60 and SKIP=2 (logged 10-step intervals left out of the median: a cold cell can
#   still compile in its second one), CELL_TIMEOUT=240 (a cold machine's first cell spends > 180 s compiling),
#   OLD_ROOT=.old (empty: no 'before' cells), TESTS=1, BENCH_TIMEOUT=520 (all cells and the profile; a cold cell
#   takes 80-120 s: with TEACHER_ATTENTION="sdpa flex", run one n per call), PROFILE_STEPS=5 (0: no profile). The
#   profile (its own run at the first n) goes to $OUT/profile.txt, profile_cpu.txt and trace.json.gz.
set -uo pipefail
PY=${PYTHON:-python3}
{ nvidia-smi --query-gpu=name,memory.total --format=csv
  $PY -c "import torch, transformers, deepspeed; print(torch.__version__, transformers.__version__, deepspeed.__version__)"
} | tee "$OUT/bench.txt"
$PY -c "from spd_ds.zoo import resolve_model; print(resolve_model('smollm2-135m-instruct'))"
if [[ "${TESTS:-1}" = 1 ]]; then
  timeout 150 $PY -m pytest -q -p no:cacheprovider tests/test_train_gpu.py 2>&1 | tail -15 | tee -a "$OUT/bench.txt"
fi
OLD_ROOT=${OLD_ROOT-.old}
CT=${COMPILE_TEACHER-inductor}
timeout "${BENCH_TIMEOUT:-520}" $PY scripts/bench_train.py --data runs/train_bench/bench1500.jsonl.gz \
  --stages ${STAGES:-2 4} --attention ${ATTENTION-flex} ${OLD_ROOT:+--old-root $OLD_ROOT} --steps "${STEPS:-60}" \
  ${CT:+--compile-teacher $CT} ${TEACHER_ATTENTION:+--teacher-attention $TEACHER_ATTENTION} --skip "${SKIP:-2}" \
  --log-every 10 --profile-steps "${PROFILE_STEPS:-5}" --timeout "${CELL_TIMEOUT:-240}" --out /tmp/bench | tee -a "$OUT/bench.txt"
cp /tmp/bench/*_profile/{profile.txt,profile_cpu.txt,trace.json.gz} /tmp/bench/*_profile.full.log "$OUT/" 2>/dev/null
cat /tmp/bench/*.log 2>/dev/null | grep -iE "error|Traceback" | tail -20 >> "$OUT/bench.txt"
true
