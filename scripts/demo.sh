#!/usr/bin/env bash
# The main job on the default model: offline generation, then a `vllm serve` round trip.
set -euo pipefail
cd "$(dirname "$0")/.."
# The recommended policy, snapkv-span: SnapKV's scores with span carry (a kept
# token keeps the 15 that follow it, so a needle's digits survive with its first
# one) and the first 4 tokens kept as attention sinks. Budget 256 of ~2,000
# prompt tokens per layer and KV head: an eighth.
echo "=== offline: LLM(..., kv_compress='snapkv-span', kv_compress_budget=256) on 2k-token prompts"
VLLM_LOGGING_LEVEL=WARNING .venv/bin/python examples/offline_generate.py --policy snapkv-span --budget 256 2>/dev/null
echo
echo "=== server: vllm serve SmolLM2 --kv-compress snapkv-span --kv-compress-budget 256"
bash examples/serve_and_query.sh snapkv-span 256
