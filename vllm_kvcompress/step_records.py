"""The records scheduler and workers exchange each step, and where they ride.

Everything that crosses the scheduler/worker boundary is one of these frozen
records (vLLM pickles them with its SchedulerOutput and ModelRunnerOutput when
workers live in other processes): the scheduler's `StepPlan` (requests
started with their plans, compactions, physical offsets) and the workers'
`WorkerReport` (layer budgets derived from attention, failed requests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .plan import CompressionPlan
from .scorers.kvzip import RepeatPass


@dataclass(frozen=True)
class StartedRequest:
    """A request whose compression state (re)starts in this step."""

    request_id: str
    plan: CompressionPlan | None  # None: compression off for this request
    # It starts from this saved compressed state (`StepPlan.saved`), its
    # tokens' KV already in its first blocks (None: from nothing).
    restored: str | None = None
    # A repeat pass of another request's prompt (KVzip): (that request, the
    # pass); its queries score that request's prompt, and nothing of its own.
    repeat: tuple[str, RepeatPass] | None = None


@dataclass(frozen=True)
class BlockCopy:
    """The blocks from `first_block` on are replaced by `fresh_blocks`, which
    receive the kept tokens, because the originals are cached or shared
    (prefix caching) and must stay as they are."""

    first_block: int
    fresh_blocks: tuple[int, ...]


@dataclass(frozen=True)
class Compaction:
    """Compact a request before the step's forward: physical lengths per KV cache group."""

    request_id: str
    old_lengths: tuple[int, ...]
    new_lengths: tuple[int, ...]
    # Per KV cache group (empty: no group copies): the group's BlockCopy, or
    # None where its kept tokens are compacted in place.
    copies: tuple[BlockCopy | None, ...] = ()


@dataclass
class StepPlan:
    """What the workers must do for the step it is attached to."""

    started: list[StartedRequest] = field(default_factory=list)
    compactions: list[Compaction] = field(default_factory=list)
    # logical - physical length per KV cache group of each request compacted
    # in this step; the workers keep the others' (none: 0) until it ends or is preempted.
    evicted: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # The logical length at which a scheduled request with a plan next
    # compresses (None: never), as its schedule says after this step's
    # compactions: the workers observe up to it (R-KV's window). Only where
    # it changed (a compaction, new budgets, a request's first step): the
    # workers keep each request's last value.
    next_due: dict[str, int | None] = field(default_factory=dict)
    # Speculative decoding: each request whose last step verified drafts, and
    # its logical length now (its rejected drafts leave the workers' state
    # before anything else: worker/speculation.py).
    settled: dict[str, int] = field(default_factory=dict)
    # Some scheduled request has a plan: the workers may run compression code
    # (and, under tensor parallelism, gather their failures at the step's end).
    compressing: bool = False
    # `reuse`: finished requests whose compression state the workers keep,
    # each under a key at a length (request id -> (key, logical length)
    # pairs: its whole history, and its prompt alone where its outputs are
    # all in the tail), and kept states no longer in the cache (their blocks
    # were reused): the workers drop them.
    saved: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    # KVzip requests whose budgets come from their scores (adaptive,
    # per_head) and whose last repeat passes end in this step: the workers
    # take the passes' scores and report the budgets with the step's output.
    repeat_budgets: tuple[str, ...] = ()


@dataclass(frozen=True)
class ReportedBudgets:
    """Worker -> scheduler: per-layer budgets derived from a prompt's attention."""

    request_id: str
    layer_budgets: tuple[int, ...]


@dataclass(frozen=True)
class WorkerReport:
    """Worker -> scheduler, with a step's output."""

    layer_budgets: tuple[ReportedBudgets, ...] = ()  # derived from prompts' attention
    failed: tuple[str, ...] = ()  # requests whose compression raised: each finishes with an error


def log_failure(request_id: str, what: str, error: BaseException) -> None:
    """What the scheduler and the workers log when one request's compression raises."""
    logging.getLogger("vllm.kvcompress").error(
        "kv_compress %s: %s failed (%s: %s); the request finishes with an error, the others go on",
        request_id, what, type(error).__name__, error, exc_info=error)


# The plugin's records ride on vLLM's own step objects (pickled with them when
# workers live in other processes), one attribute each, read and written only here.
STEP_ATTR = "kv_compress_step"  # a StepPlan on vLLM's SchedulerOutput
REPORT_ATTR = "kv_compress_report"  # a WorkerReport on vLLM's ModelRunnerOutput


def attach_step_plan(scheduler_output, plan: StepPlan) -> None:
    setattr(scheduler_output, STEP_ATTR, plan)


def step_plan_of(scheduler_output) -> StepPlan:
    """The step's plan (an empty one for a step the plugin's scheduler did not plan)."""
    plan = getattr(scheduler_output, STEP_ATTR, None)
    return plan if isinstance(plan, StepPlan) else StepPlan()


def attach_report(model_runner_output, report: WorkerReport) -> None:
    setattr(model_runner_output, REPORT_ATTR, report)


def report_of(model_runner_output) -> WorkerReport:
    report = getattr(model_runner_output, REPORT_ATTR, None)
    return report if isinstance(report, WorkerReport) else WorkerReport()
