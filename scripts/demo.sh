#!/usr/bin/env bash
# The main job on the default model: offline generation, then a `vllm serve` round trip.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "=== offline: LLM(..., kv_compress='snapkv', kv_compress_budget=512) on 2k-token prompts"
VLLM_LOGGING_LEVEL=WARNING .venv/bin/python examples/offline_generate.py --policy snapkv --budget 512 2>/dev/null
echo
echo "=== server: vllm serve SmolLM2 --kv-compress snapkv --kv-compress-budget 512"
bash examples/serve_and_query.sh snapkv 512
