"""Prometheus metrics on the server's `/metrics`.

The counters live where the work happens: the scheduler (engine-core process)
counts evictions and blocks, the worker times scoring and compaction. Each
writes a small JSON snapshot into a per-engine folder (at most twice a second,
and at once when the engine goes idle); the API server, which serves
`/metrics`, registers a collector that sums the snapshots at scrape time. vLLM's
own metrics and registry are left untouched.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ENV = "VLLM_KVCOMPRESS_METRICS_DIR"  # inherited by the engine core and workers
PREFIX = "vllm:kv_compress_"
RATIO_BUCKETS = (0.0, 0.25, 0.5, 0.75, 0.875, 0.9375, 1.0)
MIN_INTERVAL = 0.5  # seconds between snapshot writes while busy

logger = logging.getLogger("vllm.kvcompress")


class SnapshotWriter:
    """Writes one process's counters to its file, throttled.

    Metrics never take the engine down: a write that fails (the folder was
    removed under a long-running engine, say by a temp-folder cleaner) recreates
    the folder and tries once more; if that fails too, this snapshot is dropped
    with one warning (until a write succeeds again) and the next write retries.
    """

    def __init__(self, name: str) -> None:
        folder = os.environ.get(ENV)
        self.path = Path(folder) / f"{name}-{os.getpid()}.json" if folder else None
        self.last = 0.0
        self.failing = False  # warned about a failed write; reset by a successful one

    @property
    def enabled(self) -> bool:
        """Whether this process writes snapshots (a metrics folder is set)."""
        return self.path is not None

    def write(self, data: dict | Callable[[], dict], force: bool = False) -> None:
        """`data`, or what makes it (called only when a snapshot is due)."""
        now = time.monotonic()
        if self.path is None or (not force and now - self.last < MIN_INTERVAL):
            return
        text = json.dumps(data() if callable(data) else data)
        try:
            try:
                self._write(self.path, text)
            except OSError:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._write(self.path, text)
        except OSError as e:
            # The throttle clock stays put: the next write tries again.
            if not self.failing:
                logger.warning("kv_compress: could not write metrics snapshot %s (%s); /metrics may be stale "
                               "until a later write succeeds", self.path, e)
                self.failing = True
            return
        self.failing = False
        self.last = now

    @staticmethod
    def _write(path: Path, text: str) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)  # readers never see half a file


class RatioHistogram:
    """Cumulative bucket counts of per-request compression ratios."""

    def __init__(self) -> None:
        self.buckets = [0] * len(RATIO_BUCKETS)
        self.count = 0
        self.sum = 0.0

    def observe(self, ratio: float) -> None:
        self.buckets = [c + (ratio <= b) for c, b in zip(self.buckets, RATIO_BUCKETS)]
        self.count += 1
        self.sum += ratio

    def to_dict(self) -> dict:
        return {"buckets": self.buckets, "count": self.count, "sum": self.sum}


class KVCompressCollector:
    """Prometheus collector summing the engine processes' snapshots.

    Counters never go back: a snapshot that cannot be read (the folder was
    replaced by a file, removed, or a file is half gone) keeps its last good
    values, logged once until reads succeed again, and each counter is
    reported as at least what it was last scraped at (Prometheus reads a
    decrease as a counter reset). Gauges read NaN ("unknown") while the
    folder cannot be read, never 0.
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self._last: dict[str, dict] = {}  # file name -> its last good snapshot
        self._reported: dict[str, float] = {}  # counter -> the last value scraped
        self._failing = False

    def _snapshots(self, prefix: str) -> tuple[list[dict], bool]:
        """The snapshots of one kind, and whether all of them were read now."""
        try:
            names = sorted(p.name for p in self.folder.iterdir() if p.name.startswith(f"{prefix}-")
                           and p.suffix == ".json")
            fresh = True
        except OSError:
            names, fresh = [], False
        for name in names:
            try:
                self._last[name] = json.loads((self.folder / name).read_text())
            except (OSError, ValueError):
                fresh = False  # replaced between listing and reading: the last good one stands
        if not fresh and not self._failing:
            logger.warning("kv_compress: cannot read the metrics snapshots in %s; /metrics keeps the last "
                           "values read (gauges unknown) until it can", self.folder)
        self._failing = not fresh
        return [v for k, v in self._last.items() if k.startswith(f"{prefix}-")], fresh

    def _counter(self, key: str, value: float) -> float:
        value = max(value, self._reported.get(key, 0.0))
        self._reported[key] = value
        return value

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        sched, sched_fresh = self._snapshots("scheduler")
        workers, _ = self._snapshots("worker")

        def total(key: str) -> float:
            return sum(s.get(key, 0) for s in sched)

        for key, text in (
            ("tokens_evicted", "KV tokens evicted by compression"),
            ("blocks_freed", "KV blocks returned to the block pool by compression"),
            ("compressions", "Compactions performed"),
            ("requests_compressed", "Requests compressed at least once"),
        ):
            yield CounterMetricFamily(PREFIX + key, text, value=self._counter(key, total(key)))
        unknown = float("nan")
        yield GaugeMetricFamily(PREFIX + "free_blocks", "Free KV blocks in the pool (NaN: unknown now)",
                                value=total("free_blocks") if sched_fresh else unknown)
        yield GaugeMetricFamily(PREFIX + "total_blocks", "KV blocks in the pool (NaN: unknown now)",
                                value=total("total_blocks") if sched_fresh else unknown)
        # Bytes as well as blocks: a block's bytes depend on the cache dtype (fp8 halves them).
        yield GaugeMetricFamily(PREFIX + "free_bytes", "Free KV cache bytes in the pool (NaN: unknown now)",
                                value=total("free_bytes") if sched_fresh else unknown)
        yield GaugeMetricFamily(PREFIX + "total_bytes", "KV cache bytes in the pool (NaN: unknown now)",
                                value=total("total_bytes") if sched_fresh else unknown)
        hist = HistogramMetricFamily(
            PREFIX + "request_compression_ratio",
            "Per finished compressed request: fraction of its tokens evicted (kvpress convention)")
        buckets = [0] * len(RATIO_BUCKETS)
        count = ratio_sum = 0
        for s in sched:
            h = s.get("ratio_histogram", {})
            buckets = [a + b for a, b in zip(buckets, h.get("buckets", [0] * len(RATIO_BUCKETS)))]
            count += h.get("count", 0)
            ratio_sum += h.get("sum", 0.0)
        hist.add_metric([], [*((str(b), c) for b, c in zip(RATIO_BUCKETS, buckets)), ("+Inf", count)], ratio_sum)
        yield hist
        seconds = CounterMetricFamily(PREFIX + "seconds", "Worker time spent on compression", labels=["phase"])
        for phase in ("scoring", "compaction"):
            seconds.add_metric([phase], self._counter(f"seconds:{phase}", sum(w.get(phase, 0.0) for w in workers)))
        yield seconds


_registered: str | None = None


def enable_metrics() -> None:
    """In the serving process: make a folder for the engine's snapshots and
    expose them on /metrics. Runs before the engine processes are spawned."""
    global _registered
    if _registered is not None:
        return
    from prometheus_client import REGISTRY

    folder = tempfile.mkdtemp(prefix="vllm-kvcompress-metrics-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ[ENV] = folder
    REGISTRY.register(KVCompressCollector(folder))
    _registered = folder
    logger.info("kv_compress: metrics snapshots in %s", folder)
