"""H2O: keep heavy hitters (accumulated attention) plus the recent tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.torch_ops import reduce_gqa
from .base import Observation, Observe, Scorer, check_choice
from .snapkv import GQA_REDUCTIONS


@dataclass(frozen=True)
class H2O(Scorer):
    name = "h2o"
    observe = Observe.ALL

    recent_ratio: float = field(default=0.5, metadata={"help": "fraction of the budget kept for the newest tokens"})
    gqa_reduce: str = field(default="mean", metadata={
        "help": "how a GQA group's query heads are reduced", "choices": GQA_REDUCTIONS})

    def validate(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:  # also rejects NaN
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        check_choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, int(budget * self.recent_ratio)

    def score(self, obs: Observation) -> torch.Tensor:
        assert obs.attention is not None
        return reduce_gqa(obs.attention, obs.attention.shape[0] // obs.num_kv_heads, self.gqa_reduce)
