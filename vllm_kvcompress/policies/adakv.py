"""AdaKV: SnapKV scores, one top-k shared by a layer's KV heads, a floor per head."""

from dataclasses import dataclass, field

import torch

from .base import register_policy
from .snapkv import SnapKV


@register_policy
@dataclass
class AdaKV(SnapKV):
    name = "adakv"
    per_head_budgets = True
    budgets_from_attention = True  # a layer holds its fullest head: known once the window is seen

    alpha: float = field(default=0.2, metadata={"help": "each KV head keeps at least alpha * budget tokens"})

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.alpha <= 1:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def head_counts(self, ranked: torch.Tensor, budget: int) -> torch.Tensor:
        # methods.md: the global top (num_kv_heads * budget) over all heads'
        # scores, after each head's own top (alpha * budget).
        num_heads, num_tokens = ranked.shape
        floor = min(int(self.alpha * budget), num_tokens)
        total = min(budget, num_tokens) * num_heads
        own = torch.zeros_like(ranked, dtype=torch.bool)
        own.scatter_(1, ranked.topk(floor, dim=-1).indices, True)
        rest = ranked.masked_fill(own, float("-inf")).flatten()
        shared = rest.topk(total - floor * num_heads).indices // num_tokens
        return floor + torch.bincount(shared, minlength=num_heads)
