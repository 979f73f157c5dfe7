"""The worker's vLLM hooks: the wrapped model-runner and Worker methods and
AttentionGroup.build_metadata (seam table: patches.py).

V1 runner: `_update_states` (before), `_prepare_inputs` (after).
Model Runner V2: `finish_requests` (before), `prepare_attn` (after),
`prepare_dummy_attn` (before). Both: `initialize_kv_cache` (after),
`sample_tokens` (after). A draft model's slots: V1's proposer
(`set_inputs_first_pass`, `_update_positions_dependent_metadata`), MRV2's
speculator (`propose`)."""

from __future__ import annotations

import torch

from ...config import CONFIG_KEY
from ...step_records import WorkerReport, attach_report
from .runner_view import PhysicalDraftTables
from .speculation import draft_metadata, physical_draft_slots
from .startup import wrap_determine_available_memory as wrap_determine_available_memory
from .state import DRAFT_GROUP_KEY, WORKER_KEY, WorkerCompression, attach, attached
from .step_inputs import prepare_inputs


def wrap_build_metadata(original):
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        worker = attached(self)  # every AttentionGroup of a compressing runner
        if worker is not None and self.__dict__.get(DRAFT_GROUP_KEY):
            # MRV2's draft model: its own groups, physical lengths (speculation.py).
            if worker.draft_slots is not None:
                common_attn_metadata = draft_metadata(common_attn_metadata, worker.draft_slots)
        elif worker is not None and worker.metadata_edits is not None:
            common_attn_metadata = worker.metadata_edits.apply(common_attn_metadata, self.kv_cache_group_id)
        return original(self, common_attn_metadata, *args, **kwargs)

    return build_metadata


_UNSET = object()


def _compression(runner) -> WorkerCompression | None:
    """The runner's compression state, created on first use; None when off."""
    kvc = runner.__dict__.get(WORKER_KEY, _UNSET)
    if kvc is _UNSET:
        enabled = CONFIG_KEY in (runner.vllm_config.additional_config or {})
        kvc = WorkerCompression(runner) if enabled else None
        attach(runner, kvc)
    return kvc


def wrap_initialize_kv_cache(original):
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        original(self, kv_cache_config, *args, **kwargs)
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        if not profiling:
            # At startup, not at the first request: the layout self-test
            # refuses an unknown cache before anything is served.
            self.__dict__.pop(WORKER_KEY, None)
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
        kvc.clear_step()
        failed = kvc.take_failed()  # every rank: a collective under tensor parallelism
        if output is None:  # nothing goes back this step: the next one reports them
            kvc.failed.update(failed)
            return output
        # Rides back to the scheduler's update_from_output (async scheduling
        # is off): on MRV2's AsyncOutput, the ModelRunnerOutput it returns.
        if kvc.reported or failed:
            report = WorkerReport(layer_budgets=tuple(kvc.reported), failed=tuple(failed))
            attach_report(getattr(output, "model_runner_output", output), report)
            kvc.reported = []
        return output

    return sample_tokens


def wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        kvc = _compression(self)
        if kvc is not None:
            prepare_inputs(kvc, kvc.runner.step_batch(num_scheduled_tokens))
        return result

    return _prepare_inputs


# ---------------------------------------------------------------- Model Runner V2


def wrap_finish_requests(original):
    """MRV2's first state update of a real step (before add_requests and
    update_requests append the step's block ids): where V1's `_update_states` begins."""

    def finish_requests(self, scheduler_output):
        kvc = _compression(self)
        if kvc is not None:
            kvc.before_update_states(scheduler_output)
        return original(self, scheduler_output)

    return finish_requests


def wrap_prepare_attn(original):
    """After MRV2 gathered the step's block tables and computed its slot
    mappings: the compressed groups' slots become physical, their lengths
    metadata edits (the shared seq_lens stay logical for the sampler)."""

    def prepare_attn(self, input_batch, *args, **kwargs):
        block_tables, slot_mappings = original(self, input_batch, *args, **kwargs)
        kvc = _compression(self)
        if kvc is not None:
            prepare_inputs(kvc, kvc.runner.step_batch(input_batch, block_tables, slot_mappings))
        return block_tables, slot_mappings

    return prepare_attn


def wrap_prepare_dummy_attn(original):
    """A dummy run (profiling, CUDA graph capture, data parallelism's idle
    step) builds attention metadata too: with no step state of ours."""

    def prepare_dummy_attn(self, *args, **kwargs):
        kvc = _compression(self)
        if kvc is not None:
            kvc.clear_step()
        return original(self, *args, **kwargs)

    return prepare_dummy_attn


# ---------------------------------------------------------------- a draft model's slots


def wrap_draft_first_pass(original):
    """The draft's first pass (the step's tokens again, and the one just
    sampled): vLLM maps its slots from logical positions; they become physical."""

    def set_inputs_first_pass(self, *args, **kwargs):
        num_tokens, token_indices_to_sample, cm = original(self, *args, **kwargs)
        kvc = attached(self)
        if kvc is not None and kvc.draft_slots is not None:
            slots = kvc.draft_slots
            lengths = cm.query_start_loc[1:] - cm.query_start_loc[:-1]
            request_of = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths,
                                                 output_size=num_tokens)
            positions = self.positions[:num_tokens]
            cm.slot_mapping = physical_draft_slots(slots, positions, request_of, cm.block_table_tensor,
                                                   kvc.block_size, cm.slot_mapping[:num_tokens])
        return num_tokens, token_indices_to_sample, cm

    return set_inputs_first_pass


def wrap_draft_step_slots(original):
    """Each further draft token (one per request): the slot vLLM maps from
    its logical position becomes the physical one."""

    def _update_positions_dependent_metadata(self, positions, cm, batch_size, *args, **kwargs):
        result = original(self, positions, cm, batch_size, *args, **kwargs)
        kvc = attached(self)
        if kvc is not None and kvc.draft_slots is not None:
            slots = kvc.draft_slots
            out = self._slot_mapping_buffer[:batch_size]
            rows = torch.arange(batch_size, device=out.device)
            out.copy_(physical_draft_slots(slots, self.positions[:batch_size], rows, cm.block_table_tensor,
                                           kvc.block_size, out))
        return result

    return _update_positions_dependent_metadata


def wrap_mrv2_draft_propose(original):
    """MRV2's draft model proposes (after the step's sampling) with the
    runner's block tables seen through PhysicalDraftTables: its slots physical."""

    def propose(self, *args, **kwargs):
        kvc = attached(self)
        if kvc is None or kvc.draft_slots is None:  # a dummy run, or compression off
            return original(self, *args, **kwargs)
        tables = self.block_tables
        self.block_tables = PhysicalDraftTables(tables, kvc.draft_slots, kvc.block_size)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.block_tables = tables

    return propose
