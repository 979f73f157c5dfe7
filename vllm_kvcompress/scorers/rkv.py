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
            importance = torch.zeros(obs.positions.shape, dtype=torch.float32, device=obs.positions.device)
        else:
            importance = reduce_gqa(obs.attention, obs.attention.shape[0] // obs.num_kv_heads, "mean") / self.window
        # As the reference pools the tokens before its window.
        importance = pool_before_window(importance, obs.positions, self.window, self.kernel_size, "max")
        redundancy = self.redundancy(obs.cached_keys(), obs.positions, obs.positions >= obs.protected_len)
        return self.mix_lambda * importance - (1.0 - self.mix_lambda) * redundancy

    def redundancy(self, keys: torch.Tensor, positions: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """[H, T] R per head over its candidate tokens (0 elsewhere): keys
        [H, T, D], logical positions and candidate mask [H, T]. Every head at
        once, masked rather than cut to its candidates: fixed shapes, nothing
        read on the host."""
        unit = keys.float()
        unit = unit / (unit.norm(dim=-1, keepdim=True) + 1e-8)
        num_heads, num_tokens = candidates.shape
        column_sums = torch.zeros(num_heads, num_tokens, dtype=torch.float32, device=unit.device)
        # S is T x T per head: a block of rows at a time, so the scratch stays
        # within REDUNDANCY_ELEMENTS whatever the budget and interval (a long
        # generation's cache would otherwise ask for H * T**2 floats at once).
        step = max(1, REDUNDANCY_ELEMENTS // max(num_heads * num_tokens, 1))
        for start in range(0, num_tokens, step):
            rows = slice(start, start + step)
            sim = unit[:, rows] @ unit.transpose(1, 2)  # [H, b, T]
            among = candidates[:, rows].unsqueeze(2) & candidates.unsqueeze(1)
            own = torch.arange(sim.shape[1], device=unit.device)
            sim[:, own, own + start] = 0.0
            sim = sim.masked_fill(~among, 0.0)
            duplicate = (sim > self.threshold) & among
            # Each token's most recent near-duplicate (by logical position: after a
            # compaction the physical order is not chronological) is forgotten.
            newest = torch.where(duplicate, positions.unsqueeze(1), -1).argmax(dim=2, keepdim=True)
            forget = torch.zeros_like(duplicate).scatter_(2, newest, duplicate.any(dim=2, keepdim=True))
            column_sums += sim.masked_fill(forget, 0.0).sum(dim=1)
        count = candidates.sum(dim=-1, keepdim=True).clamp(min=1)
        mean = (column_sums / count).masked_fill(~candidates, float("-inf"))
        # A head without candidates has nothing redundant (softmax of all -inf is NaN).
        return torch.where(candidates, mean.softmax(dim=-1), 0.0)
