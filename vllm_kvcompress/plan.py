"""The one resolved plan per request.

The scheduler resolves a request's configuration once (`resolve_plan`) into a
frozen `CompressionPlan` and sends that plan to the workers with the step
that starts the request (step_records.py); neither side derives budgets from
a config dict again.
"""

from __future__ import annotations

from dataclasses import dataclass

from .budgets import Allocation
from .config import KVCompressConfig
from .merge import Merge, NoMerge
from .scorers import Scorer
from .selection import Selection
from .triggers import Trigger


@dataclass(frozen=True)
class CompressionPlan:
    """How one request is compressed: its composition and its budgets."""

    scorer: Scorer
    allocation: Allocation
    trigger: Trigger
    selection: Selection
    prompt_len: int  # tokens prefilled before decoding (a resumed request's outputs included)
    budget: int  # mean tokens kept per layer and KV head, after the protected start
    # Per layer, known at admission; for allocations from attention these
    # stand in (uniform) until the worker reports the real ones.
    layer_budgets: tuple[int, ...]
    interval: int  # rolling triggers evict again after this many new tokens
    # The protected start: tokens at logical positions below it are never
    # evicted, and the budgets count the tokens after it: the request's
    # `protect_prefix` (its blocks are never rewritten, so they stay shared
    # through the prefix cache), or the whole prompt under a trigger that keeps it.
    protected_len: int = 0
    # Merged pairs' upper layers hold `merge.retained(kept)` slots (their layer
    # budgets here); their attention reads the lower layer's slots.
    merge: Merge = NoMerge()
    # The prompt outgrows its budget or merges: a prompt within budget that
    # does not merge is never compressed.
    compresses_prompt: bool = False
    # The layer budgets come from the observed prompt (the worker reports
    # them at prefill end); `layer_budgets` stand in until then.
    budgets_after_prompt: bool = False


def resolve_plan(config: KVCompressConfig, prompt_len: int, num_layers: int,
                 block_size: int) -> CompressionPlan | None:
    """The plan of a request with this config and prompt; None when compression is off.

    A function of the prompt's length and the settings alone, never of what
    vLLM's prefix cache holds: the scheduler caps a request's prefix-cache
    hit instead (`RequestSchedule.longest_prefix_hit`), so a hit saves
    prefill compute and never changes the tokens kept.
    """
    parts = config.components()
    if parts is None:
        return None
    protected = max(min(config.protect_prefix or 0, prompt_len), parts.trigger.protected_len(prompt_len))
    min_budget = parts.scorer.min_budget()
    # A compression_ratio applies to the part of the prompt that may be compressed.
    compressible = None if parts.trigger.protected_len(prompt_len) else prompt_len - protected
    budget = config.resolve_budget(prompt_len - protected, min_budget)
    known = parts.allocation.layer_budgets(budget, num_layers, compressible, min_budget)
    layer_budgets = [budget] * num_layers if known is None else list(known)
    pairs = parts.merge.pairs(num_layers)
    # A merged pair keeps one token set (the lower layer's budget); its
    # upper layer holds only the retained tokens.
    kept = min(budget, prompt_len - protected)
    for _, upper in pairs:
        layer_budgets[upper] = parts.merge.retained(kept)
    compresses_prompt = prompt_len > protected + budget or bool(pairs)
    return CompressionPlan(
        scorer=parts.scorer, allocation=parts.allocation, trigger=parts.trigger, selection=parts.selection,
        prompt_len=prompt_len,
        budget=budget, layer_budgets=tuple(layer_budgets), interval=config.interval or block_size,
        protected_len=protected, merge=parts.merge, compresses_prompt=compresses_prompt,
        budgets_after_prompt=known is None,
    )
