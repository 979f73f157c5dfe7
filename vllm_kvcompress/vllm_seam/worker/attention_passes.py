"""The attention passes: what the plugin does after vLLM's attention of a layer.

vLLM's kernels do not return attention probabilities, take one length per
request (not per KV head), and read one layer's cache. So after vLLM's
forward of a compressed layer, for the step's requests that need it:

  MaskedHeads     redo the rows of requests whose heads keep different counts
  MergedLayers    redo the upper layer of a merged MiniCache pair
  FusedDecode     attend and score decode queries in one op (vLLM's kernel
                  attended one key for them: step_inputs.MetadataEdits)
  ObservedScores  score the other observed queries
  ObservedQueries add observed queries, turned back before RoPE, to their
                  request's moments (expected attention: no attention scored)
  HeldQueries     keep the observed queries of a step that verifies drafts
                  until their acceptance is known (speculation.py)
  RepeatScores    score a prompt by the queries of a pass that repeats it
                  (KVzip: scorers/kvzip.py), for the request it belongs to

Each request goes through at most one of the first three (a fused request is
neither masked nor merged). One small class per pass, one entry point (`run`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ... import host_reads
from ...host_reads import upload
from ...kernels.torch_paged import softmax_with_sinks
from ...schedule import cdiv
from ...scorers.expected_attention import unrotate
from ...scorers.kvzip import paged_repeat_scores
from ...step_records import ReportedBudgets
from ...token_state import SpeculativeQueries
from .step_inputs import ScoringBatch, StepRepeat, StepRequest, padded

if TYPE_CHECKING:
    from .state import WorkerCompression

# Scratch bounds, in elements: the per-head masked pass materialises at most
# MASK_ELEMENTS of a prompt chunk's [Hq, n, S] mask (bool) and attention
# weights at once, and GATHER_ELEMENTS of decoding requests' padded K and V,
# noisy scoring at most NOISE_ELEMENTS floats of [rows, Hq, T]; the kernel
# ops bound their own (kernels/torch_ops.py, _CHUNK_ELEMS).
MASK_ELEMENTS = 1 << 24
NOISE_ELEMENTS = 1 << 24
# Decoding requests' masked pass: the padded K and V gathered for one batch.
GATHER_ELEMENTS = 1 << 26


class StepPasses:
    """The running step's requests by what their attention needs: which
    queries feed which request's scores, which requests' heads attend to
    fewer slots than their layer holds, which read a merged layer pair. The
    attention backend calls `after_attention` for every layer."""

    def __init__(self, worker: WorkerCompression) -> None:
        self.worker = worker
        self.observed: list[StepRequest] = []  # the queries a scorer observes
        self.queried: list[StepRequest] = []  # of requests whose scorer sums the queries themselves
        # Of those, requests whose one query (a decode step) gets its attention
        # and its scores from one op (`attend_fused`): vLLM's kernel sees them
        # as one-key rows (`fused_rows`, rows of the step's batch) and does not
        # read their cache.
        self.fused: list[StepRequest] = []
        self.fused_rows: list[int] = []
        # Observed queries of requests verifying drafts: held, scored once settled.
        self.speculative: list[StepRequest] = []
        self.masked: list[StepRequest] = []  # all queries of requests with per-head budgets
        self.merged: list[StepRequest] = []  # all queries of requests with merged layer pairs
        self.repeats: list[StepRepeat] = []  # queries of repeat passes (KVzip), scoring another request's prompt
        self.batches: dict[tuple[str, int], ScoringBatch | None] = {}
        self.fused_scores: dict[int, torch.Tensor] = {}
        self.layers_seen = 0
        self.passes = (MaskedHeads(self), MergedLayers(self), FusedDecode(self), HeldQueries(self),
                       ObservedQueries(self), RepeatScores(self), ObservedScores(self))

    def batch(self, kind: str, group: int) -> ScoringBatch | None:
        """The step's `kind` requests of a group as one batch (built once per step):
        'fused', or 'window' (the other plain-softmax observed requests)."""
        if (kind, group) not in self.batches:
            fused = {id(r) for r in self.fused}
            requests = self.fused if kind == "fused" else \
                [r for r in self.observed if not r.state.noisy and id(r) not in fused]
            self.batches[kind, group] = ScoringBatch.build(requests, group, self.worker.device) if requests else None
        return self.batches[kind, group]

    def after_attention(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor,
                        output: torch.Tensor) -> None:
        """Everything the step needs after a layer's attention (vLLM's kernel
        has written `output` and this step's keys and values into `kv_cache`).
        Each request goes through at most one of the three passes that
        rewrite its rows (a fused request is neither masked nor merged)."""
        layer = self.worker.layer_of.get(layer_name)
        if layer is None:  # a sliding-window layer: not compressed
            return
        for attention_pass in self.passes:
            attention_pass.run(layer, query, kv_cache, output)



class AttentionPass:
    """One pass over a compressed layer after vLLM's attention."""

    def __init__(self, step: StepPasses) -> None:
        self.step = step
        self.worker = step.worker

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        raise NotImplementedError


