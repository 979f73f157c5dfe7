"""Compaction: the step's evictions, before anything is written to the freed blocks.

The scheduler has already given the evicted tail blocks back to the pool
(this very step may hand them to other requests); here, before the model
runner appends the step's new block ids, every layer of the compacting
requests keeps its selected tokens at the front of its blocks (one kernel op
per layer for all of them), MiniCache pairs are merged at their first
compaction, and each KV cache group's block table is cut to its new length.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ...budgets import LayerToSelect, Selected
from ...host_reads import upload
from ...schedule import cdiv
from ...step_records import Compaction
from ...token_state import MergedUpper, RequestTokens, selection_batches
from .step_inputs import padded

if TYPE_CHECKING:
    from .state import WorkerCompression

# A test hook (tests/test_reliability.py): the compaction of a request whose
# prompt has this many tokens raises, as a bug or a failed allocation would.
FAULT_ENV = "VLLM_KVCOMPRESS_FAIL_PROMPT_LEN"


class InjectedFault(RuntimeError):
    """The failure FAULT_ENV asks for."""


def compact_requests(worker: WorkerCompression, compactions: list[Compaction]) -> None:
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
    states: list[RequestTokens | None] = [worker.states.get(c.request_id) for c in compactions]
    group_ids = [[worker.runner.block_ids(c.request_id)[vg] for vg in worker.vllm_groups] for c in compactions]
    for i, c in enumerate(compactions):
        state = states[i]
        with worker.isolated(c.request_id, "compaction"):
            if state is None:
                raise RuntimeError("no compression state")
            if worker.fault_prompt_len is not None and state.plan.prompt_len == worker.fault_prompt_len:
                raise InjectedFault(f"{FAULT_ENV}={worker.fault_prompt_len}")
            for layer in range(worker.num_layers):
                if state.num_tokens(layer) != c.old_lengths[worker.group_of_layer[layer]]:
                    raise RuntimeError(
                        f"layer {layer} tracks {state.num_tokens(layer)} tokens, scheduler says "
                        f"{c.old_lengths[worker.group_of_layer[layer]]}")
    live = [c.request_id not in worker.failed for c in compactions]
    device = worker.device
    bs = worker.block_size
    tables, op_tables = {}, {}
    # (first slot copied, fresh slots) per (request, group) that copies.
    copied: dict[tuple[int, int], tuple[int, int]] = {}
    # Per group, the fresh blocks, which hold stale bytes past the kept tokens (`zero_fresh_blocks`).
    fresh: dict[int, torch.Tensor] = {}
    for g in range(worker.num_groups):
        rows, op_rows = [], []
        fresh_ids: list[int] = []
        for i, (c, ids) in enumerate(zip(compactions, group_ids)):
            rows.append(ids[g])
            copy = c.copies[g] if c.copies else None
            if copy is None:
                op_rows.append(ids[g])
            else:
                op_rows.append(list(copy.fresh_blocks) + ids[g][copy.first_block:])
                copied[i, g] = (copy.first_block * bs, len(copy.fresh_blocks) * bs)
                fresh_ids.extend(copy.fresh_blocks)
        tables[g] = padded(rows, device)
        op_tables[g] = tables[g] if not any(k[1] == g for k in copied) else padded(op_rows, device)
        if fresh_ids and worker.zero_fresh_blocks:
            fresh[g] = upload(torch.tensor(fresh_ids, dtype=torch.int64), device)
    # MiniCache pairs merge at their first compaction: both layers of a
    # pair leave the batched op, and are written once both are selected.
    merging = [{layer for pair in state.lower_of.items() for layer in pair} if state and not state.merged
               else set() for state in states]
    lower_kept: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for layer in range(worker.num_layers):
        g = worker.group_of_layer[layer]
        keys, values = worker.views(worker.layers[layer].kv_cache)
        followers = [d for d in worker.draft_layers if d.follows == layer]
        if g in fresh:
            for cache in (keys, values, *(v for d in followers for v in worker.views(d.module.kv_cache))):
                cache.index_fill_(0, fresh[g], 0)
        keeps = _select_layer(worker, compactions, states, live, layer, keys, values, tables[g])
        kept_rows = {i: k for i, k in enumerate(keeps) if k is not None and live[i]}
        selected = {i: k for i, k in kept_rows.items() if layer not in merging[i]}
        op_inputs = _op_inputs(worker, selected, copied, op_tables[g], g, len(keeps)) if selected else None
        if op_inputs is not None:
            worker.ops.compact_kv_batched(keys, values, *op_inputs)
        if followers and kept_rows:
            # A draft model's layers keep what this layer keeps (speculation.py),
            # merged pairs included (their kept order is their slot order).
            if op_inputs is None or len(selected) < len(kept_rows):
                op_inputs = _op_inputs(worker, kept_rows, copied, op_tables[g], g, len(keeps))
            table, keep_idx, counts = op_inputs
            for d in followers:
                heads = slice(None) if d.heads is None else d.heads
                worker.ops.compact_kv_batched(*worker.views(d.module.kv_cache), table, keep_idx[:, heads].contiguous(),
                                              counts[:, heads].contiguous())
        for i in range(len(keeps)):
            keep, state = keeps[i], states[i]
            if not live[i] or keep is None or state is None:
                continue
            with worker.isolated(compactions[i].request_id, "compaction"):
                if layer in merging[i]:
                    old = compactions[i].old_lengths[g]
                    kept = (_kept_dense(worker, keys, tables[g][i], old, keep),
                            _kept_dense(worker, values, tables[g][i], old, keep))
                    lower = state.lower_of.get(layer)
                    if lower is None:
                        lower_kept[i, layer] = kept
                    else:
                        _merge_pair(worker, compactions[i], state, lower, layer, lower_kept.pop((i, lower)), kept,
                                         group_ids[i])
                state.keep_selected(layer, keep)
            live[i] = compactions[i].request_id not in worker.failed
    for i, (c, state, ids) in enumerate(zip(compactions, states, group_ids)):
        if live[i] and state is not None:
            with worker.isolated(c.request_id, "compaction"):
                state.finish_compaction()
        for g, new_len in enumerate(c.new_lengths):
            copy = c.copies[g] if c.copies else None
            if copy is not None:
                ids[g][copy.first_block:] = copy.fresh_blocks
            del ids[g][cdiv(new_len, worker.block_size):]
            first_changed = len(ids[g]) if copy is None else min(copy.first_block, len(ids[g]))
            worker.runner.refill_row(c.request_id, worker.vllm_groups[g], ids[g], first_changed)


def _op_inputs(worker: WorkerCompression, selected: dict[int, torch.Tensor],
               copied: dict[tuple[int, int], tuple[int, int]], op_table: torch.Tensor, g: int,
               num_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compaction op's table rows, kept indices [R, Hkv, K] and counts
    [R, Hkv] for these rows (request index -> kept indices [Hkv, K])."""
    device = worker.device
    op_keeps = [_copy_indices(k, *copied[i, g]) if (i, g) in copied else k for i, k in selected.items()]
    # Built on the device from the device selections; the counts are
    # the plan's lengths (shapes), never read back from the device.
    width = max(k.shape[1] for k in op_keeps)
    keep_idx = torch.zeros(len(op_keeps), worker.num_kv_heads, width, dtype=torch.int64, device=device)
    for j, k in enumerate(op_keeps):
        keep_idx[j, :, : k.shape[1]] = k
    counts = torch.tensor([[k.shape[1]] * worker.num_kv_heads for k in op_keeps], dtype=torch.int64)
    rows = list(selected)
    table = op_table if len(rows) == num_rows else op_table[upload(torch.tensor(rows), device)]
    return table, keep_idx, upload(counts, device)


