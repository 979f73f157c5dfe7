"""Which cached tokens survive: selection modifiers, protected tokens, top scores,
hole-filling order.

A selection modifier reshapes a scorer's scores before the top-k, and
combines with any scorer (methods.md, "Selection modifiers"):

  top    plain top-k of the scores
  span   span carry: each token's score becomes the largest among itself and
         the `span - 1` tokens before it, so a kept token keeps what follows it
  chunk  ChunkKV: consecutive chunks of `chunk_length` tokens ranked by their
         summed scores, kept whole in that order (the last one truncated)

Shared by every scorer and allocation; the worker and the reference decoder
both select through these functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from .compat import Component, Problem, first_problem
from .host_reads import upload
from .limits import bounded

if TYPE_CHECKING:
    from .config import KVCompressConfig
    from .registry import Components


@dataclass(frozen=True)
class Selection(Component):
    """Which tokens a top-k over the scores picks (contiguous spans, chunks, or the top scores)."""

    # Adjusted scores keep the scorer's scale, so heads can be compared
    # (per-head budgets share one top-k across heads).
    comparable_across_heads: ClassVar[bool] = True

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        """Why this selection cannot serve beside the other parts (None: it can)."""
        return first_problem(
            (not self.comparable_across_heads and parts.allocation.name == "per_head", "selection",
             f"{self.name!r} ranks tokens within each head, and allocation 'per_head' compares scores across "
             f"heads; valid with it: ['span', 'top']"))

    def adjust(self, scores: torch.Tensor, positions: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """[..., Hkv, T] float32 scores -> the scores the top-k ranks (protected tokens are kept anyway)."""
        return scores


class TopScores(Selection):  # no parameters: the base's dataclass serves
    name = "top"


def _chronological(x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., H, T] in logical order per head (the cache's physical order is not), and that order."""
    order = positions.argsort(dim=-1)
    return x.gather(-1, order), order


@dataclass(frozen=True)
class SpanCarry(Selection):
    name = "span"

    span: int = field(default=8, metadata=bounded(
        1, "tokens", help="span: a token's score is the largest of itself and the span - 1 tokens before it"))
    sink_tokens: int = field(default=0, metadata=bounded(
        0, "tokens", help="span: the first tokens are kept and start no span (attention sinks)"))

    def validate(self) -> None:
        if self.span < 1:
            raise ValueError(f"span must be >= 1, got {self.span}")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens must be >= 0, got {self.sink_tokens}")

    def adjust(self, scores, positions, protected):
        # Attention sinks draw attention from every query, not for what follows
        # them: carried, their score would keep the span after them instead of
        # content. They are kept (ranked first) and carry nothing.
        sinks = positions < self.sink_tokens
        chrono, order = _chronological(scores.masked_fill(protected | sinks, float("-inf")), positions)
        # Running max over the span ending at each token: -inf padding on the left.
        rows = chrono.reshape(-1, 1, chrono.shape[-1])
        carried = F.max_pool1d(F.pad(rows, (self.span - 1, 0), value=float("-inf")), self.span, stride=1)
        return scores.scatter(-1, order, carried.view_as(chrono)).masked_fill(sinks, float("inf"))


