"""What every part of a composition is (scorer, allocation, trigger,
selection, merge): named, validated, and saying what it cannot serve beside."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from .config import KVCompressConfig
    from .registry import Components


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


@dataclass(frozen=True)
class Component:
    """The base of every part's base class; subclasses are frozen dataclasses
    whose fields are the part's parameters."""

    name: ClassVar[str]  # how the registry, the flags and messages name it

    def validate(self) -> None:
        """Raise ValueError naming the field for impossible parameter values."""

    def incompatible_with(self, parts: Components, config: KVCompressConfig) -> Problem | None:
        """Why this part cannot serve beside the other parts (None: it can)."""
        return None
