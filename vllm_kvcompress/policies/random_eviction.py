"""Random eviction: the baseline every scored policy must beat."""

from dataclasses import dataclass, field

import torch

from .base import Observation, Policy, hash_uniform, register_policy


@register_policy
@dataclass
class Random(Policy):
    name = "random"
    rolling = True

    window: int = field(default=0, metadata={"help": "newest tokens always kept"})
    seed: int = field(default=0, metadata={"help": "seed of the random scores"})

    def validate(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return max(self.window, 1)

    def score(self, obs: Observation) -> torch.Tensor:
        heads = torch.arange(obs.num_kv_heads).view(-1, 1)
        return hash_uniform(
            self.seed, torch.tensor(obs.layer), torch.tensor(obs.num_compressions),
            heads, obs.positions,
        ).to(torch.float32)
