"""Policy names -> compositions of a scorer, a budget allocation, a trigger,
a selection modifier and a merge stage.

Each name is what the papers call a method; any entry's allocation, trigger,
selection and merge can be swapped per engine or request (`allocation`,
`trigger`, `selection`, `merge` fields), e.g. h2o with per-head budgets, tova
with a pyramid, snapkv with span carry, snapkv then MiniCache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .budgets import ALLOCATIONS, Allocation
from .merge import MERGES, Merge
from .scorers import SCORERS, Scorer
from .selection import SELECTIONS, Selection
from .triggers import TRIGGERS, Trigger


@dataclass(frozen=True)
class Composition:
    """A registered policy: component names and the parameter defaults it changes."""

    scorer: str | None  # None: compression off
    allocation: str = "uniform"
    trigger: str = "once"
    selection: str = "top"
    merge: str = "none"
    defaults: Mapping[str, Any] = field(default_factory=dict)


POLICIES: dict[str, Composition] = {
    "none": Composition(None),
    "snapkv": Composition("snapkv"),
    # The recommended setting: SnapKV's scores with span carry, so a kept
    # token keeps the 15 that follow it (a needle's digits, a value), the
    # first 4 tokens kept as attention sinks (docs/evaluation.md, Quality).
    "snapkv-span": Composition("snapkv", selection="span", defaults={"span": 16, "sink_tokens": 4}),
    # The same prompt, and then generated tokens in a window (the newest
    # `decode_window`), so long answers stay bounded too (docs/evaluation.md, Admission).
    "snapkv-span-window": Composition("snapkv", trigger="once_window", selection="span",
                                      defaults={"span": 16, "sink_tokens": 4}),
    "pyramidkv": Composition("snapkv", allocation="pyramid"),
    "adaptive": Composition("snapkv", allocation="adaptive"),
    "adakv": Composition("snapkv", allocation="per_head"),
    "h2o": Composition("h2o", trigger="rolling"),
    "tova": Composition("tova", trigger="rolling"),
    "keyformer": Composition("keyformer", trigger="rolling"),
    "streamingllm": Composition("streamingllm", trigger="rolling"),
    "window": Composition("streamingllm", trigger="rolling", defaults={"sink_tokens": 0}),
    "random": Composition("random", trigger="rolling"),
    "rkv": Composition("rkv", trigger="decode"),
    "knorm": Composition("knorm"),
    # No question needed: scores from the statistics of the prompt's queries,
    # turned to the positions to come (kvpress's ExpectedAttentionPress).
    "expected_attention": Composition("expected_attention"),
    # No question needed: scores from passes that repeat the prompt (KVzip's
    # context reconstruction), at the cost of prefilling the prompt again.
    "kvzip": Composition("kvzip"),
    # Nothing evicted: the prompt's KV merged across depth at prefill end.
    "minicache": Composition("keep_all", merge="minicache"),
}


@dataclass(frozen=True)
class Components:
    """A validated composition, its parameters applied."""

    scorer: Scorer
    allocation: Allocation
    trigger: Trigger
    selection: Selection
    merge: Merge


def component_classes(policy: str, allocation: str | None, trigger: str | None,
                      selection: str | None = None, merge: str | None = None) -> list[type]:
    """The scorer, allocation, trigger, selection and merge classes of a policy with these overrides."""
    composition = POLICIES[policy]
    if composition.scorer is None:
        return []
    return [SCORERS[composition.scorer], ALLOCATIONS[allocation or composition.allocation],
            TRIGGERS[trigger or composition.trigger], SELECTIONS[selection or composition.selection],
            MERGES[merge or composition.merge]]
