"""H2O: keep heavy hitters (accumulated attention) plus the recent tokens."""

from dataclasses import dataclass, field

import torch

from .base import Observation, Observe, Policy, reduce_gqa, register_policy


@register_policy
@dataclass
class H2O(Policy):
    name = "h2o"
    observe = Observe.ALL
    rolling = True

    recent_ratio: float = field(default=0.5, metadata={"help": "fraction of the budget kept for the newest tokens"})
    gqa_reduce: str = field(default="mean", metadata={"help": "how a GQA group's query heads are reduced", "choices": ("mean", "max")})

    def validate(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if self.gqa_reduce not in ("mean", "max"):
            raise ValueError(f"gqa_reduce must be one of ['mean', 'max'], got {self.gqa_reduce!r}")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, int(budget * self.recent_ratio)

    def score(self, obs: Observation) -> torch.Tensor:
        return reduce_gqa(obs.attention, obs.num_kv_heads, self.gqa_reduce)
