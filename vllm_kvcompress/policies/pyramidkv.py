"""PyramidKV: SnapKV selection with budgets shrinking linearly up the layers."""

from dataclasses import dataclass, field

from .base import register_policy
from .snapkv import SnapKV


@register_policy
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"
    per_layer_budgets = True

    beta: int = field(default=20, metadata={"help": "top layer keeps (budget - window) / beta prefix tokens"})

    def validate(self) -> None:
        super().validate()
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int) -> list[int]:
        # KVCache-Factory's schedule (methods.md): same mean as `budget`.
        w = self.window
        min_b = (budget - w) // self.beta
        max_b = 2 * (budget - w) - min_b
        if max_b >= prompt_len - w:  # short prompt: the bottom layer keeps it all
            max_b = prompt_len - w
            min_b = 2 * (budget - w) - max_b
        step = (max_b - min_b) // (num_layers - 1) if num_layers > 1 else 0
        return [max_b - layer * step + w for layer in range(num_layers)]
