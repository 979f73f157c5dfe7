"""Budget allocations: how many tokens each layer (and each KV head) keeps.

An allocation combines with any scorer (`registry.py`). The request's budget
is the mean tokens kept per layer and KV head; an allocation spreads it:

  uniform   every layer and head keeps `budget`
  pyramid   layers keep linearly less towards the top (PyramidKV), same mean
  adaptive  each layer's share follows how many tokens hold most of its
            observed attention (ZigZagKV-style), known at prefill end
  retrieval each layer's share follows a measured profile of its retrieval
            heads (HeadKV/DuoAttention-style, per layer), known at startup
  per_head  one top-k of `budget * num_kv_heads` shared by a layer's heads,
            each head at least `alpha * budget` (AdaKV)

`min_budget` is what the scorer always keeps (its protected tokens): no layer
gets less.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from .compat import Component, Problem, first_problem
from .limits import bounded
from .retrieval_profile import CALIBRATE, load_profile
from .selection import Selection, per_request, rank_scores, select_keep_per_head, select_ranked, token_ranks
from .sharding import HeadShard

if TYPE_CHECKING:
    from .config import KVCompressConfig
    from .registry import Components


class ObservedPrompt(Protocol):
    """A request whose prompt has been observed, as allocations that share the
    budget by attention read it at prefill end (token_state.RequestTokens)."""

    num_layers: int

    def layer_attention(self, layer: int) -> torch.Tensor:
        """[Hq over all ranks, T] the layer's accumulated attention."""
        ...

    def ranked_scores(self, layer: int) -> torch.Tensor:
        """[Hkv over all ranks, T] the layer's scores as a top-k ranks them (protected tokens +inf)."""
        ...


@dataclass(frozen=True)
class Selected:
    """The tokens one layer of one request keeps."""

    keep_idx: torch.Tensor  # [Hkv, slots] physical indices, hole-filling order
    # [Hkv, slots] True where a head keeps no token in that slot (attention
    # masks it); None: every slot is live.
    dead: torch.Tensor | None


@dataclass(frozen=True)
class LayerToSelect:
    """One request's layer whose kept tokens are to be chosen (a batch's row)."""

    scores: torch.Tensor  # [Hkv, T] float, on the cache's device
    positions: torch.Tensor  # [Hkv, T] logical positions of the cached tokens
    slots: int  # the layer's new length
    layer_budget: int  # its slots after the protected start
    budget: int  # the request's mean
    protected: Callable[[int], tuple[int, int]]  # budget -> (sinks, recent) kept whatever their score
    selection: Selection
    shard: HeadShard


@dataclass(frozen=True)
class Batch:
    """Rows of `LayerToSelect` padded to one [R, Hkv, T] batch."""

    scores: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None  # [R, 1, T] False for padding (None: no padding)
    lengths: list[int]  # tokens per row

    @classmethod
    def of(cls, layers: list[LayerToSelect]) -> Batch:
        lengths = [layer.scores.shape[-1] for layer in layers]
        widest = max(lengths)
        if min(lengths) == widest:
            return cls(torch.stack([layer.scores.float() for layer in layers]),
                       torch.stack([layer.positions for layer in layers]), None, lengths)
        # Padding: no score, a position after every token (last in logical order).
        scores = torch.stack([torch.nn.functional.pad(layer.scores.float(), (0, widest - n), value=float("-inf"))
                              for layer, n in zip(layers, lengths)])
        positions = torch.stack([torch.nn.functional.pad(layer.positions, (0, widest - n), value=1 << 62)
                                 for layer, n in zip(layers, lengths)])
        steps = torch.arange(widest, device=scores.device)
        valid = steps < per_request(lengths, scores)
        return cls(scores, positions, valid, lengths)

    def protection(self, layers: list[LayerToSelect], budgets: list[int]) -> tuple[int | torch.Tensor, ...]:
        """(sinks, recent) at each row's budget: ints when every row agrees, else [R, 1, 1] on the device."""
        pairs = [layer.protected(b) for layer, b in zip(layers, budgets)]
        return tuple(values[0] if len(set(values)) == 1 else per_request(list(values), self.scores)
                     for values in zip(*pairs))


