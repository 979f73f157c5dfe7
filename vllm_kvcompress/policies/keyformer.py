"""Keyformer: H2O with a Gumbel-regularised, temperature-scheduled softmax."""

from dataclasses import dataclass, field

import torch

from .base import Observation, Observe, Policy, hash_uniform, reduce_gqa, register_policy


@register_policy
@dataclass
class Keyformer(Policy):
    name = "keyformer"
    observe = Observe.ALL
    rolling = True

    window: int = field(default=32, metadata={"help": "newest tokens always kept"})
    tau_init: float = field(default=1.0, metadata={"help": "initial softmax temperature"})
    delta_tau: float = field(default=0.01, metadata={"help": "temperature increase per compression"})
    seed: int = field(default=0, metadata={"help": "seed of the Gumbel noise"})

    def validate(self) -> None:
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.tau_init <= 0:
            raise ValueError(f"tau_init must be > 0, got {self.tau_init}")
        if self.delta_tau < 0:
            raise ValueError(f"delta_tau must be >= 0, got {self.delta_tau}")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return max(self.window, 1)

    def transform_logits(self, logits, layer, q_pos, k_pos, num_compressions):
        heads = torch.arange(logits.shape[0], device=logits.device).view(-1, 1, 1)
        u = hash_uniform(self.seed, torch.tensor(layer), heads, q_pos.view(1, -1, 1), k_pos.unsqueeze(1))
        gumbel = -torch.log(-torch.log(u)).to(logits.dtype)
        tau = self.tau_init + self.delta_tau * num_compressions
        return (logits + gumbel) / tau

    def score(self, obs: Observation) -> torch.Tensor:
        return reduce_gqa(obs.attention, obs.num_kv_heads, "mean")
