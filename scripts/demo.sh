#!/usr/bin/env bash
# The main job on the default model: offline generation, then a `vllm serve` round trip.
set -euo pipefail
cd "$(dirname "$0")/.."
# The recommended setting: SnapKV with span carry (a kept token keeps the 15 that
# follow it, so a needle's digits survive with its first one).
echo "=== offline: LLM(..., kv_compress='snapkv', kv_compress_budget=256, kv_compress_selection='span') on 2k-token prompts"
VLLM_LOGGING_LEVEL=WARNING .venv/bin/python examples/offline_generate.py --policy snapkv --budget 256 \
    --selection span --span 16 2>/dev/null
echo
echo "=== server: vllm serve SmolLM2 --kv-compress snapkv --kv-compress-budget 256 --kv-compress-selection span"
bash examples/serve_and_query.sh snapkv 256 --kv-compress-selection span --kv-compress-span 16
