"""Seconds the worker spends scoring and compacting, for /metrics.

On CPU the host does the work: wall time. On CUDA the host only launches
kernels, so wall time would count launches, not GPU work: each timed section
records a pair of CUDA events instead, and the pairs are resolved (which
waits for them: a sync) only when a metrics snapshot is written, at most
twice a second, never per step. Without a metrics folder nothing is timed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Unresolved CUDA event pairs kept at most (resolved early past it: a long
# run without snapshots must not grow without bound).
MAX_PENDING = 4096


class PhaseTimer:
    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.cuda = device.type == "cuda"
        self.enabled = enabled
        self.totals = {"scoring": 0.0, "compaction": 0.0}
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
        elif self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._pending.append((name, start, end))
            if len(self._pending) > MAX_PENDING:
                self.seconds()
        else:
            begin = time.perf_counter()
            yield
            self.totals[name] += time.perf_counter() - begin

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far (on CUDA: waits for the timed work to finish)."""
        for name, start, end in self._pending:
            end.synchronize()
            self.totals[name] += start.elapsed_time(end) / 1000.0
        self._pending.clear()
        return dict(self.totals)
