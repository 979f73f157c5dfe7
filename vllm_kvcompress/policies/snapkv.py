"""SnapKV: score prefix tokens by the attention of the last prompt queries."""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .base import Observation, Observe, Policy, reduce_gqa, register_policy

_POOLINGS = ("avg", "max")
_GQA_REDUCTIONS = ("mean", "max")


def pool_scores(scores: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """1-D pooling along tokens, stride 1, same length (SnapKV's clustering)."""
    if kernel_size <= 1 or scores.shape[-1] == 0:
        return scores
    pool = F.avg_pool1d if pooling == "avg" else F.max_pool1d
    pooled = pool(scores.unsqueeze(0), kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.squeeze(0)[..., : scores.shape[-1]]


@register_policy
@dataclass
class SnapKV(Policy):
    name = "snapkv"
    observe = Observe.WINDOW

    window: int = field(default=32, metadata={"help": "observation window: last prompt queries, always kept"})
    kernel_size: int = field(default=5, metadata={"help": "pooling kernel over token scores"})
    pooling: str = field(default="avg", metadata={"help": "pooling kind", "choices": _POOLINGS})
    gqa_reduce: str = field(default="mean", metadata={"help": "how a GQA group's query heads are reduced", "choices": _GQA_REDUCTIONS})

    def validate(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd and >= 1, got {self.kernel_size}")
        if self.pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {list(_POOLINGS)}, got {self.pooling!r}")
        if self.gqa_reduce not in _GQA_REDUCTIONS:
            raise ValueError(f"gqa_reduce must be one of {list(_GQA_REDUCTIONS)}, got {self.gqa_reduce!r}")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return self.window

    def window_queries(self) -> int:
        return self.window

    def score(self, obs: Observation) -> torch.Tensor:
        scores = reduce_gqa(obs.attention, obs.num_kv_heads, self.gqa_reduce)
        # Pool over the prefix only: the window is kept whole anyway. SnapKV
        # compresses once, at prefill end, so the cache is still chronological.
        prefix = max(scores.shape[-1] - self.window, 0)
        scores[:, :prefix] = pool_scores(scores[:, :prefix], self.kernel_size, self.pooling)
        return scores
