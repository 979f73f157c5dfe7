"""Upper bounds for every integer a configuration sets.

Every integer parameter sizes something (tokens kept, an interval, a window,
a pooling kernel, a layer index) or seeds a hash, and a request sets them: an
unbounded one is an allocation or an overflow away from taking the engine
down (a request's `interval` of 10**11 once asked for a 1.6 TB score buffer).
So each integer field declares its range with `bounded(...)` in its dataclass
field metadata, the common fields below do the same, and every value is
checked against it wherever a configuration is built:

- before an engine is known (CLI parsing, `KVCompressConfig.from_dict`):
  at most `ABSOLUTE_MAX` (nothing that counts tokens or layers is larger);
- at startup and per request (`EngineLimits` of the running engine): token
  counts at most `max_model_len`, layer counts and indices within the
  compressed layers, seeds below 2**31.

Fractions (`compression_ratio`, `retain_ratio`, `alpha`, ...) are checked in
[0, 1] by their components and size nothing larger than the tokens they
multiply, so no float can round to a size out of range.
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

ABSOLUTE_MAX = 2**31 - 1  # any token count, layer count or seed: vLLM's lengths are int32
SEED_MAX = 2**31 - 1  # hash_uniform keeps 31 bits of a seed


MAX_SHOWN = 60  # characters of a value that an error message echoes

_REPR = reprlib.Repr()  # cuts while it formats: a huge or deeply nested value is never formatted whole
_REPR.maxstring = _REPR.maxother = MAX_SHOWN // 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4
_REPR.maxlevel = 2


def shown(value: Any) -> str:
    """`value` as an error message echoes it (its repr), cut: a string to
    MAX_SHOWN characters and its length (a client's 1 MB name gives a short
    message), an integer past 30 digits to its first 12 and its length, any
    other value to 2 * MAX_SHOWN characters."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) < 10**30:
            return str(value)
        try:
            text = str(value)
        except ValueError:  # beyond Python's int-to-str limit (4300 digits)
            return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
        return f"{text[:12]}... ({len(text.lstrip('-'))} digits)"
    if isinstance(value, str) and len(value) > MAX_SHOWN:
        return f"{value[:MAX_SHOWN]!r}... ({len(value)} characters)"
    try:
        text = _REPR.repr(value)
    except ValueError:  # an integer inside beyond Python's int-to-str limit
        return f"a {type(value).__name__}"
    return text if len(text) <= 2 * MAX_SHOWN else text[:2 * MAX_SHOWN] + "..."


@dataclass(frozen=True)
class EngineLimits:
    """What bounds a configuration on a running engine."""

    max_model_len: int
    num_layers: int  # compressed (full-attention) layers


# What an upper bound is tied to: name -> (description, value on an engine).
_UPPER = {
    "tokens": ("max_model_len", lambda e: e.max_model_len),
    "layers": ("compressed layers", lambda e: e.num_layers),
    "pair_start": ("compressed layers - 2", lambda e: e.num_layers - 2),
    "seed": ("2**31 - 1", lambda e: SEED_MAX),
}


@dataclass(frozen=True)
class Bound:
    """The valid range of one integer field: `low` .. the engine's `upper`."""

    low: int
    upper: str  # a key of _UPPER

    def high(self, limits: EngineLimits | None) -> int:
        if self.upper == "seed":
            return SEED_MAX
        return ABSOLUTE_MAX if limits is None else _UPPER[self.upper][1](limits)

    def describe(self, limits: EngineLimits | None) -> str:
        high = self.high(limits)
        what = _UPPER[self.upper][0]
        return f"{self.low} .. {high}" + (f" ({what})" if limits is not None or self.upper == "seed" else "")

    def problem(self, value: int, limits: EngineLimits | None) -> str | None:
        """Why `value` is out of range (None: it is in range)."""
        if self.low <= value <= self.high(limits):
            return None
        return f"{shown(value)} is out of range; valid values: {self.describe(limits)}"


def bounded(low: int, upper: str, **metadata: Any) -> dict[str, Any]:
    """Field metadata of an integer field with this range."""
    if upper not in _UPPER:
        raise ValueError(f"unknown upper bound {upper!r}; one of {sorted(_UPPER)}")
    return {**metadata, "bounds": Bound(low, upper)}


def field_bound(metadata) -> Bound | None:
    return metadata.get("bounds")
