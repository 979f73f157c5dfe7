"""Evicts nothing: the scorer of compositions that only merge (policy `minicache`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer


@dataclass(frozen=True)
class KeepAll(Scorer):
    name = "keep_all"
    evicts = False
    same_in_every_layer = True
    same_for_every_head = True

    def score(self, obs: Observation) -> torch.Tensor:
        return torch.zeros(obs.positions.shape, dtype=torch.float32)
