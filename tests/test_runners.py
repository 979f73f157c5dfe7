"""vLLM's two model runners on CPU (kvc_tools.runners), without compression:
Model Runner V2 (through the stub Triton backend in tests/triton_cpu_stub and
Triton's interpreter) gives the V1 runner's greedy tokens.

vLLM decides once per process, at its first import of vllm.triton_utils,
whether it has Triton, so MRV2 runs in a fresh Python process: one that
enters `use_runner("mrv2")` before importing vLLM's engine and starts an
in-process engine. V1 runs here, while that process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import Engine, engine_kwargs, random_prompts
from kvc_tools.runners import RUNNERS, STUB_PATH, runner_env, use_runner

PROMPTS = random_prompts([3, 29, 70, 133], seed=5)
MAX_TOKENS = 16

# Run in a fresh process: argv = model, prompts (JSON), in_process (0/1);
# prints one line `RESULT {...}` with the tokens and the runner's class.
_MRV2_SCRIPT = """
import json, sys, time
sys.path.insert(0, sys.argv[4])
from helpers import Engine, engine_kwargs
from kvc_tools.runners import use_runner

def main():
    model, prompts, in_process = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "1"
    start = time.perf_counter()
    with use_runner("mrv2"):
        engine = Engine(in_process=in_process, **engine_kwargs(model))
    started = time.perf_counter()
    tokens = engine.generate(prompts, max_tokens=%d)
    done = time.perf_counter()
    runner = None
    if in_process:
        worker = engine.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        runner = type(worker.model_runner).__module__
    engine.close()
    print("RESULT " + json.dumps({"tokens": tokens, "runner": runner, "start_s": started - start,
                                  "generate_s": done - started}), flush=True)

if __name__ == "__main__":  # a spawned engine core imports this module again
    main()
""" % MAX_TOKENS


def _start_mrv2(model: str, in_process: bool, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / f"mrv2_{int(in_process)}.py"
    script.write_text(_MRV2_SCRIPT)
    log = tmp_path / f"mrv2_{int(in_process)}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(script), model, json.dumps(PROMPTS), str(int(in_process)),
                                 str(Path(__file__).parent)], stdout=out, stderr=subprocess.STDOUT)
    return proc, log


def _mrv2_result(proc: subprocess.Popen, log: Path, timeout: float) -> dict:
    proc.wait(timeout=timeout)
    text = log.read_text()
    results = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and results, f"MRV2 process failed ({proc.returncode}):\n{text[-6000:]}"
    assert "Using V2 Model Runner" in text
    return json.loads(results[-1][len("RESULT "):])


def _v1_tokens(model: str) -> tuple[list[list[int]], str]:
    with use_runner("v1"):
        engine = Engine(in_process=True, **engine_kwargs(model))
    try:
        worker = engine.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
        return engine.generate(PROMPTS, max_tokens=MAX_TOKENS), type(worker.model_runner).__module__
    finally:
        engine.close()


def test_runner_env():
    assert RUNNERS == ("v1", "mrv2")
    assert runner_env("v1") == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    env = runner_env("mrv2")
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "1" and env["TRITON_INTERPRET"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(STUB_PATH)
    before = dict(os.environ)
    with use_runner("v1") as set_env:
        assert set_env == runner_env("v1") and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert dict(os.environ) == before
    with pytest.raises(ValueError):
        runner_env("v3")


def test_stub_backend_is_discovered_through_pythonpath():
    """A fresh process with runner_env's PYTHONPATH finds Triton's `cpu` backend,
    and vLLM then has Triton (as every process vLLM spawns would)."""
    code = ("from triton.backends import backends; from triton.runtime import driver; "
            "from vllm.triton_utils import HAS_TRITON; "
            "print('cpu' in backends, driver.active.get_current_target().backend, HAS_TRITON)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **runner_env("mrv2")},
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-3:] == ["True", "cpu", "True"]


# In process; the spawned variant (the engine core and its worker find the
# stub through the environment alone) takes ~40 s: each spawned process
# imports vLLM again.
@pytest.mark.extended
@pytest.mark.parametrize("in_process", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mrv2_matches_v1(tiny_model, tmp_path, in_process):
    start = time.perf_counter()
    proc, log = _start_mrv2(tiny_model, in_process=in_process, tmp_path=tmp_path)
    try:
        v1, v1_runner = _v1_tokens(tiny_model)
        mrv2 = _mrv2_result(proc, log, timeout=600)
    finally:
        proc.kill()
    print(f"MRV2 start {mrv2['start_s']:.1f} s, generate {mrv2['generate_s']:.1f} s; "
          f"both runners {time.perf_counter() - start:.1f} s")
    assert v1_runner == "vllm.v1.worker.cpu_model_runner"
    if in_process:  # the runner of a spawned core is not in this process to read
        assert mrv2["runner"] == "vllm.v1.worker.cpu.model_runner"  # MRV2's CPU subclass of vllm.v1.worker.gpu's
    assert [len(t) for t in v1] == [MAX_TOKENS] * len(PROMPTS)
    assert mrv2["tokens"] == v1
