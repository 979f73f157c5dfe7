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
    budget: int | None = None  # resolved when prefill ends
    num_evicted: int = 0
    num_compressions: int = 0
    prefill_checked: bool = False

    @classmethod
    def create(cls, config: KVCompressConfig, prompt_len: int) -> RequestState:
        return cls(config=config, policy=config.make_policy(), prompt_len=prompt_len)

    def physical(self, logical_len: int) -> int:
        return logical_len - self.num_evicted

    def next_compression(self, logical_len: int, interval: int) -> int | None:
        """Physical length to compress to before the next token is written.

        `logical_len` is the number of tokens whose KV is in the cache. Called
        once per scheduling step; returns None when nothing is to be evicted.
        """
        if not self.config.enabled or logical_len < self.prompt_len:
            return None  # off, or still prefilling
        physical = self.physical(logical_len)
        if not self.prefill_checked:
            # Prefill just ended: every policy compresses an over-budget prompt.
            self.prefill_checked = True
            self.budget = self.config.resolve_budget(self.prompt_len, self.policy.min_budget())
            return self.budget if physical > self.budget else None
        if self.policy.rolling and physical >= self.budget + interval:
            return self.budget
        return None

    def commit(self, logical_len: int, new_physical: int) -> int:
        """Record a compression; return the number of tokens evicted."""
        evicted = self.physical(logical_len) - new_physical
        self.num_evicted += evicted
        self.num_compressions += 1
        return evicted

    def interval(self, block_size: int) -> int:
        return self.config.interval or block_size