@dataclass(frozen=True)
class Allocation(Component):
    """How many tokens each layer (and KV head) keeps of the request's budget."""

    # Layers keep different budgets: frees memory only with per-layer KV cache groups.
    per_layer: ClassVar[bool] = False
    # The layer budgets come from the prompt's observed attention, at prefill end.
    from_attention: ClassVar[bool] = False

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        """Why this allocation cannot serve beside the other parts (None: it can)."""
        return first_problem(*self._problems(parts, config))

    def _problems(self, parts: Components, config: KVCompressConfig) -> list[tuple[bool, str, str]]:
        """(refused, field, reason) in the order they are reported."""
        return [
            (self.per_layer and config.num_layer_groups == 1, "layer_groups",
             f"allocation {self.name!r} (policy {config.policy!r}) gives layers different budgets, which frees "
             f"memory only with per-layer KV cache groups: start the engine with --kv-compress-layer-groups set to "
             f"the number of layers (one group each) or a divisor of it (tiers)"),
            # KVzip observes nothing, but its repeat passes give attention scores (reported when they end).
            (self.from_attention and not (parts.scorer.observe.scores_attention()
                                          or parts.scorer.reconstructs_context), "allocation",
             f"{self.name!r} shares the budget by observed attention; scorer {parts.scorer.name!r} observes no "
             f"attention; "
             f"valid with it: ['pyramid', 'uniform']"),
            (self.from_attention and parts.trigger.protected_len(1) >= 1, "allocation",
             f"{self.name!r} shares the budget by the prompt's attention, which trigger {parts.trigger.name!r} never "
             f"compresses; valid with it: ['pyramid', 'uniform']")]

    def problem(self, num_layers: int) -> str | None:
        """Why this allocation cannot serve a model with `num_layers` compressed layers (None: it can)."""
        return None

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int | None,
                      min_budget: int) -> list[int] | None:
        """Tokens each layer keeps, known before the prompt runs (None: known
        only once the prompt's attention is observed, `prompt_budgets`).

        `prompt_len`: the prompt tokens that may be compressed (None: no
        bound, when only generated tokens are).
        """
        return None if self.from_attention else [budget] * num_layers

    def prompt_budgets(self, prompt: ObservedPrompt, budget: int, min_budget: int) -> torch.Tensor:
        """[num_layers] int64: slots each layer holds, from the observed prompt
        (allocations whose `layer_budgets` are None), on the scores' device."""
        raise NotImplementedError(f"allocation {self.name!r} knows its budgets before the prompt runs")

    def select(self, scores: torch.Tensor, positions: torch.Tensor, *, slots: int, layer_budget: int, budget: int,
               protected: Callable[[int], tuple[int, int]], selection: Selection, shard: HeadShard) -> Selected:
        """The tokens a layer keeps in `slots` slots, from its [Hkv, T] scores.

        `layer_budget`: this layer's slots after the protected start; `budget`:
        the request's mean; `protected(b)`: the (sinks, recent) tokens kept
        whatever their score at budget b.
        """
        return self.select_batch([LayerToSelect(scores, positions, slots, layer_budget, budget, protected,
                                                selection, shard)])[0]

    def batch_key(self) -> Hashable:
        """Layers whose allocations give the same key (and whose selections are
        equal) are selected in one batch."""
        return Allocation  # every allocation but per_head selects by a layer's slots alone

    def select_batch(self, layers: list[LayerToSelect]) -> list[Selected]:
        """Each layer's kept tokens, selected as one [R, Hkv, T] batch on the
        device (rows of one `batch_key` and one selection; their lengths,
        slots and protected tokens may differ)."""
        batch = Batch.of(layers)
        sinks, recent = batch.protection(layers, [layer.layer_budget for layer in layers])
        ranked = rank_scores(batch.scores, batch.positions, sinks, recent, layers[0].selection, batch.valid)
        keep = [min(layer.slots, n) for layer, n in zip(layers, batch.lengths)]
        keep_idx = select_ranked(ranked, keep, batch.valid)
        return [Selected(keep_idx[r, :, :k], None) for r, k in enumerate(keep)]


class Uniform(Allocation):  # no parameters: the base's dataclass serves
    """Every layer and head keeps the budget."""

    name = "uniform"


@dataclass(frozen=True)
class Pyramid(Allocation):
    """Layers keep linearly less towards the top (PyramidKV), at the same mean."""

    name = "pyramid"
    per_layer = True

    beta: int = field(default=20, metadata=bounded(
        1, "tokens", help="pyramid: the top layer keeps (budget - window) / beta tokens beyond the window"))

    def validate(self) -> None:
        if self.beta < 1:
            raise ValueError(f"beta must be >= 1, got {self.beta}")

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int | None, min_budget: int) -> list[int]:
        # KVCache-Factory's schedule (methods.md), with the scorer's protected
        # tokens as the window: same mean as `budget`.
        w = min_budget
        min_b = (budget - w) // self.beta
        max_b = 2 * (budget - w) - min_b
        if prompt_len is not None and max_b >= prompt_len - w:  # short prompt: the bottom layer keeps it all
            max_b = prompt_len - w
            min_b = 2 * (budget - w) - max_b
        step = (max_b - min_b) // (num_layers - 1) if num_layers > 1 else 0
        return [max_b - layer * step + w for layer in range(num_layers)]


