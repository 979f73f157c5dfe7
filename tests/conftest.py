"""Shared fixtures: the tiny random Llama, and real vLLM engines shared per module.

Engines run their core in the test process (a few seconds to start; a
spawned core takes ~25 s importing vLLM again), except tensor- and
data-parallel ones; each configuration is started once (module or session
scope) and shut down when its tests are done.

The suite runs on two pytest-xdist workers, one module at a time each
(pyproject's addopts: `-n 2 --dist loadfile`), the longest modules first.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# On two xdist workers (two processes on the two cores), one OpenMP thread per
# process: with two, a worker's engine step waits at every parallel region for
# a thread the other worker has descheduled (spinning, 3-4x slower; sleeping
# instead, OMP_WAIT_POLICY=PASSIVE, 2x slower even alone). The tiny models'
# steps gain little from a second thread (test_preemption alone: 46 s on one,
# 40 s on two). Inherited by the engine, server and script processes a test
# starts (vLLM sets its own workers' count from their core binding).
# Read when torch loads OpenMP, so before anything imports torch.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Each xdist worker on a core of its own, with what it starts (engine
    # threads, compile workers, servers). vLLM's CPU worker ignores
    # OMP_NUM_THREADS: it binds OpenMP threads to the cores
    # VLLM_CPU_OMP_THREADS_BIND names, by default ("auto") every core of the
    # NUMA node, and the two workers' engines, compilers and test code then
    # spin on the same cores: on the 2-core AMD EPYC two modules took 286 s
    # side by side against 141 s one after the other, and 85 s pinned like
    # this. Engines that need both cores (tensor and data parallel) name them.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.environ.setdefault("KVC_TEST_CORES", ",".join(map(str, cores)))  # helpers.all_cores
        core = cores[int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")) % len(cores)]
        os.sched_setaffinity(0, {core})
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(core))
# Not before: helpers imports torch, whose OpenMP reads OMP_NUM_THREADS as it loads.
from helpers import Engine  # noqa: E402

# Without a GPU, Triton runs on CPU tensors through its interpreter (the kernel
# tests, the GPU harness with the Triton ops). It must be set before Triton is
# first imported, which an engine test in the same run may do: hence here.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The model runner the engine tests run on: vLLM's V1 runner by default;
# KVC_TEST_RUNNER=mrv2 runs them on Model Runner V2 (through a stub Triton
# backend and Triton's interpreter: kvc_tools/runners.py), which `.ci/run`
# does for the tests marked `mrv2`. Set before anything imports vLLM, which
# decides once per process whether it has Triton.
RUNNER = os.environ.get("KVC_TEST_RUNNER", "v1")
if RUNNER != "v1":
    import sys

    from kvc_tools.runners import STUB_PATH, runner_env

    os.environ.update(runner_env(RUNNER))
    if RUNNER == "mrv2" and str(STUB_PATH) not in sys.path:
        sys.path.insert(0, str(STUB_PATH))


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


# The modules that take longest in the default suite (seconds on one of the
# two workers, the 2-core AMD EPYC, each worker pinned to a core), started
# first so that the two workers finish together; the rest follow in their
# usual order. Only the order changes, never what runs.
LONGEST_FIRST = (
    "test_server.py",  # a server, its tests: ~70 s
    "test_tensor_parallel.py",  # a TP 2 engine (spawned core and workers): ~65 s
    "test_reliability.py", "test_preemption.py",  # a server; engines preempting: ~40 s
    "test_cli.py",  # the real `vllm` commands, run at once (the extended run): ~70 s
    "test_eviction_equality.py", "test_admission_forecast.py", "test_kernels.py", "test_model_families.py",
)


# Tests whose Model Runner V2 run is extended (`.ci/run` runs it; the default
# MRV2 leg leaves it out): on V1 they run by default, and on MRV2, where
# Triton's interpreter runs vLLM's kernels, each costs minutes.
MRV2_EXTENDED = (
    "test_tensor_parallel.py::test_tensor_parallel_equals_one_device",
    "test_block_accounting.py::test_no_leak_with_preemption_and_aborts",
    # The model families run through the same hooks on both runners (V1 runs them by default).
    "test_model_families.py::test_every_policy_matches_the_reference",
    "test_model_families.py::test_gemma4_every_policy_matches_the_reference",
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    if RUNNER == "mrv2":
        for item in items:
            test = item.nodeid.removeprefix("tests/")
            if test in MRV2_EXTENDED or test.split("[")[0] in MRV2_EXTENDED:
                item.add_marker(pytest.mark.extended)

    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each module keeps its own order
