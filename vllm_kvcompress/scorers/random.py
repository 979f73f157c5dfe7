"""Random eviction: the baseline every attention-based scorer must beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .base import Observation, Scorer, check_at_least, hash_uniform


@dataclass(frozen=True)
class Random(Scorer):
    name = "random"

    window: int = field(default=0, metadata={"help": "newest tokens always kept"})
    seed: int = field(default=0, metadata={"help": "seed of the random scores"})

    def validate(self) -> None:
        check_at_least("window", self.window, 0)

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
