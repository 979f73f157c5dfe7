"""WorkerCompression: one model runner's compression state, and what it does before each step.

Per step, around vLLM's model runner (V1 or Model Runner V2: runner_view.py):
  start of the step's state update (V1 `_update_states`, MRV2
      `finish_requests`; before): drop ended requests, start new ones, run
      the step's compactions (compaction.py), truncate block tables;
  the step's inputs (V1 `_prepare_inputs`, MRV2 `prepare_attn`; after):
      slot mapping and per-group lengths become physical, positions (RoPE)
      stay logical; the step's attention passes (step_inputs.py);
  attention forward (attention.py -> attention_passes.py): redo rows whose
      KV heads keep different counts or whose layer is merged, attend fused
      decode rows, score observed queries;
  sample_tokens (after): return layer budgets derived from a prompt's
      attention, and failed requests, to the scheduler (hooks.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from ...cache_layout import AUTO, LAYOUTS, CacheDType, KVViews
from ...config import CONFIG_KEY, KVCompressConfig
from ...kernels import get_ops
from ...scorers.expected_attention import QueryGeometry
from ...scorers.kvzip import RepeatPass
from ...sharding import HeadShard
from ...step_records import ReportedBudgets, log_failure, step_plan_of
from ...token_state import RequestTokens
from ..groups import CompressedLayers, is_draft_layer, layer_index
from ..metrics import SnapshotWriter
from .attention_passes import StepPasses
from .compaction import FAULT_ENV, compact_requests
from .heap import HeapTrimmer
from .runner_view import RunnerView, view_of
from .speculation import DraftLayer, DraftSlots, draft_layers, settle_requests
from .startup import (
    CACHE_WRITERS,
    cache_dtype_of,
    check_layout,
    check_scoring_exact,
    query_geometry,
    tensor_parallel_shard,
)
from .step_inputs import MetadataEdits
from .timing import PhaseTimer

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger


class WorkerCompression:
    """Compression state of one model runner."""

    def __init__(self, runner) -> None:
        config = KVCompressConfig.from_dict(runner.vllm_config.additional_config[CONFIG_KEY])
        context = runner.compilation_config.static_forward_context
        attention = {name: m for name, m in context.items() if hasattr(m, "kv_cache") and hasattr(m, "impl")}
        attn_layers = {layer_index(name): m for name, m in attention.items() if not is_draft_layer(name)}
        drafts = {name: m for name, m in attention.items() if is_draft_layer(name)}
        groups = runner.kv_cache_config.kv_cache_groups
        # Only full-attention layers compress (a hybrid model's sliding-window
        # layers run as in vLLM). "Layer" and "group" below count compressed
        # ones; `vllm_groups` maps a group to vLLM's KV cache group id.
        compressed = CompressedLayers.from_groups(groups)
        # (Every layer of the model sits in some KV cache group, from_groups
        # checks; a Gated DeltaNet hybrid's attention layers are only some of them.)
        if not set(compressed.layers) <= set(attn_layers):
            raise RuntimeError(f"kv_compress: unexpected attention layers {sorted(attn_layers)}")
        layers = [attn_layers[i] for i in compressed.layers]
        for layer in layers:
            check_scoring_exact(layer)
        block_size = groups[compressed.vllm_groups[0]].kv_cache_spec.block_size
        view = view_of(runner)
        for g in compressed.vllm_groups:
            kernel_block_size = view.kernel_block_size(g)
            if kernel_block_size != block_size:
                raise RuntimeError(
                    f"kv_compress: kernel block size {kernel_block_size} differs from the KV manager's "
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
        cache_dtype = cache_dtype_of(layers, backend)
        self.setup(view, layers, compressed.group_of_layer, compressed.vllm_groups, compressed.num_vllm_groups,
                   block_size, LAYOUTS[backend], tensor_parallel_shard(), cache_dtype)
        # vLLM zeroes the attention blocks it allocates where a block may
        # last have held another group's bytes (a Gated DeltaNet state: read
        # as keys and values, NaN that a masked slot's zero weight keeps);
        # a compaction's fresh blocks come from the pool past that, so it
        # zeroes them itself.
        self.zero_fresh_blocks = bool(runner.kv_cache_config.needs_kv_cache_zeroing)
        if drafts:
            # vLLM's draft proposer reads group 0's metadata and block tables.
            outside = sorted(set(drafts) - set(groups[0].layer_names))
            if outside or 0 not in compressed.vllm_groups:
                raise RuntimeError(f"kv_compress: the draft model's layers must share the target's first, "
                                   f"compressed KV cache group (KV cache groups: {[g.layer_names for g in groups]})")
            self.draft_layers: list[DraftLayer] = draft_layers(drafts, self.layers, self.group_of_layer,
                                                                      compressed.vllm_groups.index(0), self.device)
        check_layout(layers[0], self.views, self.ops, CACHE_WRITERS[backend], backend, cache_dtype,
                     runner.vllm_config.model_config.dtype)
        # Scorers that observe the queries themselves (expected attention) turn them back before RoPE.
        geometry, self.no_geometry = query_geometry(runner.get_model(), layers, self.scales)
        self.geometry: QueryGeometry | None = geometry
        parts = config.components()
        if parts is not None and self.geometry is None and parts.scorer.observes_queries():
            raise RuntimeError(f"kv_compress: scorer {parts.scorer.name!r} (policy {config.policy!r}) cannot serve "
                               f"this model: {self.no_geometry}")
        # The attention backend and the metadata builders find this worker on
        # the objects they are called with (every attention layer and group).
        for module in attn_layers.values():
            attach(module, self)
        for attention_group in (g for groups in runner.attn_groups for g in groups):
            attach(attention_group, self)
        if drafts:
            # Its slot mappings (hooks.wrap_draft_*): V1's proposer, or MRV2's
            # speculator, whose own attention groups get physical lengths.
            # (V1's draft reads the target's group-0 metadata: nothing to mark.)
            proposer, draft_groups = view.draft_proposer()
            attach(proposer, self)
            for attention_group in draft_groups:
                attach(attention_group, self)
                attention_group.__dict__[DRAFT_GROUP_KEY] = True
        logger.info("kv_compress worker ready (pid %d, tensor-parallel rank %d of %d): %s, %d layers, block %d, "
                    "%s cache (%s), %s ops, %s model runner", os.getpid(), self.shard.rank, self.shard.size,
                    config.to_dict(), self.num_layers, self.block_size, backend, cache_dtype.name, self.ops.backend,
                    type(view).__name__.removesuffix("View"))

    def setup(self, runner: RunnerView, layers, group_of_layer, vllm_groups, num_vllm_groups: int,
              block_size: int, views: Callable[[torch.Tensor], KVViews], shard: HeadShard,
              cache_dtype: CacheDType = AUTO) -> None:
        """The state every step reads, from the compressed attention layers
        (each with `layer_name`, `kv_cache`, `num_heads`, `num_kv_heads` and
        `impl.scale`) and the model runner's view (block ids, table rows, the
        step's batch). The GPU harness without vLLM (kvc_tools.paged_decoder)
        builds a worker through here as well."""
        self.runner = runner
        self.layers = list(layers)
        self.layer_of = {layer.layer_name: i for i, layer in enumerate(self.layers)}
        first = self.layers[0]
        self.num_layers = len(self.layers)
        self.num_kv_heads = first.num_kv_heads  # this rank's (tensor parallelism splits heads)
        self.num_q_heads = first.num_heads
        self.shard = shard
        self.scales = [layer.impl.scale for layer in self.layers]
        # gpt-oss's learned sink logit per query head (this rank's), float32 on
        # the device, or None: every softmax the plugin computes holds it.
        self.sinks = [None if getattr(layer.impl, "sinks", None) is None
                      else layer.impl.sinks.detach().to(torch.float32).reshape(-1) for layer in self.layers]
        self.group_of_layer = list(group_of_layer)
        self.vllm_groups = vllm_groups
        self.num_vllm_groups = num_vllm_groups
        self.num_groups = len(self.vllm_groups)
        self.block_size = block_size
        # The layout's K and V views, typed as the stored values (fp8 caches are uint8 tensors).
        self.cache_dtype = cache_dtype
        self.views = lambda kv_cache: views(cache_dtype.storage(kv_cache))
        self.device = first.kv_cache.device
        self.ops = get_ops(self.device.type)
        self.states: dict[str, RequestTokens] = {}
        # `reuse`: finished requests' token states, kept while the scheduler
        # keeps their compressed KV (StepPlan.saved and .dropped).
        self.saved: dict[str, RequestTokens] = {}
        self.evicted: dict[str, tuple[int, ...]] = {}  # per KV cache group, of the requests that evicted
        # KVzip: the running repeat passes (request -> the request whose
        # prompt it repeats, and the pass), and per request the scores its
        # passes gave its prompt so far, per layer [Hkv, prompt tokens], until
        # its compaction takes them (or it ends).
        self.repeats: dict[str, tuple[str, RepeatPass]] = {}
        self.repeat_scores: dict[str, list[torch.Tensor | None]] = {}
        self._evicted_rows: tuple[list[str], np.ndarray] | None = None  # `evicted_rows`, kept
        # Per-layer budgets decided from this step's attention, for the scheduler.
        self.reported: list[ReportedBudgets] = []
        self.repeat_budgets: tuple[str, ...] = ()  # this step's (StepPlan.repeat_budgets)
        self.snapshot = SnapshotWriter("worker")
        self.timer = PhaseTimer(self.device, enabled=self.snapshot.enabled)  # for /metrics
        # Requests whose compression raised in this step: each fails alone
        # (the scheduler finishes it with an error), the others go on.
        self.failed: set[str] = set()
        self.compressing = False  # this step runs requests with a plan (the same on every rank)
        self.speculative: frozenset[str] = frozenset()  # this step's requests verifying drafts
        # The attention passes and metadata edits of the running step (step_inputs).
        self.step: StepPasses | None = None
        self.metadata_edits: MetadataEdits | None = None
        # A draft model's layers (speculative decoding) and where they write in this step.
        self.draft_layers = []
        self.draft_slots: DraftSlots | None = None
        fault = os.environ.get(FAULT_ENV, "")
        self.fault_prompt_len = int(fault) if fault.isdigit() else None
        self.heap = HeapTrimmer()  # freed host memory back to the system (heap.py)
        self.zero_fresh_blocks = False  # the cache's unwritten slots may hold NaN (__init__)
        # How the model turns its queries (expected attention), or why it is not known.
        self.geometry = None
        self.no_geometry = "no model given"

    # ------------------------------------------------------------ failures

    @contextlib.contextmanager
    def isolated(self, request_id: str, what: str):
        """One request's compression work: whatever it raises fails that
        request alone (its state is dropped, the scheduler finishes it with
        an error) and the step goes on for the others. Batched ops over
        several requests are not run inside: their sizes are checked and their
        scratch bounded by construction (docs/reliability.md)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - any failure of one request's compression
            self.fail(request_id, what, e)

    def fail(self, request_id: str, what: str, error: BaseException) -> None:
        if request_id in self.failed:
            return
        log_failure(request_id, what, error)
        self.failed.add(request_id)
        self.states.pop(request_id, None)

    def take_failed(self) -> list[str]:
        """This step's failed requests, over every tensor-parallel rank (a
        failure on one rank alone, say a device allocation, fails the request
        everywhere); called by every rank at the end of a step."""
        failed, self.failed = sorted(self.failed), set()
        if self.shard.size > 1 and self.compressing:
            failed = gather_failed(failed)
        return failed

    # ------------------------------------------------------------ _update_states

    def before_update_states(self, so) -> None:
        """At the start of the runner's state update, before vLLM appends the
        step's new block ids (V1 `_update_states`, MRV2 `finish_requests`)."""
        self.clear_step()
        self.runner.begin_step(so)
        plan = step_plan_of(so)
        preempted = getattr(so, "preempted_req_ids", None) or ()
        for rid, kept in plan.saved.items():  # before the finished requests' states go
            state = self.states.get(rid)
            if state is not None:
                with self.isolated(rid, "keeping its state"):
                    for key, length in kept:
                        self.saved[key] = state if length == state.logical_len else state.truncated(length)
        for key in plan.dropped:
            self.saved.pop(key, None)
        for rid in (*so.finished_req_ids, *preempted):
            self.states.pop(rid, None)
            self.evicted.pop(rid, None)
            self.repeats.pop(rid, None)
        if self.repeat_scores:
            for rid in so.finished_req_ids:
                self.repeat_scores.pop(rid, None)
        # Any request's end, compressed or not: both leave holes in the heap.
        self.heap.after_step(ended=bool(so.finished_req_ids or preempted), idle=not so.total_num_scheduled_tokens)
        self.compressing = plan.compressing
        self.repeat_budgets = plan.repeat_budgets
        for started in plan.started:
            self.states.pop(started.request_id, None)
            self.evicted.pop(started.request_id, None)
            if started.repeat is not None:
                self.repeats[started.request_id] = started.repeat
            if started.plan is not None:
                with self.isolated(started.request_id, "start"):
                    scorer = started.plan.scorer
                    if self.geometry is None and scorer.observes_queries():
                        raise RuntimeError(f"scorer {scorer.name!r} cannot serve this model: {self.no_geometry}")
                    tokens = RequestTokens(started.plan, self.num_layers, self.num_kv_heads, self.num_q_heads,
                                           self.shard, self.device, self.geometry)
                    if started.restored is not None:  # it starts from a saved state (`reuse`)
                        saved = self.saved.get(started.restored)
                        if saved is None:
                            raise RuntimeError(f"kv_compress: no saved state {started.restored} on this worker")
                        tokens.continue_from(saved)
                    self.states[started.request_id] = tokens
        settle_requests(self, plan.settled)
        self.speculative = frozenset(getattr(so, "scheduled_spec_decode_tokens", None) or ())
        for rid, due in plan.next_due.items():
            state = self.states.get(rid)
            if state is not None:
                state.next_due = due
        if plan.compactions:
            if self.repeat_scores:
                for op in plan.compactions:
                    # Taken once: a request preempted after it runs its passes again (scheduler).
                    scores, state = self.repeat_scores.pop(op.request_id, None), self.states.get(op.request_id)
                    if scores is not None and state is not None:
                        with self.isolated(op.request_id, "taking repeat scores"):
                            state.take_repeat_scores(scores)
            with self.timer.phase("compaction"):
                compact_requests(self, plan.compactions)
            self.snapshot.write(self.timer.seconds)
        self.evicted.update(plan.evicted)
        if so.finished_req_ids or preempted or plan.started or plan.evicted:
            self._evicted_rows = None
        self.runner.after_compaction(so)

    def evicted_rows(self, req_ids: list[str]) -> np.ndarray:
        """[R, groups] tokens evicted so far of the step's requests, in batch
        order; kept while neither the order nor a count changed (most decode
        steps), as building it reads every request."""
        kept = self._evicted_rows
        if kept is not None and kept[0] == req_ids:
            return kept[1]
        none = (0,) * self.num_groups
        rows = np.array([self.evicted.get(rid, none) for rid in req_ids], dtype=np.int64).reshape(len(req_ids), -1)
        rows.flags.writeable = False  # shared by the steps that keep it
        self._evicted_rows = (req_ids, rows)
        return rows

    def clear_step(self) -> None:
        """No attention passes or metadata edits until the next step's inputs
        (a dummy run, data parallelism's idle step, must see none)."""
        self.step = None
        self.metadata_edits = None
        self.draft_slots = None


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



# The one attribute the plugin sets on vLLM's objects (the model runner, its
# attention layers and attention groups): the runner's WorkerCompression.
WORKER_KEY = "kv_compress_worker"


# Marks a draft model's own attention groups (MRV2): their metadata gets the
# draft's physical lengths, not the target step's edits.
DRAFT_GROUP_KEY = "_kvc_draft_group"


def attach(owner, worker: WorkerCompression | None) -> None:
    owner.__dict__[WORKER_KEY] = worker


def attached(owner) -> WorkerCompression | None:
    """The WorkerCompression attached to a runner, attention layer or attention group (None: none)."""
    return owner.__dict__.get(WORKER_KEY)
