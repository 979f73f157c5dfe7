"""What every scorer shares: what it observes, its protected tokens, `score()`.

A scorer is a small frozen dataclass. Its fields are its parameters (they
become `--kv-compress-<field>` flags and YAML keys); `score()` turns what the
engine observed of one layer of one request into a score per (KV head, cached
token). How many tokens a layer or head keeps (`budgets.py`), when a request
compresses (`triggers.py`) and which tokens survive (`selection.py`) are
separate pieces that combine with any scorer (`registry.py` names the useful
combinations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from ..compat import Component, Problem, first_problem
from ..limits import bounded, shown
from ..sharding import ONE_DEVICE, HeadShard

if TYPE_CHECKING:
    from ..config import KVCompressConfig
    from ..registry import Components
    from .expected_attention import QueryGeometry, QueryMoments


EVERY_POSITION = 2**62  # past any logical position: a span without an end


class Observes:
    """Which queries' attention a scorer accumulates while the request runs,
    and how a step's attention joins what was accumulated. The request's
    token state (token_state.py) asks; it never branches on the kind."""

    value: ClassVar[str]  # how messages name it

    def attends(self) -> bool:
        """Whether any query is observed at all (its attention, or the query itself)."""
        return True

    def scores_attention(self) -> bool:
        """Whether what is observed is attention (False: the queries
        themselves, summed into moments: expected attention)."""
        return self.attends()

    def prompt_only(self) -> bool:
        """Whether only prompt queries are observed (nothing while decoding)."""
        return False

    def span(self, prompt_len: int, window: int, next_due: int | None) -> tuple[int, int] | None:
        """The logical positions [lo, hi) whose queries it observes, before
        the protected start is taken out; `next_due`: where the next
        compression happens (None: none will). None: not a fixed range (which
        queries count is decided per step, `queries`)."""
        return 0, EVERY_POSITION

    def queries(self, q_positions: torch.Tensor, prompt_len: int, window: int,
                next_due: int | None) -> torch.Tensor:
        """Bool mask over a step's queries (logical positions) to observe,
        before the protected start is taken out."""
        span = self.span(prompt_len, window, next_due)
        assert span is not None, f"{type(self).__name__} observes no fixed span: it decides per step"
        return (q_positions >= span[0]) & (q_positions < span[1])

    def first_query(self, prompt_len: int, window: int, first_due: int) -> int:
        """The lowest logical position whose query it may observe on the way
        to a request's first compression, at logical length `first_due`: a
        prefix-cache hit must end there, so that the request computes every
        query it observes (a hit's queries are never computed)."""
        return 0

    def reduce(self, probs: torch.Tensor) -> torch.Tensor:
        """[Hq, n, T] probabilities of the observed queries -> the step's [Hq, T]."""
        return probs.sum(dim=1)

    def join(self, accumulated: torch.Tensor, step: torch.Tensor) -> None:
        """Fold a step's [Hq, T] attention into the accumulated [Hq, T], in place."""
        accumulated += step

    def keeps_history(self) -> bool:
        """Whether earlier steps' attention stays in the scores (a grown buffer copies it)."""
        return True

    def afresh_after_compaction(self) -> bool:
        """Whether each compression's observation starts from nothing."""
        return False


class ObservesNothing(Observes):
    value = "nothing"  # scores from positions, keys or chance alone

    def attends(self) -> bool:
        return False

    def span(self, prompt_len, window, next_due):
        return 0, 0

    def first_query(self, prompt_len, window, first_due):
        return first_due


class ObservesWindow(Observes):
    value = "window"  # the last `window` prompt queries (SnapKV family)

    def prompt_only(self) -> bool:
        return True

    def span(self, prompt_len, window, next_due):
        return prompt_len - window, prompt_len

    def first_query(self, prompt_len, window, first_due):
        return max(prompt_len - window, 0)


class ObservesAll(Observes):
    value = "all"  # every query, prompt and decode, summed (H2O family)


class ObservesLast(Observes):
    value = "last"  # only the newest query; each step replaces the last (TOVA)

    def span(self, prompt_len, window, next_due):
        return None

    def queries(self, q_positions, prompt_len, window, next_due):
        mask = torch.zeros_like(q_positions, dtype=torch.bool)
        mask[-1] = True
        return mask

    def first_query(self, prompt_len, window, first_due):
        return max(first_due - 1, 0)  # each step's last query replaces the one before

    def reduce(self, probs: torch.Tensor) -> torch.Tensor:
        return probs[:, -1]

    def join(self, accumulated: torch.Tensor, step: torch.Tensor) -> None:
        accumulated.copy_(step)

    def keeps_history(self) -> bool:
        return False


class ObservesRecent(Observes):
    # The last `window` queries before each compression, summed; cleared after
    # it (R-KV's observation window, at every rolling compression).
    value = "recent"

    def span(self, prompt_len, window, next_due):
        return (0, 0) if next_due is None else (next_due - window, next_due)

    def first_query(self, prompt_len, window, first_due):
        return max(first_due - window, 0)

    def afresh_after_compaction(self) -> bool:
        return True


class ObservesQueries(Observes):
    # Every query up to the next compression, before RoPE, summed into its
    # moments (expected attention): no attention is computed for it.
    value = "pre-RoPE"

    def scores_attention(self) -> bool:
        return False

    def span(self, prompt_len, window, next_due):
        return (0, 0) if next_due is None else (0, next_due)


class Observe:
    """The observation kinds a scorer declares (`observe = Observe.ALL`)."""

    NOTHING = ObservesNothing()
    WINDOW = ObservesWindow()
    ALL = ObservesAll()
    LAST = ObservesLast()
    RECENT = ObservesRecent()
    QUERIES = ObservesQueries()


@dataclass
class Observation:
    """What a scorer sees of one layer of one request when it is compressed."""

    # [num_q_heads, T] accumulated attention (float32), None for Observe.NOTHING.
    attention: torch.Tensor | None
    # [num_kv_heads, T] logical (RoPE) positions of the cached tokens, in
    # physical order (heads may have kept different tokens).
    positions: torch.Tensor
    num_kv_heads: int  # this worker's
    layer: int
    # Compressions this request already had (Keyformer's temperature schedule).
    num_compressions: int
    # This worker's heads among the layer's (tensor parallelism).
    shard: HeadShard = ONE_DEVICE
    # [num_kv_heads, T, head_dim] the cached keys (post-RoPE, float32), or
    # what loads them: read through `cached_keys`, so only scorers that read
    # keys make the worker gather them.
    keys: torch.Tensor | None = None
    key_loader: Callable[[], torch.Tensor] | None = None
    # Tokens at logical positions below this are the protected start (the
    # request's `protect_prefix`, or the prompt under trigger 'decode'): kept
    # whatever their score.
    protected_len: int = 0
    # The cached values, as the keys (scorers that read them: expected attention).
    values: torch.Tensor | None = None
    value_loader: Callable[[], torch.Tensor] | None = None
    # Observe.QUERIES: the observed queries' moments (before RoPE), how the
    # model turns and scales queries, and the tokens cached (where the
    # queries to come start): scorers/expected_attention.py.
    query_moments: QueryMoments | None = None
    geometry: QueryGeometry | None = None
    logical_len: int = 0
    # KVzip: logical positions below this were scored by repeat passes (the
    # others came after a saved state the request continues).
    scored_len: int = 0

    def cached_keys(self) -> torch.Tensor:
        """[num_kv_heads, T, head_dim] the layer's cached keys (float32, on the cache's device)."""
        self.keys = self._loaded(self.keys, self.key_loader, "keys")
        return self.keys

    def cached_values(self) -> torch.Tensor:
        """[num_kv_heads, T, head_dim] the layer's cached values (float32, on the cache's device)."""
        self.values = self._loaded(self.values, self.value_loader, "values")
        return self.values

    def _loaded(self, given: torch.Tensor | None, loader: Callable[[], torch.Tensor] | None,
                what: str) -> torch.Tensor:
        if given is not None:
            return given
        if loader is None:
            raise RuntimeError(f"kv_compress: no cached {what} were given for layer {self.layer}")
        return loader()

    @property
    def first_kv_head(self) -> int:
        """Global index of this worker's first KV head (seeded scores hash it)."""
        return self.shard.first(self.num_kv_heads)


@dataclass(frozen=True)
class LogitsNoise:
    """Noise added to the observed logits before the softmax: softmax((x + noise) / tau)."""

    noise: torch.Tensor  # [Hq, n, T] for n queries over T keys
    tau: float


@dataclass(frozen=True)
class Scorer(Component):
    """What a token is worth: `score()` over one layer's observation; the lowest are evicted."""

    observe: ClassVar[Observes] = Observe.NOTHING
    # Observed logits get noise before the softmax (`logits_noise`): the
    # worker observes them apart from the fused decode kernel's plain softmax.
    noisy: ClassVar[bool] = False
    # One score per token for every KV head of a layer (they keep the same tokens).
    same_for_every_head: ClassVar[bool] = False
    # score() reads the cached keys (`Observation.cached_keys`; its values
    # too, `cached_values`): it selects from each layer's own keys when that
    # layer compresses.
    needs_keys: ClassVar[bool] = False
    # Its scores come from passes that repeat the prompt after its prefill
    # (KVzip): the scheduler runs them before the request decodes.
    reconstructs_context: ClassVar[bool] = False

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        """Why this scorer cannot serve with these parts and budget (None: it can)."""
        least = self.min_budget()
        per_head, merge = parts.allocation.name == "per_head", parts.merge.name != "none"
        # Allocations valid instead of per_head ('adaptive' shares budgets by observed attention).
        valid = ["pyramid", "uniform", "adaptive"] if self.observe.scores_attention() else ["pyramid", "uniform"]
        return first_problem(
            (per_head and self.same_for_every_head, "allocation",
             f"'per_head' gives KV heads different budgets by their scores; scorer {self.name!r} scores every "
             f"head of a layer alike (one selection per layer)"),
            (per_head and self.needs_keys, "allocation",
             f"'per_head' derives head budgets while the prompt is observed, and scorer {self.name!r} reads the "
             f"cached keys only when it compresses; valid with it: {valid}"),
            (merge and self.needs_keys, "merge",
             f"scorer {self.name!r} reads each layer's keys to select, and merge {parts.merge.name!r} selects once "
             f"per pair of layers; valid with it: scorers that read attention or positions (snapkv, h2o, tova, "
             f"streamingllm, ...)"),
            ((config.budget is None) == (config.compression_ratio is None), "budget",
             f"policy {config.policy!r} needs exactly one of budget (tokens kept) or compression_ratio (fraction "
             f"removed, in [0, 1))"),
            (config.budget is not None and config.budget < least, "budget",
             f"{config.budget} is below the {least} tokens that policy {config.policy!r} always keeps (protected "
             f"sinks/window); use a budget >= {least} or shrink the protected tokens"))

    def protected(self, budget: int) -> tuple[int, int]:
        """(sink tokens, recent tokens) that are never evicted at this budget."""
        return 0, 0

    def min_budget(self) -> int:
        """Smallest budget that still holds every protected token."""
        return 1

    def window_queries(self) -> int:
        """How many trailing prompt queries Observe.WINDOW accumulates."""
        return 0

    def query_covariance(self) -> bool:
        """Observe.QUERIES: whether the queries' covariance is kept beside their mean."""
        return False

    def observes_queries(self) -> bool:
        """Whether it observes the queries themselves (Observe.QUERIES), not attention."""
        return self.observe.attends() and not self.observe.scores_attention()

    def query_moments_bytes(self, num_layers: int, num_q_heads: int, head_dim: int) -> int:
        """Bytes of one request's query moments (`QueryMoments`: float32
        sums, [Hq, D] per layer and, with the covariance, [Hq, D, D]), on the
        device from its first prompt chunk to its compression (to its end
        under a repeating trigger); 0 where no queries are observed."""
        if not self.observes_queries():
            return 0
        return 4 * num_layers * num_q_heads * head_dim * (1 + (head_dim if self.query_covariance() else 0))

    def observed_from(self) -> int:
        """Queries at logical positions below this are never observed (expected
        attention leaves its sinks' queries out of the statistics)."""
        return 0

    def scores_key(self, layer: int) -> int:
        """Layers with one key score alike in one compaction (one selection
        serves them all): a scorer of positions alone returns one key."""
        return layer

    def logits_noise(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     num_compressions: int, first_head: int = 0) -> LogitsNoise | None:
        """Noise for the observed logits (None: a plain softmax).

        q_pos: [n] logical positions of the queries; k_pos: [Hq, T] logical
        positions of the keys each query head sees; first_head: the global
        index of the first of those query heads.
        """
        return None

    def score(self, obs: Observation) -> torch.Tensor:
        """[num_kv_heads, T] float scores; the lowest are evicted."""
        raise NotImplementedError


@dataclass(frozen=True)
class KeepsRecent(Scorer):
    """A scorer that always keeps the `window` newest tokens."""

    window: int = field(default=0, metadata=bounded(0, "tokens", help="newest tokens always kept"))

    def validate(self) -> None:
        check_at_least("window", self.window, 0)

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return max(self.window, 1)


class KeepsObservationWindow(Scorer):
    """A scorer whose observation window (its last `window` queries) is kept
    whole, and whose scores are pooled over `kernel_size` neighbours (SnapKV,
    R-KV). Subclasses declare both fields, with their own defaults."""

    window: int
    kernel_size: int

    def validate(self) -> None:
        check_at_least("window", self.window, 1)
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd and >= 1, got {self.kernel_size}")

    def protected(self, budget: int) -> tuple[int, int]:
        return 0, self.window

    def min_budget(self) -> int:
        return self.window

    def window_queries(self) -> int:
        return self.window


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {shown(value)}")


def check_at_least(name: str, value: float, low: float, unit: str = "") -> None:
    if not value >= low:  # also rejects NaN
        raise ValueError(f"{name} must be >= {low}{unit}, got {value}")


_MASK31 = (1 << 31) - 1


def hash_uniform(seed: int, *index: torch.Tensor | int) -> torch.Tensor:
    """Deterministic uniforms in (0, 1) from integer coordinates.

    Random scorers (random, Keyformer's Gumbel noise) must draw the same number
    for the same (layer, head, position) in the engine and in the reference, no
    matter how the cache is laid out or batched, so noise is a hash of logical
    coordinates rather than a generator's stream. Products stay below 2**62:
    no int64 overflow. Computed on the device of the tensor indices (the same
    integers on every device); ints stand for 0-d indices and stay Python
    ints until a tensor joins (no copy to the device, which would sync).
    """
    x: torch.Tensor | int = seed & _MASK31
    for i in index:
        x = (x * 1_000_003 + (i.to(torch.int64) if isinstance(i, torch.Tensor) else i)) & _MASK31
        x = ((x ^ (x >> 15)) * 0x2C1B3C6D) & _MASK31
        x = ((x ^ (x >> 12)) * 0x297A2D39) & _MASK31
        x = x ^ (x >> 15)
    x = torch.as_tensor(x, dtype=torch.int64)
    return (x.to(torch.float64) + 0.5) / float(1 << 31)
