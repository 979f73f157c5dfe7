"""Expected attention: score cached tokens by the attention future queries are expected to pay them.

kvpress's ExpectedAttentionPress (Devoto et al., "Expected Attention: KV
cache compression by estimating attention from future queries
distribution", 2025). No question is needed: the prompt's queries (before
RoPE, past the first `sink_tokens`) are summarised by their mean and
covariance per query head; the queries to come are assumed drawn from that
Gaussian, rotated by the RoPE of the next `future_positions` positions
(averaged into one matrix). For a Gaussian query q ~ N(mu, Sigma) and a key
k, E[exp(s q.k)] = exp(s mu.k + s^2 k^T Sigma k / 2) (s: the attention's
scale). A token's score is that, normalised over the layer's tokens per
query head (a softmax of the exponents), averaged over its GQA group and
multiplied by the norm of its value. The sinks are kept, out of the softmax.

The worker sees queries after RoPE; it turns them back with the model's own
cos/sin table (`unrotate`); the reference decoder takes them before RoPE.
Both accumulate `QueryMoments` and score through `expected_attention_scores`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..limits import bounded
from .base import Observation, Observe, Scorer, check_at_least, check_choice

STATISTICS = ("covariance", "mean")

# Scratch bound of the covariance term, in elements of [Hq, T chunk, D].
_SCORE_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ExpectedAttention(Scorer):
    name = "expected_attention"
    observe = Observe.QUERIES
    needs_keys = True

    sink_tokens: int = field(default=4, metadata=bounded(
        0, "tokens", help="first tokens always kept (attention sinks); their queries are left out of the statistics"))
    future_positions: int = field(default=512, metadata=bounded(
        1, "tokens", help="expected_attention: the positions after the compression whose RoPE is averaged"))
    statistics: str = field(default="covariance", metadata={
        "help": "expected_attention: the query statistics used (covariance: mean and covariance per query head, "
                "as kvpress; mean: the mean alone, less memory per request while the prompt runs)",
        "choices": STATISTICS})

    def validate(self) -> None:
        check_at_least("sink_tokens", self.sink_tokens, 0)
        check_at_least("future_positions", self.future_positions, 1)
        check_choice("statistics", self.statistics, STATISTICS)

    def protected(self, budget: int) -> tuple[int, int]:
        return self.sink_tokens, 0

    def min_budget(self) -> int:
        return self.sink_tokens + 1

    def observed_from(self) -> int:
        return self.sink_tokens

    def query_covariance(self) -> bool:
        return self.statistics == "covariance"

    def score(self, obs: Observation) -> torch.Tensor:
        if obs.query_moments is None or obs.query_moments.count == 0 or obs.geometry is None:
            raise RuntimeError(f"kv_compress: expected_attention observed no queries of layer {obs.layer}")
        queries = ExpectedQueries.of(obs.query_moments, obs.geometry, obs.logical_len, self.future_positions)
        return expected_attention_scores(obs.cached_keys(), obs.cached_values(), queries, obs.positions,
                                         self.sink_tokens)


@dataclass
class QueryMoments:
    """One layer's observed queries (before RoPE, float32, this worker's query
    heads), as sums: their count, sum [Hq, D] and sum of outer products
    [Hq, D, D] (None: the mean alone)."""

    count: int
    total: torch.Tensor
    outer: torch.Tensor | None

    @classmethod
    def empty(cls, num_q_heads: int, head_dim: int, covariance: bool, device: torch.device) -> QueryMoments:
        zeros = torch.zeros(num_q_heads, head_dim, dtype=torch.float32, device=device)
        outer = torch.zeros(num_q_heads, head_dim, head_dim, dtype=torch.float32, device=device) \
            if covariance else None
        return cls(0, zeros, outer)

    def add(self, queries: torch.Tensor) -> None:
        """Add [n, Hq, D] queries (before RoPE)."""
        q = queries.to(torch.float32)
        self.count += q.shape[0]
        self.total += q.sum(dim=0)
        if self.outer is not None:
            self.outer += torch.einsum("nhd,nhe->hde", q, q)

    def copy(self) -> QueryMoments:
        return QueryMoments(self.count, self.total.clone(), None if self.outer is None else self.outer.clone())


@dataclass(frozen=True)
class QueryGeometry:
    """How a model's compressed layers turn and scale their queries, as
    expected attention reads it (the same for every compressed layer):
    `cos_sin` maps logical positions [n] to the rotary embedding's (cos, sin)
    [n, R / 2] (NeoX's layout: dimension i turns with i + R / 2; the
    dimensions past R are not turned), for positions below `max_position`;
    `scale` multiplies q.k in the softmax. The tables may carry a magnitude
    (YaRN's mscale): every formula here takes them as they are."""

    cos_sin: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    max_position: int
    scale: float

    def unrotated(self, queries: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[n, H, D] queries after RoPE at logical `positions` [n] -> before it (`unrotate`)."""
        return unrotate(queries, *self.cos_sin(positions))


@dataclass
class ExpectedQueries:
    """What expected attention knows of one layer's queries to come: the
    observed moments, and the rotation they will be at (averaged)."""

    mean: torch.Tensor  # [Hq, D], rotated to the future positions
    covariance: torch.Tensor | None  # [Hq, D, D], rotated
    scale: float

    @classmethod
    def of(cls, moments: QueryMoments, geometry: QueryGeometry, logical_len: int,
           future_positions: int) -> ExpectedQueries:
        """The moments' mean and covariance, turned by the RoPE of the next
        `future_positions` positions from `logical_len` on, averaged (a
        position past the table counts as its last one)."""
        device = moments.total.device
        count = max(moments.count, 1)
        mean = moments.total / count
        positions = torch.arange(logical_len, logical_len + future_positions).clamp(max=geometry.max_position - 1)
        cos, sin = geometry.cos_sin(positions.to(device))
        turn = average_rotation(cos.to(torch.float32).mean(dim=0), sin.to(torch.float32).mean(dim=0),
                                mean.shape[-1])
        covariance = None
        if moments.outer is not None:
            centred = moments.outer / count - mean.unsqueeze(-1) * mean.unsqueeze(-2)
            covariance = turn @ centred @ turn.T
        return cls(mean @ turn.T, covariance, geometry.scale)


def average_rotation(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[D, D] the average of RoPE's rotation matrices given the averaged
    cos and sin [R / 2] (NeoX layout); identity past the rotary dimensions."""
    half = cos.shape[0]
    turn = torch.eye(head_dim, dtype=torch.float32, device=cos.device)
    idx = torch.arange(half, device=cos.device)
    turn[idx, idx] = cos
    turn[idx + half, idx + half] = cos
    turn[idx, idx + half] = -sin
    turn[idx + half, idx] = sin
    return turn


def unrotate(queries: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[n, H, D] queries after RoPE at positions whose (cos, sin) are [n, R / 2]
    -> before it, float32 (NeoX layout; the dimensions past R were not
    turned). The inverse of x1 c - x2 s, x2 c + x1 s is divided by c^2 + s^2,
    which is 1 unless the table carries a magnitude."""
    q = queries.to(torch.float32)
    half = cos.shape[-1]
    c, s = cos.to(torch.float32).unsqueeze(1), sin.to(torch.float32).unsqueeze(1)
    o1, o2, rest = q[..., :half], q[..., half: 2 * half], q[..., 2 * half:]
    norm = c * c + s * s
    return torch.cat([(o1 * c + o2 * s) / norm, (o2 * c - o1 * s) / norm, rest], dim=-1)


def expected_attention_scores(keys: torch.Tensor, values: torch.Tensor, queries: ExpectedQueries,
                              positions: torch.Tensor, sink_tokens: int) -> torch.Tensor:
    """[Hkv, T] scores of cached keys and values [Hkv, T, D] (float32, after
    RoPE) at logical `positions` [Hkv, T]: per query head the softmax over
    tokens of s mu.k + s^2 k^T Sigma k / 2, averaged over the GQA group,
    times ||v||. Tokens below `sink_tokens` are left out of the softmax and
    get the layer's highest score (they are kept anyway)."""
    hkv, num_tokens, head_dim = keys.shape
    hq = queries.mean.shape[0]
    group = hq // hkv
    scale = queries.scale
    # Query head h reads KV head h // group: [Hkv, group, D] against [Hkv, T, D].
    mean = queries.mean.view(hkv, group, head_dim)
    logits = scale * torch.einsum("hgd,htd->hgt", mean, keys)
    if queries.covariance is not None:
        covariance = queries.covariance.view(hkv, group, head_dim, head_dim)
        step = max(1, _SCORE_ELEMENTS // max(1, hq * head_dim))
        for t in range(0, num_tokens, step):
            k = keys[:, t: t + step]
            spread = (torch.einsum("htd,hgde->hgte", k, covariance) * k.unsqueeze(1)).sum(dim=-1)
            logits[:, :, t: t + step] += (scale * scale / 2) * spread
    sinks = (positions < sink_tokens).unsqueeze(1)  # [Hkv, 1, T]
    probs = torch.softmax(logits.masked_fill(sinks, float("-inf")), dim=-1).nan_to_num(0.0)
    scores = probs.mean(dim=1) * values.norm(dim=-1)
    return torch.where(sinks.squeeze(1), scores.amax(), scores)  # on the device: no host read
