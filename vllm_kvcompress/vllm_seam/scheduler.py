"""Scheduler side (EngineCore process): decide compressions, free blocks.

Before vLLM schedules a step, every running request past prefill asks the
schedule (schedule.py) whether to compress; if so its tail blocks go back to the block pool
at once, so this very step can hand them to other requests. Allocation then
follows the *physical* length. The step's plan rides to the workers as an
attribute of SchedulerOutput (a pickled dataclass); the workers compact the
cache before anything is written to the freed blocks.

Prefix caching never changes what a request keeps: its plan is made from
its prompt and settings alone, and its prefix-cache hit is capped so that the
request computes every query its scorer observes and every token from its
first compression on (`RequestSchedule.longest_prefix_hit`). Hit tokens are
compressible like any other; compaction copies the kept ones into the
request's own fresh blocks (block_manager.py), leaving the cached originals
whole for the next request or turn.
"""

from __future__ import annotations

import functools
import logging
import os
import time

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.request import Request, RequestStatus

from ..accounting import CompressionStats
from ..admission import GrowthForecast, Outlook
from ..config import CONFIG_KEY, KVCompressConfig, KVCompressConfigError, request_overrides
from ..plan import resolve_plan
from ..schedule import RequestSchedule, cdiv
from ..scorers.kvzip import KVzip, RepeatPass, RepeatTokens, repeat_passes
from ..step_records import Compaction, StartedRequest, StepPlan, attach_step_plan, log_failure, report_of
from .block_manager import CompressedAttentionManager, cache_exact_tokens_only
from .groups import CompressedLayers
from .metrics import RatioHistogram, SnapshotWriter
from .saved_states import SavedState, SavedStates

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger
_RUNNING = RequestStatus.RUNNING  # read per request per step
# A request that ends so has a complete state worth keeping (`reuse`).
_COMPLETED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)



