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

import logging
import os
import time

import numpy as np
import torch

from ..cache_layout import CPUAttnLayout, PagedLayout
from ..compression import RequestCompression
from ..config import CONFIG_KEY, KVCompressConfig
from ..kernels import get_ops
from ..planner import cdiv
from ..accounting import BUDGETS_ATTR, PLAN_ATTR, StepPlan
from .groups import group_of_layer, layer_index
from .metrics import SnapshotWriter

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger

QUERY_CHUNK = 512  # observed queries scored at once (bounds the [Hq, n, T] logits)


class StepObservation:
    """Which queries of the running step feed which request's scores, and
    which requests' heads attend to fewer slots than their layer holds."""

    def __init__(self, worker: WorkerCompression) -> None:
        self.worker = worker
        # (request id, state, batch token indices, logical positions, and per
        # KV cache group: physical positions, seq_len, block ids)
        self.items: list[tuple] = []
        # Same tuples, all of the request's tokens: requests with per-head budgets.
        self.masked: list[tuple] = []
        self.layers_seen = 0

    def mask_heads(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor, output: torch.Tensor) -> None:
        """Redo attention for requests whose heads keep different counts.

        vLLM's kernels take one length per request and layer; here each KV
        head's evicted slots are masked (in torch, over the gathered cache)
        and the rows of `output` are overwritten.
        """
        worker = self.worker
        layer = worker.layer_of[layer_name]
        group = worker.group_of_layer[layer]
        rows = output.view(output.shape[0], -1)
        for _, state, token_idx, _, q_phys_g, seq_len_g, block_ids_g in self.masked:
            q_phys, seq_len, block_ids = q_phys_g[group], seq_len_g[group], block_ids_g[group]
            dead = state.dead_slots(layer, seq_len)
            if dead is None:
                continue
            keys, values = worker.layout.gather(kv_cache, block_ids, seq_len)
            keys, values = keys.to(torch.float32), values.to(torch.float32)
            for sl in _chunks(len(token_idx)):
                logits = _causal_logits(query[token_idx[sl]], keys, q_phys[sl], worker.scale)  # [Hq, n, S]
                hq, n, _ = logits.shape
                logits = logits.view(len(keys), -1, seq_len)  # [Hkv, G*n, S]: one bmm per KV head
                logits.masked_fill_(dead.to(logits.device).unsqueeze(1), float("-inf"))
                out = torch.bmm(torch.softmax(logits, dim=-1), values)  # [Hkv, G*n, D]
                out = out.view(hq, n, -1).transpose(0, 1).reshape(n, -1)
                rows[token_idx[sl].to(rows.device)] = out.to(rows.dtype)

    def observe(self, layer_name: str, query: torch.Tensor, kv_cache: torch.Tensor) -> None:
        start = time.perf_counter()
        worker = self.worker
        layer = worker.layer_of[layer_name]
        group = worker.group_of_layer[layer]
        for _, state, token_idx, q_log, q_phys_g, seq_len_g, block_ids_g in self.items:
            q_phys, seq_len, block_ids = q_phys_g[group], seq_len_g[group], block_ids_g[group]
            if worker.fused_scores and state.plain_softmax_sums:
                # One Triton pass over the paged keys: softmax sums per slot.
                keys = worker.layout.views(kv_cache)[0]
                for sl in _chunks(len(token_idx)):
                    state.accumulate(layer, worker.ops.window_scores(
                        query[token_idx[sl]], keys, block_ids, seq_len, q_phys[sl], worker.scale))
                continue
            keys = worker.layout.gather_keys(kv_cache, block_ids, seq_len).to(torch.float32)
            for sl in _chunks(len(token_idx)):
                state.observe(layer, _causal_logits(query[token_idx[sl]], keys, q_phys[sl], worker.scale), q_log[sl])
        worker.seconds["scoring"] += time.perf_counter() - start
        self.layers_seen += 1
        if self.layers_seen == worker.num_layers:
            set_active(None)  # a later warm-up or dummy run must not observe
            for rid, state, _, q_log, *_ in self.items:
                if state.policy.budgets_from_attention and state.prefill_observed(q_log):
                    worker.layer_budgets[rid] = state.attention_budgets()
            worker.snapshot.write(worker.seconds)