def _select_layer(worker: WorkerCompression, compactions: list[Compaction], states: list[RequestTokens | None],
                  live: list[bool], layer: int, keys: torch.Tensor, values: torch.Tensor,
                  table: torch.Tensor) -> list[torch.Tensor | None]:
    """The kept indices [Hkv, new length] of this layer for every live
    request (None: failed), selected in batches: requests whose allocations
    and selections select alike share one [R, Hkv, T] selection on the
    device; each request is scored on its own (scorers differ)."""
    g = worker.group_of_layer[layer]
    keeps: list[torch.Tensor | None] = [None] * len(compactions)
    selecting = {i: state for i, state in enumerate(states) if live[i] and state is not None}
    rows = list(selecting)
    batches = selection_batches([((selecting[i].plan.allocation.batch_key(), selecting[i].plan.selection),
                                  compactions[i].old_lengths[g]) for i in rows])
    for batch in ([rows[j] for j in b] for b in batches):
        pending: dict[int, LayerToSelect | None] = {}
        for i in batch:
            c = compactions[i]
            with worker.isolated(c.request_id, "selection"):
                # Scorers that read the cached keys (R-KV's redundancy) or values
                # (expected attention) get them dense.
                def dense(view: torch.Tensor, table=table[i], length=c.old_lengths[g]) -> torch.Tensor:
                    return worker.ops.gather_dense(view, table, length)

                pending[i] = selecting[i].to_select(layer, c.new_lengths[g], functools.partial(dense, keys),
                                                    functools.partial(dense, values))
        to_select = {i: p for i, p in pending.items() if p is not None}
        selected = _select_batch(worker, compactions, selecting, to_select) if to_select else {}
        for i in pending:
            c = compactions[i]
            if c.request_id in worker.failed:
                continue
            with worker.isolated(c.request_id, "selection"):
                keeps[i] = selecting[i].take_selection(layer, c.new_lengths[g], selected.get(i))
    for i in rows:
        live[i] = keeps[i] is not None
    return keeps


