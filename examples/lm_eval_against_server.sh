#!/usr/bin/env bash
# Run the offline RULER-style lm-eval suite (eval/tasks, see
# kvc_tools/longctx.py) against a `vllm serve` with KV compression.
#
#   examples/lm_eval_against_server.sh [POLICY [BUDGET [TASKS]]]
#
#   POLICY  compression policy, default snapkv; "none" serves without compression
#   BUDGET  tokens kept per request, default 256
#   TASKS   lm-eval task or group, default kvc_ruler_1k
#           (groups: kvc_ruler, kvc_ruler_1k, kvc_ruler_2k, kvc_ruler_4k;
#            tasks: kvc_{niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt,cwe}_{1k,2k,4k})
#
# Environment:
#   LIMIT          samples per task (lm-eval --limit); unset: all (20 per task)
#   MODEL          model folder (default: the cached SmolLM2-135M-Instruct)
#   PORT           server port (default 8321)
#   MAX_MODEL_LEN  default 4608 (the 4k tasks need 4096)
#   OUTPUT_PATH    if set, lm-eval writes results and per-sample logs there
#   EXTRA_SERVE_ARGS  appended to `vllm serve`
#
# Needs lm-eval (`pip install "lm-eval[api]"`). Runs fully offline; run it from
# anywhere (it changes to the repository root, where the task data paths are
# resolved). On 2 CPU cores a 1k-token request takes ~3-6 s; the 6 tasks of a
# group with LIMIT=2 take ~2 minutes plus ~40 s of server start.
set -euo pipefail

POLICY="${1:-snapkv}"
BUDGET="${2:-256}"
TASKS="${3:-kvc_ruler_1k}"
PORT="${PORT:-8321}"
MAX_MODEL_LEN="${MAX_MODEL_LEN:-4608}"
MODEL="${MODEL:-${VLLM_KVCOMPRESS_CACHE:-$HOME/.cache/vllm_kvcompress}/models/smollm2-135m-instruct}"

cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ ! -f "$MODEL/config.json" ]]; then
    echo "model folder $MODEL not found; run: python -m kvc_tools.models prepare smollm2" >&2
    exit 1
fi
command -v lm_eval >/dev/null || { echo "lm_eval not found: pip install 'lm-eval[api]'" >&2; exit 1; }
command -v vllm >/dev/null || { echo "vllm not found (activate the venv)" >&2; exit 1; }

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"

serve_args=(serve "$MODEL" --dtype float32 --enforce-eager
            --max-model-len "$MAX_MODEL_LEN" --host 127.0.0.1 --port "$PORT")
if [[ "$POLICY" != "none" ]]; then
    serve_args+=(--kv-compress "$POLICY" --kv-compress-budget "$BUDGET")
fi
# shellcheck disable=SC2206
serve_args+=(${EXTRA_SERVE_ARGS:-})

LOG="$(mktemp -t kvc-vllm-serve.XXXXXX.log)"
echo "starting: vllm ${serve_args[*]}  (log: $LOG)" >&2
vllm "${serve_args[@]}" >"$LOG" 2>&1 &
SERVER_PID=$!

stop_server() {
    if kill -0 "$SERVER_PID" 2>/dev/null; then
        echo "stopping server (pid $SERVER_PID)" >&2
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 30); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 1
        done
        kill -9 "$SERVER_PID" 2>/dev/null || true
    fi
}
trap stop_server EXIT INT TERM

echo -n "waiting for http://127.0.0.1:$PORT/health " >&2
for i in $(seq 1 180); do
    if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1; then
        echo " up after ${i}s" >&2
        break
    fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        echo " server exited; last log lines:" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
    if [[ $i -eq 180 ]]; then
        echo " timed out; last log lines:" >&2
        tail -n 30 "$LOG" >&2
        exit 1
    fi
    echo -n "." >&2
    sleep 1
done

lm_args=(--tasks "$TASKS" --include_path eval/tasks
         --model local-completions
         --model_args "model=$MODEL,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$MODEL,num_concurrent=1,max_retries=1,max_length=$MAX_MODEL_LEN")
if [[ -n "${LIMIT:-}" ]]; then
    lm_args+=(--limit "$LIMIT")
fi
if [[ -n "${OUTPUT_PATH:-}" ]]; then
    lm_args+=(--output_path "$OUTPUT_PATH" --log_samples)
fi

echo "policy=$POLICY budget=$BUDGET tasks=$TASKS limit=${LIMIT:-all}" >&2
# lm-eval prints the results table on stdout (progress on stderr).
lm_eval "${lm_args[@]}"