@dataclass(frozen=True)
class ChunkSelection(Selection):
    name = "chunk"
    comparable_across_heads = False  # the adjusted scores are ranks within a head

    chunk_length: int = field(default=10, metadata=bounded(1, "tokens",
                                                           help="chunk: tokens per chunk, kept or evicted whole"))

    def validate(self) -> None:
        if self.chunk_length < 1:
            raise ValueError(f"chunk_length must be >= 1, got {self.chunk_length}")

    def adjust(self, scores, positions, protected):
        *rows, num_tokens = scores.shape
        # The ranked tokens (unprotected) in logical order, cut into chunks;
        # protected tokens go to one extra chunk that ranks nothing.
        chrono, order = _chronological(scores, positions)
        free = ~protected.gather(-1, order)
        num_chunks = -(-num_tokens // self.chunk_length)
        chunk = torch.where(free, (free.cumsum(-1) - 1) // self.chunk_length, num_chunks)
        sums = torch.zeros(*rows, num_chunks + 1, dtype=chrono.dtype, device=chrono.device)
        sums.scatter_add_(-1, chunk, chrono.masked_fill(~free, 0.0))
        # Chunks by summed score (ties: earlier first), tokens of a chunk in
        # order: the k best ranks are whole chunks and the start of one more.
        by_chunk = sums.gather(-1, chunk).masked_fill(~free, float("-inf"))
        place = _inverse(torch.sort(by_chunk, dim=-1, descending=True, stable=True).indices)
        ranks = (free.sum(-1, keepdim=True) - place).to(scores.dtype).masked_fill(~free, float("-inf"))
        return torch.empty_like(scores).scatter_(-1, order, ranks)


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """[..., T] row permutations -> their inverses (where each index sits)."""
    steps = torch.arange(permutation.shape[-1], device=permutation.device).expand_as(permutation)
    return torch.empty_like(permutation).scatter_(-1, permutation, steps)


# Below every key `_order_keys` gives a token: what padding (no token) gets.
NO_TOKEN = torch.iinfo(torch.int64).min


def _order_keys(ranked: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[..., T] float32 -> distinct int64 keys in the order the selection ranks
    tokens: higher values first, ties to the lower index, the same on every
    device; padding (`valid` False) below every token. The float's bits made
    monotone (negative floats flip their magnitude bits; + 0.0 makes -0.0
    equal to 0.0, as comparisons have it) in the high half, the reversed
    index in the low half (rows shorter than 2**31 tokens): one topk over
    them is 4x faster than a stable sort."""
    num_tokens = ranked.shape[-1]
    bits = (ranked.to(torch.float32) + 0.0).contiguous().view(torch.int32)
    monotone = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    reversed_index = num_tokens - 1 - torch.arange(num_tokens, device=ranked.device)
    keys = monotone * (1 << 32) + reversed_index
    return keys if valid is None else keys.masked_fill(~valid, NO_TOKEN)


def token_ranks(ranked: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[..., T] -> where each token sits in its row's selection order (0: kept first; padding last)."""
    return _inverse(_order_keys(ranked, valid).argsort(dim=-1, descending=True))


SELECTIONS: dict[str, type[Selection]] = {cls.name: cls for cls in (TopScores, SpanCarry, ChunkSelection)}
TOP = TopScores()


def protected_mask(positions: torch.Tensor, sinks: int | torch.Tensor, recent: int | torch.Tensor,
                   valid: torch.Tensor | None = None) -> torch.Tensor:
    """[..., H, T] True for protected tokens: position < sinks, or among the
    `recent` newest (ints, or one per request [R, 1, 1] for [R, H, T]
    inputs, `per_request`; `valid`: False for padding, never protected)."""
    protected = positions < sinks
    if isinstance(recent, int) and valid is None:
        if recent > 0:
            # Newest by logical position: after a compaction the physical
            # order is no longer chronological.
            protected.scatter_(-1, positions.topk(min(recent, positions.shape[-1]), dim=-1).indices, True)
        return protected
    newest = positions if valid is None else positions.masked_fill(~valid, -1)
    newest_first = _inverse(newest.argsort(dim=-1, descending=True))
    protected |= newest_first < recent
    return protected if valid is None else protected & valid


def rank_scores(scores: torch.Tensor, positions: torch.Tensor, sinks: int | torch.Tensor,
                recent: int | torch.Tensor, selection: Selection = TOP,
                valid: torch.Tensor | None = None) -> torch.Tensor:
    """The scores the top-k ranks: adjusted by the selection, protected tokens
    at +inf, padding (`valid` False) at -inf. [H, T], or [R, H, T] with
    `sinks` and `recent` per request ([R, 1, 1], `per_request`)."""
    protected = protected_mask(positions, sinks, recent, valid)
    if valid is None:
        adjusted = selection.adjust(scores.to(torch.float32), positions, protected)
        return adjusted.masked_fill(protected, float("inf"))
    # Padding is neither ranked nor carried: for the modifier it is protected.
    adjusted = selection.adjust(scores.to(torch.float32), positions, protected | ~valid)
    return adjusted.masked_fill(protected, float("inf")).masked_fill(~valid, float("-inf"))


def select_keep(
    scores: torch.Tensor, positions: torch.Tensor, keep: int, sinks: int, recent: int,
    selection: Selection = TOP,
) -> torch.Tensor:
    """Indices [Hkv, keep] of the cached tokens each head keeps, in hole-filling order.

    scores, positions: [Hkv, T]. Protected tokens (logical position < sinks,
    or among the `recent` newest) are always kept; the rest of the budget goes
    to the highest (selection-adjusted) scores. See `hole_filling_order` for the order.
    """
    ranked = rank_scores(scores, positions, sinks, recent, selection)
    return select_ranked(ranked[None], [min(keep, scores.shape[-1])])[0]


def select_ranked(ranked: torch.Tensor, keep: list[int], valid: torch.Tensor | None = None) -> torch.Tensor:
    """Request r's heads keep their `keep[r]` best tokens of `ranked` [R, H, T]:
    indices [R, H, max(keep)] in hole-filling order (row r's first keep[r] count)."""
    widest = max(keep)
    keys = _order_keys(ranked, valid)
    if widest == ranked.shape[-1] and min(keep) == widest:  # every token stays where it is
        return torch.arange(widest, device=ranked.device).expand(*ranked.shape[:-1], -1).clone()
    top = keys.topk(widest, dim=-1, sorted=True).indices
    counts = per_request(keep, ranked)
    slot = torch.arange(widest, device=ranked.device)
    return hole_filling_order(top.masked_fill(slot >= counts, ranked.shape[-1]), counts)


def per_request(values: list[int], like: torch.Tensor) -> torch.Tensor:
    """One host number per request as [R, 1, 1] on `like`'s device (uploaded,
    no wait), to broadcast over an [R, H, T] batch."""
    return upload(torch.tensor(values, dtype=torch.int64), like.device).view(-1, 1, 1)


def select_keep_per_head(ranked: torch.Tensor, counts: torch.Tensor, keep: list[int],
                         valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Head h of request r keeps its `counts[r, h]` best tokens in a layer
    `keep[r]` slots long (ranked [R, H, T]).

    Returns (indices [R, H, max(keep)] in hole-filling order, dead: the same
    shape), row r's first keep[r] entries counting: a head with fewer tokens
    than `keep[r]` pads with slots it evicts that are already in place (never
    copied); attention must mask those (`dead`).
    """
    num_tokens = ranked.shape[-1]
    widest = max(keep)
    slots = per_request(keep, ranked)
    counts = torch.minimum(counts.to(ranked.device), slots[..., 0])
    # Fixed shapes only (no per-head loop, nothing read on the host).
    kept = token_ranks(ranked, valid) < counts[..., None]
    in_layer = torch.arange(num_tokens, device=ranked.device) < slots
    free = ~kept & in_layer
    padding = free & (free.cumsum(-1) <= (slots[..., 0] - counts)[..., None])  # the first slots it evicts, in place
    chosen = kept | padding
    # Each row holds exactly keep[r] chosen tokens: their indices, ascending.
    chosen_idx = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices[..., :widest]
    slot = torch.arange(widest, device=ranked.device)
    order = hole_filling_order(chosen_idx.masked_fill(slot >= slots, num_tokens), slots)
    return order, ~torch.gather(kept, -1, order)


def hole_filling_order(kept: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """[..., K] kept physical indices (any order) -> the order compaction uses.

    Entry j is j when token j stays where it is; otherwise it is a kept token
    from beyond the new length K that moves into the evicted slot j (ascending
    sources into ascending holes). Compaction then copies only the tokens
    that move, about as many as were evicted rather than all K, and in any
    order: sources (>= K) and destinations (< K) never overlap. Attention does
    not care in which slots the cached keys sit (positions are in the keys).

    `keep` [R, 1, 1]: row r's new length when it is shorter than K (its
    entries past keep[r] are padding, any index >= the row's token count;
    the same entries of the result are padding too).
    """
    width = kept.shape[-1]
    new_len = width if keep is None else keep
    kept = kept.sort(dim=-1).values
    stays = torch.zeros(*kept.shape[:-1], width + 1, dtype=torch.bool, device=kept.device)
    stays.scatter_(-1, torch.clamp(kept, max=new_len), True)
    steps = torch.arange(width, device=kept.device)
    holes = ~stays[..., :width] & (steps < new_len)
    # Per head, #holes == #movers (m); the movers are the sorted row's last m
    # of its new length's entries, and hole i (ascending) takes mover i:
    # fixed shapes, no host read.
    movers = ((kept >= new_len) & (steps < new_len)).sum(-1, keepdim=True)
    source = (new_len - movers + holes.cumsum(-1) - 1).clamp(0, width - 1)
    return torch.where(holes, kept.gather(-1, source), steps.expand_as(kept))