def tokens_for_mass(attention: torch.Tensor, coverage: float) -> torch.Tensor:
    """[H, T] attention -> [H]: fewest tokens whose attention sums to `coverage` of each row."""
    ranked = attention.to(torch.float64).sort(dim=-1, descending=True).values
    mass = ranked.cumsum(dim=-1)
    short = mass < coverage * mass[:, -1:]
    return (short.sum(dim=-1) + 1).clamp(max=attention.shape[-1])


@dataclass(frozen=True)
class Adaptive(Allocation):
    name = "adaptive"
    per_layer = True
    from_attention = True

    coverage: float = field(default=0.9, metadata={"help": "adaptive: share of the observed attention a "
                                                           "layer's need covers"})
    floor: int = field(default=0, metadata=bounded(
        0, "tokens", help="adaptive: fewest tokens a layer keeps (0: the scorer's protected tokens)"))

    def validate(self) -> None:
        if not 0 < self.coverage <= 1:  # also rejects NaN
            raise ValueError(f"coverage must be in (0, 1], got {self.coverage}")
        if self.floor < 0:
            raise ValueError(f"floor must be >= 0, got {self.floor}")

    def prompt_budgets(self, prompt: ObservedPrompt, budget: int, min_budget: int) -> torch.Tensor:
        return self.attention_budgets([prompt.layer_attention(layer) for layer in range(prompt.num_layers)],
                                      budget, min_budget)

    def attention_budgets(self, attention: list[torch.Tensor], budget: int, min_budget: int) -> torch.Tensor:
        """[num_layers] int64: tokens each layer keeps, from each layer's
        observed [Hq, T] attention (on its device: nothing read on the host)."""
        # methods.md: MBA_l = mean over (query) heads of the tokens holding
        # `coverage` of the observed attention; budget_l = max(floor, total * MBA_l / sum MBA).
        needs = torch.stack([tokens_for_mass(a, self.coverage).to(torch.float64).mean() for a in attention])
        total = budget * len(attention)
        floor = max(self.floor, min_budget)
        return (total * needs / needs.sum()).to(torch.int64).clamp(min=floor)