class KVCompressScheduler(Scheduler):
    """vLLM's V1 scheduler plus physical-length bookkeeping for compression."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kvc_config = KVCompressConfig.from_dict(self.vllm_config.additional_config[CONFIG_KEY])
        groups = self.kv_cache_config.kv_cache_groups
        # Full-attention layers compress; a hybrid model's sliding-window
        # groups stay with vLLM's own manager.
        self.kvc_layers = CompressedLayers.from_groups(groups)
        if len(self.kvc_layers.vllm_groups) != self.kvc_config.num_layer_groups:
            raise KVCompressConfigError(
                f"kv_compress expects {self.kvc_config.num_layer_groups} compressed KV cache group(s), "
                f"this model has {len(self.kvc_layers.vllm_groups)}"
            )
        self.kvc_group_of_layer = list(self.kvc_layers.group_of_layer)
        self._kvc_hybrid = self.kvc_layers.num_vllm_groups != len(self.kvc_layers.vllm_groups)  # some stay vLLM's
        self.kvc_block_size = groups[self.kvc_layers.vllm_groups[0]].kv_cache_spec.block_size
        self.kvc_states: dict[str, RequestSchedule] = {}
        # A plan is a function of the settings and the prompt's length alone
        # (`resolve_plan`), and frozen: the engine's own settings' plans are
        # made once per prompt length (a server admitting hundreds of requests
        # a step would otherwise build the same plan for each).
        self._kvc_plan_of = functools.lru_cache(maxsize=4096)(functools.partial(
            resolve_plan, self.kvc_config, num_layers=len(self.kvc_group_of_layer),
            block_size=self.kvc_block_size))
        self.kvc_stats = CompressionStats(
            total_blocks=self.kv_cache_manager.block_pool.num_gpu_blocks - 1,
            block_bytes=sum(t.size for t in self.kv_cache_config.kv_cache_tensors) // self.kv_cache_config.num_blocks,
            kv_cache_groups=tuple("compressed" if g in self.kvc_layers.vllm_groups else _kind(group.kv_cache_spec)
                                  for g, group in enumerate(groups)))
        self._kvc_started: dict[str, StartedRequest] = {}
        # Requests whose compression raised (here, or in a worker: WorkerReport.failed)
        # are finished with an error at the step's output; those finished
        # before the step was scheduled wait there for their error output.
        self._kvc_failed: set[str] = set()
        self._kvc_errors: list[tuple[str, int]] = []
        # Preempted for room to copy (`_plan_compression`): not resumed in the
        # step that preempted them, as vLLM resumes none of its own.
        self._kvc_held_back: set[str] = set()
        # Growth-aware admission's forecast of the running requests, kept
        # from step to step; `_kvc_forecast_follows` running requests (the
        # last of them `_kvc_forecast_last`) are in it as of this step (-1:
        # one may have left since, a full sync is due).
        self._kvc_forecast = GrowthForecast(self.kvc_block_size, len(self.kvc_layers.vllm_groups),
                                            self.max_num_scheduled_tokens)
        self._kvc_step = 0
        self._kvc_forecast_follows = -1
        self._kvc_forecast_last = None
        # The most blocks each request with a state could ever hold in the
        # compressed groups (every token of its max_tokens, in every group),
        # and their sum: where that fits the free blocks, admission admits
        # without following the running requests (`_admits`).
        self._kvc_most: dict[str, int] = {}
        self._kvc_most_total = 0
        # Requests with a plan that verified drafts in the last step: the
        # workers learn their accepted length in the next step's plan.
        self._kvc_speculated: set[str] = set()
        # Requests with a plan, and the next_due each one's workers last got
        # (StepPlan.next_due carries only changes).
        self._kvc_planned: set[str] = set()
        self._kvc_due_sent: dict[str, int | None] = {}
        # Running requests that may have a compression due at the next step:
        # those whose length reached their `quiet_below` (seen where vLLM
        # sizes each request's chunk, `_reserve_prefill_lookahead`), whose
        # `quiet_below` was reset (a compression, reported budgets, a new
        # state), or that were scheduled without passing there. The others
        # are between their compressions: the step does not look at them.
        self._kvc_may_be_due: set[str] = set()
        self._kvc_sized: set[str] = set()  # requests whose chunk was sized in this step
        # Requests whose next_due may differ from what their workers have:
        # new ones, and those whose compression was looked at (only that
        # changes `quiet_below`; below it a request's next_due stays as sent).
        # Kept until the request is next scheduled.
        self._kvc_due_check: set[str] = set()
        # Inside update_from_output, requests that end leave the /metrics
        # snapshot to its end (one write a step, however many ended).
        self._kvc_updating = False
        self._kvc_snapshot_due = False
        self._kvc_snapshot = SnapshotWriter("scheduler")
        self._kvc_ratios = RatioHistogram()  # finished compressed requests, for /metrics
        managers = self.kv_cache_manager.coordinator.single_type_managers
        self._kvc_all_managers = managers
        self._kvc_managers = [managers[g] for g in self.kvc_layers.vllm_groups]
        for group, manager in zip(self.kvc_layers.vllm_groups, self._kvc_managers):
            # vLLM picks it from the groups' CompressedAttentionSpec (groups.py).
            if not isinstance(manager, CompressedAttentionManager):
                raise RuntimeError(
                    f"kv_compress: KV cache group {group} is managed by {type(manager).__name__} "
                    f"(spec {type(groups[group].kv_cache_spec).__name__}), not CompressedAttentionManager"
                )
        # A hybrid's groups that do not compress (vLLM's managers), in vLLM's order.
        uncompressed = [g for g in range(len(groups)) if g not in self.kvc_layers.vllm_groups]
        self._kvc_uncompressed = tuple(managers[g] for g in uncompressed)
        # They cache a request's blocks only up to its first compaction
        # (block_manager.cache_exact_tokens_only): the tokens it computes
        # after it read a compressed cache.
        self._kvc_exact_until: dict[str, int] = {}
        if self.cache_config.enable_prefix_caching:
            for manager in self._kvc_uncompressed:
                cache_exact_tokens_only(manager, self._kvc_exact_until)
        # `reuse`: finished requests' compressed states kept in the prefix
        # cache for later requests (saved_states.py), where vLLM caches
        # prefixes and the groups that do not compress are sliding windows
        # (engine_checks.reuse_problem refuses DeltaNet hybrids).
        self._kvc_saved = SavedStates(self.kv_cache_manager.block_pool, self.kvc_block_size, len(groups)) \
            if self.cache_config.enable_prefix_caching and all(
                isinstance(groups[g].kv_cache_spec, SlidingWindowSpec) for g in uncompressed) else None
        self._kvc_fingerprint: dict[str, str] = {}  # requests with reuse: their settings, as states are keyed
        self._kvc_attaching: dict[str, SavedState] = {}  # this step's hits on a saved state, not yet scheduled
        # Requests with reuse once started: the state they started from (None:
        # none). A preempted one resumes from that one again, or from nothing.
        self._kvc_began: dict[str, str | None] = {}
        # The blocks of its state a request that started from one holds until
        # it ends (preempted too: it resumes from the same state).
        self._kvc_pins: dict[str, tuple[str, list]] = {}
        self._kvc_saved_now: dict[str, tuple[tuple[str, int], ...]] = {}  # for the next step's plan (StepPlan.saved)
        self._kvc_dropped: list[str] = []
        # KVzip: requests whose prompt is scored by repeat passes (requests
        # of their own, started here once the prompt is prefilled): those not
        # started yet; per request, its passes still running (it waits for
        # them before it decodes: scores and compression come first); per
        # pass, its request and what it repeats; this step's finished passes
        # (their outputs are the plugin's, not the client's); the passes of
        # requests that ended, to abort.
        self._kvc_to_repeat: set[str] = set()
        self._kvc_repeating: dict[str, set[str]] = {}
        self._kvc_repeated: set[str] = set()  # all passes ended, not preempted since
        self._kvc_repeat_of: dict[str, tuple[str, RepeatPass]] = {}
        self._kvc_repeats_ended: set[str] = set()
        self._kvc_orphans: list[str] = []
        self._kvc_repeat_tokens: RepeatTokens | None = None
        logger.info("kv_compress scheduler ready (pid %d): %s, block %d, compressing %d of %d KV cache group(s)",
                    os.getpid(), self.kvc_config.to_dict(), self.kvc_block_size, len(self._kvc_managers),
                    len(groups))
        # /metrics shows the pool from startup on, not only after the first
        # compression or finish (idle now, so the write is forced).
        self._write_snapshot()

    # ---------------------------------------------------------------- steps

    def _request_state(self, request) -> RequestSchedule:
        """The request's compression state, created on first use."""
        rid = request.request_id
        state = self.kvc_states.get(rid)
        if state is None and rid in self._kvc_repeat_of:
            # A repeat pass: uncompressed, its prompt's blocks from vLLM's
            # prefix cache (`_get_local_prefix_cache_hit`), its queries scored
            # for the request it repeats (the workers learn which from here).
            state = self.kvc_states[rid] = RequestSchedule.create(None, self.kvc_group_of_layer)
            self._kvc_started[rid] = StartedRequest(rid, None, repeat=self._kvc_repeat_of[rid])
            return state
        if state is None:
            params = request.sampling_params
            # Validated in the front end (InputProcessor) already.
            overrides = request_overrides(params.extra_args if params else None)
            config = self.kvc_config.merged(overrides) if overrides else self.kvc_config
            # Resolved once, here: the workers get this very plan. A resumed
            # (preempted) request gets its first life's plan (same prompt) and
            # recomputes prompt and outputs in chunks that end at its first
            # life's compression points (`tokens_until_due`): same tokens kept.
            try:
                plan = self._kvc_plan_of(request.num_prompt_tokens) if config is self.kvc_config else \
                    resolve_plan(config, request.num_prompt_tokens, len(self.kvc_group_of_layer), self.kvc_block_size)
            except Exception as e:  # noqa: BLE001 - one request's plan, never the engine
                # It runs uncompressed until this step's output, then finishes with an error.
                log_failure(rid, "planning", e)
                self._kvc_failed.add(rid)
                plan = None
            if plan is not None:
                problem = self._merge_problem(plan.merge)
                if problem is not None:
                    logger.warning("kv_compress %s: runs uncompressed: %s", rid, problem)
                    plan = None
            state = RequestSchedule.create(plan, self.kvc_group_of_layer)
            self.kvc_states[request.request_id] = state
            if config.reuse and plan is not None and plan.merge.name == "none" and self._kvc_saved is not None:
                self._kvc_fingerprint[rid] = repr(sorted(config.to_dict().items()))
            most = self._kvc_forecast.most_blocks(self._final_len(request))
            self._kvc_most_total += most - self._kvc_most.get(rid, 0)
            self._kvc_most[rid] = most
            if plan is not None:
                self._kvc_planned.add(rid)
                self._kvc_due_check.add(rid)
                self._kvc_may_be_due.add(rid)
                if plan.scorer.reconstructs_context and plan.compresses_prompt \
                        and rid not in self._kvc_repeating and rid not in self._kvc_repeated:
                    self._kvc_to_repeat.add(rid)
            cap = state.max_physical(request.num_tokens)
            for manager in self._kvc_managers:
                manager.set_admission_cap(request.request_id, cap)
            self._kvc_started[request.request_id] = StartedRequest(request.request_id, plan)
            prefilled = max(request.num_prompt_tokens, request.num_tokens - 1)  # a resumed one's outputs too
            self.kvc_stats.start(request.request_id, prefilled, config.policy)
        return state

    def _merge_problem(self, merge) -> str | None:
        """Why this engine cannot merge layer pairs (None: it can). An engine
        configured to merge is refused at startup for the same reasons
        (engine_checks.check_model); a request asking for it runs uncompressed."""
        layers = self.kvc_layers
        problem = merge.problem(len(layers.layers), len(layers.vllm_groups),
                                hybrid=layers.num_vllm_groups != len(layers.vllm_groups))
        return None if problem is None else f"merge {merge.name!r}: {problem}"

    def _plan_compressions(self) -> list[Compaction]:
        ops = []
        # Blocks the step's compactions release, freed once all of them have
        # their fresh blocks (`release_evicted`).
        released: list = []
        states = self.kvc_states
        # A request between its compressions (most requests, most steps) has
        # nothing due, and is not looked at (`_kvc_may_be_due`); the others in
        # the running order, as vLLM's.
        candidates, self._kvc_may_be_due = self._kvc_may_be_due, set()
        due = [r for r in self.running if r.request_id in candidates] if candidates else []
        self._kvc_due_check.update(r.request_id for r in due)
        for request in due:
            try:
                op = self._plan_compression(request, released)
            except Exception as e:  # noqa: BLE001 - one request's compaction, never the engine
                # Its blocks may be half compacted: it leaves before this step is scheduled.
                log_failure(request.request_id, "compaction planning", e)
                for finished in self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR):
                    self._kvc_errors.append((finished.request_id, finished.client_index))
                continue
            if op is not None:
                ops.append(op)
        # Still at or past `quiet_below` (a compression resets it): looked at
        # next step too, scheduled or not (a request not looked at is below it).
        for request in due:
            state = states.get(request.request_id)
            if state is not None and request.num_computed_tokens >= state.quiet_below:
                self._kvc_may_be_due.add(request.request_id)
        self.kv_cache_manager.block_pool.free_blocks(released)
        return ops

    def _plan_compression(self, request, released: list) -> Compaction | None:
        """The request's compaction in this step (None: none is due)."""
        pool = self.kv_cache_manager.block_pool
        rid = request.request_id
        state = self._request_state(request)
        if rid in self._kvc_repeating or rid in self._kvc_to_repeat:
            return None  # its scores come from repeat passes still to run (looked at again once they end)
        logical = request.num_computed_tokens
        targets = state.next_compression(logical)
        if targets is None:
            return None
        protected = state.plan.protected_len if state.plan is not None else 0
        copies = [m.copies_needed(rid, t, protected) for m, t in zip(self._kvc_managers, targets)]
        if None in copies or sum(c or 0 for c in copies) > pool.get_num_free_blocks():
            # Its blocks are shared through the prefix cache and the pool has
            # no room to copy the kept tokens. Decoding on uncompressed would
            # move its compression points (other tokens kept): it is preempted
            # instead, and replays exactly (preemption keeps answers) once
            # there is room, its own blocks freed for the others meanwhile.
            logger.warning("kv_compress %s: preempted: its blocks are shared through the prefix cache and the pool "
                           "has no room to copy the tokens its compaction keeps", rid)
            self.running.remove(request)
            self._preempt_request(request, time.monotonic())
            self._kvc_held_back.add(rid)
            return None
        old = state.physical(logical)
        done = [manager.release_evicted(rid, logical, target, protected, bool(copy), released)
                for manager, target, copy in zip(self._kvc_managers, targets, copies)]
        state.commit(logical, targets)
        self._kvc_exact_until.setdefault(rid, logical)
        # Where it next compresses, found now (sets its `quiet_below`): a
        # rolling policy's request is then not looked at again in the next
        # step (at 1,024 running, tens of compactions a step). Nothing is due
        # at the length it was just compressed at.
        state.next_compression(logical)
        self.kvc_stats.compressed(rid, old, targets, sum(r.freed for r in done), sum(r.held for r in done))
        copied = tuple(r.copy for r in done)
        return Compaction(rid, old, targets, copied if any(copied) else ())

    def schedule(self, *args, **kwargs):
        # Before anything is scheduled: the lengths after the last step's rejections.
        settled = {rid: self.requests[rid].num_computed_tokens for rid in self._kvc_speculated if rid in self.requests}
        self._kvc_step += 1
        if self._kvc_orphans:  # repeat passes of requests that ended
            orphans, self._kvc_orphans = self._kvc_orphans, []
            self.finish_requests(orphans, RequestStatus.FINISHED_ABORTED)
        ops = self._plan_compressions()
        self._kvc_sized.clear()
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            self._kvc_held_back.clear()
        restored = self._take_saved_state_hits(output.num_scheduled_tokens)
        if self._kvc_to_repeat:
            self._start_repeat_passes(output.num_scheduled_tokens)
        if self._kvc_repeating and not output.num_scheduled_tokens:
            self._unblock_repeat_passes()
        # Scheduled without vLLM asking `_reserve_prefill_lookahead` (none
        # known on 0.32-0.34): their lengths moved unseen, so they are looked at.
        self._kvc_may_be_due.update(output.num_scheduled_tokens.keys() - self._kvc_sized)
        # New and resumed requests get their state in the step that prefills
        # them: the workers observe prompt queries from the first chunk on.
        for rid in output.num_scheduled_tokens.keys() - self.kvc_states.keys():
            self._request_state(self.requests[rid])
        # A request preempted in this step already gave back all its blocks;
        # its state (and any op) is gone.
        ops = [op for op in ops if op.request_id in self.kvc_states]
        started = [v for rid, v in self._kvc_started.items() if rid in self.kvc_states]
        self._kvc_started.clear()
        # The workers keep each request's evicted counts: only this step's compactions change them.
        evicted = {op.request_id: tuple(self.kvc_states[op.request_id].num_evicted) for op in ops}
        evicted.update(restored)
        saved, self._kvc_saved_now = self._kvc_saved_now, {}
        dropped, self._kvc_dropped = self._kvc_dropped, []
        if self._kvc_saved is not None:
            dropped += self._kvc_saved.sweep({key for key, _ in self._kvc_pins.values()}, most=8)
        scheduled = output.num_scheduled_tokens
        planned = self._kvc_planned
        self._kvc_speculated = {rid for rid in output.scheduled_spec_decode_tokens if rid in planned}
        attach_step_plan(output, StepPlan(started=started, compactions=ops, evicted=evicted,
                                          next_due=self._next_due_changes(scheduled), settled=settled,
                                          compressing=not (planned.isdisjoint(scheduled)
                                                           and self._kvc_repeat_of.keys().isdisjoint(scheduled)),
                                          saved=saved,
                                          dropped=dropped,
                                          repeat_budgets=self._repeat_budgets_due(scheduled)
                                          if self._kvc_repeating else ()))
        if ops:
            self._write_snapshot()
        return output

    def _repeat_budgets_due(self, scheduled: dict[str, int]) -> tuple[str, ...]:
        """KVzip requests whose allocation shares the budget by their scores
        (adaptive, per_head) and whose every running repeat pass ends its
        prefill in this step: the workers report their budgets with this
        step's output, which also ends the passes, so the request compresses
        at the next step, as one whose budgets came with its prompt's end."""
        due = []
        for target, passes in self._kvc_repeating.items():
            state = self.kvc_states.get(target)
            if state is not None and state.budgets_pending and all(
                    p in scheduled and self.requests[p].num_computed_tokens >= self.requests[p].num_prompt_tokens
                    for p in passes):
                due.append(target)
        return tuple(due)

    def _next_due_changes(self, scheduled: dict[str, int]) -> dict[str, int | None]:
        """Where each scheduled request with a plan next compresses, from its
        length before this step's tokens, for those whose workers have
        another value (or none yet).

        Only requests in `_kvc_due_check` are looked at: a request below its
        `quiet_below` has next_due `quiet_below` (`RequestSchedule.next_due`),
        and `quiet_below` is set only where its compression is looked at (the
        step's due list, `_plan_compressions`) and reset to 0 by a compression
        or reported budgets (the next step's due list then holds it). Anything
        else is as last sent (tests/test_step_shortcuts.py)."""
        states, requests, sent, check = self.kvc_states, self.requests, self._kvc_due_sent, self._kvc_due_check
        changes = {}
        for rid in check.intersection(scheduled):
            check.discard(rid)
            state = states.get(rid)
            if state is None or state.plan is None:
                continue
            due = state.next_due(requests[rid].num_computed_tokens - scheduled[rid])
            if sent.get(rid, _UNSENT) != due:
                changes[rid] = sent[rid] = due
        return changes

    def update_from_output(self, scheduler_output, model_runner_output):
        # Budgets decided from a prompt's attention (adaptive, per_head): the
        # request compresses to them when the next step is planned.
        report = report_of(model_runner_output)
        failed, self._kvc_failed = set(report.failed) | self._kvc_failed, set()
        for budgets in report.layer_budgets:
            state = self.kvc_states.get(budgets.request_id)
            if state is not None and budgets.request_id not in failed:
                state.set_layer_budgets(budgets.layer_budgets)
                self._kvc_may_be_due.add(budgets.request_id)  # `quiet_below` reset
        if failed and model_runner_output.sampled_token_ids:
            # A failed request's token of this step came from a cache its
            # compression left unusable: it is not emitted.
            failing = set(failed)  # rows by req_ids (0.34 has no req_id_to_index)
            dropped = {i for i, rid in enumerate(model_runner_output.req_ids) if rid in failing}
            model_runner_output.sampled_token_ids = [[] if i in dropped else list(t) for i, t in
                                                     enumerate(model_runner_output.sampled_token_ids)]
        self._kvc_updating = True
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
            errors, self._kvc_errors = self._kvc_errors, []
            if failed:
                errors += [(r.request_id, r.client_index)
                           for r in self.finish_requests(failed, RequestStatus.FINISHED_ERROR)]
        finally:
            self._kvc_updating = False
        if self._kvc_snapshot_due:
            self._write_snapshot()
        if self._kvc_repeats_ended:
            _drop_outputs(outputs, self._kvc_repeats_ended)
            self._kvc_repeats_ended = set()
        for rid, client in errors:
            # What vLLM sends for its own per-request errors: the client's
            # request ends with finish_reason "error" (HTTP 500 for that request).
            outputs.setdefault(client, EngineCoreOutputs()).outputs.append(
                EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason=FinishReason.ERROR))
        return outputs

    def _get_local_prefix_cache_hit(self, request, *args, **kwargs):
        state = self._request_state(request)
        limit = args[0] if args else kwargs.get("max_cache_hit_length")  # vLLM 0.33+'s own cap
        if request.request_id in self._kvc_fingerprint:
            hit = self._saved_state_hit(request, state, limit)
            if hit is not None:
                return hit
        cap = state.longest_prefix_hit()
        repeat = self._kvc_repeat_of.get(request.request_id)
        if repeat is not None:
            cap = repeat[1].context_len  # a repeat pass computes every query of its own
        if args or "max_cache_hit_length" in kwargs:
            # vLLM 0.33+: the hit's cap is vLLM's own parameter; ours joins it.
            kwargs.pop("max_cache_hit_length", None)
            if cap is not None:
                limit = cap if limit is None else min(limit, cap)
            return super()._get_local_prefix_cache_hit(request, limit, *args[1:], **kwargs)
        hit = super()._get_local_prefix_cache_hit(request)
        if cap is None or hit[1] <= cap:
            return hit
        # vLLM 0.32: a shorter hit, found as vLLM's `get_computed_blocks` finds its own.
        manager = self.kv_cache_manager
        blocks, num_tokens, num_uncached = manager.coordinator.find_longest_cache_hit(request.block_hashes, cap)
        return manager.create_kv_cache_blocks(blocks), num_tokens, num_tokens + num_uncached if num_uncached else 0, \
            False

    # ------------------------------------------------------------ reuse

    def _saved_state_hit(self, request, state: RequestSchedule, limit: int | None):
        """The prefix-cache hit of a request with `reuse` on a saved state (None:
        none): the state's blocks per KV cache group and its logical length,
        as vLLM's own hit; the request's lengths become physical from there."""
        rid = request.request_id
        assert self._kvc_saved is not None and state.plan is not None
        self._kvc_attaching.pop(rid, None)
        if rid in self._kvc_began:  # resumed after a preemption: as in its first life
            key = self._kvc_began[rid]
            found = None if key is None else self._kvc_saved.get(key)
        else:
            found = self._kvc_saved.find(self._kvc_fingerprint[rid], request.all_token_ids, request.block_hashes,
                                         state.plan.protected_len, self._kvc_dropped)
        if found is not None and limit is not None and found.length > limit:
            found = None
        if found is None:
            self._detach(rid, state)
            return None
        evicted = found.num_evicted()
        state.start_from(evicted)
        for manager, e in zip(self._kvc_managers, evicted):
            manager.num_evicted[rid] = e
            manager.cacheable[rid] = 0  # its blocks hold compressed tokens: never vLLM's to cache
        self._kvc_exact_until[rid] = 0  # every token it computes reads the state
        self._kvc_attaching[rid] = found
        self._kvc_started[rid] = StartedRequest(rid, state.plan, restored=found.key)
        return self.kv_cache_manager.create_kv_cache_blocks(found.blocks), found.length, 0, False

    def _detach(self, rid: str, state: RequestSchedule) -> None:
        """A request found no saved state (or vLLM did not schedule it on one):
        it starts from nothing."""
        if not any(state.num_evicted):
            return
        state.start_from((0,) * len(state.num_evicted))
        for manager in self._kvc_managers:
            manager.num_evicted.pop(rid, None)
            manager.cacheable.pop(rid, None)
        self._kvc_exact_until.pop(rid, None)
        self._kvc_started[rid] = StartedRequest(rid, state.plan)

    def _take_saved_state_hits(self, scheduled: dict[str, int]) -> dict[str, tuple[int, ...]]:
        """After vLLM scheduled the step: requests it started on a saved state
        hold that state's blocks until they end (evicted per group returned,
        for the workers); the others start from nothing after all."""
        attaching, self._kvc_attaching = self._kvc_attaching, {}
        restored = {}
        for rid, found in attaching.items():
            state = self.kvc_states.get(rid)
            if state is None:
                continue
            if rid not in scheduled:
                self._detach(rid, state)
                continue
            restored[rid] = found.num_evicted()
            if rid not in self._kvc_pins:
                blocks = found.all_blocks()
                self.kv_cache_manager.block_pool.touch(blocks)
                self._kvc_pins[rid] = (found.key, blocks)
                self.kvc_stats.reused(rid, found.length)
        # Per request with reuse not yet begun (not per running request: a step's cost).
        for rid in self._kvc_fingerprint.keys() - self._kvc_began.keys():
            if rid in scheduled:
                self._kvc_began[rid] = attaching[rid].key if rid in attaching else None
        return restored

    def _save_state(self, request) -> None:
        """A finishing request with `reuse`: its compressed state stays (its
        blocks named in the pool before they are freed), at its whole
        history and, where its trigger compressed it for the last time at or
        before its prompt's end, at its prompt alone too (its outputs are the
        cache's tail: a document sent alone, compressed once, for many
        questions)."""
        rid = request.request_id
        state = self.kvc_states.get(rid)
        assert self._kvc_saved is not None
        if state is None or state.plan is None or not (state.num_compressions or self._kvc_began.get(rid)):
            return  # nothing compressed: vLLM's own prefix cache keeps what it can of it
        computed, prompt_len = request.num_computed_tokens, request.num_prompt_tokens
        lengths = [computed]
        if not state.plan.trigger.repeats() and state.compressed_at <= prompt_len < computed:
            lengths.append(prompt_len)
        saved = []
        for length in lengths:
            key = self._save_at(request, state, length, computed)
            if key is not None:
                saved.append((key, length))
        if saved:
            self._kvc_saved_now[rid] = tuple(saved)
            stats = self.kvc_stats.requests.get(rid)
            if stats is not None:
                self.kvc_stats.saved(stats)

    def _save_at(self, request, state: RequestSchedule, length: int, computed: int) -> str | None:
        """Keep the request's state as it was at `length` tokens (the newer
        ones, its cache's tail, left out); its key (None: not kept)."""
        assert self._kvc_saved is not None and state.plan is not None
        bs, rid = self.kvc_block_size, request.request_id
        anchor = length // bs
        if anchor == 0 or len(request.block_hashes) < anchor:
            return None
        physical = tuple(p - (computed - length) for p in state.physical(computed))
        blocks = [manager.req_to_blocks.get(rid, [])[: cdiv(p, bs)] for manager, p in zip(self._kvc_managers, physical)]
        if any(len(b) != cdiv(p, bs) for b, p in zip(blocks, physical)):
            return None
        if self._kvc_uncompressed:  # sliding windows (`_kvc_saved`)
            windows = [_window_blocks(manager, rid, length) for manager in self._kvc_uncompressed]
            if None in windows:
                return None  # a window's block at that length was dropped (the answer outgrew the window)
            held = iter(blocks)
            at = iter(windows)
            blocks = [next(held) if g in self.kvc_layers.vllm_groups else next(at)
                      for g in range(self.kvc_layers.num_vllm_groups)]
        saved = self._kvc_saved.save(self._kvc_fingerprint[rid], request.all_token_ids[:length],
                                     request.block_hashes[anchor - 1], physical, state.plan.protected_len, blocks)
        return None if saved is None else saved.key

    def _end_reuse(self, request) -> None:
        """A request ended (not preempted): its hold on a saved state goes."""
        rid = request.request_id
        self._kvc_fingerprint.pop(rid, None)
        self._kvc_began.pop(rid, None)
        pin = self._kvc_pins.pop(rid, None)
        if pin is not None:
            self.kv_cache_manager.block_pool.free_blocks(reversed(pin[1]))

    def _reserve_prefill_lookahead(self, request, num_computed_tokens: int, num_new_tokens: int) -> int:
        # vLLM's last word on a request's chunk (running and waiting alike): a
        # chunk ends where the request's next compression is due.
        num_new_tokens = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        rid = request.request_id
        self._kvc_sized.add(rid)
        if rid in self._kvc_repeating and num_computed_tokens >= request.num_prompt_tokens:
            return 0  # prefilled, its repeat passes still running: it compresses on their scores first
        state = self.kvc_states.get(rid)
        if num_new_tokens <= 1 and state is not None and request.status is _RUNNING and (
                state.plan is None or num_computed_tokens >= state.plan.prompt_len):
            # A running request past its prompt (most requests, most steps):
            # a step may always compute a token (`tokens_until_due`). Its
            # compression may be due at the next step only if this token
            # reaches `quiet_below`.
            if num_computed_tokens + num_new_tokens >= state.quiet_below:
                self._kvc_may_be_due.add(rid)
            return num_new_tokens
        self._kvc_may_be_due.add(rid)  # prefilling, waiting: looked at in the next step
        if rid in self._kvc_held_back:
            # Waiting until the next step. vLLM 0.32 then admits no other
            # waiting request this step; 0.33+ requeues it and goes on with
            # the others (answers are exact either way: it replays as preempted).
            return 0
        if num_new_tokens and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) \
                and not self._admits(request):
            # Growth-aware admission: it waits (with every waiting request
            # behind it, on 0.32) until the running set's growth leaves room.
            return 0
        state = self.kvc_states.get(request.request_id) or self._request_state(request)
        if num_new_tokens <= 1 and state.plan is not None and num_computed_tokens >= state.plan.prompt_len:
            return num_new_tokens  # past its prompt, a step may always compute a token (`tokens_until_due`)
        cap = state.tokens_until_due(num_computed_tokens)
        return num_new_tokens if cap is None else min(num_new_tokens, cap)

    # ------------------------------------------------------------ KVzip

    def _start_repeat_passes(self, scheduled: dict[str, int]) -> None:
        """Requests whose prompt this step prefills to its end start their
        repeat passes: requests of their own, at the front of the waiting
        queue, whose prompt is the prompt and the pass (scorers/kvzip.py)."""
        for rid in self._kvc_to_repeat.intersection(scheduled):
            request = self.requests[rid]
            if request.num_computed_tokens < request.num_prompt_tokens:
                continue
            self._kvc_to_repeat.discard(rid)
            if self._kvc_began.get(rid) is not None:
                # It continues a saved state (`reuse`): the state's tokens keep
                # their scores, its own new ones are kept before them (KVzip.score).
                continue
            state = self.kvc_states[rid]
            assert state.plan is not None
            try:
                if request.prompt_token_ids is None or request.mm_features:
                    raise ValueError("kvzip repeats prompts of token ids only (no embeddings or multimodal inputs)")
                scorer = state.plan.scorer
                assert isinstance(scorer, KVzip)  # the only scorer that reconstructs its context
                passes = repeat_passes(request.prompt_token_ids, scorer, self._repeat_tokens(), self.max_model_len)
            except Exception as e:  # noqa: BLE001 - one request's passes, never the engine
                log_failure(rid, "starting its repeat passes", e)
                self._kvc_failed.add(rid)
                continue
            children = set()
            for i, rp in enumerate(passes):
                cid = f"{rid}{REPEAT_SUFFIX}{i}"
                self._kvc_repeat_of[cid] = (rid, rp)
                child = Request(request_id=cid, prompt_token_ids=[*request.prompt_token_ids, *rp.tokens],
                                sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                                pooling_params=None, client_index=request.client_index,
                                arrival_time=request.arrival_time, lora_request=request.lora_request,
                                cache_salt=request.cache_salt, priority=request.priority,
                                block_hasher=request._block_hasher)
                self.add_request(child)
                children.add(cid)
            self._put_first(children)  # the request holds its blocks while it waits for them
            self._kvc_repeating[rid] = children

    def _unblock_repeat_passes(self) -> None:
        """Nothing was scheduled while requests wait for their repeat passes:
        the passes wait for blocks that the waiting requests hold (nothing
        else runs to free any). The newest such request whose passes have not
        started is preempted (as vLLM preempts: it replays exactly); its blocks
        stay cached for its passes to hit, and its passes go ahead of it."""
        for request in reversed(self.running):
            rid = request.request_id
            passes = self._kvc_repeating.get(rid)
            if passes is None or any(self.requests[p].status is _RUNNING for p in passes if p in self.requests):
                continue
            logger.warning("kv_compress %s: preempted: its repeat passes wait for blocks it holds", rid)
            self.running.remove(request)
            self._preempt_request(request, time.monotonic())
            self._put_first(passes)
            return

    def _put_first(self, request_ids: set[str]) -> None:
        """These waiting requests (repeat passes) to the front of the waiting queue."""
        ahead = [r for r in self.waiting if r.request_id in request_ids]
        self.waiting.remove_requests(ahead)
        self.waiting.prepend_requests(ahead)

    def _repeat_tokens(self) -> RepeatTokens:
        """The repeat passes' instructions, from the model's tokenizer (loaded once)."""
        if self._kvc_repeat_tokens is None:
            from transformers import AutoTokenizer

            mc = self.vllm_config.model_config
            tokenizer = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision,
                                                      trust_remote_code=mc.trust_remote_code)
            self._kvc_repeat_tokens = RepeatTokens.of(tokenizer)
        return self._kvc_repeat_tokens

    def _end_repeats(self, request) -> None:
        """A request ended: a repeat pass's request learns it (once all its
        passes ended it compresses; a pass that failed fails it); a request's
        running passes are aborted."""
        rid = request.request_id
        self._kvc_to_repeat.discard(rid)
        self._kvc_repeated.discard(rid)
        orphans = self._kvc_repeating.pop(rid, None)
        if orphans:
            self._kvc_orphans += orphans
        repeat = self._kvc_repeat_of.pop(rid, None)
        if repeat is None:
            return
        self._kvc_repeats_ended.add(rid)
        target = repeat[0]
        running = self._kvc_repeating.get(target)
        if running is None:
            return
        running.discard(rid)
        if request.status not in _COMPLETED:
            logger.warning("kv_compress %s: its repeat pass %s ended (%s)", target, rid, request.status.name)
            self._kvc_failed.add(target)
            self._kvc_orphans += running
            running.clear()
        if not running:
            del self._kvc_repeating[target]
            self._kvc_repeated.add(target)
            self._kvc_may_be_due.add(target)

    # ------------------------------------------------------------ admission

    def _admits(self, request) -> bool:
        """Whether a waiting compressed request may start now (a vanilla one:
        always, vLLM decides): only if it and the running requests fit the
        pool at every step ahead, each growing as its plan keeps tokens
        (admission.py). The first request always starts (vLLM checked at
        startup that one of `max_model_len` fits). Blocks of uncompressed
        groups (a hybrid model's sliding windows) are vLLM's own and not
        counted.
        """
        if not self.running or self.kvc_config.reserve_growth == 0:
            return True
        if self._request_state(request).plan is None:
            return True
        manager = self.kv_cache_manager
        pool = manager.block_pool
        free = pool.get_num_free_blocks() - manager.watermark_blocks
        # Every request with a state (the running ones, this one, others
        # waiting) at its most fits: the forecast below would admit it, so it
        # is not followed (most steps while memory is not short). The rule's
        # capacity is the free blocks plus those the running requests hold,
        # and no running request ever holds more than its most. Where every
        # KV cache group is compressed, each block in use is held by a running
        # request (KV connectors are refused), so the whole pool is a lower
        # bound of that capacity; a hybrid's sliding-window groups hold blocks
        # of the same pool, so there only the free ones count.
        capacity = free if self._kvc_hybrid else pool.num_gpu_blocks - 1 - manager.watermark_blocks
        if self._kvc_most_total <= capacity:
            return True
        forecast, running = self._kvc_forecast, self.running
        if forecast.step == self._kvc_step and self._kvc_forecast_follows >= 0 \
                and len(running) >= self._kvc_forecast_follows and running[self._kvc_forecast_follows - 1] is \
                self._kvc_forecast_last:
            # Later in the same step: the running requests are those of the
            # last check and those started since (appended).
            for r in running[self._kvc_forecast_follows:]:
                forecast.update(r.request_id, self._outlook(r))
        else:
            forecast.sync(self._kvc_step, ((r.request_id, self._outlook(r)) for r in running))
        self._kvc_forecast_follows, self._kvc_forecast_last = len(running), running[-1]
        return forecast.admits(self._outlook(request), free)

    def _final_len(self, request) -> int:
        """The length a request ends at: its max_tokens, or max_model_len."""
        return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)

    def _outlook(self, request) -> Outlook:
        final = self._final_len(request)
        if self.kvc_config.reserve_growth is not None:
            final = min(final, request.num_tokens + self.kvc_config.reserve_growth)
        rid = request.request_id
        state = self.kvc_states.get(rid)
        # A full-attention manager's block table holds no null blocks.
        managers = self._kvc_managers
        held = len(managers[0].req_to_blocks.get(rid, ())) if len(managers) == 1 else \
            sum(len(m.req_to_blocks.get(rid, ())) for m in managers)
        return Outlook(held, request.num_computed_tokens, request.num_tokens, final,
                       state if state is not None else _UNPLANNED)

    def _write_snapshot(self) -> None:
        self._kvc_snapshot_due = False
        if not self._kvc_snapshot.enabled:
            return
        data = self.kvc_stats.snapshot(self.kv_cache_manager.block_pool.get_num_free_blocks(), per_request=False)
        data["ratio_histogram"] = self._kvc_ratios.to_dict()
        # Exact when the engine goes idle; throttled while it is busy.
        idle = not self.waiting and all(r.is_finished() for r in self.running)
        self._kvc_snapshot.write(data, force=idle)

    def _free_request_blocks(self, request) -> None:
        # Preemption and finish both end here: the request's cache is gone.
        # Every group's blocks (a sliding-window group's dropped ones are the null block).
        held = tuple(sum(not b.is_null for b in m.req_to_blocks.get(request.request_id, ()))
                     for m in self._kvc_all_managers)
        if request.request_id in self._kvc_fingerprint and request.status in _COMPLETED:
            self._save_state(request)
        super()._free_request_blocks(request)
        if request.is_finished():
            self._end_reuse(request)
            if self._kvc_repeat_of or self._kvc_repeating or self._kvc_to_repeat or self._kvc_repeated:
                self._end_repeats(request)
        elif self._kvc_repeated:
            # Preempted after its passes: its compaction took their scores (the
            # workers keep none), so its replay runs them again (same scores).
            self._kvc_repeated.discard(request.request_id)
        self._kvc_forecast.retire(request.request_id)
        self._kvc_forecast_follows, self._kvc_forecast_last = -1, None
        self.kvc_states.pop(request.request_id, None)
        self._kvc_exact_until.pop(request.request_id, None)  # a replay computes its tokens again
        self._kvc_most_total -= self._kvc_most.pop(request.request_id, 0)
        self._kvc_started.pop(request.request_id, None)
        self._kvc_planned.discard(request.request_id)
        self._kvc_due_sent.pop(request.request_id, None)
        self._kvc_due_check.discard(request.request_id)
        preempted = not request.is_finished()
        r = self.kvc_stats.finish(request.request_id, preempted=preempted, blocks_held=held)
        if r is not None and r.compressions and not preempted:
            self._kvc_ratios.observe(r.tokens_evicted / (r.tokens_evicted + r.tokens_kept))
        if r is not None:
            if self._kvc_updating:
                self._kvc_snapshot_due = True
            else:
                self._write_snapshot()
        if r is not None and r.compressions:
            logger.info(
                "kv_compress %s %s: prompt %d tokens, evicted %d in %d compression(s), freed %d blocks, "
                "held %d blocks at the end%s", r.policy, request.request_id, r.prefill_len,
                r.tokens_evicted, r.compressions, r.blocks_freed, sum(held), " (preempted)" if preempted else "")

    # ---------------------------------------------------------------- stats

    def kv_compress_stats(self) -> dict:
        return self.kvc_stats.snapshot(free_blocks=self.kv_cache_manager.block_pool.get_num_free_blocks())


