#!/usr/bin/env bash
# The vLLM 0.34 test leg: in .venv-vllm034 (scripts/setup_vllm034.sh), the
# tests marked mrv2 (0.34's CPU runner is Model Runner V2 itself; Triton's
# interpreter and the test-only stub backend run its kernels, as for MRV2 on
# 0.32), the version-window tests and the seam check against the installed 0.34.
# Extra arguments go to pytest. Exits 0 with one line when the leg is not set up.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm034/bin/python ]; then
  echo "vLLM 0.34 leg skipped: .venv-vllm034 is not set up (scripts/setup_vllm034.sh needs ../shared/wheels)"
  exit 0
fi
export KVC_TEST_RUNNER=mrv2
start=$(date +%s)
.venv-vllm034/bin/python -m pytest -q -m "mrv2 or versions" "$@"
echo "vLLM 0.34 leg: passed in $(( $(date +%s) - start )) s"