def _causal_logits(query: torch.Tensor, keys: torch.Tensor, q_phys: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled q.k [Hq, n, S] of queries [n, Hq, D] over one request's keys
    [Hkv, S, D], -inf past each query's own slot. Query heads are grouped by
    KV head (GQA); K is never repeated per query head."""
    hkv, seq_len, d = keys.shape
    n = query.shape[0]
    q = query.to(torch.float32).permute(1, 0, 2).reshape(hkv, -1, d)  # [Hkv, G*n, D]
    logits = torch.bmm(q, keys.transpose(1, 2)).view(-1, n, seq_len) * scale
    key_pos = torch.arange(seq_len, device=keys.device)
    return logits.masked_fill_(key_pos.view(1, 1, -1) > q_phys.to(keys.device).view(1, -1, 1), float("-inf"))


def _chunks(num_queries: int):
    return (slice(i, i + QUERY_CHUNK) for i in range(0, num_queries, QUERY_CHUNK))


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


# attention backend -> (layout for the kernel ops, vLLM's own cache writer for the self-test)
LAYOUTS = {
    "CPU_ATTN": (lambda ops, device: CPUAttnLayout, _write_cpu_attn),
    "FLASH_ATTN": (PagedLayout, _write_flash_attn),
}


def check_layout(layer, layout, write) -> None:
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
    keys, values = layout.gather(scratch, torch.arange(2, device=cache.device), n)
    if not (torch.equal(keys, key.transpose(0, 1)) and torch.equal(values, value.transpose(0, 1))):
        raise RuntimeError(
            f"kv_compress: unknown {layout.name} KV cache layout (shape {tuple(cache.shape)}, "
            f"strides {cache.stride()}, dtype {cache.dtype}); refusing to compact"
        )


class WorkerCompression:
    """Compression state of one model runner."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.config = KVCompressConfig.from_dict(runner.vllm_config.additional_config[CONFIG_KEY])
        context = runner.compilation_config.static_forward_context
        attn_layers = {name: m for name, m in context.items() if hasattr(m, "kv_cache") and hasattr(m, "impl")}
        self.layer_of = {name: layer_index(name) for name in attn_layers}
        order = sorted(attn_layers, key=self.layer_of.__getitem__)
        if [self.layer_of[n] for n in order] != list(range(len(order))):
            raise RuntimeError(f"kv_compress: unexpected attention layer names {order}")
        self.layers = [attn_layers[n] for n in order]
        first = self.layers[0]
        self.num_layers = len(order)
        self.num_kv_heads = first.num_kv_heads
        self.num_q_heads = first.num_heads
        self.scale = first.impl.scale
        groups = runner.kv_cache_config.kv_cache_groups
        self.group_of_layer = group_of_layer(groups)
        self.num_groups = len(groups)
        self.block_size = groups[0].kv_cache_spec.block_size
        for g in range(self.num_groups):
            table = runner.input_batch.block_table[g]
            if table.block_size != self.block_size:
                raise RuntimeError(
                    f"kv_compress: kernel block size {table.block_size} differs from the KV manager's "
                    f"{self.block_size}; choose --block-size as a multiple of 32 that the backend uses as is"
                )
        # Dispatch, once: the cache layout by attention backend, the kernel
        # ops by device (Triton on CUDA, torch elsewhere).
        backend = first.attn_backend.get_name()
        if backend not in LAYOUTS:
            raise RuntimeError(
                f"kv_compress: attention backend {backend} is not supported (CPU_ATTN on CPU, "
                f"FLASH_ATTN on CUDA); refusing to compact a cache layout it does not know"
            )
        make_layout, write = LAYOUTS[backend]
        self.ops = get_ops(first.kv_cache.device.type)
        self.layout = make_layout(self.ops, first.kv_cache.device)
        check_layout(first, self.layout, write)
        # Triton's fused window scores read the paged keys once per request.
        self.fused_scores = self.ops.backend == "triton" and isinstance(self.layout, PagedLayout)
        self.states: dict[str, RequestCompression] = {}
        self.evicted: dict[str, tuple[int, ...]] = {}  # per KV cache group
        # Per-layer budgets decided from this step's attention, for the scheduler.
        self.layer_budgets: dict[str, list[int]] = {}
        self.seconds = {"scoring": 0.0, "compaction": 0.0}  # for /metrics
        self.snapshot = SnapshotWriter("worker")
        logger.info("kv_compress worker ready (pid %d): %s, %d layers, block %d, %s cache, %s ops",
                    os.getpid(), self.config.to_dict(), self.num_layers, self.block_size, backend,
                    self.ops.backend)

    def kv_cache(self, layer: int) -> torch.Tensor:
        return self.layers[layer].kv_cache

    # ------------------------------------------------------------ _update_states

    def before_update_states(self, so) -> None:
        set_active(None)
        set_group_seq_len_deltas(None)
        plan: StepPlan = getattr(so, PLAN_ATTR, None) or StepPlan()
        for rid in so.finished_req_ids:
            self.states.pop(rid, None)
        for rid in getattr(so, "preempted_req_ids", None) or ():
            self.states.pop(rid, None)
        for rid, (prefill_len, config) in plan.started.items():
            self.states[rid] = RequestCompression(
                KVCompressConfig.from_dict(config), prefill_len,
                self.num_layers, self.num_kv_heads, self.num_q_heads,
            )
        if plan.ops:
            start = time.perf_counter()
            for rid, old_len, new_len in plan.ops:
                self.compact(rid, old_len, new_len)
            self.seconds["compaction"] += time.perf_counter() - start
            self.snapshot.write(self.seconds)
        self.evicted = plan.evicted

    def compact(self, rid: str, old_lens: tuple[int, ...], new_lens: tuple[int, ...]) -> None:
        """Compact every layer to its KV cache group's new length; truncate each group's table."""
        state = self.states[rid]
        group_block_ids = self.runner.requests[rid].block_ids
        ids = [torch.tensor(b, dtype=torch.int64) for b in group_block_ids]
        moves, planned_for, planned_group = None, None, None
        for layer in range(self.num_layers):
            g = self.group_of_layer[layer]
            if state.num_tokens(layer) != old_lens[g]:
                raise RuntimeError(
                    f"kv_compress: request {rid} layer {layer} tracks "
                    f"{state.num_tokens(layer)} tokens, scheduler says {old_lens[g]}"
                )
            keep_idx = state.select(layer, new_lens[g])
            if keep_idx is not planned_for or g != planned_group:  # layers that keep alike share a plan
                moves = self.layout.plan_moves(ids[g], keep_idx, self.block_size)
                planned_for, planned_group = keep_idx, g
            self.layout.move(self.kv_cache(layer), moves)
            state.compact(layer, keep_idx)
        state.finish_compaction()
        row = self.runner.input_batch.req_id_to_index.get(rid)
        for g, new_len in enumerate(new_lens):
            del group_block_ids[g][cdiv(new_len, self.block_size):]
            if row is not None:
                table = self.runner.input_batch.block_table[g]
                table.clear_row(row)
                table.add_row(group_block_ids[g], row)

    # ------------------------------------------------------------ _prepare_inputs

    def after_prepare_inputs(self, so, num_scheduled_tokens: np.ndarray) -> None:
        runner = self.runner
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = batch.req_ids[:num_reqs]
        total = int(num_scheduled_tokens.sum())
        starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)[:-1]])
        none = (0,) * self.num_groups
        offsets = np.array([self.evicted.get(rid, none) for rid in req_ids], dtype=np.int64).reshape(num_reqs, -1)
        positions = runner.positions[:total]
        physical = [positions] * self.num_groups
        if offsets.any():
            for g in range(self.num_groups):
                if offsets[:, g].any():
                    per_token = torch.from_numpy(np.repeat(offsets[:, g], num_scheduled_tokens))
                    physical[g] = positions - per_token.to(positions.device)
                    batch.block_table[g].compute_slot_mapping(
                        num_reqs, runner.query_start_loc.gpu[: num_reqs + 1], physical[g])
            # seq_lens are shared by all groups' metadata: group 0's lengths here,
            # the other groups' differences applied when their metadata is built.
            off = torch.from_numpy(offsets[:, 0]).to(torch.int32)
            runner.seq_lens[:num_reqs] -= off.to(runner.seq_lens.device, runner.seq_lens.dtype)
            runner.optimistic_seq_lens_cpu[:num_reqs] -= off.to(runner.optimistic_seq_lens_cpu.dtype)
            deltas = {g: torch.from_numpy(offsets[:, g] - offsets[:, 0]).to(torch.int32)
                      for g in range(1, self.num_groups) if (offsets[:, g] != offsets[:, 0]).any()}
            set_group_seq_len_deltas(deltas or None)
        step = StepObservation(self)
        for i, rid in enumerate(req_ids):
            state = self.states.get(rid)
            if state is None:
                continue
            sl = slice(int(starts[i]), int(starts[i]) + int(num_scheduled_tokens[i]))
            q_log = positions[sl].cpu()
            state.append(q_log)
            observed = state.observed(q_log)
            if observed.any():
                step.items.append(self._step_item(rid, state, sl, observed, q_log, physical))
            if any(d is not None for d in state.dead):
                step.masked.append(self._step_item(rid, state, sl, slice(None), q_log, physical))
        set_active(step if step.items or step.masked else None)

    def _step_item(self, rid: str, state: RequestCompression, sl: slice, mask, q_log, physical) -> tuple:
        """A request's selected queries in this step, in StepObservation's tuple form."""
        token_idx = torch.arange(sl.start, sl.stop)[mask]
        q_phys = [p[sl].cpu()[mask] for p in physical]
        seq_lens = [int(p[sl.stop - 1]) + 1 for p in physical]
        ids = [torch.tensor(b, dtype=torch.int64) for b in self.runner.requests[rid].block_ids]
        return (rid, state, token_idx, q_log[mask], q_phys, seq_lens, ids)