def _window_blocks(manager, request_id: str, length: int) -> list | None:
    """A sliding-window group's blocks of a request's first `length` tokens as
    a hit at that length holds them: the null block before the window (what
    the next token does not read), the request's own blocks from there on
    (None: one of those was dropped already)."""
    blocks = manager.req_to_blocks.get(request_id, [])
    skipped = manager.get_num_skipped_tokens(length) // manager.block_size
    window = blocks[skipped: cdiv(length, manager.block_size)]
    if len(window) != cdiv(length, manager.block_size) - skipped or any(b.is_null for b in window):
        return None
    return [manager.block_pool.null_block] * skipped + window


_UNPLANNED = RequestSchedule.create(None)  # a request not planned yet: uncompressed
_UNSENT = object()  # no next_due sent to the workers yet
REPEAT_SUFFIX = "::kvzip-repeat-"  # a repeat pass's request id: its request's, this, the pass's number


def _drop_outputs(outputs: dict, request_ids: set[str]) -> None:
    """Leave these requests (repeat passes, the plugin's own) out of the step's outputs to the clients."""
    for out in outputs.values():
        out.outputs = [o for o in out.outputs if o.request_id not in request_ids]
        if out.finished_requests:
            out.finished_requests = out.finished_requests - request_ids


def _kind(spec) -> str:
    """SlidingWindowSpec -> "sliding_window"."""
    name = type(spec).__name__.removesuffix("Spec")
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def make_engine_stats(_original):
    """EngineCore.kv_compress_stats: reachable through the client's utility calls."""

    def kv_compress_stats(self) -> dict | None:
        stats = getattr(self.scheduler, "kv_compress_stats", None)
        return stats() if stats is not None else None

    return kv_compress_stats
