"""Adaptive layer budgets (ZigZagKV-style): SnapKV selection, and each layer
gets a share of the request's total budget in proportion to how many tokens it
needs to hold most of the observation window's attention."""

from dataclasses import dataclass, field

import torch

from .base import register_policy
from .snapkv import SnapKV


def tokens_for_mass(attention: torch.Tensor, coverage: float) -> torch.Tensor:
    """[H, T] attention -> [H]: fewest tokens whose attention sums to `coverage` of each row."""
    ranked = attention.to(torch.float64).sort(dim=-1, descending=True).values
    mass = ranked.cumsum(dim=-1)
    short = mass < coverage * mass[:, -1:]
    return (short.sum(dim=-1) + 1).clamp(max=attention.shape[-1])


@register_policy
@dataclass
class Adaptive(SnapKV):
    name = "adaptive"
    per_layer_budgets = True
    budgets_from_attention = True

    coverage: float = field(default=0.9, metadata={"help": "share of the window's attention a layer's need covers"})
    floor: int = field(default=0, metadata={"help": "fewest tokens a layer keeps (0: the window)"})

    def validate(self) -> None:
        super().validate()
        if not 0 < self.coverage <= 1:
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage}")
        if self.floor < 0:
            raise ValueError(f"floor must be >= 0, got {self.floor}")

    def attention_budgets(self, attention: list[torch.Tensor], budget: int, prompt_len: int) -> list[int]:
        # methods.md: MBA_l = mean over (query) heads of the tokens holding
        # `coverage` of the window's attention; budget_l = max(floor, total * MBA_l / sum MBA).
        needs = [float(tokens_for_mass(a, self.coverage).to(torch.float64).mean()) for a in attention]
        total = budget * len(attention)
        floor = max(self.floor, self.min_budget())
        return [max(floor, int(total * need / sum(needs))) for need in needs]
