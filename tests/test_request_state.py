"""After a burst of compressed requests ends, the plugin holds nothing of them.

A server runs for days: whatever the plugin keeps per request must go when
the request does, however it ends (finished, aborted mid-decode, preempted
by a tight pool, failed in the worker's compaction). One in-process engine
with a small pool (preemptions) and the fault hook (one prompt length fails
its compaction) serves a burst of requests of mixed policies, some aborted
mid-decode; then every container the plugin's scheduler and worker objects
reach (walked generically, so that a container added later is checked too)
must hold no request id of the burst, the per-request objects must be gone
from the heap, and the worker's tensors must be back to their size before
the burst. What may stay: the finished requests' records in the scheduler's
stats (`/stats`), at most `CompressionStats.max_finished` of them.
"""

from __future__ import annotations

import gc
import logging

import pytest
import torch
from _pytest.logging import LogCaptureHandler

from helpers import engine_kwargs, in_process_engine, random_prompts
from vllm_kvcompress.vllm_seam.worker import FAULT_ENV
from vllm_kvcompress.vllm_seam.worker.state import attached

NUM_BLOCKS = 20  # of 32 tokens: the burst's two uncompressed requests alone do not fit
FAULTY_PROMPT_LEN = 157
PREFIX = "burstreq"  # every request id of the burst starts with it (vLLM appends a suffix)
KEEP_FINISHED = 4  # the stats' bound on finished records, small for the test

# (prompt length, kv_compress overrides, max_tokens); None: uncompressed.
BURST = [
    (230, None, 150),  # first in, last preempted: the compressed ones behind them are
    (240, None, 150),
    (180, {"policy": "snapkv", "budget": 64}, 24),
    (200, {"policy": "snapkv-span", "compression_ratio": 0.75}, 24),
    (150, {"policy": "h2o", "budget": 48, "interval": 8}, 30),
    (210, {"policy": "tova", "budget": 64}, 24),
    (170, {"policy": "streamingllm", "budget": 48}, 24),
    (190, {"policy": "adakv", "budget": 64}, 20),
    (160, {"policy": "snapkv", "budget": 96, "window": 16}, 20),
    (220, {"policy": "keyformer", "budget": 64}, 20),
    (140, {"policy": "rkv", "budget": 48, "interval": 8}, 30),
    (175, {"policy": "knorm", "compression_ratio": 0.5}, 20),
    (FAULTY_PROMPT_LEN, {"policy": "snapkv", "budget": 64}, 20),  # FAULTY: its compaction raises
    (185, {"policy": "random", "budget": 64}, 20),
]
FAULTY = 12
ABORT_AFTER = {4: 5, 10: 3, 13: 12}  # burst index -> aborted once it has this many output tokens (mid-decode)


@pytest.fixture(scope="module")
def engine(tiny_model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FAULT_ENV, str(FAULTY_PROMPT_LEN))  # read when the worker starts
        with in_process_engine(**engine_kwargs(tiny_model, kv_compress="none",
                                               num_gpu_blocks_override=NUM_BLOCKS, max_model_len=512)) as e:
            yield e


def plugin_objects(engine) -> dict[str, object]:
    """The plugin's per-engine objects: the scheduler, its managers, the
    worker's WorkerCompression and its runner view (names for messages)."""
    core = engine.llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler
    runner = core.model_executor.driver_worker.worker.model_runner
    worker = attached(runner)
    assert worker is not None, "the worker has no compression state"
    objects: dict[str, object] = {"scheduler": scheduler, "worker": worker, "worker.runner": worker.runner}
    for i, manager in enumerate(scheduler._kvc_all_managers):
        objects[f"manager{i}"] = manager
    return objects


# What the walk does not enter: vLLM's model, its KV caches and its runner (the
# plugin's view of it is walked), and plain values.
_SKIPPED_ATTRS = {"layers", "runner", "model", "kv_cache", "vllm_config", "kv_cache_config", "views", "ops"}
_LEAVES = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)


