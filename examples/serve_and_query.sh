#!/usr/bin/env bash
# Serve SmolLM2 with KV compression, send one long completion, show what was evicted.
#
#   examples/serve_and_query.sh [POLICY [BUDGET [FLAG...]]]   (default: snapkv 512)
#   examples/serve_and_query.sh snapkv 512 --kv-compress-selection span --kv-compress-span 16
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
POLICY="${1:-snapkv}"
BUDGET="${2:-512}"
shift $(( $# < 2 ? $# : 2 ))  # the rest: more --kv-compress-* flags
PORT="${PORT:-8322}"
PY=.venv/bin/python
MODEL=$($PY -m kvc_tools.models prepare smollm2 2>/dev/null | tail -1)
LOG=$(mktemp /tmp/kvcompress-serve.XXXX.log)

HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} .venv/bin/vllm serve "$MODEL" \
    --host 127.0.0.1 --port "$PORT" --dtype float32 --enforce-eager --block-size 32 \
    --max-model-len 4096 --kv-compress "$POLICY" --kv-compress-budget "$BUDGET" "$@" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
echo "starting vllm serve --kv-compress $POLICY --kv-compress-budget $BUDGET $* (log: $LOG)"
for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
    kill -0 $SERVER 2>/dev/null || { tail -30 "$LOG"; exit 1; }
    sleep 1
done

# A needle-in-a-haystack prompt of ~2k tokens from the offline eval suite.
$PY - "$PORT" "$MODEL" <<'PY'
import json, sys, urllib.request
sys.path.insert(0, ".")
from kvc_tools.longctx import generate_samples
port, model = sys.argv[1], sys.argv[2]
sample = generate_samples("niah_single", 2048, 1)[0]
body = json.dumps({"model": model, "prompt": sample["input"], "max_tokens": 16, "temperature": 0}).encode()
req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"})
out = json.load(urllib.request.urlopen(req, timeout=300))
print(f"prompt tokens: {out['usage']['prompt_tokens']}, expected answer {sample['outputs'][0]}, "
      f"completion: {out['choices'][0]['text'].strip()!r}")
PY
sleep 1
echo "--- what the server's scheduler logged:"
grep -o "kv_compress .*" "$LOG" | grep -v "ready" | tail -5
