"""What a component says when it cannot serve beside the other parts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """Why a composition cannot be served: the field to change, and why."""

    field: str
    reason: str
