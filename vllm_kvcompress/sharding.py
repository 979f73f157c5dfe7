"""Which of a layer's heads this worker holds.

Tensor parallelism splits every layer's query and KV heads evenly across the
ranks of vLLM's tensor-parallel group; each rank scores, selects and compacts
its own heads. Whatever a composition decides across heads (TOVA's mean over
all query heads, per-head budgets' shared top-k, attention-derived layer
budgets) gathers the other ranks' heads first, so that every rank reaches the
same decision as one device would, and the layer lengths the scheduler gets
back are the same from every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadShard:
    """This rank's heads: a contiguous slice, rank `rank` of `size`."""

    rank: int = 0
    size: int = 1
    # Concatenates a [local heads, ...] tensor over the ranks, in rank order
    # (a collective: every rank calls it at the same point). None: one rank.
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def first(self, num_local_heads: int) -> int:
        """Global index of this rank's first head."""
        return self.rank * num_local_heads

    def all_heads(self, local: torch.Tensor) -> torch.Tensor:
        """[local heads, ...] -> [all heads, ...] (this rank's rows included)."""
        if self.size == 1 or self.gather is None:
            return local
        return self.gather(local.contiguous())

    def mine(self, all_heads: torch.Tensor, num_local_heads: int) -> torch.Tensor:
        """The rows of `all_heads` that are this rank's."""
        first = self.first(num_local_heads)
        return all_heads[first: first + num_local_heads]


ONE_DEVICE = HeadShard()
