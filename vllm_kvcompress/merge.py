"""Merge stages: what happens to the kept tokens across depth after selection.

  none       every layer keeps its own K and V
  minicache  MiniCache (methods.md, "Merging"): from `start_layer` upward,
             adjacent layers (l, l + 1) form pairs; per token, KV head and
             tensor (K, V), one SLERP direction of the two layers' unit
             vectors replaces both, each layer's norm is kept, and the
             `retain_ratio` most divergent tokens (largest angle) stay exact

How a merged pair is stored (the shape that gives memory back):

- the pair's *lower* layer keeps one slot per token, as before, holding
  ``||x_lower|| * d_m`` (its own norm on the merged direction) for merged
  tokens and its exact vector for retained ones: its attention is vLLM's own;
- the *upper* layer's own KV cache group holds only `retained(T)` slots: slot
  j of head h holds, in K, the exact key of head h's j-th retained key token
  and, in V, the exact value of its j-th retained value token (K and V, and
  every head, retain their own tokens); tokens generated after the merge
  follow, exact;
- per token, KV head and tensor: ``scale = ||x_upper|| / ||x_lower||`` and
  where the token sits among the retained slots (-1: merged). The upper
  layer's attention reads merged tokens from the lower layer's slots times
  `scale` (``scale * ||x_lower|| * d_m = ||x_upper|| * d_m``, MiniCache's
  restore) and retained ones from its own slots (`restore`).

One implementation of the math, used by the worker and the reference decoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from .compat import Component, Problem, first_problem
from .limits import bounded

if TYPE_CHECKING:
    from .config import KVCompressConfig
    from .registry import Components

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values

# Below this angle the two directions are treated as one: SLERP divides by sin(omega).
PARALLEL = 1e-7


@dataclass(frozen=True)
class Merge(Component):
    """How adjacent layers share their keys and values (NoMerge: they do not)."""

    merges: ClassVar[bool] = False

    def pairs(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        """(lower, upper) layer pairs that merge (layers counted among the compressed ones)."""
        return ()

    def retained(self, num_tokens: int) -> int:
        """Slots the upper layer of a pair of `num_tokens` tokens holds."""
        return num_tokens

    def merge_pair(self, lower: KV, upper: KV) -> tuple[MergedTensor, MergedTensor]:
        """Merge a pair's keys and values ([Hkv, T, D] each, the same tokens in the same order)."""
        raise NotImplementedError(f"merge {self.name!r} merges nothing")

    def problem(self, num_layers: int, num_groups: int, hybrid: bool) -> str | None:
        """Why an engine with these compressed layers and KV cache groups cannot merge (None: it can)."""
        if not self.merges:
            return None
        if hybrid:
            return ("a hybrid model's full-attention layers are not adjacent in depth (only models whose layers "
                    "all use full attention merge)")
        if num_groups != num_layers:
            return (f"needs one KV cache group per layer (--kv-compress-layer-groups {num_layers}), the engine "
                    f"has {num_groups}")
        if not self.pairs(num_layers):
            return (f"start_layer {getattr(self, 'start_layer', None)} leaves no pair of layers to merge in a "
                    f"{num_layers}-layer model; valid values: -1 (half the depth) or 0 .. {num_layers - 2}")
        return None


class NoMerge(Merge):  # no parameters: the base's dataclass serves
    """Every layer keeps its own keys and values."""

    name = "none"


@dataclass(frozen=True)
class MiniCache(Merge):
    """Adjacent layers from `start_layer` up share one SLERP-merged copy of a
    pair's keys and values; a few tokens per head stay exact (methods.md)."""

    name = "minicache"
    merges = True

    start_layer: int = field(default=-1, metadata=bounded(
        -1, "pair_start", help="minicache: first layer of the first merged pair (-1: half the depth); pairs (l, l + 1) "
                "from there up"))
    t: float = field(default=0.6, metadata={"help": "minicache: SLERP weight of the upper layer's direction"})
    retain_ratio: float = field(default=0.05, metadata={
        "help": "minicache: fraction of a pair's tokens kept exact per KV head and tensor (largest angle)"})

    def validate(self) -> None:
        if self.start_layer < -1:
            raise ValueError(f"start_layer must be -1 (half the depth) or a layer index >= 0, got {self.start_layer}")
        if not 0.0 <= self.t <= 1.0:
            raise ValueError(f"t must be in [0, 1], got {self.t}")
        if not 0.0 <= self.retain_ratio <= 1.0:
            raise ValueError(f"retain_ratio must be in [0, 1], got {self.retain_ratio}")

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        return first_problem(
            (parts.trigger.name != "once", "trigger",
             f"merge {self.name!r} merges the prompt's KV once, at prefill end; valid with it: ['once'], not "
             f"{parts.trigger.name!r}"),
            (parts.allocation.name != "uniform", "allocation",
             f"merge {self.name!r} merges the two layers of a pair token by token, so they keep the same tokens; "
             f"valid with it: ['uniform'], not {parts.allocation.name!r}"),
            (config.num_layer_groups == 1, "layer_groups",
             f"merge {self.name!r} gives the upper layer of each merged pair its own, smaller block table: start "
             f"the engine with --kv-compress-layer-groups set to the number of layers (one group each)"),
            (bool(config.protect_prefix), "protect_prefix",
             f"merge {self.name!r} rewrites every token of a merged pair, and a protected prefix stays whole in "
             f"blocks other requests share; valid with it: 0"))

    def first_layer(self, num_layers: int) -> int:
        return num_layers // 2 if self.start_layer == -1 else self.start_layer

    def pairs(self, num_layers: int) -> tuple[tuple[int, int], ...]:
        return tuple((lo, lo + 1) for lo in range(self.first_layer(num_layers), num_layers - 1, 2))

    def retained(self, num_tokens: int) -> int:
        """Tokens each KV head keeps exact per tensor, of a pair's `num_tokens`."""
        # Rounded up (a product like 0.05 * 100 may land a hair above an integer).
        return min(num_tokens, math.ceil(self.retain_ratio * num_tokens - 1e-9))

    def merge_pair(self, lower: KV, upper: KV) -> tuple[MergedTensor, MergedTensor]:
        retained = self.retained(lower[0].shape[1])
        return merge_tensor(lower[0], upper[0], self.t, retained), merge_tensor(lower[1], upper[1], self.t, retained)


