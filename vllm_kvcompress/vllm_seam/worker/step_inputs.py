"""The step's inputs: physical slots and lengths, metadata edits, which queries are observed.

Once the runner has prepared the step's inputs (`prepare_inputs`): each
request's slot mapping follows its physical (compacted) cache, seq_lens its
physical length per KV cache group, while positions (RoPE) stay logical; fused decode rows
attend one key in vLLM's kernel (`MetadataEdits`); and the step's requests
are sorted into the attention passes they need (`step_passes`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...host_reads import host_list, upload
from ...scorers.kvzip import RepeatPass
from ...token_state import RequestTokens
from .speculation import DraftSlots

if TYPE_CHECKING:
    from .attention_passes import StepPasses
    from .runner_view import StepBatch
    from .state import WorkerCompression


def padded(rows, device: torch.device) -> torch.Tensor:
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



@dataclass
class StepRequest:
    """One request's queries in the running step, and where its cache is.
    Index tensors are on the cache's device (uploaded once per step, read by
    every layer); logical positions stay on the host, where the step's
    decisions are made (uploaded once for scorers that hash them)."""

    request_id: str
    state: RequestTokens
    token_idx: torch.Tensor  # rows of the step's query tensor
    q_logical: torch.Tensor  # [n] logical (RoPE) positions, on the host
    # Per KV cache group: physical slots of the queries, keys visible, block ids.
    q_physical: list[torch.Tensor]
    seq_lens: list[int]
    block_ids: list[torch.Tensor]
    q_logical_device: torch.Tensor | None = None  # q_logical on the cache's device, once needed

    def logical_on(self, device: torch.device) -> torch.Tensor:
        if self.q_logical_device is None:
            self.q_logical_device = upload(self.q_logical, device)
        return self.q_logical_device


@dataclass
class StepRepeat:
    """A repeat pass's queries in the running step (KVzip): they score the
    prompt of request `target` (`RepeatScores`)."""

    request_id: str
    target: str
    repeat: RepeatPass
    token_idx: torch.Tensor  # rows of the step's query tensor
    q_slots: torch.Tensor  # [n] their slots (= logical positions), on the cache's device
    last: int  # the last one's, on the host
    block_ids: list[torch.Tensor]  # per KV cache group


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
            block_tables=padded([r.block_ids[group] for r in requests], device),
            seq_lens=upload(torch.tensor(seq_lens, dtype=torch.int64), device),
            q_positions=torch.cat([r.q_physical[group] for r in requests]),
            max_seq_len=max(seq_lens),
            max_q_len=max(lens),
        )



@dataclass(frozen=True)
class MetadataEdits:
    """How this step's attention metadata differs, per vLLM KV cache group,
    from the seq_lens the runner computed (V1: vLLM group 0's physical
    lengths, written in place; Model Runner V2: the logical lengths, which
    its sampler reads too)."""

    num_reqs: int
    # vLLM group -> [num_reqs] int32, host: how much shorter than the
    # runner's seq_lens each request's physical length is in that group.
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



def prepare_inputs(worker: WorkerCompression, batch: StepBatch) -> None:
    """Once the runner has the step's inputs: slot mapping and per-group
    lengths become physical (positions, RoPE, stay logical); the step's
    attention passes and metadata edits go to the worker, where the attention
    backend and the metadata builders find them."""
    view = worker.runner
    req_ids, num_scheduled_tokens = batch.req_ids, batch.num_scheduled
    num_reqs = len(req_ids)
    total = int(num_scheduled_tokens.sum())
    starts = np.concatenate([[0], np.cumsum(num_scheduled_tokens)[:-1]])
    evicted = worker.evicted_rows(req_ids)
    # Per vLLM KV cache group (a sliding-window group evicts nothing of ours).
    offsets: np.ndarray = np.zeros((num_reqs, worker.num_vllm_groups), dtype=np.int64)
    offsets[:, list(worker.vllm_groups)] = evicted
    positions = batch.positions[:total]
    # The same logical positions on the host, as vLLM derives them (its
    # tensor may be on the GPU: reading it back would be a host sync).
    positions_host = torch.from_numpy(
        np.repeat(batch.num_computed - starts, num_scheduled_tokens) + np.arange(total)
    ).to(torch.int64)
    if positions.device.type == "cpu" and not torch.equal(positions, positions_host):
        raise RuntimeError("kv_compress: the runner's positions are not num_computed_tokens + query offset")
    physical_host = [positions_host] * worker.num_groups
    deltas: dict[int, torch.Tensor] = {}
    if offsets.any():
        for g, vg in enumerate(worker.vllm_groups):
            if offsets[:, vg].any():
                per_token = torch.from_numpy(np.repeat(offsets[:, vg], num_scheduled_tokens))
                physical_host[g] = positions_host - per_token
                view.write_physical_slots(batch, vg, positions - upload(per_token, positions.device))
        deltas = view.seq_len_deltas(offsets)
    if worker.draft_layers:
        # vLLM group 0, where a draft model's layers are (speculation.py).
        capacity = [len(view.block_ids(rid)[0]) * worker.block_size for rid in req_ids]
        evicted_host = torch.from_numpy(offsets[:, 0].copy())
        worker.draft_slots = DraftSlots(upload(evicted_host, worker.device),
                                        upload(torch.tensor(capacity, dtype=torch.int64), worker.device), evicted_host)
    step = step_passes(worker, req_ids, starts, num_scheduled_tokens, batch.num_computed, positions_host,
                       physical_host)
    worker.step = step
    fused = torch.tensor(step.fused_rows if step is not None else [], dtype=torch.int64)
    if deltas or len(fused):
        worker.metadata_edits = MetadataEdits(num_reqs, deltas, fused, upload(fused, batch.seq_lens_device),
                                              frozenset(worker.vllm_groups))

def step_passes(worker: WorkerCompression, req_ids, starts, num_scheduled_tokens, num_computed,
                positions_host: torch.Tensor, physical_host: list[torch.Tensor]) -> StepPasses | None:
    """The step's queries to observe, mask or merge (None: none): request
    i's queries are rows starts[i]..+num_scheduled_tokens[i], at logical
    `positions_host` (from num_computed[i] on) and per group physical
    `physical_host` (host tensors). Per request, a few integer tests unless
    its queries need a pass (most decode steps need none)."""
    from .attention_passes import StepPasses  # it reads the step's requests, as built here

    step = StepPasses(worker)
    states, speculative, repeats = worker.states, worker.speculative, worker.repeats
    # Python ints once (an array element read per request costs more).
    computed, counts = host_list(num_computed[:len(req_ids)]), host_list(num_scheduled_tokens)
    for i, rid in enumerate(req_ids):
        state = states.get(rid)
        if state is None:
            if repeats and rid in repeats:  # a repeat pass (KVzip): no state of its own
                with worker.isolated(rid, "repeat pass"):
                    _add_repeat(worker, step, rid, int(starts[i]), computed[i], counts[i])
            continue
        first, n = computed[i], counts[i]
        try:  # as `worker.isolated`, without a context manager per request and step
            if state.advance(first, n) and rid not in speculative:
                continue
            start = int(starts[i])
            _add_request(worker, step, i, rid, state, slice(start, start + n), positions_host, physical_host)
        except Exception as e:  # noqa: BLE001 - one request's observation, never the step
            worker.fail(rid, "observation", e)
    return step if step.observed or step.queried or step.speculative or step.masked or step.merged \
        or step.repeats else None


def _add_repeat(worker: WorkerCompression, step: StepPasses, rid: str, start: int, first: int, n: int) -> None:
    """A repeat pass's queries of this step (rows start.., slots first..):
    those past the prompt it repeats are its own, scored."""
    target, rp = worker.repeats[rid]
    begin = max(first, rp.context_len)
    if begin >= first + n:
        return  # still the prompt (no prefix-cache hit of it)
    step.repeats.append(StepRepeat(
        request_id=rid, target=target, repeat=rp,
        token_idx=upload(torch.arange(start + begin - first, start + n), worker.device),
        q_slots=upload(torch.arange(begin, first + n), worker.device), last=first + n - 1,
        block_ids=_block_ids(worker, rid)))

def _add_request(worker: WorkerCompression, step: StepPasses, i: int, rid: str, state: RequestTokens,
                 sl: slice,
                     positions_host: torch.Tensor, physical_host: list[torch.Tensor]) -> None:
    """Request i (rows `sl` of the step, appended to its state) into the
    step's observed, fused, masked and merged lists, as its state asks."""
    q_log = positions_host[sl]
    speculative = rid in worker.speculative
    observed = state.observed(q_log, one_at_a_time=speculative)
    masked = state.masks_heads
    if observed.any() and speculative:
        # Verifying drafts: its observed queries wait until the scheduler
        # says which were accepted (speculation.py).
        step.speculative.append(_step_request(worker, rid, state, sl, observed, q_log, physical_host))
    elif observed.any() and not state.scorer.observe.scores_attention():
        # The queries themselves (expected attention): no attention is scored for them.
        step.queried.append(_step_request(worker, rid, state, sl, observed, q_log, physical_host))
    elif observed.any():
        request = _step_request(worker, rid, state, sl, observed, q_log, physical_host)
        step.observed.append(request)
        # One query observed with a plain softmax: it sees every
        # cached slot, so its attention and its scores are one pass.
        if len(q_log) == 1 and not state.noisy and not masked and not state.merged:
            step.fused.append(request)
            step.fused_rows.append(i)
    if masked:
        step.masked.append(_step_request(worker, rid, state, sl, slice(None), q_log, physical_host))
    if state.merged:
        step.merged.append(_step_request(worker, rid, state, sl, slice(None), q_log, physical_host))

def _step_request(worker: WorkerCompression, rid: str, state: RequestTokens, sl: slice, mask, q_log,
                  physical) -> StepRequest:
    """A request's selected queries in this step, its index tensors
    uploaded to the cache's device once (`physical`: host positions)."""
    return StepRequest(
        request_id=rid, state=state, token_idx=upload(torch.arange(sl.start, sl.stop)[mask], worker.device),
        q_logical=q_log[mask],
        q_physical=[upload(p[sl][mask], worker.device) for p in physical],
        seq_lens=[int(p[sl.stop - 1]) + 1 for p in physical],
        block_ids=_block_ids(worker, rid),
    )


def _block_ids(worker: WorkerCompression, rid: str) -> list[torch.Tensor]:
    """A request's block ids per compressed KV cache group, on the cache's device."""
    ids = worker.runner.block_ids(rid)
    return [upload(torch.tensor(ids[vg], dtype=torch.int64), worker.device) for vg in worker.vllm_groups]


