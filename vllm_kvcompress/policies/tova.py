"""TOVA: evict the tokens the newest query attends to least."""

from dataclasses import dataclass, field

import torch

from .base import Observation, Observe, Policy, reduce_gqa, register_policy


@register_policy
@dataclass
class TOVA(Policy):
    name = "tova"
    observe = Observe.LAST
    rolling = True

    window: int = field(default=0, metadata={"help": "newest tokens always kept"})

    def validate(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return max(self.window, 1)

    def score(self, obs: Observation) -> torch.Tensor:
        # TOVA averages the last query's attention over heads.
        return reduce_gqa(obs.attention, obs.num_kv_heads, "mean")
