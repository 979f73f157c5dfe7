"""Per-request compression state that moves with the cache: scores, positions.

Worker and reference decoder both keep one `RequestTokens` per request.
It tracks, per layer, the logical position of every cached token (per KV
head: heads may keep different tokens) and the attention the scorer has
accumulated for it, and turns a compaction order (keep N tokens) into the
kept indices per (layer, KV head). Where the K/V themselves live (vLLM's paged
cache, the reference's dense tensors) is the caller's business.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from . import host_reads
from .budgets import LayerToSelect, Selected
from .kernels.torch_paged import softmax_with_sinks
from .merge import MergedTensor
from .plan import CompressionPlan
from .scorers import Observation
from .scorers.expected_attention import QueryGeometry, QueryMoments
from .selection import rank_scores
from .sharding import ONE_DEVICE, HeadShard

# A layer's cached keys [Hkv, T, D], or what loads them (once, if the scorer reads them).
KeySource = torch.Tensor | Callable[[], torch.Tensor] | None


@dataclass
class MergedUpper:
    """What the upper layer of a merged pair needs to attend (see merge.py):
    its first `tokens` keys and values are the lower layer's first slots,
    rescaled, except the retained ones, which sit in its own first slots."""

    lower: int  # the pair's lower layer
    tokens: int  # the pair's tokens at the merge (lower layer slots 0 .. tokens - 1)
    retained: int  # the upper layer's slots that hold retained tokens (then: tokens appended since)
    key_slot: torch.Tensor  # [Hkv, tokens] int64: retained slot of the token's key, -1 if merged
    key_scale: torch.Tensor  # [Hkv, tokens] float32: ||k_upper|| / ||k_lower||
    value_slot: torch.Tensor
    value_scale: torch.Tensor

    @classmethod
    def of(cls, lower: int, key: MergedTensor, value: MergedTensor) -> MergedUpper:
        return cls(lower=lower, tokens=key.slot.shape[1], retained=key.retained.shape[1], key_slot=key.slot,
                   key_scale=key.scale, value_slot=value.slot, value_scale=value.scale)


@dataclass
class SpeculativeQueries:
    """One layer's observed queries of a step that verified drafts, until settled."""

    queries: torch.Tensor  # [n, Hq, D] (a copy), on the cache's device
    logical: torch.Tensor  # [n] logical positions, on the host, ascending

    def before(self, logical_len: int) -> SpeculativeQueries:
        """The queries of tokens below `logical_len` (accepted)."""
        n = int((self.logical < logical_len).sum())
        return SpeculativeQueries(self.queries[:n], self.logical[:n])

    def __len__(self) -> int:
        return len(self.logical)


# Most columns a layer's score buffer holds beyond its cached tokens.
SCORE_SLACK_TOKENS = 256


