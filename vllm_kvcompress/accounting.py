"""Compression statistics: per request and in total, kept by the scheduler.

Plain data, returned to clients by `vllm_kvcompress.stats()` and written to
the metrics snapshot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any


def per_layer(values) -> int | float:
    """Tokens per layer from per-group counts (groups hold equally many layers)."""
    total = sum(values)
    return total // len(values) if total % len(values) == 0 else total / len(values)


@dataclass
class RequestStats:
    policy: str
    prefill_len: int
    tokens_evicted: int | float = 0  # per layer: a mean over KV cache groups
    blocks_freed: int = 0
    compressions: int = 0
    # Tokens per layer (the mean over KV cache groups, which have equal sizes).
    tokens_kept: int | float = 0  # physical length after the latest compression
    blocks_held: int = 0  # after the latest compression, then when the cache was released
    finished: bool = False
    tokens_kept_per_group: tuple[int, ...] = ()
    # When the cache was released: blocks per vLLM KV cache group, compressed
    # or not (a hybrid model's sliding-window groups too).
    blocks_held_per_group: tuple[int, ...] = ()
    # Tokens taken from a saved compressed state (an earlier turn's): never computed.
    tokens_reused: int = 0
    # Its compressed state was kept for a later request (`reuse`).
    saved: bool = False


@dataclass
class CompressionStats:
    """Per-request and total counters kept by the scheduler."""

    total_blocks: int
    # Bytes of KV cache per block of the pool (the allocation over its
    # blocks): what a block costs at the cache's dtype, fp8 or the model's.
    block_bytes: int = 0
    # vLLM's KV cache groups in order: "compressed", or the kind vLLM manages
    # itself (a hybrid model's "sliding_window" groups).
    kv_cache_groups: tuple[str, ...] = ()
    max_finished: int = 1000  # finished requests remembered, oldest dropped first
    requests: dict = field(default_factory=dict)  # running
    finished: OrderedDict = field(default_factory=OrderedDict)
    tokens_evicted: int | float = 0  # per layer: a mean over KV cache groups
    blocks_freed: int = 0
    compressions: int = 0
    requests_compressed: int = 0
    preemptions: int = 0
    # `reuse`: compressed states kept, and requests and tokens that started from one.
    states_saved: int = 0
    states_reused: int = 0
    tokens_reused: int = 0

    def start(self, request_id: str, prefill_len: int, policy: str) -> None:
        self.requests[request_id] = RequestStats(policy=policy, prefill_len=prefill_len)

    def reused(self, request_id: str, tokens: int) -> None:
        """The request starts from a saved compressed state of `tokens` tokens."""
        self.requests[request_id].tokens_reused = tokens
        self.states_reused += 1
        self.tokens_reused += tokens

    def saved(self, request: RequestStats) -> None:
        """A finished request's compressed state is kept for later requests."""
        request.saved = True
        self.states_saved += 1

    def compressed(self, request_id: str, old: tuple[int, ...], new: tuple[int, ...], blocks_freed: int,
                   blocks_held: int) -> None:
        """Lengths per KV cache group; blocks summed over groups."""
        r = self.requests[request_id]
        if r.compressions == 0:
            self.requests_compressed += 1
        evicted = per_layer([o - n for o, n in zip(old, new)])
        r.tokens_evicted += evicted
        r.blocks_freed += blocks_freed
        r.compressions += 1
        r.blocks_held = blocks_held
        r.tokens_kept = per_layer(new)
        r.tokens_kept_per_group = tuple(new)
        self.tokens_evicted += evicted
        self.blocks_freed += blocks_freed
        self.compressions += 1

    def finish(self, request_id: str, preempted: bool, blocks_held: tuple[int, ...]) -> RequestStats | None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        r.finished = True
        r.blocks_held = sum(blocks_held)
        r.blocks_held_per_group = tuple(blocks_held)
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
        out: dict[str, Any] = {
            "total_blocks": self.total_blocks,
            "free_blocks": free_blocks,
            "block_bytes": self.block_bytes,
            "total_bytes": self.total_blocks * self.block_bytes,
            "free_bytes": free_blocks * self.block_bytes,
            "kv_cache_groups": list(self.kv_cache_groups),
            "tokens_evicted": self.tokens_evicted,
            "blocks_freed": self.blocks_freed,
            "compressions": self.compressions,
            "requests_compressed": self.requests_compressed,
            "preemptions": self.preemptions,
            "states_saved": self.states_saved,
            "states_reused": self.states_reused,
            "tokens_reused": self.tokens_reused,
        }
        if per_request:
            out["requests"] = {k: {**asdict(v), "bytes_held": v.blocks_held * self.block_bytes}
                               for k, v in {**self.finished, **self.requests}.items()}
        return out
