"""What every policy shares: the protocol, the registry, and token selection.

A policy is a small dataclass. Its fields are its parameters (they become
`--kv-compress-<field>` flags and YAML keys); `score()` turns what the engine
observed of one layer of one request into a score per (KV head, cached token).
Budgets, protected tokens, selection and compaction are shared and live here or
in the planner, so a new policy is one short file.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import ClassVar

import torch


class Observe(enum.Enum):
    """Which queries' attention a policy accumulates while the request runs."""

    NOTHING = "nothing"  # scores from positions (or chance) alone
    WINDOW = "window"  # the last `window` prompt queries (SnapKV family)
    ALL = "all"  # every query, prompt and decode, summed (H2O family)
    LAST = "last"  # only the newest query; each step replaces the last (TOVA)


@dataclass
class Observation:
    """What a policy sees of one layer of one request when it is compressed."""

    # [num_q_heads, T] accumulated attention (float32), None for Observe.NOTHING.
    attention: torch.Tensor | None
    # [num_kv_heads, T] logical (RoPE) positions of the cached tokens, in
    # physical order (heads may have kept different tokens).
    positions: torch.Tensor
    num_kv_heads: int
    layer: int
    num_layers: int
    # Compressions this request already had (Keyformer's temperature schedule).
    num_compressions: int


class Policy:
    """Base class of every policy. Subclasses are dataclasses."""

    name: ClassVar[str]
    observe: ClassVar[Observe] = Observe.NOTHING
    # True: evict again during decoding whenever the cache outgrows the budget
    # by `interval` tokens. False: compress once, at the end of prefill.
    rolling: ClassVar[bool] = False
    # True: scores depend on positions alone, the same in every layer, so one
    # selection serves all layers (and every layer keeps the same tokens).
    same_selection_in_every_layer: ClassVar[bool] = False
    # True: `layer_budgets` differ by layer (needs per-layer KV cache groups).
    per_layer_budgets: ClassVar[bool] = False
    # True: the layer budgets come from the prompt's observed attention
    # (`attention_budgets`, at prefill end) instead of `layer_budgets`.
    budgets_from_attention: ClassVar[bool] = False
    # True: KV heads keep different numbers of tokens (`head_counts`); a
    # layer holds its fullest head's count and attention masks the others'
    # unused slots. Such a policy compresses once (not rolling).
    per_head_budgets: ClassVar[bool] = False

    def validate(self) -> None:
        """Raise ValueError naming the field for impossible parameter values."""

    def protected(self, budget: int) -> tuple[int, int]:
        """(sink tokens, recent tokens) that are never evicted at this budget."""
        return 0, 0

    def min_budget(self) -> int:
        """Smallest budget that still holds every protected token."""
        return 1

    def layer_budgets(self, budget: int, num_layers: int, prompt_len: int) -> list[int]:
        """Tokens each layer keeps, given the request's (uniform) budget."""
        return [budget] * num_layers

    def attention_budgets(self, attention: list[torch.Tensor], budget: int, prompt_len: int) -> list[int]:
        """Tokens each layer keeps, from each layer's observed [Hq, T] attention."""
        raise NotImplementedError

    def head_counts(self, ranked: torch.Tensor, budget: int) -> torch.Tensor:
        """[Hkv, T] ranked scores (protected tokens +inf) -> [Hkv] tokens each head keeps."""
        raise NotImplementedError

    def prompt_chunk_size(self) -> int:
        """Prompt tokens prefilled between evictions; 0: the whole prompt first.

        Only position-scored policies can evict mid-prompt (no later query can
        change their choice); they then hold at most budget + chunk tokens
        while prefilling, so admitting a request needs only that many blocks.
        """
        return 0

    def window_queries(self) -> int:
        """How many trailing prompt queries Observe.WINDOW accumulates."""
        return 0

    def transform_logits(
        self, logits: torch.Tensor, layer: int, q_pos: torch.Tensor,
        k_pos: torch.Tensor, num_compressions: int,
    ) -> torch.Tensor:
        """Logits [Hq, Tq, Tk] -> logits fed to the accumulated softmax.

        q_pos: [Tq] logical positions of the queries; k_pos: [Hq, Tk] logical
        positions of the keys each query head sees.
        """
        return logits

    def score(self, obs: Observation) -> torch.Tensor:
        """[num_kv_heads, T] float scores; the lowest are evicted."""
        raise NotImplementedError


POLICIES: dict[str, type[Policy]] = {}


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a policy available by its `name`."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"policy {cls.__name__} must be a dataclass")
    if cls.per_head_budgets and cls.rolling:
        raise TypeError(f"policy {cls.__name__}: per-head budgets compress once (masks are not rolled)")
    POLICIES[cls.name] = cls
    return cls


