"""Two quality runs, cell by cell, on the prompts they share: the difference and its spread.

For runs of `quality.py` that differ in one engine setting (fp8 against float32:
``--kv-cache-dtype``), each cell (policy, kept) present in both is scored as the
suite scores it (mean over task kinds of the per-task means) on the prompts both
ran, with the second minus the first and a 95% paired bootstrap interval of that
difference (prompts resampled within each task kind, 2000 times, seed 0).

    python benchmarks/quality_compare.py benchmarks/results/quality-main benchmarks/results/quality-fp8

Prints a Markdown table and writes it to ``SECOND/compare.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path


def load(folder: Path) -> dict[tuple, float]:
    rows = (json.loads(line) for line in (folder / "quality_predictions.jsonl").read_text().splitlines() if line)
    return {(r["policy"], r["kept_fraction"], r["task"], r["index"]): r["score"] for r in rows}


def suite_score(scores: dict[tuple, float], keys: list[tuple]) -> float:
    tasks = sorted({k[2] for k in keys})
    return statistics.mean(statistics.mean(scores[k] for k in keys if k[2] == t) for t in tasks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path)
    p.add_argument("second", type=Path)
    p.add_argument("--reps", type=int, default=2000)
    args = p.parse_args()
    a, b = load(args.first), load(args.second)
    rng = random.Random(0)
    lines = [f"Cells of `{args.second}` against `{args.first}` on the prompts both ran: mean over task kinds, "
             f"second minus first, 95% paired bootstrap interval ({args.reps} resamples within task kinds).", "",
             f"| policy | kept | {args.first.name} | {args.second.name} | difference (95% interval) | prompts |",
             "|---|---:|---:|---:|---|---:|"]
    for policy, kept in sorted({(k[0], k[1]) for k in b}, key=lambda c: (c[0] != "none", c[0], -c[1])):
        keys = [k for k in b if (k[0], k[1]) == (policy, kept) and k in a]
        if not keys:
            continue
        by_task = {t: [k for k in keys if k[2] == t] for t in sorted({k[2] for k in keys})}
        diffs = []
        for _ in range(args.reps):
            sample = [rng.choice(ks) for ks in by_task.values() for _ in ks]
            diffs.append(suite_score(b, sample) - suite_score(a, sample))
        diffs.sort()
        lo, hi = diffs[int(0.025 * args.reps)], diffs[int(0.975 * args.reps) - 1]
        first, second = suite_score(a, keys), suite_score(b, keys)
        name = "full KV" if policy == "none" else policy
        lines.append(f"| {name} | {kept:g} | {first:.3f} | {second:.3f} | {second - first:+.3f} ({lo:+.3f} .. "
                     f"{hi:+.3f}) | {len(keys)} |")
    table = "\n".join(lines) + "\n"
    print(table)
    (args.second / "compare.md").write_text(table)


if __name__ == "__main__":
    main()
