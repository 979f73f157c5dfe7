"""Keyformer: H2O with a Gumbel-regularised, temperature-scheduled softmax."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..kernels.torch_ops import reduce_gqa
from ..limits import bounded
from .base import KeepsRecent, LogitsNoise, Observation, Observe, hash_uniform


@dataclass(frozen=True)
class Keyformer(KeepsRecent):
    name = "keyformer"
    observe = Observe.ALL
    noisy = True

    window: int = field(default=32, metadata=bounded(0, "tokens", help="newest tokens always kept"))
    tau_init: float = field(default=1.0, metadata={"help": "initial softmax temperature"})
    delta_tau: float = field(default=0.01, metadata={"help": "temperature increase per compression"})
    seed: int = field(default=0, metadata=bounded(0, "seed", help="seed of the Gumbel noise"))

    def validate(self) -> None:
        super().validate()
        if not 0 < self.tau_init < float("inf"):
            raise ValueError(f"tau_init must be > 0 and finite, got {self.tau_init}")
        if not 0 <= self.delta_tau < float("inf"):
            raise ValueError(f"delta_tau must be >= 0 and finite, got {self.delta_tau}")

    def logits_noise(self, layer, q_pos, k_pos, num_compressions, first_head=0) -> LogitsNoise:
        # On the keys' device: the same integers there as on the host.
        heads = (torch.arange(k_pos.shape[0], device=k_pos.device) + first_head).view(-1, 1, 1)
        u = hash_uniform(self.seed, layer, heads, q_pos.to(k_pos.device).view(1, -1, 1), k_pos.unsqueeze(1))
        return LogitsNoise(noise=-torch.log(-torch.log(u)).to(torch.float32),
                           tau=self.tau_init + self.delta_tau * num_compressions)

    def score(self, obs: Observation) -> torch.Tensor:
        assert obs.attention is not None
        return reduce_gqa(obs.attention, obs.attention.shape[0] // obs.num_kv_heads, "mean")