class FusedDecode(AttentionPass):
    """Decode queries observed with a plain softmax: attention and scores in one op."""

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Decode attention and decode scoring in one pass over K and V
        (`decode_attention_with_scores`) for the fused requests, all of them
        in one op call per layer: their rows of `output` are written here
        (vLLM's kernel attended one key for them) and the probabilities go to
        each request's scores."""
        worker = self.worker
        group = worker.group_of_layer[layer]
        batch = self.step.batch("fused", group)
        if batch is None:
            return
        with worker.timer.phase("scoring"):
            self._fused(worker, batch, group, layer, query, kv_cache, output)

    def _fused(self, worker, batch, group, layer, query, kv_cache, output) -> None:
        keys, values = worker.views(kv_cache)
        # One zeroed buffer per group and step, reused by its layers: the
        # probabilities are added into each request's own scores right after.
        scores = self.step.fused_scores.get(group)
        if scores is None:
            scores = self.step.fused_scores[group] = torch.zeros(
                len(batch.requests), query.shape[1], batch.max_seq_len, dtype=torch.float32, device=keys.device)
        else:
            scores.zero_()
        out = worker.ops.decode_attention_with_scores(
            query[batch.token_idx], keys, values, batch.block_tables, batch.seq_lens, worker.scales[layer],
            scores, max_seq_len=batch.max_seq_len, sinks=worker.sinks[layer])
        rows = output.view(output.shape[0], -1)
        rows[batch.token_idx] = out.reshape(len(batch.requests), -1).to(rows.dtype)
        for i, r in enumerate(batch.requests):
            with worker.isolated(r.request_id, "decode scoring"):
                r.state.accumulate(layer, scores[i, :, : r.seq_lens[group]])


class MaskedHeads(AttentionPass):
    """Requests whose KV heads keep different counts: their rows redone with each head's evicted slots masked."""

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Redo attention for requests whose heads keep different counts.

        vLLM's kernels take one length per request and layer; here each KV
        head's evicted slots are masked (torch's SDPA in the model's dtype,
        over the gathered cache; the masks were uploaded at compaction) and
        the rows of `output` are overwritten. Decoding requests (one query
        each) share one SDPA call per batch, their caches padded to the
        longest; a prompt chunk gets its own, in query chunks.
        """
        worker = self.worker
        group = worker.group_of_layer[layer]
        rows = output.view(output.shape[0], -1)
        key_view, value_view = worker.views(kv_cache)
        scale, hq, sinks = worker.scales[layer], query.shape[1], worker.sinks[layer]
        decoding = []
        for r in self.step.masked:
            if r.request_id in worker.failed:
                continue
            q_phys, seq_len, block_ids = r.q_physical[group], r.seq_lens[group], r.block_ids[group]
            dead = r.state.dead_slots(layer, seq_len)
            if dead is None:
                continue
            if len(r.token_idx) == 1:
                decoding.append((r, dead))
                continue
            keys, values = (worker.cache_dtype.read(worker.ops.gather_dense(view, block_ids, seq_len)).unsqueeze(0)
                            for view in (key_view, value_view))  # [1, Hkv, S, D]
            live = ~dead.repeat_interleave(hq // len(dead), dim=0).unsqueeze(1)  # [Hq, 1, S]
            key_slot = torch.arange(seq_len, device=live.device)
            for sl in _chunks(len(r.token_idx), hq * seq_len):
                q = query[r.token_idx[sl]].transpose(0, 1).unsqueeze(0).to(keys.dtype)  # [1, Hq, n, D]
                mask = live & (key_slot <= q_phys[sl].unsqueeze(1))  # [Hq, n, S]: live and causal
                out = _attend(q, keys, values, mask.unsqueeze(0), scale, sinks)
                rows[r.token_idx[sl]] = out[0].transpose(0, 1).reshape(q.shape[2], -1).to(rows.dtype)
        for batch in _decode_batches(decoding, group, key_view.shape[2] * key_view.shape[3]):
            self._mask_decoding(batch, group, query, key_view, value_view, rows, scale, sinks)

    def _mask_decoding(self, batch, group: int, query: torch.Tensor, key_view: torch.Tensor,
                       value_view: torch.Tensor, rows: torch.Tensor, scale: float,
                       sinks: torch.Tensor | None) -> None:
        """One masked SDPA for decoding requests: a decode query sees every
        cached slot, so the mask is the live slots, padding dead."""
        longest = max(r.seq_lens[group] for r, _ in batch)
        num_blocks = cdiv(longest, key_view.shape[1])
        table = padded([r.block_ids[group][:num_blocks] for r, _ in batch], key_view.device)
        hkv, d = key_view.shape[2], key_view.shape[3]
        # [B, Hkv, S, D] through the padded block table (padding reads block 0; it is masked).
        keys, values = (self.worker.cache_dtype.read(view[table].reshape(len(batch), -1, hkv, d)[:, :longest])
                        .transpose(1, 2) for view in (key_view, value_view))
        live = torch.zeros(len(batch), hkv, longest, dtype=torch.bool, device=key_view.device)
        for j, (r, dead) in enumerate(batch):
            live[j, :, : r.seq_lens[group]] = ~dead
        token_idx = torch.cat([r.token_idx for r, _ in batch])
        q = query[token_idx].unsqueeze(2).to(keys.dtype)  # [B, Hq, 1, D]
        mask = live.repeat_interleave(query.shape[1] // hkv, dim=1).unsqueeze(2)  # [B, Hq, 1, S]
        out = _attend(q, keys, values, mask, scale, sinks)
        rows[token_idx] = out.reshape(len(batch), -1).to(rows.dtype)


class MergedLayers(AttentionPass):
    """The upper layer of a merged MiniCache pair: its rows redone from both layers' caches."""

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Redo the upper layer of a merged pair for the requests merged in it.

        Its own KV cache group holds only its retained tokens and the tokens
        appended since; the merged ones it reads from the lower layer's slots,
        rescaled (merge.py). vLLM's pass over its own slots is overwritten.
        """
        worker = self.worker
        rows = output.view(output.shape[0], -1)
        upper_keys, upper_values = worker.views(kv_cache)
        for r in self.step.merged:
            m = r.state.merged.get(layer)
            if m is None or r.request_id in worker.failed:
                continue
            lower_keys, lower_values = worker.views(worker.layers[m.lower].kv_cache)
            g_lo, g_up = worker.group_of_layer[m.lower], worker.group_of_layer[layer]
            if r.seq_lens[g_lo] - m.tokens != r.seq_lens[g_up] - m.retained:
                raise RuntimeError(f"kv_compress: request {r.request_id} merged layers {m.lower} and {layer} "
                                   f"hold {r.seq_lens[g_lo]} and {r.seq_lens[g_up]} slots")
            out = worker.ops.merged_attention(
                query[r.token_idx], r.q_physical[g_lo], worker.scales[layer],
                lower_keys, lower_values, r.block_ids[g_lo],
                upper_keys, upper_values, r.block_ids[g_up], r.seq_lens[g_up], m.retained,
                m.key_slot, m.key_scale, m.value_slot, m.value_scale, sinks=worker.sinks[layer])
            rows[r.token_idx] = out.reshape(len(r.token_idx), -1).to(rows.dtype)


class HeldQueries(AttentionPass):
    """Requests verifying drafts: their observed queries kept, to be scored
    at the next step for the tokens accepted (speculation.settle_requests)."""

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        for r in self.step.speculative:
            if r.request_id not in self.worker.failed:
                with self.worker.isolated(r.request_id, "holding speculative queries"):
                    r.state.hold_speculative(layer, SpeculativeQueries(query[r.token_idx].clone(), r.q_logical))


class ObservedQueries(AttentionPass):
    """Observed queries of scorers that read the queries themselves: turned
    back before RoPE (one op for the step's requests), added to each request's moments."""

    def __init__(self, step: StepPasses) -> None:
        super().__init__(step)
        # The step's rows and their RoPE tables, built at the first layer.
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        requests = self.step.queried
        if not requests:
            return
        worker = self.worker
        with worker.timer.phase("scoring"):
            if self._rows is None:
                assert worker.geometry is not None  # a request without it fails at its start
                positions = upload(torch.cat([r.q_logical for r in requests]), worker.device)
                self._rows = (torch.cat([r.token_idx for r in requests]), *worker.geometry.cos_sin(positions))
            token_idx, cos, sin = self._rows
            before_rope = unrotate(query[token_idx], cos, sin)
            start = 0
            for r in requests:
                n = len(r.token_idx)
                if r.request_id not in worker.failed:
                    with worker.isolated(r.request_id, "observing queries"):
                        r.state.observe_queries(layer, before_rope[start: start + n])
                start += n


class RepeatScores(AttentionPass):
    """Repeat passes' queries (KVzip): each chunk token's highest attention
    from them, kept per layer for the request whose prompt they repeat
    (`WorkerCompression.repeat_scores`, taken at its compaction)."""

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        if not self.step.repeats:
            return
        worker = self.worker
        group = worker.group_of_layer[layer]
        keys = worker.views(kv_cache)[0]
        with worker.timer.phase("scoring"):
            for r in self.step.repeats:
                if r.request_id in worker.failed:
                    continue
                with worker.isolated(r.request_id, "repeat scores"):
                    rp = r.repeat
                    scores = paged_repeat_scores(query[r.token_idx], keys, r.block_ids[group], r.q_slots, r.last, rp,
                                                 worker.scales[layer], worker.sinks[layer])
                    layers = worker.repeat_scores.setdefault(r.target, [None] * worker.num_layers)
                    by_position = layers[layer]
                    if by_position is None:
                        by_position = layers[layer] = torch.zeros(scores.shape[0], rp.context_len,
                                                                  dtype=torch.float32, device=scores.device)
                    chunk = by_position[:, rp.start: rp.end]
                    chunk.copy_(torch.maximum(chunk, scores))


class ObservedScores(AttentionPass):
    """The other observed queries: their attention added to each request's scores."""

    def run(self, layer: int, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        worker = self.worker
        group = worker.group_of_layer[layer]
        keys = worker.views(kv_cache)[0]
        with worker.timer.phase("scoring"):
            batch = self.step.batch("window", group)
            if batch is not None:
                # One op over every request: softmax sums per cached slot.
                q = query[batch.token_idx]
                scores = worker.ops.window_scores_batched(
                    q, batch.cu_q_lens, keys, batch.block_tables, batch.seq_lens, batch.q_positions,
                    worker.scales[layer], max_seq_len=batch.max_seq_len, max_q_len=batch.max_q_len,
                    sinks=worker.sinks[layer])
                for i, r in enumerate(batch.requests):
                    with worker.isolated(r.request_id, "scoring"):
                        r.state.accumulate(layer, scores[i, :, : r.seq_lens[group]])
            for r in self.step.observed:
                if r.state.noisy and r.request_id not in worker.failed:
                    with worker.isolated(r.request_id, "noisy scoring"):
                        self._observe_noisy(r, layer, group, query, keys)
        self.step.layers_seen += 1
        if self.step.layers_seen == worker.num_layers:
            worker.step = None  # a later warm-up or dummy run must not observe
            reporting: list[tuple[str, torch.Tensor]] = []
            for r in self.step.observed:
                if r.request_id not in worker.failed and r.state.reports_budgets(r.q_logical):
                    with worker.isolated(r.request_id, "layer budgets"):
                        reporting.append((r.request_id, r.state.layer_slots()))
            for rid in worker.repeat_budgets:  # KVzip: its last repeat passes ran in this step
                state, scores = worker.states.get(rid), worker.repeat_scores.pop(rid, None)
                if state is not None and scores is not None and rid not in worker.failed:
                    with worker.isolated(rid, "layer budgets from repeat scores"):
                        state.take_repeat_scores(scores)  # its compaction then finds them taken
                        reporting.append((rid, state.layer_slots()))
            if reporting:  # every request's layer budgets in one read
                slots = host_reads.read_list(torch.stack([s for _, s in reporting]), "layer budgets from the prompt")
                worker.reported += [ReportedBudgets(rid, tuple(row)) for (rid, _), row in zip(reporting, slots)]
            worker.snapshot.write(worker.timer.seconds)

    def _observe_noisy(self, r: StepRequest, layer: int, group: int, query: torch.Tensor, keys: torch.Tensor) -> None:
        """Scorers that perturb the logits (Keyformer): each observed query is
        one row of the decode-scoring op, seeing the keys up to its own slot."""
        seq_len, heads = r.seq_lens[group], query.shape[1]
        device = keys.device
        step = max(1, NOISE_ELEMENTS // (heads * seq_len))
        total = torch.zeros(heads, seq_len, dtype=torch.float32, device=device)
        for i in range(0, len(r.token_idx), step):
            sl = slice(i, i + step)
            noise = r.state.logits_noise(layer, r.logical_on(device)[sl])
            assert noise is not None
            rows = len(r.token_idx[sl])
            scores = torch.zeros(rows, heads, seq_len, dtype=torch.float32, device=device)
            # The noise is a hash of logical coordinates, made on the keys' device (base.hash_uniform).
            self.worker.ops.accumulate_decode_scores(
                query[r.token_idx[sl]], keys, r.block_ids[group].expand(rows, -1),
                r.q_physical[group][sl] + 1, scores, self.worker.scales[layer],
                ("gumbel", noise.noise.transpose(0, 1), noise.tau), max_seq_len=seq_len, sinks=self.worker.sinks[layer])
            total += scores.sum(dim=0)
        r.state.accumulate(layer, total)



def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """Masked attention, q [B, Hq, n, D] over keys and values [B, Hkv, S, D]
    where `mask` [B, Hq, n, S] is True: SDPA, in the model's dtype. SDPA
    takes no sinks: with them (gpt-oss), written out in float32 with each
    head's sink logit in the softmax (kernels' softmax_with_sinks)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys, values = (x.to(torch.float32).repeat_interleave(group, dim=1) for x in (keys, values))
    logits = (q.to(torch.float32) @ keys.transpose(-1, -2)) * scale
    probs = softmax_with_sinks(logits.masked_fill(~mask, float("-inf")), sinks.view(1, -1, 1, 1))
    return (probs @ values).to(q.dtype)


def _decode_batches(decoding: list, group: int, elements_per_slot: int):
    """Decoding requests in batches whose padded K and V stay within GATHER_ELEMENTS."""
    batch: list = []
    longest = 0  # the batch's longest cache, what every request is padded to
    for item in decoding:
        seq_len = item[0].seq_lens[group]
        if batch and 2 * (len(batch) + 1) * max(longest, seq_len) * elements_per_slot > GATHER_ELEMENTS:
            yield batch
            batch, longest = [], 0
        batch.append(item)
        longest = max(longest, seq_len)
    if batch:
        yield batch


def _chunks(num_queries: int, elements_per_query: int):
    """Query slices whose [Hq, n, S] scratch stays within MASK_ELEMENTS."""
    step = max(1, MASK_ELEMENTS // max(1, elements_per_query))
    return (slice(i, i + step) for i in range(0, num_queries, step))


# ------------------------------------------------------------ cache layouts


