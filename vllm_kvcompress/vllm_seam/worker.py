"""Worker side: compaction, physical slots, and query observation.

Per step, around vLLM's V1 GPUModelRunner (also the CPU runner's base):
  _update_states (before): drop ended requests, start new ones, run the
      step's compactions (every layer, per KV head), truncate block tables;
  _prepare_inputs (after): slot mapping and seq_lens become physical,
      positions (RoPE) stay logical; publish which queries to observe;
  attention forward (attention.py): redo rows whose KV heads keep different
      counts (per-head masks), feed observed queries' scores;
  sample_tokens (after): return layer budgets derived from a prompt's
      attention (adaptive, adakv) to the scheduler on ModelRunnerOutput.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..cache_layout import LAYOUTS, KVViews
from ..compression import MergedUpper, RequestCompression, score_bytes_per_kv_byte
from ..config import CONFIG_KEY, KVCompressConfig
from ..kernels import get_ops
from ..plan import BUDGETS_ATTR, FAILED_ATTR, PLAN_ATTR, Compaction, ReportedBudgets, StepPlan
from ..planner import cdiv
from ..sharding import ONE_DEVICE, HeadShard
from .groups import CompressedLayers, layer_index
from .metrics import SnapshotWriter

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger

# A test hook (tests/test_reliability.py): the compaction of a request whose
# prompt has this many tokens raises, as a bug or a failed allocation would.
FAULT_ENV = "VLLM_KVCOMPRESS_FAIL_PROMPT_LEN"


class InjectedFault(RuntimeError):
    """The failure FAULT_ENV asks for."""


# Scratch bounds, in elements: the per-head masked pass materialises at most
# MASK_ELEMENTS of a prompt chunk's [Hq, n, S] mask (bool) and attention
# weights at once, and GATHER_ELEMENTS of decoding requests' padded K and V,
# noisy scoring at most NOISE_ELEMENTS floats of [rows, Hq, T]; the kernel
# ops bound their own (kernels/reference.py, _CHUNK_ELEMS).
MASK_ELEMENTS = 1 << 24
NOISE_ELEMENTS = 1 << 24
# Decoding requests' masked pass: the padded K and V gathered for one batch.
GATHER_ELEMENTS = 1 << 26


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned memory, asynchronously:
    a copy from pageable memory would wait for the device (a host sync)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclass
class StepRequest:
    """One request's queries in the running step, and where its cache is.
    Index tensors are on the cache's device (uploaded once per step, read by
    every layer); logical positions stay on the host, where decisions are made."""

    request_id: str
    state: RequestCompression
    token_idx: torch.Tensor  # rows of the step's query tensor
    q_logical: torch.Tensor  # [n] logical (RoPE) positions, on the host
    # Per KV cache group: physical slots of the queries, keys visible, block ids.
    q_physical: list[torch.Tensor]
    seq_lens: list[int]
    block_ids: list[torch.Tensor]


@dataclass
class ScoringBatch:
    """The step's plain-softmax observed queries of one KV cache group, as the
    batched kernel op takes them (built once per step and group)."""

    requests: list[StepRequest]
    token_idx: torch.Tensor
    cu_q_lens: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    q_positions: torch.Tensor
    max_seq_len: int
    max_q_len: int

    @classmethod
    def build(cls, requests: list[StepRequest], group: int, device) -> ScoringBatch:
        lens = [len(r.token_idx) for r in requests]
        seq_lens = [r.seq_lens[group] for r in requests]
        return cls(
            requests=requests,
            token_idx=torch.cat([r.token_idx for r in requests]),
            cu_q_lens=upload(torch.tensor([0, *np.cumsum(lens)], dtype=torch.int64), device),
            block_tables=_padded([r.block_ids[group] for r in requests], device),
            seq_lens=upload(torch.tensor(seq_lens, dtype=torch.int64), device),
            q_positions=torch.cat([r.q_physical[group] for r in requests]),
            max_seq_len=max(seq_lens),
            max_q_len=max(lens),
        )


class StepObservation:
    """Which queries of the running step feed which request's scores, and
    which requests' heads attend to fewer slots than their layer holds."""

    def __init__(self, worker: WorkerCompression) -> None:
        self.worker = worker
        self.observed: list[StepRequest] = []  # the queries a scorer observes
        # Of those, requests whose one query (a decode step) gets its attention
        # and its scores from one op (`attend_fused`): vLLM's kernel sees them
        # as one-key rows (`fused_rows`, rows of the step's batch) and does not
        # read their cache.
        self.fused: list[StepRequest] = []
        self.fused_rows: list[int] = []
        self.masked: list[StepRequest] = []  # all queries of requests with per-head budgets
        self.merged: list[StepRequest] = []  # all queries of requests with merged layer pairs
        self._batches: dict[tuple[str, int], ScoringBatch | None] = {}
        self._fused_scores: dict[int, torch.Tensor] = {}
        self.layers_seen = 0

    def _batch(self, kind: str, group: int) -> ScoringBatch | None:
        """The step's `kind` requests of a group as one batch (built once per step):
        'fused', or 'window' (the other plain-softmax observed requests)."""
        if (kind, group) not in self._batches:
            fused = {id(r) for r in self.fused}
            requests = self.fused if kind == "fused" else \
                [r for r in self.observed if not r.state.noisy and id(r) not in fused]
            self._batches[kind, group] = ScoringBatch.build(requests, group, self.worker.device) if requests else None
        return self._batches[kind, group]

    def after_attention(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor,
                        output: torch.Tensor) -> None:
        """Everything the step needs after a layer's attention (vLLM's kernel
        has written `output` and this step's keys and values into `kv_cache`).
        Each request goes through at most one of the three passes that
        rewrite its rows (a fused request is neither masked nor merged)."""
        self.mask_heads(layer_name, query, kv_cache, output)
        self.attend_merged(layer_name, query, kv_cache, output)
        self.attend_fused(layer_name, query, kv_cache, output)
        self.observe(layer_name, query, kv_cache)

    def attend_fused(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor,
                     output: torch.Tensor) -> None:
        """Decode attention and decode scoring in one pass over K and V
        (`decode_attention_with_scores`) for the fused requests, all of them
        in one op call per layer: their rows of `output` are written here
        (vLLM's kernel attended one key for them) and the probabilities go to
        each request's scores."""
        worker = self.worker
        layer = worker.layer_of.get(layer_name)
        if layer is None:  # a sliding-window layer: not compressed
            return
        group = worker.group_of_layer[layer]
        batch = self._batch("fused", group)
        if batch is None:
            return
        start = time.perf_counter()
        keys, values = worker.views(kv_cache)
        # One zeroed buffer per group and step, reused by its layers: the
        # probabilities are added into each request's own scores right after.
        scores = self._fused_scores.get(group)
        if scores is None:
            scores = self._fused_scores[group] = torch.zeros(
                len(batch.requests), query.shape[1], batch.max_seq_len, dtype=torch.float32, device=keys.device)
        else:
            scores.zero_()
        out = worker.ops.decode_attention_with_scores(
            query[batch.token_idx], keys, values, batch.block_tables, batch.seq_lens, worker.scales[layer],
            scores, max_seq_len=batch.max_seq_len)
        rows = output.view(output.shape[0], -1)
        rows[batch.token_idx] = out.reshape(len(batch.requests), -1).to(rows.dtype)
        for i, r in enumerate(batch.requests):
            with worker.isolated(r.request_id, "decode scoring"):
                r.state.accumulate(layer, scores[i, :, : r.seq_lens[group]])
        worker.seconds["scoring"] += time.perf_counter() - start

    def mask_heads(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Redo attention for requests whose heads keep different counts.

        vLLM's kernels take one length per request and layer; here each KV
        head's evicted slots are masked (torch's SDPA in the model's dtype,
        over the gathered cache; the masks were uploaded at compaction) and
        the rows of `output` are overwritten. Decoding requests (one query
        each) share one SDPA call per batch, their caches padded to the
        longest; a prompt chunk gets its own, in query chunks.
        """
        worker = self.worker
        layer = worker.layer_of.get(layer_name)
        if layer is None:  # a sliding-window layer: not compressed
            return
        group = worker.group_of_layer[layer]
        rows = output.view(output.shape[0], -1)
        key_view, value_view = worker.views(kv_cache)
        scale, hq = worker.scales[layer], query.shape[1]
        decoding = []
        for r in self.masked:
            if r.request_id in worker.failed:
                continue
            q_phys, seq_len, block_ids = r.q_physical[group], r.seq_lens[group], r.block_ids[group]
            dead = r.state.dead_slots(layer, seq_len)
            if dead is None:
                continue
            if len(r.token_idx) == 1:
                decoding.append((r, dead))
                continue
            keys = worker.ops.gather_dense(key_view, block_ids, seq_len).unsqueeze(0)  # [1, Hkv, S, D]
            values = worker.ops.gather_dense(value_view, block_ids, seq_len).unsqueeze(0)
            live = ~dead.repeat_interleave(hq // len(dead), dim=0).unsqueeze(1)  # [Hq, 1, S]
            key_slot = torch.arange(seq_len, device=live.device)
            for sl in _chunks(len(r.token_idx), hq * seq_len):
                q = query[r.token_idx[sl]].transpose(0, 1).unsqueeze(0).to(keys.dtype)  # [1, Hq, n, D]
                mask = live & (key_slot <= q_phys[sl].unsqueeze(1))  # [Hq, n, S]: live and causal
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask.unsqueeze(0), scale=scale,
                                                     enable_gqa=True)
                rows[r.token_idx[sl]] = out[0].transpose(0, 1).reshape(q.shape[2], -1).to(rows.dtype)
        for batch in _decode_batches(decoding, group, key_view.shape[2] * key_view.shape[3]):
            self._mask_decoding(batch, group, query, key_view, value_view, rows, scale)

    def _mask_decoding(self, batch, group: int, query: torch.Tensor, key_view: torch.Tensor,
                       value_view: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
        """One masked SDPA for decoding requests: a decode query sees every
        cached slot, so the mask is the live slots, padding dead."""
        longest = max(r.seq_lens[group] for r, _ in batch)
        num_blocks = cdiv(longest, key_view.shape[1])
        table = _padded([r.block_ids[group][:num_blocks] for r, _ in batch], key_view.device)
        hkv, d = key_view.shape[2], key_view.shape[3]
        # [B, Hkv, S, D] through the padded block table (padding reads block 0; it is masked).
        keys, values = (view[table].reshape(len(batch), -1, hkv, d)[:, :longest].transpose(1, 2)
                        for view in (key_view, value_view))
        live = torch.zeros(len(batch), hkv, longest, dtype=torch.bool, device=key_view.device)
        for j, (r, dead) in enumerate(batch):
            live[j, :, : r.seq_lens[group]] = ~dead
        token_idx = torch.cat([r.token_idx for r, _ in batch])
        q = query[token_idx].unsqueeze(2).to(keys.dtype)  # [B, Hq, 1, D]
        mask = live.repeat_interleave(query.shape[1] // hkv, dim=1).unsqueeze(2)  # [B, Hq, 1, S]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        rows[token_idx] = out.reshape(len(batch), -1).to(rows.dtype)

    def attend_merged(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor,
                      output: torch.Tensor) -> None:
        """Redo the upper layer of a merged pair for the requests merged in it.

        Its own KV cache group holds only its retained tokens and the tokens
        appended since; the merged ones it reads from the lower layer's slots,
        rescaled (merge.py). vLLM's pass over its own slots is overwritten.
        """
        worker = self.worker
        layer = worker.layer_of.get(layer_name)
        if layer is None:
            return
        rows = output.view(output.shape[0], -1)
        upper_keys, upper_values = worker.views(kv_cache)
        for r in self.merged:
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
                m.key_slot, m.key_scale, m.value_slot, m.value_scale)
            rows[r.token_idx] = out.reshape(len(r.token_idx), -1).to(rows.dtype)

    def observe(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        worker = self.worker
        layer = worker.layer_of.get(layer_name)
        if layer is None:  # a sliding-window layer: not compressed
            return
        start = time.perf_counter()
        group = worker.group_of_layer[layer]
        keys = worker.views(kv_cache)[0]
        batch = self._batch("window", group)
        if batch is not None:
            # One op over every request: softmax sums per cached slot.
            q = query[batch.token_idx]
            scores = worker.ops.window_scores_batched(
                q, batch.cu_q_lens, keys, batch.block_tables, batch.seq_lens, batch.q_positions,
                worker.scales[layer], max_seq_len=batch.max_seq_len, max_q_len=batch.max_q_len)
            for i, r in enumerate(batch.requests):
                with worker.isolated(r.request_id, "scoring"):
                    r.state.accumulate(layer, scores[i, :, : r.seq_lens[group]])
        for r in self.observed:
            if r.state.noisy and r.request_id not in worker.failed:
                with worker.isolated(r.request_id, "noisy scoring"):
                    self._observe_noisy(r, layer, group, query, keys)
        worker.seconds["scoring"] += time.perf_counter() - start
        self.layers_seen += 1
        if self.layers_seen == worker.num_layers:
            set_active(None)  # a later warm-up or dummy run must not observe
            for r in self.observed:
                if r.request_id not in worker.failed and r.state.reports_budgets(r.q_logical):
                    with worker.isolated(r.request_id, "layer budgets"):
                        worker.reported.append(ReportedBudgets(r.request_id, r.state.attention_budgets()))
            worker.snapshot.write(worker.seconds)

    def _observe_noisy(self, r: StepRequest, layer: int, group: int, query: torch.Tensor, keys: torch.Tensor) -> None:
        """Scorers that perturb the logits (Keyformer): each observed query is
        one row of the decode-scoring op, seeing the keys up to its own slot."""
        seq_len, heads = r.seq_lens[group], query.shape[1]
        device = keys.device
        step = max(1, NOISE_ELEMENTS // (heads * seq_len))
        total = torch.zeros(heads, seq_len, dtype=torch.float32, device=device)
        for i in range(0, len(r.token_idx), step):
            sl = slice(i, i + step)
            noise = r.state.logits_noise(layer, r.q_logical[sl])
            assert noise is not None
            rows = len(r.token_idx[sl])
            scores = torch.zeros(rows, heads, seq_len, dtype=torch.float32, device=device)
            # The noise is a hash of logical coordinates, made on the host (base.hash_uniform).
            self.worker.ops.accumulate_decode_scores(
                query[r.token_idx[sl]], keys, r.block_ids[group].expand(rows, -1),
                r.q_physical[group][sl] + 1, scores, self.worker.scales[layer],
                ("gumbel", upload(noise.noise, device).transpose(0, 1), noise.tau), max_seq_len=seq_len)
            total += scores.sum(dim=0)
        r.state.accumulate(layer, total)


def _padded(rows, device: torch.device) -> torch.Tensor:
    """Block id rows (host lists, or tensors already on `device`) as one
    [R, widest] table on `device` (zero padded)."""
    if not all(isinstance(r, torch.Tensor) for r in rows):
        table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64)
        for i, r in enumerate(rows):
            table[i, : len(r)] = torch.as_tensor(r, dtype=torch.int64)
        return upload(table, device)
    table = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.int64, device=device)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


def _copy_indices(keep: torch.Tensor, first: int, fresh: int) -> torch.Tensor:
    """Kept indices [Hkv, K] -> the op's, for a row of `fresh` slots of new
    blocks followed by the original blocks from slot `first` on: slots before
    `first` stay (the protected start keeps them in place), every other kept
    token is copied from the originals."""
    if first and not bool((keep[:, :first] == torch.arange(first)).all()):
        raise RuntimeError("kv_compress: a compaction would move tokens of the protected start")
    return keep[:, first:] - first + fresh


def _kept_dense(ops, view: torch.Tensor, row: torch.Tensor, length: int, keep: torch.Tensor) -> torch.Tensor:
    """The kept tokens [Hkv, K, D] of one request's layer, in the order `keep` [Hkv, K] lists them."""
    dense = ops.gather_dense(view, row, length)
    return torch.gather(dense, 1, keep.to(dense.device).unsqueeze(-1).expand(-1, -1, dense.shape[-1]))


