"""The model runner as the plugin's worker sees it: one small view, two runners.

vLLM 0.32 has two model runners, and 0.34 only the second:
  V1 (`v1/worker/gpu_model_runner.py`, the CPU runner's base on 0.32 by
      default): host block ids per request (`runner.requests`), a block table
      per KV cache group with its own slot-mapping method, and seq_lens that
      only attention reads;
  Model Runner V2 (`v1/worker/gpu/model_runner.py`, vLLM's default on CUDA):
      block ids only on the device, one Triton kernel computing every group's
      slot mapping into a persistent buffer, and seq_lens that the sampler
      also reads ("still prefilling" while seq_len < prefill length).

Everything above this module (compaction, the step's passes, metadata edits,
the attention backends, the hooks) works on a `RunnerView`: a request's host
block ids per vLLM KV cache group, a way to refill a table row after
compaction, the step's batch, where physical slots go, how per-group lengths
reach the metadata, and where a draft model proposes. Nothing above asks
which runner it has. Docs: docs/internals.md (Model runners).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from ...host_reads import upload
from .speculation import DraftSlots, physical_draft_slots

MRV2_MODULE = "vllm.v1.worker.gpu.model_runner"


@dataclass
class StepBatch:
    """The step's requests in the runner's batch order."""

    req_ids: list[str]
    num_scheduled: np.ndarray  # [R] tokens each request computes in this step
    num_computed: np.ndarray  # [R] tokens computed before this step (logical)
    positions: torch.Tensor  # [N] logical (RoPE) positions, on the runner's device
    seq_lens_device: torch.device  # where the attention metadata's seq_lens live
    # MRV2: the step's gathered block tables [R(padded), blocks] per vLLM group
    # and its slot-mapping rows [groups, N(padded)], both vLLM's persistent buffers.
    block_tables: tuple[torch.Tensor, ...] = ()
    slot_mappings: torch.Tensor | None = None


class RunnerView(Protocol):
    """What the plugin's worker needs of a model runner; V1View and MRV2View implement it."""

    # Whether the runner's shared seq_lens take group 0's physical lengths in
    # place (V1: only attention reads them) or stay logical (MRV2: the sampler reads them).
    seq_lens_in_place: bool

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per vLLM KV cache group (mutable: compaction truncates them)."""
        ...

    def refill_row(self, request_id: str, vllm_group: int, ids: list[int], first_changed: int) -> None:
        """The request's row of this group's block table is now `ids` (from `first_changed` on new)."""
        ...

    def kernel_block_size(self, vllm_group: int) -> int: ...

    def begin_step(self, scheduler_output: Any) -> None:
        """Before compaction."""
        ...

    def after_compaction(self, scheduler_output: Any) -> None:
        """After compaction, before vLLM appends the step's new block ids."""
        ...

    def step_batch(self, *inputs: Any) -> StepBatch:
        """The step's batch, from what the runner's input hook was given and returned."""
        ...

    def write_physical_slots(self, step: StepBatch, vllm_group: int, physical: torch.Tensor) -> None:
        """This group's slot mapping for the step's tokens at `physical` positions (on the device)."""
        ...

    def seq_len_deltas(self, offsets: np.ndarray) -> dict[int, torch.Tensor]:
        """Per-request physical offsets [R, vLLM groups] -> what the metadata edits subtract per group."""
        ...

    def draft_proposer(self) -> tuple[Any, list[Any]]:
        """The runner's draft-model proposer and the attention groups of its
        own that need physical lengths (V1's draft reads the target's group-0
        metadata: none)."""
        ...