# ---------------------------------------------------------------- helpers


def reduce_gqa(attention: torch.Tensor, num_kv_heads: int, mode: str) -> torch.Tensor:
    """[Hq, T] -> [Hkv, T]: reduce each group's query heads (mean or max).

    Scores are per KV head because that is what is stored; K/V are never
    repeated per query head.
    """
    grouped = attention.view(num_kv_heads, -1, attention.shape[-1])
    return grouped.amax(dim=1) if mode == "max" else grouped.mean(dim=1)


_MASK31 = (1 << 31) - 1


def hash_uniform(seed: int, *index: torch.Tensor) -> torch.Tensor:
    """Deterministic uniforms in (0, 1) from integer coordinates.

    Random policies (random, Keyformer's Gumbel noise) must draw the same number
    for the same (layer, head, position) in the engine and in the reference, no
    matter how the cache is laid out or batched, so noise is a hash of logical
    coordinates rather than a generator's stream. Products stay below 2**62:
    no int64 overflow.
    """
    x = torch.tensor(seed & _MASK31, dtype=torch.int64)
    for i in index:
        x = (x * 1_000_003 + i.to(torch.int64)) & _MASK31
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK31
        x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK31
        x = x ^ (x >> 15)
    return (x.to(torch.float64) + 0.5) / float(1 << 31)


def select_keep(
    scores: torch.Tensor, positions: torch.Tensor, keep: int, sinks: int, recent: int
) -> torch.Tensor:
    """Indices [Hkv, keep] of the cached tokens each head keeps, in hole-filling order.

    scores, positions: [Hkv, T]. Protected tokens (logical position < sinks,
    or among the `recent` newest) are always kept; the rest of the budget goes
    to the highest scores. See `hole_filling_order` for the order.
    """
    num_tokens = scores.shape[-1]
    if keep >= num_tokens:
        return torch.arange(num_tokens).expand(scores.shape[0], -1).clone()
    ranked = rank_scores(scores, positions, sinks, recent)
    return hole_filling_order(torch.topk(ranked, keep, dim=-1, sorted=False).indices)


def rank_scores(scores: torch.Tensor, positions: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """Scores with protected tokens (position < sinks, or among the `recent` newest) at +inf."""
    protected = positions < sinks
    if recent > 0:
        # Newest by logical position: after a compaction the physical order
        # is no longer chronological.
        protected.scatter_(1, positions.topk(min(recent, scores.shape[-1]), dim=-1).indices, True)
    return scores.to(torch.float32).masked_fill(protected, float("inf"))


def select_keep_per_head(ranked: torch.Tensor, counts: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Head h keeps its `counts[h]` best tokens in a layer `keep` slots long.

    Returns (indices [Hkv, keep] in hole-filling order, dead [Hkv, keep]):
    a head with fewer tokens than `keep` pads with slots it evicts that are
    already in place (never copied); attention must mask those (`dead`).
    """
    num_heads, num_tokens = ranked.shape
    keep = min(keep, num_tokens)
    kept = torch.zeros(num_heads, num_tokens, dtype=torch.bool)
    padding = torch.zeros_like(kept)
    for h in range(num_heads):
        count = min(int(counts[h]), keep)
        kept[h, ranked[h].topk(count, sorted=False).indices] = True
        padding[h, (~kept[h, :keep]).nonzero().flatten()[: keep - count]] = True
    order = hole_filling_order((kept | padding).nonzero()[:, 1].view(num_heads, keep))
    return order, ~torch.gather(kept, 1, order)


def hole_filling_order(kept: torch.Tensor) -> torch.Tensor:
    """[H, K] kept physical indices (any order) -> the order compaction uses.

    Entry j is j when token j stays where it is; otherwise it is a kept token
    from beyond the new length K that moves into the evicted slot j (ascending
    sources into ascending holes). Compaction then copies only the tokens
    that move, about as many as were evicted rather than all K, and in any
    order: sources (>= K) and destinations (< K) never overlap. Attention does
    not care in which slots the cached keys sit (positions are in the keys).
    """
    num_heads, keep = kept.shape
    kept = kept.sort(dim=-1).values
    moving = kept >= keep
    stays = torch.zeros(num_heads, keep + 1, dtype=torch.bool)
    stays.scatter_(1, kept.masked_fill(moving, keep), True)
    order = torch.arange(keep).expand(num_heads, -1).clone()
    # Per head, #holes == #movers; both masks flatten row by row.
    order[~stays[:, :keep]] = kept[moving]
    return order