class RequestTokens:
    """One request's compression state on one worker: `num_kv_heads` and
    `num_q_heads` are the heads this worker holds (`shard`)."""

    def __init__(self, plan: CompressionPlan, num_layers: int, num_kv_heads: int, num_q_heads: int,
                 shard: HeadShard = ONE_DEVICE, device: torch.device | str = "cpu",
                 geometry: QueryGeometry | None = None) -> None:
        self.plan = plan
        # Where the cache is: positions, scores, selections and per-head masks
        # live there, and nothing of them is read on the host (host_reads.py):
        # the lengths the host needs come from the plan.
        self.device = torch.device(device)
        self.scorer = plan.scorer
        self.shard = shard
        self.num_q_heads = num_q_heads
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.group = num_q_heads // num_kv_heads
        self.num_compressions = 0
        self.logical_len = 0  # tokens appended
        # Where the next compression is due (None: none is): the scheduler's
        # schedule says, whenever it changes (StepPlan.next_due); R-KV observes the
        # window of queries before it (Observe.RECENT).
        self.next_due: int | None = None
        # Positions per layer = what the last compaction kept ([Hkv, n], per
        # head) + the tokens appended since, one contiguous logical range shared
        # by every layer and head: appending costs O(1) per step.
        self._kept = [torch.empty(num_kv_heads, 0, dtype=torch.int64, device=self.device)
                      for _ in range(num_layers)]
        self._tail_start = 0
        self._tail_len = 0
        self.attention: list[torch.Tensor | None] = [None] * num_layers
        # Observe.QUERIES (expected attention): per layer the observed queries'
        # moments, and how the model turns them (`geometry`).
        self.moments: list[QueryMoments | None] = [None] * num_layers
        self.geometry = geometry
        # The last layer's selection, keyed (scores_key, compaction, slots):
        # layers with equal scores select once per compaction.
        self._last_key: tuple[int, int, int] | None = None
        self._last_selected: Selected | None = None
        # Per-head budgets: [Hkv, n] slots of the kept part that hold no token
        # of that head (attention masks them); None: every slot is live.
        self.dead: list[torch.Tensor | None] = [None] * num_layers
        self._num_dead = 0  # layers with a mask in `dead` (the step's per-request test reads this)
        self._dead_after: dict[int, torch.Tensor | None] = {}  # selected, not yet compacted
        # Merge stage: upper layer -> lower layer of each merged pair; a pair
        # selects once, from its two layers' summed scores (they must keep
        # the same tokens to merge them), and its upper layer attends through
        # `merged` once the pair is merged.
        self.lower_of = {upper: lower for lower, upper in plan.merge.pairs(num_layers)}
        self._pair_keep: dict[int, torch.Tensor] = {}  # upper -> the pair's selection, not yet compacted
        self.merged: dict[int, MergedUpper] = {}
        # Speculative decoding: the observed queries of a step that verified
        # drafts, per layer, held until the scheduler says how many of its
        # tokens were accepted (`settle`); a rejected draft's query is never scored.
        self.speculative: dict[int, SpeculativeQueries] = {}
        # Whether any query's attention can still influence a compression
        # (fixed by the plan): compressing once, a prompt within budget is never compressed.
        self.needs_attention = self.scorer.observe.attends() and (plan.trigger.repeats() or plan.compresses_prompt)
        # KVzip: logical positions below this were scored by the prompt's
        # repeat passes (`take_repeat_scores`); their scores stay with the kept
        # tokens, for a request continuing this state (`reuse`).
        self.scored_len = 0
        self._span_of: tuple[int | None, tuple[int, int] | None] | None = None  # (next_due, its span), cached

    def continue_from(self, saved: RequestTokens) -> None:
        """Start where `saved` (a finished request's state, kept for `reuse`)
        ended: the same cached tokens at the same positions, with what was
        observed of them. `saved` stays as it is for other requests (what a
        step changes in place is copied)."""
        if saved.merged or self.lower_of:
            raise RuntimeError("kv_compress: a state with merged layers cannot be continued")
        self.logical_len, self._tail_start, self._tail_len = saved.logical_len, saved._tail_start, saved._tail_len
        self._kept = list(saved._kept)  # replaced, never written in place
        self.attention = [None if a is None else a.clone() for a in saved.attention]
        self.moments = [None if m is None else m.copy() for m in saved.moments]
        self.dead, self._num_dead = list(saved.dead), saved._num_dead
        self.num_compressions = saved.num_compressions
        self.scored_len = saved.scored_len

    def truncated(self, logical_len: int) -> RequestTokens:
        """This state as it was at `logical_len` tokens, the newer ones dropped
        from the tail (they came after the last compaction); for `reuse` of a
        prompt without its outputs. A copy: this state is left as it is."""
        drop = self.logical_len - logical_len
        if not 0 <= drop <= self._tail_len or self.speculative:
            raise RuntimeError(f"kv_compress: {drop} tokens cannot leave a tail of {self._tail_len}")
        out = copy.copy(self)
        out.logical_len, out._tail_len = logical_len, self._tail_len - drop
        # Score columns of the dropped tokens read as unobserved (zero) again.
        out.attention = [None if a is None else a.clone() for a in self.attention]
        for layer, a in enumerate(out.attention):
            if a is not None:
                a[:, out.num_tokens(layer):] = 0
        return out

    # ------------------------------------------------------------ observing

    def observed(self, q_positions: torch.Tensor, one_at_a_time: bool = False) -> torch.Tensor:
        """Bool mask over this step's queries (logical positions) to observe.
        `one_at_a_time`: as if each query were a step of its own (a step that
        verifies drafts: which of them count is known only later, `settle`)."""
        if not self.needs_attention:
            return torch.zeros_like(q_positions, dtype=torch.bool)
        if one_at_a_time and len(q_positions) > 1:
            return torch.cat([self.observed(q_positions[i : i + 1]) for i in range(len(q_positions))])
        # Queries in the protected start attend only protected keys: nothing to
        # learn from them (and the engine never computes prefix-cache hits).
        unprotected = q_positions >= max(self.plan.protected_len, self.scorer.observed_from())
        return self.scorer.observe.queries(q_positions, self.plan.prompt_len, self.scorer.window_queries(),
                                           self.next_due) & unprotected

    def observes_any(self, first: int, n: int) -> bool:
        """Whether any query at logical positions [first, first + n) may be
        observed (`observed` says which): the step's cheap test, so that a
        request with nothing to observe costs no tensor work."""
        if not self.needs_attention:
            return False
        cached = self._span_of  # read here: this runs per request per step
        span = cached[1] if cached is not None and cached[0] == self.next_due else self._observed_span()
        return span is None or max(first, span[0]) < min(first + n, span[1])

    def _observed_span(self) -> tuple[int, int] | None:
        """The logical positions whose queries may be observed as things stand,
        past the protected start (None: any), cached per `next_due`."""
        cached = self._span_of
        if cached is None or cached[0] != self.next_due:
            span = self.scorer.observe.span(self.plan.prompt_len, self.scorer.window_queries(), self.next_due)
            first = max(self.plan.protected_len, self.scorer.observed_from())
            cached = self._span_of = (self.next_due, None if span is None else (max(span[0], first), span[1]))
        return cached[1]

    def advance(self, first: int, n: int) -> bool:
        """The worker's call per request and step: `append_range` of its
        queries [first, first + n), and whether they are quiet (need no
        attention pass: none observed, no head with dead slots, no merged
        layer)."""
        if self._tail_len and first == self._tail_start + self._tail_len:  # decoding on: append_range's usual case
            self._tail_len += n
            self.logical_len = first + n
        else:
            self.append_range(first, n)
        return not self.merged and not self._num_dead and not self.observes_any(first, n)

    @property
    def masks_heads(self) -> bool:
        """Whether some layer has per-head dead slots (`dead`) its attention masks."""
        return self._num_dead > 0

    def append(self, q_positions: torch.Tensor) -> None:
        """New tokens entered the cache (same positions in every layer/head)."""
        self.append_range(int(q_positions[0]), len(q_positions))

    def append_range(self, first: int, n: int) -> None:
        """`append` of the positions [first, first + n)."""
        if self.logical_len == 0:
            # The first tokens computed: any before them came from the prefix
            # cache, and are in the cache from slot 0 on.
            self._tail_start, self._tail_len = 0, first
        elif self._tail_len == 0:
            self._tail_start = first
        elif first != self._tail_start + self._tail_len:
            expected = self._tail_start + self._tail_len
            raise RuntimeError(f"kv_compress: non-contiguous positions {first} after {expected}")
        self._tail_len += n
        self.logical_len = first + n

    def hold_speculative(self, layer: int, queries: SpeculativeQueries) -> None:
        """This step verifies drafts: its observed queries of `layer` wait for `settle`."""
        self.speculative[layer] = queries

    def settle(self, logical_len: int) -> dict[int, SpeculativeQueries]:
        """The last step verified drafts and `logical_len` tokens are now
        computed (the rest were rejected): the cache's tail drops the rejected
        tokens (the next step writes over their slots), and the held queries
        of accepted tokens are returned per layer, in position order, for the
        caller to score and `accumulate` one by one, as decoding them one a
        step would have. Rejected tokens only ever sit in the appended tail:
        no compression falls inside a speculative step (the scheduler ends
        the step where one is due)."""
        held, self.speculative = self.speculative, {}
        rejected = self.logical_len - logical_len
        if rejected < 0 or rejected > self._tail_len:
            raise RuntimeError(f"kv_compress: {self.logical_len} tokens computed, the scheduler says "
                               f"{logical_len} (a tail of {self._tail_len})")
        self._tail_len -= rejected
        self.logical_len = logical_len
        return {layer: accepted for layer, q in held.items() if len(accepted := q.before(logical_len))}

    def num_tokens(self, layer: int) -> int:
        return self._kept[layer].shape[-1] + self._tail_len

    def positions(self, layer: int) -> torch.Tensor:
        """[Hkv, T] logical positions of this layer's cached tokens (physical order)."""
        tail = torch.arange(self._tail_start, self._tail_start + self._tail_len,
                            device=self.device).expand(self.num_kv_heads, -1)
        return torch.cat([self._kept[layer], tail], dim=1)

    def key_positions(self, layer: int) -> torch.Tensor:
        """[Hq, T] logical positions of the keys each query head attends."""
        return self.positions(layer).repeat_interleave(self.group, dim=0)

    @property
    def noisy(self) -> bool:
        """Whether observed logits get the scorer's noise before the softmax."""
        return self.scorer.noisy

    def logits_noise(self, layer: int, q_positions: torch.Tensor):
        """The scorer's noise for these observed queries' logits (None: plain softmax)."""
        return self.scorer.logits_noise(layer, q_positions, self.key_positions(layer), self.num_compressions,
                                        self.shard.first(self.num_q_heads))

    def observe(self, layer: int, logits: torch.Tensor, q_positions: torch.Tensor,
                sinks: torch.Tensor | None = None) -> None:
        """Accumulate the attention of observed queries from their dense logits.

        The reference decoder's path (the engine's goes through the kernel
        ops). logits: [Hq, n, T] scaled q.k over this layer's cached keys,
        already masked with -inf where a query may not look (causality).
        sinks: [Hq] each head's sink logit (gpt-oss), in every softmax's
        denominator, transformed as the logits are but without noise (it is
        no token).
        """
        noise = self.logits_noise(layer, q_positions)
        sink = None if sinks is None else sinks.to(torch.float32).view(-1, 1, 1)
        if noise is not None:
            logits = (logits + noise.noise.to(logits.device)) / noise.tau
            sink = None if sink is None else sink / noise.tau
        probs = softmax_with_sinks(logits.to(torch.float32), sink)
        self.accumulate(layer, self.scorer.observe.reduce(probs))

    def observe_queries(self, layer: int, queries: torch.Tensor) -> None:
        """Add this step's observed [n, Hq, D] queries of a layer, before RoPE
        (Observe.QUERIES), to its moments, on the device they are on."""
        moments = self.moments[layer]
        if moments is None:
            moments = self.moments[layer] = QueryMoments.empty(
                queries.shape[1], queries.shape[2], self.scorer.query_covariance(), queries.device)
        moments.add(queries)

    def accumulate(self, layer: int, attention: torch.Tensor) -> None:
        """Add this step's [Hq, T] attention (summed over its observed queries),
        in place, on the device it was computed on: no copy to the host per step.

        The buffer holds up to `SCORE_SLACK_TOKENS` columns beyond the cache
        (the interval, when shorter), zero until their tokens are observed,
        so a decoding request allocates once per compaction interval (or per
        that many tokens), not once per step; readers take the cache's length
        of it (`_observed`). The slack is a constant, not the interval a
        request sets: a request's scores never outgrow its cache by more."""
        width = attention.shape[-1]
        acc = self.attention[layer]
        if acc is None or acc.shape[-1] < width:
            slack = min(max(self.plan.interval, 1), SCORE_SLACK_TOKENS)
            grown = torch.zeros(attention.shape[0], width + slack, dtype=torch.float32, device=attention.device)
            if acc is not None and self.scorer.observe.keeps_history():
                grown[:, : acc.shape[-1]] = acc
            acc = self.attention[layer] = grown
        self.scorer.observe.join(acc[:, :width], attention)

    def take_repeat_scores(self, scores: list[torch.Tensor | None]) -> None:
        """The scores its repeat passes gave the prompt (KVzip), per layer
        [Hkv, prompt tokens] by logical position, as this layer's attention:
        each query head holds its KV head's (the scorer reads one of a group)."""
        for layer, by_position in enumerate(scores):
            if by_position is None:
                raise RuntimeError(f"kv_compress: no repeat pass scored layer {layer}")
            positions = self.positions(layer)
            if positions.shape[-1] > by_position.shape[-1]:
                raise RuntimeError(f"kv_compress: repeat passes scored {by_position.shape[-1]} tokens, "
                                   f"layer {layer} holds {positions.shape[-1]}")
            self.attention[layer] = by_position.gather(1, positions).repeat_interleave(self.group, dim=0)
            self.scored_len = by_position.shape[-1]

    def _observed(self, layer: int) -> torch.Tensor | None:
        """[Hq, T] accumulated attention of the layer's T cached tokens (None: nothing observed)."""
        acc = self.attention[layer]
        if acc is None:
            return None
        length = self._kept[layer].shape[-1] + self._tail_len  # positions(layer)'s length, without building it
        return acc[:, :length] if acc.shape[-1] >= length else _pad_tokens(acc, length)

    def reports_budgets(self, q_positions: torch.Tensor) -> bool:
        """Whether these observed queries end a prompt whose layer budgets come from its attention."""
        return (self.plan.budgets_after_prompt and self.needs_attention
                and int(q_positions.max()) == self.plan.prompt_len - 1)

    def layer_slots(self) -> torch.Tensor:
        """[num_layers] int64 on the device: each layer's slots from the observed
        prompt (plans whose budgets come `budgets_after_prompt`), the same on every rank."""
        return self.plan.allocation.prompt_budgets(self, self.plan.budget, self.scorer.min_budget())

    def attention_budgets(self) -> tuple[int, ...]:
        """`layer_slots` on the host (the engine's worker reads every request's at once)."""
        return tuple(host_reads.read_list(self.layer_slots(), "layer budgets from the prompt"))

    def layer_attention(self, layer: int) -> torch.Tensor:
        """[Hq over all ranks, T] the layer's accumulated attention."""
        observed = self._observed(layer)
        if observed is None:
            observed = torch.zeros(self.num_q_heads, 0, device=self.device)
        return self.shard.all_heads(observed)

    def ranked_scores(self, layer: int) -> torch.Tensor:
        """[Hkv over all ranks, T] the layer's scores as a top-k at the request's budget ranks them."""
        scores, positions = self._scores(layer)
        return self.shard.all_heads(rank_scores(scores, positions, *self._protected(self.plan.budget),
                                                self.plan.selection))

    def dead_slots(self, layer: int, num_slots: int) -> torch.Tensor | None:
        """[Hkv, num_slots] True where a head must not attend (None: nowhere)."""
        dead = self.dead[layer]
        if dead is None:
            return None
        return torch.nn.functional.pad(dead, (0, num_slots - dead.shape[-1]))

    # ------------------------------------------------------------ compacting

    def select(self, layer: int, keep: int, keys: KeySource = None, values: KeySource = None) -> torch.Tensor:
        """[Hkv, keep] physical indices this layer keeps per head (hole-filling order).

        `keys`, `values`: the layer's cached keys and values [Hkv, T, D] (or
        what loads them, once, when the scorer reads them). Layers whose
        scores are equal (the scorer's `scores_key`) get the same tensor
        within one compaction (callers reuse what they derive from it). The
        worker selects every compacting request's layer in one batch instead:
        `to_select`, the allocation's `select_batch`, then `take_selection`.
        """
        pending = self.to_select(layer, keep, keys, values)
        selected = None if pending is None else self.plan.allocation.select_batch([pending])[0]
        return self.take_selection(layer, keep, selected)

    def to_select(self, layer: int, keep: int, keys: KeySource = None,
                  values: KeySource = None) -> LayerToSelect | None:
        """What this layer's selection needs (its scores, scored now), or None
        when it is already known: the upper layer of a merged pair (its
        pair's), a layer whose scores equal the last selected layer's."""
        if layer in self.lower_of or self._last_selected is not None and self._last_key == self._key(layer, keep):
            return None
        scores, positions = self._scores(layer, keys, values)
        upper = self._upper_of(layer)
        if upper is not None:  # one selection for the pair, from both layers' scores
            scores = scores + self._scores(upper)[0]
        return LayerToSelect(scores, positions, slots=keep, layer_budget=keep - self.plan.protected_len,
                             budget=self.plan.budget, protected=self._protected, selection=self.plan.selection,
                             shard=self.shard)

    def take_selection(self, layer: int, keep: int, selected: Selected | None) -> torch.Tensor:
        """Record this layer's selection (None: the one `to_select` found known)
        and return its kept indices [Hkv, keep]."""
        if layer in self.lower_of:  # the upper layer of a merged pair: the pair's selection
            return self._pair_keep.pop(layer)
        if selected is not None:
            self._last_key, self._last_selected = self._key(layer, keep), selected
        if self._last_selected is None:
            raise RuntimeError(f"kv_compress: layer {layer} has no selection")
        self._dead_after[layer] = self._last_selected.dead
        upper = self._upper_of(layer)
        if upper is not None:
            self._pair_keep[upper] = self._last_selected.keep_idx
        return self._last_selected.keep_idx

    def _key(self, layer: int, keep: int) -> tuple:
        return (self.scorer.scores_key(layer), self.num_compressions, keep)

    def _upper_of(self, layer: int) -> int | None:
        """The upper layer of the merged pair whose lower layer this is."""
        return layer + 1 if self.lower_of.get(layer + 1) == layer else None

    def _protected(self, budget: int) -> tuple[int, int]:
        """The scorer's (sinks, recent) at this budget (tokens after the
        protected start), or past the prompt the trigger's when it has its
        own; the protected start counts as sinks."""
        after = self.plan.trigger.protected_after_prompt(self.plan.prompt_len) \
            if self.logical_len > self.plan.prompt_len else None
        sinks, recent = self.scorer.protected(budget) if after is None else after
        return max(sinks, self.plan.protected_len), recent

    def _scores(self, layer: int, keys: KeySource = None,
                values: KeySource = None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.positions(layer)
        acc = self._observed(layer)
        obs = Observation(
            attention=None if acc is None else acc.clone(),  # a copy the scorer may modify
            positions=positions,
            num_kv_heads=self.num_kv_heads,
            layer=layer,
            num_compressions=self.num_compressions,
            shard=self.shard,
            keys=_dense(keys, self.device),
            key_loader=_loader(keys, self.device),
            protected_len=self.plan.protected_len,
            values=_dense(values, self.device),
            value_loader=_loader(values, self.device),
            query_moments=self.moments[layer],
            geometry=self.geometry,
            logical_len=self.logical_len,
            scored_len=self.scored_len,
        )
        return self.scorer.score(obs), positions

    def keep_selected(self, layer: int, keep_idx: torch.Tensor) -> None:
        """Move this layer's bookkeeping the way its K/V were moved."""
        positions = self.positions(layer)
        self._kept[layer] = torch.gather(positions, 1, keep_idx)
        self._num_dead -= self.dead[layer] is not None
        self.dead[layer] = self._dead_after.pop(layer, None)  # every later step masks with it
        self._num_dead += self.dead[layer] is not None
        acc = self.attention[layer]
        if acc is not None:
            acc = _pad_tokens(acc, positions.shape[-1])
            q_idx = keep_idx.repeat_interleave(self.group, dim=0)
            self.attention[layer] = torch.gather(acc, 1, q_idx)

    def finish_compaction(self) -> None:
        """All layers are compacted: the appended tail now lives in `_kept`."""
        self._tail_len = 0
        self.num_compressions += 1
        self._last_key, self._last_selected = None, None  # never reused: the key holds the compaction
        if (not self.plan.trigger.repeats() or self.scorer.observe.afresh_after_compaction()) \
                and not self.scorer.reconstructs_context:
            # Never needed again (once), or the next window starts afresh
            # (recent). KVzip's stay: a request continuing this state (`reuse`)
            # selects among its tokens by them.
            self.attention = [None] * self.num_layers
        if not self.plan.trigger.repeats():
            self.moments = [None] * self.num_layers  # a repeating trigger's next compression reads every query


def _dense(source: KeySource, device: torch.device) -> torch.Tensor | None:
    """Cached keys or values given as a tensor, float32 on the state's device (None: loaded, or none)."""
    return source.to(device, torch.float32) if isinstance(source, torch.Tensor) else None


def _loader(source: KeySource, device: torch.device) -> Callable[[], torch.Tensor] | None:
    """What loads cached keys or values given as a loader, float32 on the state's device."""
    return None if source is None or isinstance(source, torch.Tensor) else lambda: source().to(device, torch.float32)


def _pad_tokens(acc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Scores for tokens that entered the cache since they were last observed: zero."""
    if acc.shape[-1] >= num_tokens:
        return acc
    return torch.nn.functional.pad(acc, (0, num_tokens - acc.shape[-1]))


def score_bytes_per_kv_byte(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_bytes: int) -> float:
    """Bytes of accumulated scores (`RequestTokens.attention`: float32, one
    per query head) a cached token may hold per byte of its keys and values
    (one K and one V per KV head, `kv_bytes` each element): what a KV cache
    of B bytes can cost again in scores, at most, is B times this."""
    return 4 * num_q_heads / (2 * num_kv_heads * head_dim * kv_bytes)


# Padded tokens (rows x the widest row) one batched selection takes at most:
# a layer's selection over many requests is split into batches this large
# (a longer request alone is a batch), which bounds its scratch.
SELECTION_BATCH_TOKENS = 1 << 16


def selection_batches(rows: list[tuple[Hashable, int]]) -> list[list[int]]:
    """Rows (batch key, tokens) -> batches of row indices: rows of one key,
    in order, each batch at most SELECTION_BATCH_TOKENS padded tokens."""
    by_key: dict[Hashable, list[list[int]]] = {}
    widest: dict[Hashable, int] = {}
    for i, (key, tokens) in enumerate(rows):
        batches = by_key.setdefault(key, [[]])
        wide = max(widest.get(key, 0), tokens)
        if batches[-1] and (len(batches[-1]) + 1) * wide > SELECTION_BATCH_TOKENS:
            batches.append([])
            wide = tokens
        batches[-1].append(i)
        widest[key] = wide
    return [batch for batches in by_key.values() for batch in batches]


def selection_scratch_bytes(max_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Most bytes a step's selection holds at once on the device, beyond the
    persistent scores: compaction selects a layer's requests batch by batch
    (`selection_batches`), scoring one request at a time.

    Per cached token of the request being scored: the scores' copy and
    reductions (16 B per query head: float32 copy, sum and pooled forms) and
    the dense float32 keys and values a key-reading scorer or a MiniCache pair
    gathers (2 x 4 B per KV head and dimension); plus R-KV's similarity block
    (`REDUNDANCY_ELEMENTS` x 8 B: the float32 block, its masks and argmax).
    Per padded token of the batch (at most max(max_tokens,
    SELECTION_BATCH_TOKENS)): its scores and positions (12 B per KV head) and
    the ranking (64 B per KV head: sort keys and indices, inverse
    permutation, masks)."""
    from .scorers.rkv import REDUNDANCY_ELEMENTS

    scoring = max_tokens * (16 * num_q_heads + 8 * num_kv_heads * head_dim) + 8 * REDUNDANCY_ELEMENTS
    return scoring + max(max_tokens, SELECTION_BATCH_TOKENS) * 76 * num_kv_heads

