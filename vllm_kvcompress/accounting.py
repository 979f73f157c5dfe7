"""Messages between scheduler and workers, and compression statistics.

Plain data: pickled from the engine core to the workers with each step, and
returned to clients by `vllm_kvcompress.stats()`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field

PLAN_ATTR = "kv_compress_plan"  # the StepPlan's attribute on vLLM's SchedulerOutput


@dataclass
class StepPlan:
    """What the workers must do for the step it is attached to."""

    # Requests whose compression state (re)starts: id -> (prefill length, config dict).
    started: dict[str, tuple[int, dict]] = field(default_factory=dict)
    # Compactions to run before the step's forward: (request id, old, new physical length).
    ops: list[tuple[str, int, int]] = field(default_factory=list)
    # logical - physical length of every scheduled request with a state.
    evicted: dict[str, int] = field(default_factory=dict)


@dataclass
class RequestStats:
    policy: str
    prefill_len: int
    tokens_evicted: int = 0
    blocks_freed: int = 0
    compressions: int = 0
    tokens_kept: int = 0  # physical length after the latest compression
    blocks_held: int = 0  # after the latest compression, then when the cache was released
    finished: bool = False


@dataclass
class CompressionStats:
    """Per-request and total counters kept by the scheduler."""

    total_blocks: int
    max_finished: int = 1000  # finished requests remembered, oldest dropped first
    requests: dict = field(default_factory=dict)  # running
    finished: OrderedDict = field(default_factory=OrderedDict)
    tokens_evicted: int = 0
    blocks_freed: int = 0
    compressions: int = 0
    requests_compressed: int = 0
    preemptions: int = 0

    def start(self, request_id: str, prefill_len: int, policy: str) -> None:
        self.requests[request_id] = RequestStats(policy=policy, prefill_len=prefill_len)

    def compressed(self, request_id: str, old: int, new: int, blocks_freed: int, blocks_held: int) -> None:
        r = self.requests[request_id]
        if r.compressions == 0:
            self.requests_compressed += 1
        r.tokens_evicted += old - new
        r.blocks_freed += blocks_freed
        r.compressions += 1
        r.blocks_held = blocks_held
        r.tokens_kept = new
        self.tokens_evicted += old - new
        self.blocks_freed += blocks_freed
        self.compressions += 1

    def finish(self, request_id: str, preempted: bool, blocks_held: int) -> RequestStats | None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        r.finished = True
        r.blocks_held = blocks_held
        # A preempted request starts over (re-prefill, new state); its first
        # life is kept under a distinct key so totals stay explainable.
        key = request_id
        if preempted:
            self.preemptions += 1
            key = f"{request_id}#preempted{self.preemptions}"
        self.finished[key] = r
        while len(self.finished) > self.max_finished:
            self.finished.popitem(last=False)
        return r

    def snapshot(self, free_blocks: int, per_request: bool = True) -> dict:
        out = {
            "total_blocks": self.total_blocks,
            "free_blocks": free_blocks,
            "tokens_evicted": self.tokens_evicted,
            "blocks_freed": self.blocks_freed,
            "compressions": self.compressions,
            "requests_compressed": self.requests_compressed,
            "preemptions": self.preemptions,
        }
        if per_request:
            out["requests"] = {k: asdict(v) for k, v in {**self.finished, **self.requests}.items()}
        return out
