"""Shared fixtures: the tiny random Llama, and real vLLM engines shared per module.

Engines run their core in the test process (a few seconds to start; a
spawned core takes ~25 s importing vLLM again), except tensor- and
data-parallel ones; each configuration is started once (module or session
scope) and shut down when its tests are done.
"""

from __future__ import annotations

import os

import pytest

from helpers import Engine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Without a GPU, Triton runs on CPU tensors through its interpreter (the kernel
# tests, the GPU harness with the Triton ops). It must be set before Triton is
# first imported, which an engine test in the same run may do: hence here.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

@pytest.fixture(scope="session")
def tiny_model() -> str:
    from kvc_tools.models import build_tiny_llama, default_cache_root

    return str(build_tiny_llama(default_cache_root() / "models" / "tiny-llama-seed0", seed=0))


@pytest.fixture(scope="module")
def start_engine():
    """Factory fixture: engines started through it are closed after the module."""
    engines: list[Engine] = []

    def start(**kwargs) -> Engine:
        # In this process unless it needs several (tensor or data parallel).
        parallel = kwargs.get("tensor_parallel_size", 1) > 1 or kwargs.get("data_parallel_size", 1) > 1
        engines.append(Engine(in_process=not parallel, **kwargs))
        return engines[-1]

    yield start
    for e in engines:
        e.close()