MERGES: dict[str, type[Merge]] = {cls.name: cls for cls in (NoMerge, MiniCache)}


@dataclass
class MergedTensor:
    """One merged tensor (K or V) of one pair, for one request."""

    lower: torch.Tensor  # [H, T, D] what the lower layer stores (merged or exact), float32
    retained: torch.Tensor  # [H, R, D] the upper layer's exact vectors of its retained tokens, float32
    slot: torch.Tensor  # [H, T] int64: the token's retained slot in the upper layer, -1 if merged
    scale: torch.Tensor  # [H, T] float32: ||x_upper|| / ||x_lower|| (0 where retained)


def merge_tensor(lower: torch.Tensor, upper: torch.Tensor, t: float, num_retained: int) -> MergedTensor:
    """MiniCache on one tensor of a pair: `lower`, `upper` [H, T, D], the
    same tokens in the same order (post-RoPE keys of one position rotate
    alike, and SLERP commutes with that rotation)."""
    x1, x2 = lower.to(torch.float32), upper.to(torch.float32)
    n1, n2 = x1.norm(dim=-1), x2.norm(dim=-1)  # [H, T]
    u1 = x1 / n1.clamp_min(1e-30).unsqueeze(-1)
    u2 = x2 / n2.clamp_min(1e-30).unsqueeze(-1)
    omega = torch.arccos((u1 * u2).sum(dim=-1).clamp(-1.0, 1.0))  # [H, T]
    sin = torch.sin(omega).unsqueeze(-1)
    w1, w2 = torch.sin((1 - t) * omega).unsqueeze(-1), torch.sin(t * omega).unsqueeze(-1)
    parallel = (omega < PARALLEL).unsqueeze(-1)
    slerp = (w1 * u1 + w2 * u2) / torch.where(parallel, torch.ones_like(sin), sin)
    lerp = (1 - t) * u1 + t * u2
    lerp = lerp / lerp.norm(dim=-1, keepdim=True).clamp_min(1e-30)
    direction = torch.where(parallel, lerp, slerp)
    # A zero lower vector cannot carry the upper one's direction: retain it first.
    divergence = torch.where(n1 > 0, omega, torch.full_like(omega, math.inf))
    heads, tokens = omega.shape
    chosen = torch.topk(divergence, num_retained, dim=-1).indices.sort(dim=-1).values  # [H, R]
    slot = torch.full((heads, tokens), -1, dtype=torch.int64, device=omega.device)
    slot.scatter_(1, chosen, torch.arange(num_retained, device=omega.device).expand(heads, -1).contiguous())
    merged = slot < 0
    stored = torch.where(merged.unsqueeze(-1), n1.unsqueeze(-1) * direction, x1)
    scale = torch.where(merged, n2 / n1.clamp_min(1e-30), torch.zeros_like(n2))
    retained = torch.gather(x2, 1, chosen.unsqueeze(-1).expand(-1, -1, x2.shape[-1]))
    return MergedTensor(lower=stored, retained=retained, slot=slot, scale=scale)


def restore(lower: torch.Tensor, retained: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The upper layer's vectors [H, T, D] (float32) of a merged pair's tokens:
    merged ones as `scale` x the lower layer's stored ones (||x_upper|| * d_m),
    retained ones exact from the upper layer's slots. `lower` [H, T, D] and
    `retained` [H, R, D] are what the two layers' caches hold."""
    if retained.shape[1] == 0:  # nothing retained
        return lower.to(torch.float32) * scale.unsqueeze(-1)
    merged = (slot < 0).unsqueeze(-1)
    exact = torch.gather(retained.to(torch.float32), 1, slot.clamp_min(0).unsqueeze(-1).expand(-1, -1, lower.shape[-1]))
    return torch.where(merged, lower.to(torch.float32) * scale.unsqueeze(-1), exact)