def _write_slots(key_view: torch.Tensor, value_view: torch.Tensor, row, keys: torch.Tensor,
                 values: torch.Tensor) -> None:
    """Write [Hkv, n, D] keys and values into slots 0..n-1 of a request's blocks `row`."""
    n, block = keys.shape[1], key_view.shape[1]
    slots = torch.arange(n, device=key_view.device)
    blocks = torch.as_tensor(row, dtype=torch.int64).to(key_view.device)[slots // block]
    key_view[blocks, slots % block] = keys.transpose(0, 1).to(key_view.dtype)
    value_view[blocks, slots % block] = values.transpose(0, 1).to(value_view.dtype)


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


def _write_cpu_attn(layer, scratch: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    from vllm import _custom_ops as ops

    _, heads, block, two_d = scratch.shape
    key_cache, value_cache = scratch.view(2, heads, 2 * block, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(len(key)), layer.isa)


def _write_flash_attn(layer, scratch: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    from vllm import _custom_ops as ops

    key_cache, value_cache = scratch.transpose(1, 2).split(scratch.shape[-1] // 2, dim=-1)
    slots = torch.arange(len(key), device=scratch.device)
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", layer._k_scale, layer._v_scale)


# attention backend -> vLLM's own cache writer, for the layout self-test
CACHE_WRITERS = {"CPU_ATTN": _write_cpu_attn, "FLASH_ATTN": _write_flash_attn}


def check_layout(layer, views, ops, write, backend: str) -> None:
    """Refuse to run unless our reader sees what vLLM's own writer wrote.

    A cache's inner layout depends on the backend, the instruction-set path
    and the cache dtype; reading it wrong would corrupt output silently.
    """
    if layer.impl.kv_cache_dtype != "auto":
        raise RuntimeError(f"kv_compress: KV cache dtype {layer.impl.kv_cache_dtype!r} is not supported (use auto)")
    cache = layer.kv_cache
    _, heads, block, two_d = cache.shape
    dim, n = two_d // 2, block + 3
    scratch = torch.zeros_like(cache[:2])  # two blocks, the cache's own strides
    key = torch.randn(n, heads, dim).to(cache.dtype).to(cache.device)
    value = torch.randn(n, heads, dim).to(cache.dtype).to(cache.device)
    write(layer, scratch, key, value)
    key_view, value_view = views(scratch)
    blocks = torch.arange(2, device=cache.device)
    keys, values = ops.gather_dense(key_view, blocks, n), ops.gather_dense(value_view, blocks, n)
    if not (torch.equal(keys, key.transpose(0, 1)) and torch.equal(values, value.transpose(0, 1))):
        raise RuntimeError(
            f"kv_compress: unknown {backend} KV cache layout (shape {tuple(cache.shape)}, "
            f"strides {cache.stride()}, dtype {cache.dtype}); refusing to compact"
        )


def check_scoring_exact(layer) -> None:
    """Refuse attention the scoring ops would not reproduce.

    Scores (and the per-head masked pass) are softmax(scale * q.k): a logit
    soft cap (Gemma 2), ALiBi slopes or attention sinks (gpt-oss) change the
    attention, so the scores would be of a different attention than the model's.
    """
    impl = layer.impl
    for attr, what in (("logits_soft_cap", "an attention logit soft cap"), ("alibi_slopes", "ALiBi slopes"),
                       ("sinks", "attention sinks")):
        if getattr(impl, attr, None) not in (None, 0, 0.0):
            raise RuntimeError(f"kv_compress cannot be served with {what} (layer {layer.layer_name}); "
                               f"its scores would not be the model's attention")


def gather_failed(failed: list[str]) -> list[str]:
    """The union of every tensor-parallel rank's failed requests (a count
    first, over the ranks' CPU group: the ids travel only when there are some)."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group().cpu_group
    count = torch.tensor([len(failed)])
    dist.all_reduce(count, group=group)
    if not int(count):
        return failed
    everyone: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, failed, group=group)
    return sorted({rid for ids in everyone for rid in ids or ()})


def tensor_parallel_shard() -> HeadShard:
    """This worker's heads among vLLM's tensor-parallel ranks (a slice of every layer's)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return ONE_DEVICE
    group = get_tp_group()
    return HeadShard(rank=get_tensor_model_parallel_rank(), size=size,
                     gather=lambda local: group.all_gather(local, dim=0))


class WorkerCompression:
    """Compression state of one model runner."""

    def __init__(self, runner) -> None:
        config = KVCompressConfig.from_dict(runner.vllm_config.additional_config[CONFIG_KEY])
        context = runner.compilation_config.static_forward_context
        attn_layers = {layer_index(name): m for name, m in context.items()
                       if hasattr(m, "kv_cache") and hasattr(m, "impl")}
        groups = runner.kv_cache_config.kv_cache_groups
        # Only full-attention layers compress (a hybrid model's sliding-window
        # layers run as in vLLM). "Layer" and "group" below count compressed
        # ones; `vllm_groups` maps a group to vLLM's KV cache group id.
        compressed = CompressedLayers.from_groups(groups)
        if sorted(attn_layers) != list(range(len(attn_layers))) or not set(compressed.layers) <= set(attn_layers):
            raise RuntimeError(f"kv_compress: unexpected attention layers {sorted(attn_layers)}")
        layers = [attn_layers[i] for i in compressed.layers]
        for layer in layers:
            check_scoring_exact(layer)
        block_size = groups[compressed.vllm_groups[0]].kv_cache_spec.block_size
        for g in compressed.vllm_groups:
            table = runner.input_batch.block_table[g]
            if table.block_size != block_size:
                raise RuntimeError(
                    f"kv_compress: kernel block size {table.block_size} differs from the KV manager's "
                    f"{block_size}; choose --block-size as a multiple of 32 that the backend uses as is"
                )
        # Dispatch, once: the cache views by attention backend, the kernel
        # ops by device (Triton on CUDA, torch elsewhere).
        backend = layers[0].attn_backend.get_name()
        if backend not in LAYOUTS:
            raise RuntimeError(
                f"kv_compress: attention backend {backend} is not supported (CPU_ATTN on CPU, "
                f"FLASH_ATTN on CUDA); refusing to compact a cache layout it does not know"
            )
        self.setup(runner, layers, compressed.group_of_layer, compressed.vllm_groups, compressed.num_vllm_groups,
                   block_size, LAYOUTS[backend], tensor_parallel_shard())
        check_layout(layers[0], self.views, self.ops, CACHE_WRITERS[backend], backend)
        logger.info("kv_compress worker ready (pid %d, tensor-parallel rank %d of %d): %s, %d layers, block %d, "
                    "%s cache, %s ops", os.getpid(), self.shard.rank, self.shard.size, config.to_dict(),
                    self.num_layers, self.block_size, backend, self.ops.backend)

    def setup(self, runner, layers, group_of_layer, vllm_groups, num_vllm_groups: int, block_size: int,
              views: Callable[[torch.Tensor], KVViews], shard: HeadShard) -> None:
        """The state every step reads, from the compressed attention layers
        (each with `layer_name`, `kv_cache`, `num_heads`, `num_kv_heads` and
        `impl.scale`) and the runner's per-request block ids
        (`runner.requests[id].block_ids`). The GPU harness without vLLM
        (kvc_tools.paged_decoder) builds a worker through here as well."""
        self.runner = runner
        self.layers = list(layers)
        self.layer_of = {layer.layer_name: i for i, layer in enumerate(self.layers)}
        first = self.layers[0]
        self.num_layers = len(self.layers)
        self.num_kv_heads = first.num_kv_heads  # this rank's (tensor parallelism splits heads)
        self.num_q_heads = first.num_heads
        self.shard = shard
        self.scales = [layer.impl.scale for layer in self.layers]
        self.group_of_layer = list(group_of_layer)
        self.vllm_groups = vllm_groups
        self.num_vllm_groups = num_vllm_groups
        self.num_groups = len(self.vllm_groups)
        self.block_size = block_size
        self.views = views
        self.device = first.kv_cache.device
        self.ops = get_ops(self.device.type)
        self.states: dict[str, RequestCompression] = {}
        self.evicted: dict[str, tuple[int, ...]] = {}  # per KV cache group
        # Per-layer budgets decided from this step's attention, for the scheduler.
        self.reported: list[ReportedBudgets] = []
        self.seconds = {"scoring": 0.0, "compaction": 0.0}  # for /metrics
        self.snapshot = SnapshotWriter("worker")
        # Requests whose compression raised in this step -> why: each fails
        # alone (the scheduler finishes it with an error), the others go on.
        self.failed: dict[str, str] = {}
        self.compressing = False  # this step runs requests with a plan (the same on every rank)
        fault = os.environ.get(FAULT_ENV, "")
        self.fault_prompt_len = int(fault) if fault.isdigit() else None

    # ------------------------------------------------------------ failures

    @contextlib.contextmanager
    def isolated(self, request_id: str, what: str):
        """One request's compression work: whatever it raises fails that
        request alone (its state is dropped, the scheduler finishes it with
        an error) and the step goes on for the others. Batched ops over
        several requests are not run inside: their sizes are checked and their
        scratch bounded by construction (README, Reliability)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure of one request's compression
            self.fail(request_id, what, e)

    def fail(self, request_id: str, what: str, error: BaseException) -> None:
        if request_id in self.failed:
            return
        logger.error("kv_compress %s: %s failed (%s: %s); the request finishes with an error, the others go on",
                     request_id, what, type(error).__name__, error, exc_info=error)
        self.failed[request_id] = f"{what}: {type(error).__name__}: {error}"
        self.states.pop(request_id, None)

    def take_failed(self) -> list[str]:
        """This step's failed requests, over every tensor-parallel rank (a
        failure on one rank alone, say a device allocation, fails the request
        everywhere); called by every rank at the end of a step."""
        failed, self.failed = sorted(self.failed), {}
        if self.shard.size > 1 and self.compressing:
            failed = gather_failed(failed)
        return failed

    # ------------------------------------------------------------ _update_states

    def before_update_states(self, so) -> None:
        set_active(None)
        set_metadata_edits(None)
        plan: StepPlan = getattr(so, PLAN_ATTR, None) or StepPlan()
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self.states.pop(rid, None)
        self.compressing = plan.compressing
        for started in plan.started:
            self.states.pop(started.request_id, None)
            if started.plan is not None:
                with self.isolated(started.request_id, "start"):
                    self.states[started.request_id] = RequestCompression(
                        started.plan, self.num_layers, self.num_kv_heads, self.num_q_heads, self.shard, self.device)
        if plan.compactions:
            start = time.perf_counter()
            self.compact(plan.compactions)
            self.seconds["compaction"] += time.perf_counter() - start
            self.snapshot.write(self.seconds)
        self.evicted = plan.evicted

    def compact(self, compactions: list[Compaction]) -> None:
        """Compact every layer of these requests to their KV cache groups' new
        lengths (one kernel op per layer for all of them); truncate each group's table.

        A group the scheduler copies (prefix caching: its blocks from the
        protected start's on were cached or shared) gets the kept tokens from
        there on in fresh blocks: the op's row for it is the fresh blocks
        followed by the originals, and every kept token past the protected
        start is read from the originals (indices shifted past the fresh ones).
        """
        # A request whose compression fails leaves the batch for the layers
        # still to come (its cache is then unusable: the scheduler finishes
        # it with an error); its block table is still cut as the scheduler
        # planned, since those blocks are back in the pool.
        states: list[RequestCompression | None] = [self.states.get(c.request_id) for c in compactions]
        group_ids = [[self.runner.requests[c.request_id].block_ids[vg] for vg in self.vllm_groups]
                     for c in compactions]
        for i, c in enumerate(compactions):
            state = states[i]
            with self.isolated(c.request_id, "compaction"):
                if state is None:
                    raise RuntimeError("no compression state")
                if self.fault_prompt_len is not None and state.plan.prompt_len == self.fault_prompt_len:
                    raise InjectedFault(f"{FAULT_ENV}={self.fault_prompt_len}")
                for layer in range(self.num_layers):
                    if state.num_tokens(layer) != c.old_lengths[self.group_of_layer[layer]]:
                        raise RuntimeError(
                            f"layer {layer} tracks {state.num_tokens(layer)} tokens, scheduler says "
                            f"{c.old_lengths[self.group_of_layer[layer]]}")
        live = [c.request_id not in self.failed for c in compactions]
        device = self.device
        bs = self.block_size
        tables, op_tables = {}, {}
        # (first slot copied, fresh slots) per (request, group) that copies.
        copied: dict[tuple[int, int], tuple[int, int]] = {}
        for g in range(self.num_groups):
            rows, op_rows = [], []
            for i, (c, ids) in enumerate(zip(compactions, group_ids)):
                rows.append(ids[g])
                copy = c.copies[g] if c.copies else None
                if copy is None:
                    op_rows.append(ids[g])
                else:
                    first, fresh = copy
                    op_rows.append(list(fresh) + ids[g][first:])
                    copied[i, g] = (first * bs, len(fresh) * bs)
            tables[g] = _padded(rows, device)
            op_tables[g] = tables[g] if not any(k[1] == g for k in copied) else _padded(op_rows, device)
        # MiniCache pairs merge at their first compaction: both layers of a
        # pair leave the batched op, and are written once both are selected.
        merging = [{layer for pair in state.lower_of.items() for layer in pair} if state and not state.merged
                   else set() for state in states]
        lower_kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(self.num_layers):
            g = self.group_of_layer[layer]
            keys, values = self.views(self.layers[layer].kv_cache)
            keeps: list[torch.Tensor | None] = [None] * len(compactions)
            for i, (c, state) in enumerate(zip(compactions, states)):
                if not live[i] or state is None:
                    continue
                with self.isolated(c.request_id, "selection"):
                    # Scorers that read the cached keys (R-KV's redundancy) get them dense.
                    dense = self.ops.gather_dense(keys, tables[g][i], c.old_lengths[g]) \
                        if state.scorer.needs_keys else None
                    keeps[i] = state.select(layer, c.new_lengths[g], dense)
                live[i] = keeps[i] is not None
            selected = {i: k for i, k in enumerate(keeps) if k is not None and live[i] and layer not in merging[i]}
            batch = list(selected)
            if batch:
                op_keeps = [_copy_indices(k, *copied[i, g]) if (i, g) in copied else k for i, k in selected.items()]
                width = max(k.shape[1] for k in op_keeps)
                keep_idx = torch.zeros(len(op_keeps), self.num_kv_heads, width, dtype=torch.int64)
                for j, k in enumerate(op_keeps):
                    keep_idx[j, :, : k.shape[1]] = k
                counts = torch.tensor([[k.shape[1]] * self.num_kv_heads for k in op_keeps], dtype=torch.int64)
                table = op_tables[g] if len(batch) == len(keeps) else op_tables[g][upload(torch.tensor(batch), device)]
                self.ops.compact_kv_batched(keys, values, table, upload(keep_idx, device), upload(counts, device))
            for i in range(len(keeps)):
                keep, state = keeps[i], states[i]
                if not live[i] or keep is None or state is None:
                    continue
                with self.isolated(compactions[i].request_id, "compaction"):
                    if layer in merging[i]:
                        old = compactions[i].old_lengths[g]
                        kept = (_kept_dense(self.ops, keys, tables[g][i], old, keep),
                                _kept_dense(self.ops, values, tables[g][i], old, keep))
                        lower = state.lower_of.get(layer)
                        if lower is None:
                            lower_kept[i, layer] = kept
                        else:
                            self._merge_pair(compactions[i], state, lower, layer, lower_kept.pop((i, lower)), kept,
                                             group_ids[i])
                    state.compact(layer, keep)
                live[i] = compactions[i].request_id not in self.failed
        for i, (c, state, ids) in enumerate(zip(compactions, states, group_ids)):
            if live[i] and state is not None:
                with self.isolated(c.request_id, "compaction"):
                    state.finish_compaction()
            row = self.runner.input_batch.req_id_to_index.get(c.request_id)
            for g, new_len in enumerate(c.new_lengths):
                copy = c.copies[g] if c.copies else None
                if copy is not None:
                    ids[g][copy[0]:] = copy[1]
                del ids[g][cdiv(new_len, self.block_size):]
                if row is not None:
                    table = self.runner.input_batch.block_table[self.vllm_groups[g]]
                    table.clear_row(row)
                    table.add_row(ids[g], row)

    def _merge_pair(self, c: Compaction, state: RequestCompression, lower: int, upper: int,
                    lower_kv: tuple[torch.Tensor, torch.Tensor], upper_kv: tuple[torch.Tensor, torch.Tensor],
                    ids: list[list[int]]) -> None:
        """MiniCache on one pair of a compaction: the lower layer's first
        slots get the stored (merged or exact) vectors, the upper layer's
        first ones its retained exact vectors (merge.py).

        `*_kv`: the pair's kept tokens [Hkv, T, D] in their new slot order,
        read before anything was written; `ids`: the request's block ids per
        group before this compaction (a group that copies writes to its fresh blocks).
        """
        g_lo, g_up = self.group_of_layer[lower], self.group_of_layer[upper]
        key, value = state.plan.merge.merge_pair(lower_kv, upper_kv)
        tokens, retained = key.slot.shape[1], key.retained.shape[1]
        if tokens != c.new_lengths[g_lo] or retained != c.new_lengths[g_up]:
            raise RuntimeError(f"kv_compress: request {c.request_id} merges {tokens} tokens ({retained} retained) "
                               f"of layers {lower} and {upper}, scheduler planned {c.new_lengths[g_lo]} and "
                               f"{c.new_lengths[g_up]} slots")
        for layer, g, k, v in ((lower, g_lo, key.lower, value.lower), (upper, g_up, key.retained, value.retained)):
            copy = c.copies[g] if c.copies else None
            row = ids[g] if copy is None else ids[g][: copy[0]] + list(copy[1])
            _write_slots(*self.views(self.layers[layer].kv_cache), row, k, v)
        state.merged[upper] = MergedUpper.of(lower, key, value)

    # ------------------------------------------------------------ _prepare_inputs

    def after_prepare_inputs(self, so, num_scheduled_tokens: np.ndarray) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids[:num_reqs]
        total = int(num_scheduled_tokens.sum())
        starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)[:-1]])
        none = (0,) * self.num_groups
        evicted = np.array([self.evicted.get(rid, none) for rid in req_ids], dtype=np.int64).reshape(num_reqs, -1)
        # Per vLLM KV cache group (a sliding-window group evicts nothing of ours).
        offsets = np.zeros((num_reqs, self.num_vllm_groups), dtype=np.int64)
        offsets[:, list(self.vllm_groups)] = evicted
        positions = runner.positions[:total]
        # The same logical positions on the host, as vLLM derives them (its
        # tensor may be on the GPU: reading it back would be a host sync).
        positions_host = torch.from_numpy(
            np.repeat(batch.num_computed_tokens_cpu[:num_reqs] - starts, num_scheduled_tokens) + np.arange(total)
        ).to(torch.int64)
        if positions.device.type == "cpu" and not torch.equal(positions, positions_host):
            raise RuntimeError("kv_compress: the runner's positions are not num_computed_tokens + query offset")
        physical_host = [positions_host] * self.num_groups
        deltas: dict[int, torch.Tensor] = {}
        if offsets.any():
            for g, vg in enumerate(self.vllm_groups):
                if offsets[:, vg].any():
                    per_token = torch.from_numpy(np.repeat(offsets[:, vg], num_scheduled_tokens))
                    physical_host[g] = positions_host - per_token
                    batch.block_table[vg].compute_slot_mapping(
                        num_reqs, runner.query_start_loc.gpu[: num_reqs + 1],
                        positions - upload(per_token, positions.device))
            # seq_lens are shared by all groups' metadata: vLLM group 0's lengths
            # here, the other groups' differences applied when their metadata is built.
            off = torch.from_numpy(offsets[:, 0]).to(torch.int32)
            runner.seq_lens[:num_reqs] -= upload(off, runner.seq_lens.device).to(runner.seq_lens.dtype)
            runner.optimistic_seq_lens_cpu[:num_reqs] -= off.to(runner.optimistic_seq_lens_cpu.dtype)
            deltas = {g: torch.from_numpy(offsets[:, g] - offsets[:, 0]).to(torch.int32)
                      for g in range(1, self.num_vllm_groups) if (offsets[:, g] != offsets[:, 0]).any()}
        step = self.observation(req_ids, starts, num_scheduled_tokens, positions_host, physical_host)
        set_active(step)
        fused = torch.tensor(step.fused_rows if step is not None else [], dtype=torch.int64)
        if deltas or len(fused):
            set_metadata_edits(MetadataEdits(num_reqs, deltas, fused, upload(fused, runner.seq_lens.device),
                                             frozenset(self.vllm_groups)))

    def observation(self, req_ids, starts, num_scheduled_tokens, positions_host: torch.Tensor,
                    physical_host: list[torch.Tensor]) -> StepObservation | None:
        """The step's queries to observe, mask or merge (None: none): request
        i's queries are rows starts[i]..+num_scheduled_tokens[i], at logical
        `positions_host` and per group physical `physical_host` (host tensors)."""
        step = StepObservation(self)
        for i, rid in enumerate(req_ids):
            state = self.states.get(rid)
            if state is None:
                continue
            with self.isolated(rid, "observation"):
                self._observe_request(step, i, rid, state, slice(int(starts[i]), int(starts[i]) +
                                                                 int(num_scheduled_tokens[i])),
                                      positions_host, physical_host)
        return step if step.observed or step.masked or step.merged else None

    def _observe_request(self, step: StepObservation, i: int, rid: str, state: RequestCompression, sl: slice,
                         positions_host: torch.Tensor, physical_host: list[torch.Tensor]) -> None:
        """Request i (rows `sl` of the step) into the step's observed, fused,
        masked and merged lists, as its state asks."""
        q_log = positions_host[sl]
        state.append(q_log)
        observed = state.observed(q_log)
        masked = any(d is not None for d in state.dead)
        if observed.any():
            request = self._step_request(rid, state, sl, observed, q_log, physical_host)
            step.observed.append(request)
            # One query observed with a plain softmax: it sees every
            # cached slot, so its attention and its scores are one pass.
            if len(q_log) == 1 and not state.noisy and not masked and not state.merged:
                step.fused.append(request)
                step.fused_rows.append(i)
        if masked:
            step.masked.append(self._step_request(rid, state, sl, slice(None), q_log, physical_host))
        if state.merged:
            step.merged.append(self._step_request(rid, state, sl, slice(None), q_log, physical_host))

    def _step_request(self, rid: str, state: RequestCompression, sl: slice, mask, q_log, physical) -> StepRequest:
        """A request's selected queries in this step, its index tensors
        uploaded to the cache's device once (`physical`: host positions)."""
        return StepRequest(
            request_id=rid, state=state, token_idx=upload(torch.arange(sl.start, sl.stop)[mask], self.device),
            q_logical=q_log[mask],
            q_physical=[upload(p[sl][mask], self.device) for p in physical],
            seq_lens=[int(p[sl.stop - 1]) + 1 for p in physical],
            block_ids=[upload(torch.tensor(self.runner.requests[rid].block_ids[vg], dtype=torch.int64), self.device)
                       for vg in self.vllm_groups],
        )


# The step whose queries the attention backend must observe (one model runner
# per worker process).
_active_step: StepObservation | None = None


def set_active(step: StepObservation | None) -> None:
    global _active_step
    _active_step = step


@dataclass(frozen=True)
class MetadataEdits:
    """How this step's attention metadata differs, per vLLM KV cache group,
    from the seq_lens the runner computed (vLLM group 0's physical lengths)."""

    num_reqs: int
    # vLLM group (other than 0) -> [num_reqs] int32, host: how much shorter
    # than group 0 each request's physical length is.
    deltas: dict[int, torch.Tensor]
    # Rows (requests) whose attention `attend_fused` computes in the
    # compressed groups: vLLM's kernel attends one key for them (seq_len 1,
    # a valid row for every backend) instead of reading their whole cache.
    fused_rows: torch.Tensor  # host int64
    fused_rows_device: torch.Tensor  # the same, on the seq_lens' device
    compressed_groups: frozenset[int]

    def apply(self, cm, vllm_group: int):
        """vLLM's CommonAttentionMetadata `cm` for this group, edited (a copy;
        `cm` itself is shared by every group)."""
        delta = self.deltas.get(vllm_group)
        fuse = vllm_group in self.compressed_groups and len(self.fused_rows) > 0
        if delta is None and not fuse:
            return cm
        if cm.num_reqs != self.num_reqs:
            raise RuntimeError(f"kv_compress: metadata for {cm.num_reqs} requests, step planned {self.num_reqs}")
        seq_lens = cm.seq_lens.clone()
        upper = cm.seq_lens_cpu_upper_bound
        upper = None if upper is None else upper.clone()
        max_seq_len = cm.max_seq_len  # still an upper bound where fused rows shrink
        if delta is not None:
            seq_lens[: len(delta)] -= upload(delta, seq_lens.device).to(seq_lens.dtype)
            if upper is not None:
                upper[: len(delta)] -= delta.to(upper.dtype)
            # This group may be longer than group 0: the longest from the host
            # bound when there is one (no read-back).
            bound = upper if upper is not None else seq_lens
            max_seq_len = max(max_seq_len, int(bound[: len(delta)].max()) if len(delta) else 0)
        if fuse:
            seq_lens[self.fused_rows_device] = 1
            if upper is not None:
                upper[self.fused_rows] = 1
        return cm.replace(seq_lens=seq_lens, seq_lens_cpu_upper_bound=upper, max_seq_len=max_seq_len,
                          _num_computed_tokens_cache=None)


_metadata_edits: MetadataEdits | None = None


def set_metadata_edits(edits: MetadataEdits | None) -> None:
    global _metadata_edits
    _metadata_edits = edits


def wrap_build_metadata(original):
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        edits = _metadata_edits
        if edits is not None:
            common_attn_metadata = edits.apply(common_attn_metadata, self.kv_cache_group_id)
        return original(self, common_attn_metadata, *args, **kwargs)

    return build_metadata


def active_observation() -> StepObservation | None:
    return _active_step


def _compression(runner) -> WorkerCompression | None:
    """The runner's compression state, created on first use; None when off."""
    kvc = runner.__dict__.get("_kv_compress", False)
    if kvc is False:
        enabled = CONFIG_KEY in (runner.vllm_config.additional_config or {})
        kvc = runner._kv_compress = WorkerCompression(runner) if enabled else None
    return kvc


def wrap_determine_available_memory(original):
    """CUDA: leave room for the scores beside the KV cache vLLM sizes.

    vLLM gives the KV cache what its profiling run leaves free; the plugin's
    per-request scores (float32 per query head and cached token, on the
    device while a policy needs them) grow with the cached tokens and were
    never part of that run. Worst case every cached token carries scores, so
    the cache gets B / (1 + f) of the B bytes, f = score bytes per KV byte
    (about 3% for 4 query heads per KV head, head_dim 128, bf16). The CPU
    worker sizes its cache from VLLM_CPU_KVCACHE_SPACE instead (its own
    method; this one is not called there)."""

    def determine_available_memory(self) -> int:
        available = original(self)
        if CONFIG_KEY not in (self.vllm_config.additional_config or {}) or self.cache_config.kv_cache_memory_bytes:
            return available  # off, or the user sized the KV cache in bytes: scores come on top
        if self.cache_config.cache_dtype != "auto":  # check_layout refuses other cache dtypes at startup
            return available
        model, parallel = self.model_config, self.parallel_config
        ratio = score_bytes_per_kv_byte(model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel),
                                        model.get_head_size(), model.dtype.itemsize)
        kept = int(available / (1 + ratio))
        logger.info("kv_compress: %.2f GiB of %.2f GiB left for the KV cache; %.2f GiB for scores "
                    "(%.1f%% of the KV bytes)", kept / 2**30, available / 2**30, (available - kept) / 2**30,
                    100 * ratio)
        return kept

    return determine_available_memory


def wrap_initialize_kv_cache(original):
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        original(self, kv_cache_config, *args, **kwargs)
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        if not profiling:
            # At startup, not at the first request: the layout self-test
            # refuses an unknown cache before anything is served.
            self.__dict__.pop("_kv_compress", None)
            _compression(self)

    return initialize_kv_cache


def wrap_update_states(original):
    def _update_states(self, scheduler_output):
        kvc = _compression(self)
        if kvc is not None:
            kvc.before_update_states(scheduler_output)
        return original(self, scheduler_output)

    return _update_states


def wrap_sample_tokens(original):
    def sample_tokens(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        kvc = _compression(self)
        if kvc is None:
            return output
        failed = kvc.take_failed()  # every rank: a collective under tensor parallelism
        if output is None:  # nothing goes back this step: the next one reports them
            kvc.failed.update(dict.fromkeys(failed, "reported late"))
            return output
        # Both ride back to the scheduler's update_from_output (async scheduling is off).
        if kvc.reported:
            setattr(output, BUDGETS_ATTR, kvc.reported)
            kvc.reported = []
        if failed:
            setattr(output, FAILED_ATTR, failed)
        return output

    return sample_tokens


def wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        kvc = _compression(self)
        if kvc is not None:
            kvc.after_prepare_inputs(scheduler_output, num_scheduled_tokens)
        return result

    return _prepare_inputs
