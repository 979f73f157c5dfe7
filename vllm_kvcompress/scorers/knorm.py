"""Knorm: keep the keys with the smallest L2 norm (kvpress's KnormPress).

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression" (EMNLP 2024): a key with a low L2 norm draws high attention, so a
token's score is its key's norm, negated. No attention is observed; the score
reads the cached keys when the request compresses (post-RoPE: a rotation keeps
the norm). Every KV head ranks its own keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Observation, Scorer


@dataclass(frozen=True)
class Knorm(Scorer):
    name = "knorm"
    needs_keys = True

    def score(self, obs: Observation) -> torch.Tensor:
        # A token repeated in the prompt has the same key norm at every
        # position (RoPE is a rotation): equal in exact arithmetic, apart in
        # the last bits, differently in every implementation of the model.
        # Rounded, such ties are ties everywhere, and the selection breaks them
        # the same way in the engine and in the reference.
        return -torch.round(obs.cached_keys().norm(dim=-1), decimals=NORM_DECIMALS)


NORM_DECIMALS = 4
