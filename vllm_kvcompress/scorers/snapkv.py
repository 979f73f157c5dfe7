"""SnapKV: score prefix tokens by the attention of the last prompt queries."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.torch_ops import pool_scores, reduce_gqa
from ..limits import bounded
from .base import KeepsObservationWindow, Observation, Observe, check_choice

POOLINGS = ("avg", "max")
GQA_REDUCTIONS = ("mean", "max")


@dataclass(frozen=True)
class SnapKV(KeepsObservationWindow):
    name = "snapkv"
    observe = Observe.WINDOW

    window: int = field(default=32, metadata=bounded(
        1, "tokens", help="observation window: last prompt queries, kept (see kept_window)"))
    kernel_size: int = field(default=5, metadata=bounded(1, "tokens", help="pooling kernel over token scores"))
    pooling: str = field(default="avg", metadata={"help": "pooling kind", "choices": POOLINGS})
    gqa_reduce: str = field(default="mean", metadata={
        "help": "how a GQA group's query heads are reduced", "choices": GQA_REDUCTIONS})
    # Observing more queries than it keeps lets a question that sits before
    # the answer prefix pick the tokens it asks about, while its own tokens
    # compete for the budget on their scores. On SmolLM2-135M's suite at an
    # eighth of the prompt it kept less than the default (docs/evaluation.md, Quality).
    kept_window: int = field(default=-1, metadata=bounded(
        -1, "tokens", help="snapkv: the newest window tokens always kept (-1: the whole window); the older "
                "window tokens are scored like the prefix"))

    def validate(self) -> None:
        super().validate()
        check_choice("pooling", self.pooling, POOLINGS)
        check_choice("gqa_reduce", self.gqa_reduce, GQA_REDUCTIONS)
        if self.kept_window != -1 and not 1 <= self.kept_window <= self.window:
            raise ValueError(f"kept_window must be -1 (the whole window) or in [1, window={self.window}], "
                             f"got {self.kept_window}")

    @property
    def kept(self) -> int:
        return self.window if self.kept_window == -1 else self.kept_window

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.kept

    def min_budget(self) -> int:
        return self.kept

    def score(self, obs: Observation) -> torch.Tensor:
        assert obs.attention is not None
        group = obs.attention.shape[0] // obs.num_kv_heads
        scores = reduce_gqa(obs.attention, group, self.gqa_reduce)
        return pool_before_window(scores, obs.positions, self.kept, self.kernel_size, self.pooling)


def pool_before_window(scores: torch.Tensor, positions: torch.Tensor, window: int, kernel_size: int,
                       pooling: str) -> torch.Tensor:
    """Pool [Hkv, T] scores over neighbours in logical order, all but the
    `window` newest tokens (kept whole anyway). At the first compaction the
    cache is chronological; a rolling trigger compacts it out of order."""
    order = positions.argsort(dim=-1)
    prefix = max(scores.shape[-1] - window, 0)
    if prefix:
        chronological = scores.gather(1, order)
        chronological[:, :prefix] = pool_scores(chronological[:, :prefix], kernel_size, pooling)
        scores = scores.scatter(1, order, chronological)
    return scores