def _is_burst_id(value) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def walk(objects: dict[str, object], depth: int = 4) -> tuple[dict[str, int], dict[str, int]]:
    """(path -> entries naming a burst request, path -> tensor bytes) over everything
    reachable from `objects` through attributes and containers, `depth` levels
    deep: every dict, set, list, tuple and deque is checked for burst ids among
    its keys and items, however it is named."""
    found: dict[str, int] = {}
    seen: set[int] = set()
    tensors: dict[int, tuple[str, int]] = {}  # storage pointer -> (a path, bytes): views counted once

    def visit(path: str, value, level: int) -> None:
        if isinstance(value, _LEAVES) or id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type != "meta":
                storage = value.untyped_storage()
                tensors[storage.data_ptr()] = (path, storage.nbytes())
            return
        if level > depth or callable(value) and not hasattr(value, "__dict__"):
            return
        if isinstance(value, dict):
            hits = sum(_is_burst_id(k) for k in value)
            if hits:
                found[path] = hits
            for k, v in list(value.items()):
                visit(f"{path}[{k!r}]" if not _is_burst_id(k) else f"{path}[<burst id>]", v, level + 1)
            return
        if isinstance(value, (list, tuple, set, frozenset)) or type(value).__name__ == "deque":
            items = list(value)
            hits = sum(_is_burst_id(v) for v in items)
            if hits:
                found[path] = hits
            for i, v in enumerate(items[:256]):
                visit(f"{path}[{i}]", v, level + 1)
            return
        attrs = getattr(value, "__dict__", None)
        if attrs is None and hasattr(value, "__slots__"):
            attrs = {s: getattr(value, s) for s in value.__slots__ if hasattr(value, s)}
        if not attrs:
            return
        if _is_burst_id(getattr(value, "request_id", None)):
            found[path] = found.get(path, 0) + 1  # a record of a burst request
        for name, v in list(attrs.items()):
            if name not in _SKIPPED_ATTRS and not name.startswith("__"):
                visit(f"{path}.{name}", v, level + 1)

    for name, obj in objects.items():
        seen.add(id(obj))
        for attr, v in list(vars(obj).items()):
            if attr not in _SKIPPED_ATTRS:
                visit(f"{name}.{attr}", v, 1)
    return found, dict(tensors.values())


# The plugin's per-request types: none may be alive once the burst is over.
PER_REQUEST_TYPES = ("RequestTokens", "RequestSchedule", "StartedRequest", "Compaction", "ReportedBudgets")


