"""R-KV: importance minus redundancy, for compressing long generations.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models"
(arXiv 2505.24133), as in methods.md ("Redundancy-aware decode scores"). Per
KV head, over the candidate tokens (those after the protected start):

  importance I_j   the attention of the last `window` queries before the
                   compression (summed per query head, GQA group mean, divided
                   by `window`: their mean), max-pooled over `kernel_size`
                   neighbours in logical order (the tokens before the window),
                   as SnapKV pools
  redundancy R_j   with unit keys k^_i: S_ij = k^_i . k^_j (S_ii = 0); each
                   token i forgets its most recent near-duplicate (the newest
                   j with S_ij > `threshold`, R-KV's "retain last"); then
                   R = softmax_j(mean_i S_ij) over the candidates
  score            Z_j = mix_lambda * I_j - (1 - mix_lambda) * R_j

The `window` newest tokens are always kept. Defaults are the reference code's
(window 8, kernel 7, lambda 0.07, threshold 0.5). One difference: a token
with no near-duplicate forgets nothing (the reference code zeroes its
similarity to the cache's first token instead, an artefact of its argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.torch_ops import reduce_gqa
from ..limits import bounded
from .base import KeepsObservationWindow, Observation, Observe
from .snapkv import pool_before_window

# Most elements of the similarity matrix materialised at once (rows of it).
REDUNDANCY_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class RKV(KeepsObservationWindow):
    name = "rkv"
    observe = Observe.RECENT
    needs_keys = True

    window: int = field(default=8, metadata=bounded(
        1, "tokens", help="rkv: observation window, the last queries before each compression (always kept)"))
    kernel_size: int = field(default=7, metadata=bounded(1, "tokens", help="pooling kernel over token scores"))
    mix_lambda: float = field(default=0.07, metadata={
        "help": "rkv: weight of importance against redundancy (score = l * I - (1 - l) * R)"})
    threshold: float = field(default=0.5, metadata={
        "help": "rkv: key cosine similarity above which two tokens are near-duplicates"})

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [-1, 1], got {self.threshold}")

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.attention is None:  # no query observed yet (a prompt within the window): redundancy alone
            importance = torch.zeros(obs.positions.shape, dtype=torch.float32)
        else:
            importance = reduce_gqa(obs.attention, obs.attention.shape[0] // obs.num_kv_heads, "mean") / self.window
        # As the reference pools the tokens before its window.
        importance = pool_before_window(importance, obs.positions, self.window, self.kernel_size, "max")
        redundancy = torch.zeros_like(importance)
        keys = obs.cached_keys()
        for h in range(obs.num_kv_heads):
            candidates = (obs.positions[h] >= obs.protected_len).nonzero().flatten()
            if len(candidates):
                redundancy[h, candidates] = self.redundancy(keys[h, candidates], obs.positions[h, candidates])
        return self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundancy

    def redundancy(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[n] R over n candidate tokens of one head: keys [n, D], logical positions [n]."""
        unit = keys.float()
        unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)
        n = unit.shape[0]
        column_sums = torch.zeros(n, dtype=torch.float32, device=unit.device)
        # S is n x n: a block of rows at a time, so the scratch stays within
        # REDUNDANCY_ELEMENTS whatever the budget and interval (a long
        # generation's cache would otherwise ask for n**2 floats at once).
        step = max(1, REDUNDANCY_ELEMENTS // max(n, 1))
        for start in range(0, n, step):
            sim = unit[start : start + step] @ unit.T
            rows = torch.arange(sim.shape[0], device=unit.device)
            sim[rows, rows + start] = 0.0
            duplicate = sim > self.threshold
            # Each token's most recent near-duplicate (by logical position: after a
            # compaction the physical order is not chronological) is forgotten.
            newest = torch.where(duplicate, positions.view(1, -1), -1).argmax(dim=1)
            has = duplicate.any(dim=1).nonzero().flatten()
            sim[has, newest[has]] = 0.0
            column_sums += sim.sum(dim=0)
        return (column_sums / n).softmax(dim=0)