@dataclass(frozen=True)
class PerHead(Allocation):
    """KV heads keep different numbers of tokens (`head_counts`); a layer holds
    its fullest head's count and attention masks the others' unused slots."""

    name = "per_head"
    from_attention = True  # a layer holds its fullest head: known once the attention is seen

    alpha: float = field(default=0.2, metadata={"help": "per_head: each KV head keeps at least alpha * budget "
                                                        "tokens"})

    def validate(self) -> None:
        if not 0 <= self.alpha <= 1:  # also rejects NaN
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")

    def _problems(self, parts: Components, config: KVCompressConfig) -> list[tuple[bool, str, str]]:
        problems = super()._problems(parts, config)
        trigger = parts.trigger
        # Reported before the prompt check: every trigger but 'once' is refused.
        problems.insert(-1, (trigger.repeats(), "trigger",
                             f"allocation 'per_head' compresses once (per-head masks are not re-derived while "
                             f"rolling); use trigger 'once', not {trigger.name!r}"))
        problems.append((bool(config.protect_prefix), "protect_prefix",
                         "allocation 'per_head' lays each KV head's kept tokens out on its own, and a protected "
                         "prefix stays whole in blocks other requests share; valid with it: 0"))
        return problems

    def prompt_budgets(self, prompt: ObservedPrompt, budget: int, min_budget: int) -> torch.Tensor:
        # A layer holds as many slots as its fullest head keeps.
        return torch.stack([self.head_counts(prompt.ranked_scores(layer)[None], [budget]).max()
                            for layer in range(prompt.num_layers)])

    def batch_key(self) -> Hashable:
        return self  # alpha sets the counts

    def select_batch(self, layers: list[LayerToSelect]) -> list[Selected]:
        batch = Batch.of(layers)
        budgets = [layer.budget for layer in layers]
        # Heads share the request's budget: protection at it, not at the fullest head's.
        sinks, recent = batch.protection(layers, budgets)
        ranked = rank_scores(batch.scores, batch.positions, sinks, recent, layers[0].selection, batch.valid)
        # One top-k over a layer's heads: the other ranks' heads take part.
        shard = layers[0].shard
        counts = self.head_counts(shard.all_heads(ranked.transpose(0, 1)).transpose(0, 1), budgets,
                                  batch.valid, batch.lengths)
        counts = shard.mine(counts.transpose(0, 1), ranked.shape[1]).transpose(0, 1)
        keep = [min(layer.slots, n) for layer, n in zip(layers, batch.lengths)]
        keep_idx, dead = select_keep_per_head(ranked, counts, keep, batch.valid)
        # A mask even where every head is full: not read on the host.
        return [Selected(keep_idx[r, :, :k], dead[r, :, :k]) for r, k in enumerate(keep)]

    def head_counts(self, ranked: torch.Tensor, budgets: list[int], valid: torch.Tensor | None = None,
                    lengths: list[int] | None = None) -> torch.Tensor:
        """[R, Hkv, T] ranked scores (protected tokens +inf; `valid` False:
        padding, row r holding lengths[r] tokens) -> [R, Hkv] tokens each head keeps."""
        # methods.md: the global top (num_kv_heads * budget) over all heads'
        # scores, after each head's own top (alpha * budget).
        rows, num_heads, num_tokens = ranked.shape
        lengths = lengths or [num_tokens] * rows
        floor = [min(int(self.alpha * b), n) for b, n in zip(budgets, lengths)]
        shared = [(min(b, n) - f) * num_heads for b, n, f in zip(budgets, lengths, floor)]
        floors = per_request(floor, ranked)
        own = token_ranks(ranked, valid) < floors
        rest = ~own if valid is None else valid & ~own
        picked = token_ranks(ranked.reshape(rows, -1), rest.reshape(rows, -1)) < per_request(shared, ranked)[..., 0]
        return floors[..., 0] + picked.view(rows, num_heads, num_tokens).sum(-1)


def water_fill(wants: list[float], cap: float) -> list[float]:
    """Cap each share at `cap`; what the capped ones lose goes to the others, in proportion."""
    wants = list(wants)
    for _ in range(len(wants)):
        over = sum(max(0.0, w - cap) for w in wants)
        room = sum(w for w in wants if w < cap)
        if over <= 0 or room <= 0:
            break
        wants = [cap if w >= cap else w + over * w / room for w in wants]
    return [min(w, cap) for w in wants]


@dataclass(frozen=True)
class Retrieval(Allocation):
    name = "retrieval"
    per_layer = True

    profile: str = field(default="", metadata={
        "help": f"retrieval: the model's retrieval-head profile (JSON, from {CALIBRATE}); an engine setting",
        "engine": True, "path": True})
    share: float = field(default=0.5, metadata={"help": "retrieval: share of the budget beyond the protected "
                                                        "tokens that follows the profile (the rest is uniform)"})

    def validate(self) -> None:
        if not self.profile:
            raise ValueError(f"profile must name a retrieval profile file ({CALIBRATE} writes one)")
        if not 0 <= self.share <= 1:  # also rejects NaN
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        load_profile(self.profile)

    def problem(self, num_layers: int) -> str | None:
        layers = load_profile(self.profile).num_layers
        if layers != num_layers:
            return (f"profile {self.profile!r} has {layers} layers, this model {num_layers} compressed "
                    f"(full-attention) layers: measure its own profile")
        return None

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int | None, min_budget: int) -> list[int]:
        # docs/policies.md, allocations: each layer keeps its protected tokens, (1 - share)
        # of the rest of the budget, and its part of share * the rest summed over
        # layers in proportion to the layer's retrieval score; a layer wanting
        # more than the prompt holds passes the excess on (same mean).
        scores = load_profile(self.profile).layer_scores()
        extra = budget - min_budget
        total = sum(scores)
        if total <= 0:
            return [budget] * num_layers
        wants = [extra * (1 - self.share) + extra * num_layers * self.share * s / total for s in scores]
        if prompt_len is not None:
            wants = water_fill(wants, max(prompt_len - min_budget, 0))
        return [min_budget + int(w + 1e-6) for w in wants]  # 1e-6: a whole share stays whole in floats


ALLOCATIONS: dict[str, type[Allocation]] = {cls.name: cls for cls in (Uniform, Pyramid, Adaptive, PerHead, Retrieval)}
