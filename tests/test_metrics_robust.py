"""Metrics snapshots never take the engine down, and show the block pool from startup on.

Each engine process writes a JSON snapshot into a folder that the serving
process made under the temp directory; a temp-folder cleaner may remove it
under a long-running server. A write then recreates the folder; one that still
fails is dropped with one warning, never raised into the scheduler or worker.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.vllm_seam import metrics
from vllm_kvcompress.vllm_seam.metrics import ENV, KVCompressCollector, SnapshotWriter

LOGGER = "vllm.kvcompress"


def warnings_about(caplog, path: Path) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING and str(path) in r.getMessage()]


def collected(folder: Path) -> dict[str, float]:
    """What /metrics would show: the collector's samples by name (and labels)."""
    out = {}
    for family in KVCompressCollector(str(folder)).collect():
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


# ---------------------------------------------------------------- SnapshotWriter


@pytest.fixture
def writer(tmp_path, monkeypatch):
    folder = tmp_path / "metrics"
    folder.mkdir()
    monkeypatch.setenv(ENV, str(folder))
    w = SnapshotWriter("scheduler")
    assert w.path is not None and w.path.parent == folder
    return w


def test_write_recreates_a_removed_folder(writer, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    writer.write({"total_blocks": 7, "free_blocks": 5}, force=True)
    shutil.rmtree(writer.path.parent)
    snapshot = {"total_blocks": 7, "free_blocks": 3, "total_bytes": 7 * 4096, "free_bytes": 3 * 4096}
    writer.write(snapshot, force=True)  # must not raise
    assert json.loads(writer.path.read_text()) == snapshot
    assert not warnings_about(caplog, writer.path)  # recovered at once: nothing was lost
    # The collector behind /metrics only globs the folder: it reads the recreated snapshot.
    m = collected(writer.path.parent)
    assert m["vllm:kv_compress_total_blocks"] == 7
    assert m["vllm:kv_compress_free_blocks"] == 3
    assert m["vllm:kv_compress_free_bytes"] == 3 * 4096 and m["vllm:kv_compress_total_bytes"] == 7 * 4096


def test_unwritable_folder_warns_once_and_recovers(writer, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    folder = writer.path.parent
    shutil.rmtree(folder)
    folder.write_text("not a folder")  # mkdir fails too, even as root
    for i in range(5):
        writer.write({"n": i}, force=True)  # never raises
    # Unforced writes are retried as well: a failure does not advance the throttle clock.
    writer.write({"n": 5})
    (record,) = warnings_about(caplog, writer.path)
    assert "metrics snapshot" in record.getMessage()

    folder.unlink()  # restored (the writer recreates the folder itself)
    writer.write({"n": 6})  # not forced: the failures left the throttle open
    assert json.loads(writer.path.read_text()) == {"n": 6}
    assert len(warnings_about(caplog, writer.path)) == 1

    shutil.rmtree(folder)
    folder.write_text("not a folder")
    writer.write({"n": 7}, force=True)
    writer.write({"n": 8}, force=True)
    assert len(warnings_about(caplog, writer.path)) == 2  # failing again after a success: warned again
    folder.unlink()


def test_throttle_still_applies_after_a_success(writer):
    writer.write({"n": 1}, force=True)
    writer.write({"n": 2})  # within MIN_INTERVAL of the last write: skipped
    assert json.loads(writer.path.read_text()) == {"n": 1}


def test_without_the_folder_setting_nothing_is_written(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    w = SnapshotWriter("scheduler")
    assert w.path is None
    w.write({"n": 1}, force=True)


# ---------------------------------------------------------------- engine


def engine_core_pid(engine) -> int:
    """The engine core's pid (the scheduler runs there), or ours if it runs in-process."""
    manager = getattr(getattr(engine.llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
    processes = getattr(manager, "processes", None)
    return processes[0].pid if processes else os.getpid()


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    # The serving process makes the folder (enable_metrics) while the engine
    # config is created, before the engine core is spawned: read it afterwards.
    eng = start_engine(**engine_kwargs(tiny_model, kv_compress="snapkv", kv_compress_budget=64))
    assert metrics._registered is not None and os.environ.get(ENV) == metrics._registered
    eng.folder = Path(os.environ[ENV])
    eng.snapshot = eng.folder / f"scheduler-{engine_core_pid(eng)}.json"
    return eng


def test_pool_metrics_are_right_from_startup_and_survive_a_removed_folder(engine):
    # Item 2: a snapshot right after startup, before any request.
    assert engine.snapshot.exists(), sorted(p.name for p in engine.folder.iterdir())
    start = json.loads(engine.snapshot.read_text())
    assert start["total_blocks"] > 0
    assert start["free_blocks"] == start["total_blocks"]
    assert start["compressions"] == 0

    # Item 1: the folder removed under the running engine (a temp cleaner).
    shutil.rmtree(engine.folder)
    prompts = random_prompts((200, 220, 240, 200), seed=71)
    outs = engine.generate(prompts, max_tokens=24)
    assert [len(o) for o in outs] == [24] * len(prompts)
    # And the engine keeps serving.
    assert [len(o) for o in engine.generate(prompts[:1], max_tokens=8)] == [8]

    assert engine.folder.is_dir() and engine.snapshot.exists()
    after = json.loads(engine.snapshot.read_text())  # the idle engine's forced, exact snapshot
    assert after["compressions"] > 0 and after["tokens_evicted"] > 0
    assert after["total_blocks"] == start["total_blocks"]
    assert after["free_blocks"] == after["total_blocks"]  # every request finished
    stats = engine.stats()
    assert stats["compressions"] == after["compressions"]

    # /metrics sums whatever snapshots the (recreated) folder holds.
    snapshots = [json.loads(p.read_text()) for p in engine.folder.glob("scheduler-*.json")]
    m = collected(engine.folder)
    assert m["vllm:kv_compress_total_blocks"] == sum(s["total_blocks"] for s in snapshots) >= after["total_blocks"]
    assert m["vllm:kv_compress_compressions_total"] >= after["compressions"]
