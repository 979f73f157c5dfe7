"""TOVA: evict the tokens the newest query attends to least."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.reference import reduce_gqa
from .base import KeepsRecent, Observation, Observe


@dataclass(frozen=True)
class TOVA(KeepsRecent):
    name = "tova"
    observe = Observe.LAST

    def score(self, obs: Observation) -> torch.Tensor:
        # The newest query's attention averaged over each KV head's own query
        # group, so each KV head keeps its own tokens. (methods.md averages over
        # all query heads, one selection per layer: not what this does yet.)
        assert obs.attention is not None
        return reduce_gqa(obs.attention, obs.attention.shape[0] // obs.num_kv_heads, "mean")
