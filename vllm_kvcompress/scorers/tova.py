"""TOVA: evict the tokens the newest query attends to least."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import KeepsRecent, Observation, Observe


@dataclass(frozen=True)
class TOVA(KeepsRecent):
    name = "tova"
    observe = Observe.LAST
    same_for_every_head = True

    def score(self, obs: Observation) -> torch.Tensor:
        # methods.md: the newest query's attention averaged over all query
        # heads of the layer, one score per token shared by every KV head (so
        # they keep the same tokens, as in the paper and kvpress's TOVAPress).
        assert obs.attention is not None
        # Slots are comparable across heads only while every head holds the
        # same tokens in the same slots, which is what a shared selection keeps
        # (per-head budgets are refused with TOVA): checked on the device.
        torch._assert_async((obs.positions == obs.positions[:1]).all(),
                            "kv_compress: tova needs every KV head of a layer to hold the same tokens")
        every_head = obs.shard.all_heads(obs.attention)  # tensor parallel: the other ranks' heads too
        return every_head.mean(dim=0, keepdim=True).expand(obs.num_kv_heads, -1).clone()
