#!/usr/bin/env bash
# GPU checks for the kernels and the CUDA path; one run of about 8 minutes on one H200.
#
#   bash scripts/gpu_check.sh [--cpu] [OUT_DIR]     (from the repository root)
#
# Needs torch and triton (torch 2.11 / triton 3.6 on the lent machine); no
# network, no vLLM (its CUDA build cannot be installed there: the end-to-end
# step runs only where vLLM 0.32's CUDA build is importable).
#   1. install this package without dependencies (works offline);
#   2. the kernel tests compiled for the GPU;
#   3. the GPU harness without vLLM (tests/test_paged_decoder.py): the worker's
#      CUDA path on FLASH_ATTN caches equals its CPU run for every
#      configuration (once, rolling, per-head, streamed, per-layer groups with
#      MiniCache, a hybrid layout), the per-layer hooks and every compaction
#      step under torch.cuda.set_sync_debug_mode("error") (no host sync);
#   4. benchmarks/kernels.py: Triton vs torch vs the bytes-moved floor;
#   5. benchmarks/compaction.py: one compaction step, 64 requests x 8 layers x 8k tokens;
#   6. benchmarks/harness_serving.py: tokens/s compressed vs uncompressed at the
#      same KV memory, the decode step split, peak memory;
#   7. scripts/gpu_e2e.py through vLLM, where vLLM 0.32's CUDA build is installed.
# --cpu: the same script end to end without a GPU (CI-sized): the kernel tests
# and the harness's Triton ops under Triton's interpreter (the CUDA-vs-CPU
# equality needs CUDA: skipped, and the summary says so), the benchmarks at
# toy sizes on CPU, no end-to-end step.
# Results go to OUT_DIR (default $OUT, else ./gpu_check_out); summary.md there
# lists every step with its status and the benchmark tables. Exit status 1 if
# any step that ran failed.
set -uo pipefail
cd "$(dirname "$0")/.."
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ $CPU = 1 ]; then export TRITON_INTERPRET=1; else export TRITON_INTERPRET=0; fi
SUMMARY="$OUT_DIR/summary.md"
echo "# gpu_check.sh $([ $CPU = 1 ] && echo --cpu) ($(date -u +%Y-%m-%dT%H:%MZ))" > "$SUMMARY"
failed=0

# step NAME LOG TIMEOUT COMMAND...: runs it, logs it, records its status in the summary.
step() {
    local name=$1 log=$2 limit=$3; shift 3
    echo "== $name"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT_DIR/$log"
    local rc=${PIPESTATUS[0]}
    local status="passed"
    if [ "$rc" != 0 ]; then status="FAILED (exit $rc)"; failed=1; fi
    echo "- $name: $status in $((SECONDS - start)) s ($log): $(grep -E '[0-9]+ (passed|failed)' "$OUT_DIR/$log" | tail -1)" >> "$SUMMARY"
}

echo "== machine"
{ if [ $CPU = 0 ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; fi
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT_DIR/machine.txt"
{ echo; echo '```'; cat "$OUT_DIR/machine.txt"; echo '```'; echo; } >> "$SUMMARY"

echo "== install (no dependencies)"
# From the repository root the checkout is what imports (vllm_kvcompress/kernels
# links to kernels/); the install only has to exist for scripts run elsewhere.
# Without build isolation pip needs setuptools >= 70.1 (or the wheel package)
# on the machine: when it is missing, the checkout alone serves.
[ -e vllm_kvcompress/kernels/__init__.py ] || ln -sfn ../kernels vllm_kvcompress/kernels
if [ $CPU = 0 ]; then
    $PY -m pip install -q --no-deps --no-build-isolation --no-index . 2>&1 | tee "$OUT_DIR/install.txt" \
        || echo "install failed (above): running from the checkout" | tee -a "$OUT_DIR/install.txt"
fi
$PY -c "import vllm_kvcompress.kernels as k, kvc_tools.paged_decoder; print('kernels from', k.__file__)" \
    2>&1 | tee -a "$OUT_DIR/install.txt" || exit 1

# Without the project's addopts: every test of these files, extended ones
# included, in one process (the GPU machine may have no pytest-xdist).
PYTEST="$PY -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels -o addopts="
step "kernel tests" kernel_tests.txt 240 $PYTEST tests/kernels
if [ $CPU = 1 ]; then
    step "harness: Triton ops (interpreted) = torch ops, every configuration" paged_harness.txt 400 \
        $PYTEST tests/test_paged_decoder.py -k "triton or hybrid or admits"
    echo "- harness CUDA = CPU under sync-debug: SKIPPED (--cpu: needs CUDA)" >> "$SUMMARY"
    step "kernel benchmark (torch ops, CPU)" kernels_log.txt 120 \
        $PY benchmarks/kernels.py --num-reqs 2 --seq-len 256 --iters 3 --warmup 1 --out "$OUT_DIR/kernels.md"
    step "compaction benchmark (CPU)" compaction_log.txt 120 \
        $PY benchmarks/compaction.py --requests 4 --layers 2 --tokens 512 --budget 64 --q-heads 8 --kv-heads 2 \
        --head-dim 32 --repeats 2 --device cpu --out "$OUT_DIR/compaction.json"
    step "serving benchmark (toy sizes)" serving_log.txt 120 \
        $PY benchmarks/harness_serving.py --smoke --device cpu --out "$OUT_DIR/serving.md"
    echo "- end to end through vLLM: SKIPPED (--cpu)" >> "$SUMMARY"
else
    step "harness: CUDA = CPU, every configuration, no host sync" paged_harness.txt 240 \
        $PYTEST tests/test_paged_decoder.py -k "cuda or hybrid or admits"
    step "kernel benchmark" kernels_log.txt 120 $PY benchmarks/kernels.py --out "$OUT_DIR/kernels.md"
    step "compaction benchmark" compaction_log.txt 90 \
        $PY benchmarks/compaction.py --requests 64 --layers 8 --tokens 8192 --budget 1024 --device cuda \
        --out "$OUT_DIR/compaction.json"
    step "serving benchmark" serving_log.txt 240 \
        $PY benchmarks/harness_serving.py --device cuda --out "$OUT_DIR/serving.md"
    if $PY -c "import sys, vllm; sys.exit(not vllm.__version__.startswith('0.32'))" 2>/dev/null; then
        step "end to end through vLLM" e2e.txt 300 $PY scripts/gpu_e2e.py
    else
        echo "- end to end through vLLM: SKIPPED (vLLM 0.32 is not importable with $PY)" >> "$SUMMARY"
    fi
fi

for table in kernels.md serving.md; do
    [ -f "$OUT_DIR/$table" ] && { echo; cat "$OUT_DIR/$table"; } >> "$SUMMARY"
done
[ -f "$OUT_DIR/compaction.json" ] && { echo; echo '```'; cat "$OUT_DIR/compaction.json"; echo '```'; } >> "$SUMMARY"
echo; echo "== summary ($SUMMARY)"; cat "$SUMMARY"
exit $failed
