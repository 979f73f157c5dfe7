"""The worker's vLLM hooks: the wrapped GPUModelRunner/Worker methods and
AttentionGroup.build_metadata (seam table: patches.py)."""

from __future__ import annotations

from ...config import CONFIG_KEY
from ...step_records import WorkerReport, attach_report
from .startup import wrap_determine_available_memory as wrap_determine_available_memory
from .state import WORKER_KEY, WorkerCompression, attach, attached
from .step_inputs import prepare_inputs


def wrap_build_metadata(original):
    def build_metadata(self, common_attn_metadata, *args, **kwargs):
        worker = attached(self)  # every AttentionGroup of a compressing runner
        edits = None if worker is None else worker.metadata_edits
        if edits is not None:
            common_attn_metadata = edits.apply(common_attn_metadata, self.kv_cache_group_id)
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
        failed = kvc.take_failed()  # every rank: a collective under tensor parallelism
        if output is None:  # nothing goes back this step: the next one reports them
            kvc.failed.update(failed)
            return output
        # Rides back to the scheduler's update_from_output (async scheduling is off).
        if kvc.reported or failed:
            attach_report(output, WorkerReport(layer_budgets=tuple(kvc.reported), failed=tuple(failed)))
            kvc.reported = []
        return output

    return sample_tokens


def wrap_prepare_inputs(original):
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        result = original(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        kvc = _compression(self)
        if kvc is not None:
            prepare_inputs(kvc, num_scheduled_tokens)
        return result

    return _prepare_inputs
