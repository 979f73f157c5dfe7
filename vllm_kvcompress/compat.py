"""What a component says when it cannot serve beside the other parts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """Why a composition cannot be served: the field to change, and why."""

    field: str
    reason: str


def first_problem(*checks: tuple[bool, str, str]) -> Problem | None:
    """The first (condition, field, reason) whose condition holds, as a Problem
    (None: none holds). A component lists what it cannot serve beside, in order."""
    for condition, field, reason in checks:
        if condition:
            return Problem(field, reason)
    return None
