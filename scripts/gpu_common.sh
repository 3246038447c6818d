# Sourced by the scripts/gpu_*.sh drivers (not run on its own): strict mode, repository root as the working
# directory, $OUT (required) with $LOG = $OUT/log.txt, $PY, offline hub, NVLink multicast off, and say() for
# time-stamped log lines.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
: "${OUT:?set OUT to the output directory}"
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the host is shared: keep these
LOG="$OUT/log.txt"
touch "$LOG"
say() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