# The step whose queries the attention backend must observe (one model runner
# per worker process).
_active_step: StepObservation | None = None


def set_active(step: StepObservation | None) -> None:
    global _active_step
    _active_step = step


# Per KV cache group (other than 0): how much shorter than group 0 each
# scheduled request's physical length is, for this step's metadata.
_group_seq_len_deltas: dict[int, torch.Tensor] | None = None


def set_group_seq_len_deltas(deltas: dict[int, torch.Tensor] | None) -> None:
    global _group_seq_len_deltas
    _group_seq_len_deltas = deltas


def wrap_build_metadata(original):
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        deltas = _group_seq_len_deltas
        delta = None if deltas is None else deltas.get(self.kv_cache_group_id)
        if delta is not None:
            cm = common_attn_metadata
            if cm.num_reqs != len(delta):
                raise RuntimeError(f"kv_compress: metadata for {cm.num_reqs} requests, step planned {len(delta)}")
            seq_lens = cm.seq_lens.clone()
            seq_lens[: len(delta)] -= delta.to(seq_lens.device, seq_lens.dtype)
            upper = cm.seq_lens_cpu_upper_bound
            if upper is not None:
                upper = upper.clone()
                upper[: len(delta)] -= delta.to(upper.dtype)
            longest = int(seq_lens[: len(delta)].max()) if len(delta) else 0
            common_attn_metadata = cm.replace(seq_lens=seq_lens, seq_lens_cpu_upper_bound=upper,
                                              max_seq_len=max(cm.max_seq_len, longest),
                                              _num_computed_tokens_cache=None)
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
        if kvc is not None and kvc.layer_budgets and output is not None:
            # Rides back to the scheduler's update_from_output (async scheduling is off).
            setattr(output, BUDGETS_ATTR, kvc.layer_budgets)
            kvc.layer_budgets = {}
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
