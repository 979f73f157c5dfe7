"""When a request is compressed and to how many tokens: pure bookkeeping.

The scheduler (which frees blocks), the worker (which compacts) and the
reference decoder (the test oracle) all follow this one state machine, so they
agree on every compression without talking to each other. The decision needs
only lengths; which tokens survive is the policy's business, in the worker.

Lengths: *logical* counts every token the request has seen (RoPE positions,
vLLM's `num_computed_tokens`); *physical* counts the cache slots it holds.
`num_evicted` = logical - physical.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import KVCompressConfig
from .policies import Policy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class RequestState:
    """One request's compression state. Reset when its KV cache is dropped."""

    config: KVCompressConfig
    policy: Policy
    prompt_len: int
    budget: int | None = None  # None: compression off
    num_evicted: int = 0
    num_compressions: int = 0
    prefill_checked: bool = False

    @classmethod
    def create(cls, config: KVCompressConfig, prompt_len: int) -> RequestState:
        policy = config.make_policy()
        budget = config.resolve_budget(prompt_len, policy.min_budget()) if config.enabled else None
        return cls(config=config, policy=policy, prompt_len=prompt_len, budget=budget)

    def physical(self, logical_len: int) -> int:
        return logical_len - self.num_evicted

    def next_compression(self, logical_len: int, interval: int) -> int | None:
        """Physical length to compress to before the next token is written.

        `logical_len` is the number of tokens whose KV is in the cache. Called
        once per scheduling step; returns None when nothing is to be evicted.
        """
        if self.budget is None:
            return None
        physical = self.physical(logical_len)
        if logical_len < self.prompt_len:
            # Still prefilling: only a streamed prompt evicts, at chunk ends.
            chunk = self.policy.prompt_chunk_size()
            return self.budget if chunk and physical >= self.budget + chunk else None
        if not self.prefill_checked:
            # Prefill just ended: every policy compresses an over-budget prompt.
            self.prefill_checked = True
            return self.budget if physical > self.budget else None
        if self.policy.rolling and physical >= self.budget + interval:
            return self.budget
        return None

    def prefill_cap(self, logical_len: int) -> int | None:
        """Most prompt tokens the next step may prefill (None: no limit).

        A streamed prompt's chunk must end where its next eviction is due, so
        that every run (any batch, any chunking) evicts at the same tokens.
        """
        chunk = self.policy.prompt_chunk_size() if self.budget is not None else 0
        if not chunk or logical_len >= self.prompt_len:
            return None
        return max(self.budget + chunk - self.physical(logical_len), 0)

    def commit(self, logical_len: int, new_physical: int) -> int:
        """Record a compression; return the number of tokens evicted."""
        evicted = self.physical(logical_len) - new_physical
        self.num_evicted += evicted
        self.num_compressions += 1
        return evicted

    def interval(self, block_size: int) -> int:
        return self.config.interval or block_size
