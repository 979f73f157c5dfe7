"""Which cached tokens survive: top scores, protected tokens, hole-filling order.

Shared by every scorer and allocation; the worker and the reference decoder
both select through these functions.
"""

from __future__ import annotations

import torch


def rank_scores(scores: torch.Tensor, positions: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """Scores with protected tokens (position < sinks, or among the `recent` newest) at +inf."""
    protected = positions < sinks
    if recent > 0:
        # Newest by logical position: after a compaction the physical order
        # is no longer chronological.
        protected.scatter_(1, positions.topk(min(recent, scores.shape[-1]), dim=-1).indices, True)
    return scores.to(torch.float32).masked_fill(protected, float("inf"))


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
