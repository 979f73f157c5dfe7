"""Retrieval-head profiles: which KV heads copy from the context, measured offline.

A few attention heads do the copying when a model quotes its context (a
needle's digits, a variable's value): Wu et al. (2024) call them retrieval
heads, and DuoAttention, RazorAttention and HeadKV give them the cache the
other heads can do without. Allocation `retrieval` (budgets.py) reads such a
profile and moves budget to the layers that hold these heads. A profile is
measured once per model, offline (`python -m kvc_tools.calibrate_profile
MODEL --out PROFILE.json`, which says how); this module is its format and
its checked loader.

The file (JSON): `format`, `model`, `num_layers` and `num_kv_heads` (of the
compressed, full-attention layers), `kv_head_scores` ([num_layers][num_kv_heads]),
and what it was measured on (`calibration`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass

FORMAT = "vllm-kvcompress retrieval profile 1"
CALIBRATE = "python -m kvc_tools.calibrate_profile MODEL --out FILE"


@dataclass(frozen=True)
class RetrievalProfile:
    kv_head_scores: tuple[tuple[float, ...], ...]  # [num_layers][num_kv_heads]

    @property
    def num_layers(self) -> int:
        return len(self.kv_head_scores)

    def layer_scores(self) -> list[float]:
        """A layer's weight: the sum of its KV heads' scores."""
        return [sum(row) for row in self.kv_head_scores]


MAX_PROFILE_BYTES = 1 << 20


@functools.lru_cache(maxsize=8)
def load_profile(path: str) -> RetrievalProfile:
    """Read and check a profile file; ValueError starting "profile" on any problem."""
    try:
        with open(path) as f:
            # A profile is a [layers][KV heads] table: kilobytes. A larger
            # file is not one, and is not read whole into memory.
            text = f.read(MAX_PROFILE_BYTES + 1)
        if len(text) > MAX_PROFILE_BYTES:
            raise ValueError(f"profile {path!r} is larger than {MAX_PROFILE_BYTES} bytes: not a retrieval profile")
        data = json.loads(text)
    except OSError as e:
        raise ValueError(f"profile cannot read {path!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path!r} is not JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"profile {path!r} is not a retrieval profile (want \"format\": {FORMAT!r}; "
                         f"write one with {CALIBRATE})")
    rows = data.get("kv_head_scores")
    ok = isinstance(rows, list) and bool(rows) and all(
        isinstance(r, list) and r and len(r) == len(rows[0])
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in r)
        for r in rows)
    if not ok or not isinstance(rows, list):
        raise ValueError(f"profile {path!r}: kv_head_scores must be a [layers][KV heads] table of finite "
                         f"scores >= 0")
    return RetrievalProfile(kv_head_scores=tuple(tuple(float(x) for x in r) for r in rows))
