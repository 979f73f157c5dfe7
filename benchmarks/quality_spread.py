"""Spread of quality.py's scores: each configuration against full KV on the same prompts.

Reads one or more quality.py result folders (their quality_predictions.jsonl)
and, per policy and kept fraction, reports the mean over task kinds, its
difference to full KV on the same prompts, and a 95% interval of that
difference from a paired bootstrap: samples are resampled within each task
kind (the same draws for the policy and for full KV), the mean over task kinds
recomputed, 2,000 times.

    python benchmarks/quality_spread.py benchmarks/results/quality-main
    python benchmarks/quality_spread.py results/quality-minicache-alone --full-from results/quality-minicache
    python benchmarks/quality_spread.py results/quality-2k-n12 --out results/quality-2k-n12/spread.md
    python benchmarks/quality_spread.py results/quality-4k results/quality-4k-4to7 --merge

--merge reads the folders as one run: runs of other sample indices of the same
seed (quality.py --first-sample) add prompts to a cell; a cell that lacks some
of full KV's prompts is left out, and the table says so.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FULL = ("none", 1.0)


def load(folder: Path) -> dict[tuple[str, float], dict[str, dict[int, float]]]:
    """scores[(policy, kept)][task][sample index]."""
    out: dict[tuple[str, float], dict[str, dict[int, float]]] = {}
    with open(folder / "quality_predictions.jsonl") as f:
        for line in f:
            p = json.loads(line)
            key = (p["policy"], float(p["kept_fraction"]))
            out.setdefault(key, {}).setdefault(p["task"], {})[int(p["index"])] = float(p["score"])
    return out


def merged(runs: list[dict]) -> dict:
    """The union of several runs' scores; a prompt scored twice must score the same."""
    out: dict = {}
    for run in runs:
        for key, tasks in run.items():
            for task, by_index in tasks.items():
                cell = out.setdefault(key, {}).setdefault(task, {})
                for index, score in by_index.items():
                    if cell.get(index, score) != score:
                        raise SystemExit(f"{key} {task} #{index}: scored {cell[index]} and {score} in two runs")
                    cell[index] = score
    return out


def mean_over_tasks(cell: dict[str, dict[int, float]], draws: dict[str, list[int]]) -> float:
    return sum(sum(cell[t][i] for i in idx) / len(idx) for t, idx in draws.items()) / len(draws)


def spread(scores, reps: int = 2000, seed: int = 0, partial_ok: bool = False) -> list[dict]:
    """Rows per (policy, kept) cell; with `partial_ok`, cells lacking some of
    full KV's prompts are left out (returned as rows with `missing` set)."""
    full = scores[FULL]
    tasks = sorted(full)
    rng = random.Random(seed)
    resamples = []
    for _ in range(reps):
        resamples.append({t: [rng.choice(sorted(full[t])) for _ in full[t]] for t in tasks})
    exact = {t: sorted(full[t]) for t in tasks}
    rows = []
    for key, cell in scores.items():
        if sorted(cell) != tasks or any(sorted(cell[t]) != exact[t] for t in tasks):
            if partial_ok:
                rows.append(dict(policy=key[0], kept=key[1], missing=True,
                                 prompts=sum(len(v) for v in cell.values())))
                continue
            raise SystemExit(f"{key}: not the full-KV run's prompts")
        mean = mean_over_tasks(cell, exact)
        diffs = sorted(mean_over_tasks(cell, d) - mean_over_tasks(full, d) for d in resamples)
        rows.append(dict(policy=key[0], kept=key[1], mean=mean, diff=mean - mean_over_tasks(full, exact),
                         low=diffs[int(0.025 * reps)], high=diffs[int(0.975 * reps) - 1],
                         prompts=sum(len(v) for v in cell.values())))
    return rows


def frac(k: float) -> str:
    return "1" if k == 1.0 else (f"1/{round(1 / k)}" if abs(1 / k - round(1 / k)) < 1e-9 else f"{k:g}")


def render(folder: Path | str, rows: list[dict]) -> str:
    partial = [r for r in rows if r.get("missing")]
    rows = [r for r in rows if not r.get("missing")]
    kept = sorted({r["kept"] for r in rows if r["policy"] != "none"}, reverse=True)
    policies = list(dict.fromkeys(r["policy"] for r in rows if r["policy"] != "none"))
    by = {(r["policy"], r["kept"]): r for r in rows}
    full = by[FULL]
    lines = [f"Mean score over task kinds, {full['prompts']} prompts per cell ({folder}); "
             f"full KV {full['mean']:.3f}. Each cell: mean (difference to full KV on the same prompts, "
             f"95% paired-bootstrap interval of the difference).", "",
             "| policy | " + " | ".join(f"kept {frac(k)}" for k in kept) + " |",
             "|---|" + "---:|" * len(kept)]
    for p in policies:
        cells = []
        for k in kept:
            r = by.get((p, k))
            cells.append("-" if r is None else f"{r['mean']:.3f} ({r['diff']:+.3f}, {r['low']:+.3f} .. "
                                               f"{r['high']:+.3f})")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    if partial:
        lines += ["", "Left out (not all of full KV's prompts): " + "; ".join(
            f"{r['policy']} kept {frac(r['kept'])} ({r['prompts']} prompts)" for r in partial) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--out", type=Path, default=None, help="write the tables here too")
    p.add_argument("--full-from", type=Path, default=None, metavar="FOLDER",
                   help="full KV's scores from this run (same tasks, samples and seed) for a run made with --no-full")
    p.add_argument("--merge", action="store_true", help="read the folders as one run (see above)")
    args = p.parse_args()
    full = load(args.full_from)[FULL] if args.full_from else None

    def scores(folder: Path):
        s = load(folder)
        if full is not None:
            s[FULL] = full
        return s

    if args.merge:
        runs = [load(f) for f in args.folders] + ([{FULL: full}] if full is not None else [])
        text = render(" + ".join(map(str, args.folders)), spread(merged(runs), partial_ok=True))
    else:
        text = "\n".join(render(f, spread(scores(f))) for f in args.folders)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
