"""TOVA: evict the tokens the newest query attends to least."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.reference import reduce_gqa
from .base import Observation, Observe, Scorer, check_at_least


@dataclass(frozen=True)
class TOVA(Scorer):
    name = "tova"
    observe = Observe.LAST

    window: int = field(default=0, metadata={"help": "newest tokens always kept"})

    def validate(self) -> None:
        check_at_least("window", self.window, 0)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return max(self.window, 1)

    def score(self, obs: Observation) -> torch.Tensor:
        # The newest query's attention averaged over each KV head's own query
        # group, so each KV head keeps its own tokens. (methods.md averages over
        # all query heads, one selection per layer: not what this does yet.)
        assert obs.attention is not None
        return reduce_gqa(obs.attention, obs.attention.shape[0] // obs.num_kv_heads, "mean")
