"""Choosing vLLM's model runner on CPU: V1 (``vllm.v1.worker.cpu_model_runner``)
or Model Runner V2 (MRV2, ``vllm.v1.worker.gpu`` through its CPU subclass
``vllm.v1.worker.cpu.model_runner``).

vLLM 0.32's CPU build enables Triton, and so MRV2, only when Triton lists a
``cpu`` backend (triton-cpu, which has no wheel). For tests, MRV2 runs with the
stub backend in ``tests/triton_cpu_stub`` (a checkout only; never installed):
it is found through ``PYTHONPATH`` (so the processes vLLM spawns find it too)
and never compiles; kernels run in Triton's interpreter (``TRITON_INTERPRET=1``).

vLLM decides whether it has Triton once per process, when ``vllm.triton_utils``
is first imported (which ``from vllm import LLM`` does), and binds its kernels
then. So MRV2 in *this* process needs ``use_runner("mrv2")`` to be entered
before that import; a process that already decided "no Triton" cannot switch
(``use_runner`` says so), and should start the engine in a fresh process with
``runner_env("mrv2")`` in its environment. Spawned engine cores and workers
are fresh processes: they follow the environment alone.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

RUNNERS = ("v1", "mrv2")

# The stub Triton backend: a package and its dist-info (entry point
# `[triton.backends] cpu = kvc_triton_cpu_stub`), in a checkout's tests/.
STUB_PATH = Path(__file__).resolve().parents[1] / "tests" / "triton_cpu_stub"
STUB_PACKAGE = "kvc_triton_cpu_stub"


def _check(runner: str) -> None:
    if runner not in RUNNERS:
        raise ValueError(f"unknown runner {runner!r}; one of {RUNNERS}")


def runner_env(runner: str) -> dict[str, str]:
    """The environment variables that make vLLM 0.32 on CPU use `runner`; the
    stub's folder is put first on the current ``PYTHONPATH``."""
    _check(runner)
    if runner == "v1":
        return {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if _real_triton_cpu():
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    if not (STUB_PATH / STUB_PACKAGE / "driver.py").is_file():
        raise FileNotFoundError(f"the stub Triton backend is not at {STUB_PATH} (it ships in a checkout only)")
    path = [str(STUB_PATH)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p and p != str(STUB_PATH)]
    return {"PYTHONPATH": os.pathsep.join(path), "TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}


def _real_triton_cpu() -> bool:
    """Whether an installed Triton backend named cpu (triton-cpu) exists: then no stub."""
    from importlib.metadata import entry_points

    return any(ep.name == "cpu" and ep.value != STUB_PACKAGE for ep in entry_points(group="triton.backends"))


def _vllm_decided_no_triton() -> bool:
    importing = sys.modules.get("vllm.triton_utils.importing")
    return importing is not None and not getattr(importing, "HAS_TRITON", False)


def _triton_bound_compiled() -> bool:
    """Whether Triton was imported without its interpreter: its own library
    functions (tl.max, ...) are then bound for compiling, which the stub cannot."""
    standard = sys.modules.get("triton.language.standard")
    if standard is None:
        return False
    from triton.runtime.jit import JITFunction

    return isinstance(getattr(standard, "sigmoid", None), JITFunction)


def _register_stub_backend() -> None:
    """Make the stub importable here and, if Triton has already discovered its
    backends (a dict filled once, at `import triton`), add it to that dict."""
    if str(STUB_PATH) not in sys.path:
        sys.path.insert(0, str(STUB_PATH))
    importlib.invalidate_caches()
    backends_module = sys.modules.get("triton.backends")
    if backends_module is None or "cpu" in backends_module.backends:
        return  # Triton discovers the stub's entry point when imported
    from triton.backends import Backend, _find_concrete_subclasses
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    compiler = importlib.import_module(f"{STUB_PACKAGE}.compiler")
    driver = importlib.import_module(f"{STUB_PACKAGE}.driver")
    backends_module.backends["cpu"] = Backend(_find_concrete_subclasses(compiler, BaseBackend),
                                              _find_concrete_subclasses(driver, DriverBase))


def _disable_vllm_envs_cache() -> None:
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        envs.disable_envs_cache()


@contextlib.contextmanager
def use_runner(runner: str) -> Iterator[dict[str, str]]:
    """Set `runner_env(runner)` in ``os.environ`` for the duration (restored
    after), so an `LLM(...)` made inside, in this process or spawned, uses
    `runner`. For "mrv2" the stub backend is also registered in this process;
    it stays registered after, as vLLM keeps any Triton kernels it bound."""
    env = runner_env(runner)
    if runner == "mrv2":
        if _vllm_decided_no_triton():
            raise RuntimeError(
                "vLLM in this process was imported without a Triton cpu backend (vllm.triton_utils.HAS_TRITON is "
                "False) and cannot switch to Model Runner V2 now: enter use_runner('mrv2') before importing vLLM's "
                "engine, or start the engine in a fresh process with runner_env('mrv2') in its environment")
        if env.get("TRITON_INTERPRET") == "1" and _triton_bound_compiled():
            raise RuntimeError(
                "Triton was imported in this process without TRITON_INTERPRET=1, so Model Runner V2's kernels "
                "cannot run in its interpreter here: set TRITON_INTERPRET=1 before importing torch or triton, or "
                "start the engine in a fresh process with runner_env('mrv2') in its environment")
        _register_stub_backend()
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    _disable_vllm_envs_cache()
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _disable_vllm_envs_cache()
