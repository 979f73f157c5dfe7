"""Give the worker's freed host memory back to the system (glibc's `malloc_trim`).

Requests allocate host memory of sizes that vary with each of them
(compression's scores, positions and selections are host tensors on CPU,
and its records Python objects everywhere; vLLM's own per-step buffers),
freed when they end. glibc's malloc keeps freed chunks in its heap and
returns only the top of it on `free`: the holes ended requests leave rarely
fit the next ones' sizes, so the heap, and the worker's RSS, grew with the
requests served while the bytes in use stayed flat (docs/reliability.md,
Days of traffic: `malloc_stats` of a soaked CPU worker, 549 MB in use in an
815 MB heap, then in 886 MB; its other arenas held under 1 MB, so
MALLOC_ARENA_MAX would not help). `malloc_trim(0)` returns every free page
of the heap (madvise), whatever is allocated around it.

Its cost grows with the heap's free chunks (8 ms to 0.8 s on the loaded
2-core test machine; it holds the arena's lock), so the worker trims only
after a step in which requests ended, and then at once when the step
computes nothing (the server went idle: no request waits for it; it may be
the last step for a while) or when `VLLM_KVCOMPRESS_TRIM_SECONDS` (default
30; 0: never trim) have passed since the last trim. Without glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import time
from collections.abc import Callable

logger = logging.getLogger("vllm.kvcompress")

TRIM_ENV = "VLLM_KVCOMPRESS_TRIM_SECONDS"
DEFAULT_TRIM_SECONDS = 30.0
SLOW_TRIM_SECONDS = 0.1  # a trim this slow is logged at info level


def _malloc_trim() -> Callable[[int], int] | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def _interval() -> float:
    value = os.environ.get(TRIM_ENV, "")
    try:
        return max(float(value), 0.0) if value else DEFAULT_TRIM_SECONDS
    except ValueError:
        logger.warning("kv_compress: %s=%r is not a number of seconds; using %s", TRIM_ENV, value[:40],
                       DEFAULT_TRIM_SECONDS)
        return DEFAULT_TRIM_SECONDS


class HeapTrimmer:
    """When a worker returns its freed host memory (`after_step`)."""

    def __init__(self, interval: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = _interval() if interval is None else interval
        self.trim = _malloc_trim() if self.interval > 0 else None
        self.clock = clock
        self.last = clock()
        self.pending = False  # requests ended since the last trim
        self.trims = 0
        self.seconds = 0.0
        self.longest = 0.0  # seconds, the slowest trim

    def after_step(self, ended: bool, idle: bool) -> bool:
        """At a step's state update: `ended`, requests ended (finished,
        aborted, preempted); `idle`, the step computes nothing. True: it trimmed."""
        self.pending |= ended
        if self.trim is None or not self.pending:
            return False
        if not idle and self.clock() - self.last < self.interval:
            return False
        begin = time.perf_counter()
        self.trim(0)
        took = time.perf_counter() - begin
        self.last, self.pending = self.clock(), False
        self.trims += 1
        self.seconds += took
        self.longest = max(self.longest, took)
        level = logging.INFO if took >= SLOW_TRIM_SECONDS or self.trims == 1 else logging.DEBUG
        logger.log(level, "kv_compress: malloc_trim returned the worker's free heap in %.1f ms (%d trims, %.2f s "
                   "in all)", took * 1e3, self.trims, self.seconds)
        return True