def _select_batch(worker: WorkerCompression, compactions: list[Compaction], states: dict[int, RequestTokens],
                  pending: dict[int, LayerToSelect]) -> dict[int, Selected]:
    """One allocation's `select_batch` over these rows (one batch key); if it
    raises, each row alone, so that one request's failure fails it alone."""
    rows = list(pending)
    allocation = states[rows[0]].plan.allocation
    try:
        return dict(zip(rows, allocation.select_batch([pending[i] for i in rows])))
    except Exception:  # noqa: BLE001 - found out row by row below
        selected = {}
        for i in rows:
            with worker.isolated(compactions[i].request_id, "selection"):
                selected[i] = allocation.select_batch([pending[i]])[0]
        return selected


def _merge_pair(worker: WorkerCompression, c: Compaction, state: RequestTokens, lower: int, upper: int,
                lower_kv: tuple[torch.Tensor, torch.Tensor], upper_kv: tuple[torch.Tensor, torch.Tensor],
                ids: list[list[int]]) -> None:
    """MiniCache on one pair of a compaction: the lower layer's first
    slots get the stored (merged or exact) vectors, the upper layer's
    first ones its retained exact vectors (merge.py).

    `*_kv`: the pair's kept tokens [Hkv, T, D] in their new slot order,
    read before anything was written; `ids`: the request's block ids per
    group before this compaction (a group that copies writes to its fresh blocks).
    """
    g_lo, g_up = worker.group_of_layer[lower], worker.group_of_layer[upper]
    key, value = state.plan.merge.merge_pair(lower_kv, upper_kv)
    tokens, retained = key.slot.shape[1], key.retained.shape[1]
    if tokens != c.new_lengths[g_lo] or retained != c.new_lengths[g_up]:
        raise RuntimeError(f"kv_compress: request {c.request_id} merges {tokens} tokens ({retained} retained) "
                           f"of layers {lower} and {upper}, scheduler planned {c.new_lengths[g_lo]} and "
                           f"{c.new_lengths[g_up]} slots")
    for layer, g, k, v in ((lower, g_lo, key.lower, value.lower), (upper, g_up, key.retained, value.retained)):
        copy = c.copies[g] if c.copies else None
        row = ids[g] if copy is None else ids[g][: copy.first_block] + list(copy.fresh_blocks)
        _write_slots(worker, *worker.views(worker.layers[layer].kv_cache), row, k, v)
    state.merged[upper] = MergedUpper.of(lower, key, value)


def _copy_indices(keep: torch.Tensor, first: int, fresh: int) -> torch.Tensor:
    """Kept indices [Hkv, K] -> the op's, for a row of `fresh` slots of new
    blocks followed by the original blocks from slot `first` on: slots before
    `first` stay (the protected start keeps them in place), every other kept
    token is copied from the originals."""
    if first:  # checked on the device (a host read would stall the batch)
        torch._assert_async((keep[:, :first] == torch.arange(first, device=keep.device)).all(),
                            "kv_compress: a compaction would move tokens of the protected start")
    return keep[:, first:] - first + fresh


def _kept_dense(worker: WorkerCompression, view: torch.Tensor, row: torch.Tensor, length: int,
                keep: torch.Tensor) -> torch.Tensor:
    """The kept tokens [Hkv, K, D] of one request's layer, in the order `keep` [Hkv, K] lists them (as read)."""
    dense = worker.cache_dtype.read(worker.ops.gather_dense(view, row, length))
    return torch.gather(dense, 1, keep.unsqueeze(-1).expand(-1, -1, dense.shape[-1]))


def _write_slots(worker: WorkerCompression, key_view: torch.Tensor, value_view: torch.Tensor, row,
                 keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write [Hkv, n, D] keys and values into slots 0..n-1 of a request's
    blocks `row`, stored as vLLM's writer stores them (an fp8 cache rounds)."""
    n, block = keys.shape[1], key_view.shape[1]
    slots = torch.arange(n, device=key_view.device)
    blocks = torch.as_tensor(row, dtype=torch.int64).to(key_view.device)[slots // block]
    key_view[blocks, slots % block] = worker.cache_dtype.write(keys.transpose(0, 1), key_view.dtype)
    value_view[blocks, slots % block] = worker.cache_dtype.write(values.transpose(0, 1), value_view.dtype)