class V1View:
    """vLLM's V1 model runner (and the GPU harness's stand-in for it, which
    has `requests` and an `input_batch` whose `req_id_to_index` is empty)."""

    # The runner's seq_lens are read by attention only: group 0's physical
    # lengths go there, the other groups' differences into the metadata edits.
    seq_lens_in_place = True

    def __init__(self, runner) -> None:
        self.runner = runner

    def block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block ids per vLLM KV cache group (mutable: compaction truncates them)."""
        return self.runner.requests[request_id].block_ids

    def refill_row(self, request_id: str, vllm_group: int, ids: list[int], first_changed: int) -> None:
        """The request's row of this group's block table is now `ids` (from `first_changed` on new)."""
        row = self.runner.input_batch.req_id_to_index.get(request_id)
        if row is not None:
            table = self.runner.input_batch.block_table[vllm_group]
            table.clear_row(row)
            table.add_row(ids, row)

    def kernel_block_size(self, vllm_group: int) -> int:
        return self.runner.input_batch.block_table[vllm_group].block_size

    def step_batch(self, *inputs: Any) -> StepBatch:
        """From `_prepare_inputs(scheduler_output, num_scheduled_tokens)`: its second argument."""
        (num_scheduled_tokens,) = inputs
        runner, batch = self.runner, self.runner.input_batch
        num_reqs = batch.num_reqs
        total = int(num_scheduled_tokens.sum())
        return StepBatch(list(batch.req_ids[:num_reqs]), num_scheduled_tokens,
                         batch.num_computed_tokens_cpu[:num_reqs], runner.positions[:total], runner.seq_lens.device)

    def write_physical_slots(self, step: StepBatch, vllm_group: int, physical: torch.Tensor) -> None:
        """This group's slot mapping for the step's tokens at `physical` positions (on the device)."""
        num_reqs = len(step.req_ids)
        self.runner.input_batch.block_table[vllm_group].compute_slot_mapping(
            num_reqs, self.runner.query_start_loc.gpu[: num_reqs + 1], physical)

    def seq_len_deltas(self, offsets: np.ndarray) -> dict[int, torch.Tensor]:
        """Per-request physical offsets [R, vLLM groups] -> what the metadata
        edits subtract per group: V1's seq_lens take group 0's in place."""
        runner = self.runner
        num_reqs = len(offsets)
        off = torch.from_numpy(offsets[:, 0]).to(torch.int32)
        runner.seq_lens[:num_reqs] -= upload(off, runner.seq_lens.device).to(runner.seq_lens.dtype)
        runner.optimistic_seq_lens_cpu[:num_reqs] -= off.to(runner.optimistic_seq_lens_cpu.dtype)
        return {g: torch.from_numpy(offsets[:, g] - offsets[:, 0]).to(torch.int32)
                for g in range(1, offsets.shape[1]) if (offsets[:, g] != offsets[:, 0]).any()}

    def begin_step(self, scheduler_output) -> None:
        """Before compaction (nothing to follow: V1 keeps host block ids)."""

    def after_compaction(self, scheduler_output) -> None:
        """After compaction, before vLLM appends the step's new block ids."""

    def draft_proposer(self) -> tuple[Any, list[Any]]:
        return self.runner.drafter, []


