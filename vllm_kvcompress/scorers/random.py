"""Random eviction: the baseline every attention-based scorer must beat."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..limits import bounded
from .base import KeepsRecent, Observation, hash_uniform


@dataclass(frozen=True)
class Random(KeepsRecent):
    name = "random"

    seed: int = field(default=0, metadata=bounded(0, "seed", help="seed of the random scores"))

    def score(self, obs: Observation) -> torch.Tensor:
        heads = (torch.arange(obs.num_kv_heads, device=obs.positions.device) + obs.first_kv_head).view(-1, 1)
        return hash_uniform(self.seed, obs.layer, obs.num_compressions, heads, obs.positions).to(torch.float32)
