#!/usr/bin/env bash
# GPU checks for the kernels and the CUDA path; about 5 minutes on one H200.
#
#   bash scripts/gpu_check.sh [OUT_DIR]     (from the repository root)
#
# Needs a CUDA GPU with torch and triton; vLLM 0.32 (CUDA build) only for the
# end-to-end step, which is skipped, and says so, when vLLM is not importable.
#   1. install this package without dependencies (works offline);
#   2. the kernel tests compiled for the GPU (CI runs them in Triton's interpreter);
#   3. the GPU harness without vLLM (tests/test_paged_decoder.py -k cuda): the
#      worker's CUDA path on FLASH_ATTN caches (fused decode rows included)
#      equals its CPU run, no host syncs;
#   4. benchmarks/kernels.py: Triton vs torch vs the bytes-moved floor (incl.
#      fused decode attention + scores vs attention alone);
#   5. scripts/gpu_e2e.py: vLLM on the GPU with the plugin (FLASH_ATTN; its h2o
#      request decodes through the fused op and the metadata edit).
# Results go to OUT_DIR (default $OUT, else ./gpu_check_out). Exit status 1 if
# any step that ran failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
failed=0

echo "== machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT_DIR/machine.txt"

echo "== install (no dependencies)"
# From the repository root the checkout is what imports (vllm_kvcompress/kernels
# links to kernels/); the install only has to exist for scripts run elsewhere.
# Without build isolation pip needs setuptools >= 70.1 (or the wheel package)
# on the machine: when it is missing, the checkout alone serves.
[ -e vllm_kvcompress/kernels/__init__.py ] || ln -sfn ../kernels vllm_kvcompress/kernels
$PY -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | tee "$OUT_DIR/install.txt" \
    || echo "install failed (above): running from the checkout" | tee -a "$OUT_DIR/install.txt"
$PY -c "import vllm_kvcompress.kernels as k, kvc_tools.paged_decoder; print('kernels from', k.__file__)" \
    2>&1 | tee -a "$OUT_DIR/install.txt" || exit 1

echo "== kernel tests on the GPU"
timeout 300 $PY -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels tests/kernels 2>&1 \
    | tee "$OUT_DIR/kernel_tests.txt" || failed=1

echo "== the worker's CUDA path without vLLM (kvc_tools.paged_decoder: CUDA vs CPU, no host syncs)"
timeout 300 $PY -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels tests/test_paged_decoder.py -k cuda 2>&1 \
    | tee "$OUT_DIR/paged_harness.txt" || failed=1

echo "== kernel benchmark"
timeout 240 $PY benchmarks/kernels.py --out "$OUT_DIR/kernels.md" 2>&1 | tee "$OUT_DIR/kernels_log.txt" || failed=1

echo "== end to end through vLLM"
if $PY -c "import sys, vllm; sys.exit(not vllm.__version__.startswith('0.32'))" 2>/dev/null; then
    timeout 300 $PY scripts/gpu_e2e.py 2>&1 | tee "$OUT_DIR/e2e.txt" || failed=1
else
    echo "SKIPPED: vLLM 0.32 is not importable with $PY" | tee "$OUT_DIR/e2e.txt"
fi
exit $failed