class MRV2View:
    """vLLM's Model Runner V2. Its block ids live on the device only, so the
    view keeps a host copy per request from the scheduler outputs; table rows
    are cut by their block count and refilled by staged writes; the shared
    seq_lens stay logical (the sampler reads them), every compressed group's
    physical length goes through the metadata edits."""

    seq_lens_in_place = False

    def __init__(self, runner) -> None:
        self.runner = runner
        self.host_block_ids: dict[str, list[list[int]]] = {}

    def block_ids(self, request_id: str) -> list[list[int]]:
        return self.host_block_ids[request_id]

    def refill_row(self, request_id: str, vllm_group: int, ids: list[int], first_changed: int) -> None:
        tables = self.runner.block_tables
        index = self.runner.req_states.req_id_to_index.get(request_id)
        if index is None:
            return
        # vLLM appends this step's new ids from num_blocks on (update_requests);
        # the staged write lands with them (apply_staged_writes), before the forward.
        tables.num_blocks.np[vllm_group, index] = len(ids)
        tables.block_tables[vllm_group].stage_write(index, first_changed, ids[first_changed:])

    def kernel_block_size(self, vllm_group: int) -> int:
        return self.runner.kernel_block_sizes[vllm_group]

    def begin_step(self, scheduler_output) -> None:
        """Drop the ids of requests that ended or were preempted (a preempted
        request comes back as a new one, with all its ids)."""
        for rid in scheduler_output.finished_req_ids:
            self.host_block_ids.pop(rid, None)
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self.host_block_ids.pop(rid, None)

    def after_compaction(self, scheduler_output) -> None:
        """The step's new block ids, as vLLM's add_requests/update_requests take them."""
        for new in scheduler_output.scheduled_new_reqs:
            self.host_block_ids[new.req_id] = [list(ids) for ids in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if new_ids is None:
                continue
            held = self.host_block_ids.setdefault(rid, [[] for _ in new_ids])
            for row, ids in zip(held, new_ids):
                row.extend(ids)

    def step_batch(self, *inputs: Any) -> StepBatch:
        """From `prepare_attn(input_batch)` and the (block tables, slot mappings) it returned."""
        input_batch, block_tables, slot_mappings = inputs
        num_reqs = input_batch.num_reqs
        return StepBatch(list(input_batch.req_ids[:num_reqs]), input_batch.num_scheduled_tokens[:num_reqs],
                         input_batch.num_computed_tokens_np[:num_reqs], input_batch.positions[: input_batch.num_tokens],
                         input_batch.seq_lens.device, tuple(block_tables), slot_mappings)

    def write_physical_slots(self, step: StepBatch, vllm_group: int, physical: torch.Tensor) -> None:
        """In place into the step's slot-mapping row (the buffer the KV write
        and the metadata both read, so CUDA graphs stay valid)."""
        assert step.slot_mappings is not None
        table = step.block_tables[vllm_group]
        block = self.runner.block_tables.block_sizes[vllm_group]
        rows = torch.repeat_interleave(torch.arange(len(step.req_ids), device=table.device),
                                       upload(torch.from_numpy(step.num_scheduled.astype(np.int64)), table.device))
        blocks = table[rows, physical // block].to(torch.int64)
        step.slot_mappings[vllm_group, : len(physical)] = blocks * block + physical % block

    def seq_len_deltas(self, offsets: np.ndarray) -> dict[int, torch.Tensor]:
        return {g: torch.from_numpy(offsets[:, g]).to(torch.int32)
                for g in range(offsets.shape[1]) if offsets[:, g].any()}

    def draft_proposer(self) -> tuple[Any, list[Any]]:
        speculator = self.runner.speculator
        return speculator, [g for groups in speculator.attn_groups for g in groups]


# MRV2's draft-model speculator (vLLM 0.32's StandaloneARSpeculator) runs the
# draft after the step's sampling: once over the step's tokens, the correction
# token and the rejected slots, then one token a step. Its slot mappings come
# from the runner's BlockTables at logical positions, and its attention
# metadata's seq_lens are logical too. While it proposes, it sees the tables
# through `PhysicalDraftTables` (slots made physical in place, in the
# buffers its metadata and its KV writes read), and its attention groups'
# metadata is edited by `speculation.draft_metadata` (physical lengths).


class PhysicalDraftTables:
    """vLLM's MRV2 BlockTables as the draft's speculator sees them while it
    proposes: every slot mapping it computes is made physical in vLLM group 0
    (where the draft's layers are), in the buffer vLLM returns."""

    def __init__(self, tables: Any, slots: DraftSlots, block_size: int) -> None:
        self._tables, self._slots, self._block_size = tables, slots, block_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tables, name)

    def compute_slot_mappings(self, idx_mapping: torch.Tensor, query_start_loc: torch.Tensor,
                              positions: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._tables.compute_slot_mappings(idx_mapping, query_start_loc, positions, *args, **kwargs)
        n = min(positions.shape[0], out.shape[1])
        num_reqs = len(self._slots.evicted)
        # Batch row of each token: the step's rows, in the target's order.
        tokens = torch.arange(n, device=positions.device)
        request_of = torch.searchsorted(query_start_loc[1:num_reqs + 1].contiguous().to(torch.int64), tokens,
                                        right=True).clamp_(max=num_reqs - 1)
        table = self._tables.input_block_tables[0]
        out[0, :n] = physical_draft_slots(self._slots, positions[:n], request_of, table, self._block_size,
                                          out[0, :n])
        return out


def view_of(runner) -> RunnerView:
    """The view for this runner: MRV2 for Model Runner V2 and its subclasses
    (the CPU runner's), V1 otherwise (vLLM's V1 runner, the GPU harness)."""
    if any(cls.__module__ == MRV2_MODULE for cls in type(runner).__mro__):
        return MRV2View(runner)
    if hasattr(runner, "requests") and hasattr(runner, "input_batch"):
        return V1View(runner)
    # e.g. vLLM 0.34's CPU runner without Triton (non-x86), which is neither.
    raise RuntimeError(f"kv_compress: model runner {type(runner).__module__}.{type(runner).__name__} is not "
                       f"supported (V1's GPUModelRunner or Model Runner V2 and their subclasses)")
