"""benchmarks/quality_spread.py: runs of different sample indices merge into one table."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "quality_spread", Path(__file__).resolve().parents[1] / "benchmarks" / "quality_spread.py")
quality_spread = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(quality_spread)


def _run(folder: Path, rows: list[tuple[str, float, str, int, float]]) -> Path:
    folder.mkdir()
    with open(folder / "quality_predictions.jsonl", "w") as f:
        for policy, kept, task, index, score in rows:
            f.write(json.dumps(dict(policy=policy, kept_fraction=kept, task=task, index=index, score=score)) + "\n")
    return folder


def test_merge_adds_sample_indices_and_leaves_out_partial_cells(tmp_path):
    # Run a: full KV and "p" on samples 0-1; run b: full KV on 2-3, "p" on 2-3,
    # "q" only on 2-3 (not all of full KV's prompts once merged).
    a = _run(tmp_path / "a", [("none", 1.0, "t", 0, 1.0), ("none", 1.0, "t", 1, 0.0),
                              ("p", 0.25, "t", 0, 1.0), ("p", 0.25, "t", 1, 1.0)])
    b = _run(tmp_path / "b", [("none", 1.0, "t", 2, 1.0), ("none", 1.0, "t", 3, 1.0),
                              ("p", 0.25, "t", 2, 0.0), ("p", 0.25, "t", 3, 1.0),
                              ("q", 0.25, "t", 2, 1.0), ("q", 0.25, "t", 3, 1.0)])
    scores = quality_spread.merged([quality_spread.load(a), quality_spread.load(b)])
    assert sorted(scores[("none", 1.0)]["t"]) == [0, 1, 2, 3]
    rows = {r["policy"]: r for r in quality_spread.spread(scores, reps=200, partial_ok=True)}
    assert rows["p"]["prompts"] == 4 and rows["p"]["mean"] == pytest.approx(0.75)
    assert rows["p"]["diff"] == pytest.approx(0.0)  # full KV also 3 of 4
    assert rows["q"]["missing"] and rows["q"]["prompts"] == 2
    text = quality_spread.render("a + b", list(rows.values()))
    assert "| p | 0.750 (+0.000" in text
    assert "Left out (not all of full KV's prompts): q kept 1/4 (2 prompts)." in text
    with pytest.raises(SystemExit, match="not the full-KV run's prompts"):
        quality_spread.spread(scores, reps=10)


def test_merge_refuses_a_prompt_scored_differently_by_two_runs(tmp_path):
    a = _run(tmp_path / "a", [("none", 1.0, "t", 0, 1.0)])
    b = _run(tmp_path / "b", [("none", 1.0, "t", 0, 0.0)])
    with pytest.raises(SystemExit, match="scored 1.0 and 0.0"):
        quality_spread.merged([quality_spread.load(a), quality_spread.load(b)])
