"""Evicts nothing: the scorer of compositions that only merge (policy `minicache`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..compat import Problem
from .base import Observation, Scorer

if TYPE_CHECKING:
    from ..config import KVCompressConfig
    from ..registry import Components


@dataclass(frozen=True)
class KeepAll(Scorer):
    name = "keep_all"
    same_for_every_head = True

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        if config.budget is not None or config.compression_ratio is not None:
            name = "budget" if config.budget is not None else "compression_ratio"
            return Problem(name, f"policy {config.policy!r} evicts nothing (it only merges); to evict, then "
                                 f"merge, choose an evicting policy with merge {parts.merge.name!r} (e.g. snapkv)")
        return None

    def scores_key(self, layer: int) -> int:
        return 0  # positions alone: the same scores in every layer

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.zeros(obs.positions.shape, dtype=torch.float32)