def live_plugin_objects() -> dict[str, int]:
    """Live instances of the plugin's classes on the heap, by class name.

    pytest's log capture keeps every record, and a failure's record its
    exception's traceback, whose frames hold the failed compaction's locals
    (a server's handlers format a record and drop it): dropped first."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, LogCaptureHandler):
            handler.records.clear()  # in place: the report's stash holds this very list
    gc.collect()
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        cls = type(obj)
        if cls.__module__.startswith("vllm_kvcompress"):
            counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    return counts


def params(max_tokens: int, config: dict | None):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                          extra_args=None if config is None else {"kv_compress": config})


def run_burst(engine) -> dict[str, str]:
    """The burst, step by step; how each request ended, by its index."""
    llm_engine = engine.llm.llm_engine
    prompts = random_prompts([n for n, _, _ in BURST], seed=42)
    for i, (prompt, (_, config, max_tokens)) in enumerate(zip(prompts, BURST)):
        llm_engine.add_request(f"{PREFIX}{i}", {"prompt_token_ids": prompt}, params(max_tokens, config))
    ended: dict[str, str] = {}
    step = 0
    while llm_engine.has_unfinished_requests():
        for out in llm_engine.step():
            name = out.request_id.split("-")[0]
            index = int(name.removeprefix(PREFIX))
            if out.finished and name not in ended:
                ended[name] = str(out.outputs[0].finish_reason)
            elif len(out.outputs[0].token_ids) >= ABORT_AFTER.get(index, 10**9):
                llm_engine.abort_request([out.request_id], internal=True)
                ended[name] = "abort"
        step += 1
        assert step < 2000, "the burst did not end"
    settle(engine)
    return ended


def settle(engine) -> None:
    """vLLM tells the worker of the last finished requests in the step after
    they finish (the engine core keeps stepping while it has some to tell)."""
    llm_engine = engine.llm.llm_engine
    for _ in range(10):
        if not llm_engine.engine_core.engine_core.scheduler.has_requests():
            return
        llm_engine.step()
    raise AssertionError("the engine did not go idle")


@pytest.mark.mrv2
def test_nothing_of_a_burst_stays(engine):
    objects = plugin_objects(engine)
    scheduler, worker = objects["scheduler"], objects["worker"]
    scheduler.kvc_stats.max_finished = KEEP_FINISHED
    engine.generate(random_prompts((120,), seed=1), 8, [{"policy": "snapkv", "budget": 32}])  # warm up
    settle(engine)
    _, tensors_before = walk(objects)
    preemptions_before = scheduler.kvc_stats.preemptions

    ended = run_burst(engine)

    # The burst did what it is meant to: each way of ending happened.
    assert scheduler.kvc_stats.preemptions > preemptions_before, "the pool was meant to be too small"
    assert ended[f"{PREFIX}{FAULTY}"] == "error", ended
    assert {name for name, reason in ended.items() if reason == "abort"} == {f"{PREFIX}{i}" for i in ABORT_AFTER}
    assert sum(reason == "length" for reason in ended.values()) == len(BURST) - len(ABORT_AFTER) - 1, ended

    found, tensors = walk(objects)
    # Finished records stay for /stats, bounded.
    kept = {path: n for path, n in found.items() if path == "scheduler.kvc_stats.finished"}
    assert sum(kept.values()) <= KEEP_FINISHED
    assert len(scheduler.kvc_stats.finished) <= KEEP_FINISHED
    leaks = {path: n for path, n in found.items()
             if path not in kept and not path.startswith("scheduler.kvc_stats.finished[")}
    assert not leaks, f"per-request state left after the burst: {leaks}"
    assert sum(tensors.values()) <= sum(tensors_before.values()), (tensors_before, tensors)
    live = live_plugin_objects()
    assert not {name: live[name] for name in PER_REQUEST_TYPES if live.get(name)}, live
    assert live.get("RequestStats", 0) <= KEEP_FINISHED, live
    # The worker's step state and the block pool are back to idle too.
    assert worker.step is None and worker.metadata_edits is None and not worker.failed and not worker.reported
    assert scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


def test_the_worker_trims_its_heap_after_requests_end():
    """`HeapTrimmer`: only after a step in which requests ended; at once when
    the step computes nothing, otherwise every `interval` seconds; never with
    interval 0."""
    from vllm_kvcompress.vllm_seam.worker.heap import HeapTrimmer

    now = [100.0]
    trimmer = HeapTrimmer(interval=30.0, clock=lambda: now[0])
    calls: list[int] = []
    trimmer.trim = lambda pad: calls.append(pad) or 1
    assert not trimmer.after_step(ended=False, idle=True)  # nothing ended
    assert trimmer.after_step(ended=True, idle=True)  # idle: at once
    assert not trimmer.after_step(ended=False, idle=True)  # nothing ended since
    now[0] += 5
    assert not trimmer.after_step(ended=True, idle=False)  # busy: waits for the interval
    now[0] += 20
    assert not trimmer.after_step(ended=False, idle=False)
    now[0] += 10
    assert trimmer.after_step(ended=False, idle=False)  # the end was remembered
    assert calls == [0, 0] and trimmer.trims == 2
    off = HeapTrimmer(interval=0.0)
    assert off.trim is None and not off.after_step(ended=True, idle=True)
