"""Host cost per engine step at production batch sizes: vanilla vLLM against the plugin.

GPU servers run hundreds of requests at once and a decode step on a GPU takes
tens of milliseconds, so host work the plugin adds to a step is paid by every
request, every step. This runs N requests at once (`max_num_seqs` = N, all
submitted together, prompts of 128-256 tokens, `--new-tokens` each, a pool
large enough for all: no memory is short) on a model whose forward pass is
cheap (a tiny random 4-layer Llama, hidden 64), and records per engine step:

  schedule   Scheduler.schedule, at its outermost call
  update     Scheduler.update_from_output
  host       the worker's time outside the model's forward pass and the
             plugin's kernels (execute_model + sample_tokens - forward -
             compaction)
  kernels    the plugin's scoring (its attention passes, inside the forward)
             and compaction, reported apart
  step       the engine's whole step (wall: LLMEngine.step)

for vanilla vLLM, the recommended setting (snapkv-span, ratio 0.75) and a
rolling policy (streamingllm, trigger rolling), at 64, 256, 512 and 1,024
running. The plugin's added host time per step is (schedule + update + host)
minus vanilla's, beside vanilla's step time.

Each configuration runs in its own subprocess with the engine core in that
process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so the scheduler and the worker are
timed directly. The configs' engines step in turn (one step each, then again),
so that all of them meet the machine at the same moments: this VM's speed
drifts by up to 2x within minutes, more than the differences measured. Each
batch size runs `--rounds` times, the configs' order rotated; a plugin's
ratios are to the vanilla engine of its own round, reported as the median over
rounds with their range. "wall" is the sum of the engine's own steps.

    python benchmarks/host_cost.py                         # 64 256 512 1024, 3 rounds, ~25 min on 2 cores
    python benchmarks/host_cost.py --running 256 --configs vanilla snapkv-span
    python benchmarks/host_cost.py --plot                  # redraw the plot from the JSON
    python benchmarks/host_cost.py --trim-seconds 1 --out benchmarks/results/host_cost_trims  # heap trims under load

Writes `benchmarks/results/host_cost.{json,md,svg}`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
RESULTS = HERE / "results"
BLOCK_SIZE = 32  # vLLM CPU attention takes multiples of 32
CONFIGS = {
    "vanilla": None,
    "snapkv-span": {"policy": "snapkv-span", "compression_ratio": 0.75},
    "streamingllm-rolling": {"policy": "streamingllm", "budget": 64, "trigger": "rolling", "interval": 32},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--running", type=int, nargs="+", default=[64, 256, 512, 1024])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds per batch size: each runs every config once, one after the other, in an order "
                        "that rotates between rounds (the VM's speed drifts: each round's plugin runs are "
                        "compared with that round's vanilla run)")
    p.add_argument("--trim-seconds", type=float, default=None,
                   help="VLLM_KVCOMPRESS_TRIM_SECONDS for the plugin's workers (default: the plugin's, 30 s, "
                        "longer than a run: 1 trims under load)")
    p.add_argument("--plot", action="store_true", help="only redraw the plot and table from the JSON")
    p.add_argument("--out", default=str(RESULTS / "host_cost"))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: config:running
    return p.parse_args(argv)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_one(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import random

    from vllm import LLM, SamplingParams

    from kvc_tools.models import build_tiny_llama, default_cache_root
    from vllm_kvcompress.vllm_seam.worker import attention_passes, state

    name, running = args.one.split(":")
    running = int(running)
    config = CONFIGS[name]
    model = build_tiny_llama(default_cache_root() / "models" / "tiny-llama-h64", seed=0, hidden_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=64, intermediate_size=128)
    max_len = 256 + args.new_tokens + 16
    blocks = running * -(-max_len // BLOCK_SIZE) + 64
    extra = {} if config is None else {"additional_config": {"kv_compress": config}}
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, seed=0,
              enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=running,
              max_num_batched_tokens=8192, num_gpu_blocks_override=blocks, disable_log_stats=True,
              gpu_memory_utilization=0.3, **extra)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    times: dict[str, list[float]] = {k: [] for k in ("schedule", "update", "execute", "sample", "forward",
                                                     "compaction", "scoring", "step")}
    current: dict[str, float] = {}

    def timed(owner, attr: str, key: str, per_step: bool = True) -> None:
        original = getattr(owner, attr)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                current[key] = current.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, attr, wrapper)

    timed(core.scheduler, "schedule", "schedule")
    timed(core.scheduler, "update_from_output", "update")
    timed(core.model_executor, "execute_model", "execute")
    timed(core.model_executor, "sample_tokens", "sample")
    timed(runner.model, "forward", "forward")
    timed(state, "compact_requests", "compaction")
    timed(attention_passes.StepPasses, "after_attention", "scoring")

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 2000) for _ in range(rng.randint(128, 256))]}
               for _ in range(running)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    print("ready", flush=True)
    while True:
        sys.stdin.readline()  # the parent's turn: one engine steps at a time (`run_round`)
        current.clear()
        begin = time.perf_counter()
        engine.step()
        current["step"] = time.perf_counter() - begin
        if "schedule" in current:
            steps.append({**{k: 0.0 for k in times}, **current, "running": len(core.scheduler.running)})
        if not engine.has_unfinished_requests():
            break  # the results line follows instead
        print("stepped", flush=True)
    # The engine's own steps: in lockstep, the time between them is the other configs'.
    wall = sum(s["step"] for s in steps)
    worker = getattr(runner, state.WORKER_KEY, None)  # the plugin's worker state (vanilla: none)
    heap = worker.heap if worker is not None else None
    for s in steps:
        s["host"] = s["execute"] + s["sample"] - s["forward"] - s["compaction"]
        s["kernels"] = s["scoring"] + s["compaction"]
        s["added"] = s["schedule"] + s["update"] + s["host"]
    full = [s for s in steps if s["running"] >= running * 0.9]  # every request running
    out = {"config": name, "running": running, "wall_s": wall, "steps": len(steps), "full_steps": len(full),
           "new_tokens": args.new_tokens,
           # The worker's heap trims in the run (inside "host"): count, slowest, all (ms).
           "heap_trims": heap.trims if heap else 0, "heap_trim_max_ms": 1e3 * heap.longest if heap else 0.0,
           "heap_trim_total_ms": 1e3 * heap.seconds if heap else 0.0}
    for key in ("schedule", "update", "host", "kernels", "added", "forward", "step"):
        values = [1e3 * s[key] for s in steps]
        out[key] = {"median_ms": statistics.median(values), "p99_ms": _percentile(values, 0.99),
                    "max_ms": max(values), "total_s": sum(values) / 1e3,
                    "median_full_ms": statistics.median([1e3 * s[key] for s in full]) if full else None}
    # Every step's schedule() time, for percentiles over all rounds' steps.
    out["schedule_steps_ms"] = [round(1e3 * s["schedule"], 4) for s in steps]
    return out


def run_round(args, running: int, names: list[str], rnd: int) -> list[dict]:
    """Every config's engine at `running`, each in its own process, stepped in
    turn (one step of each, in `names` order, then again): the VM's speed
    drifts by up to 2x within minutes, and stepping in lockstep gives every
    config the same machine at the same moment."""
    env = dict(os.environ)
    if args.trim_seconds is not None:
        env["VLLM_KVCOMPRESS_TRIM_SECONDS"] = str(args.trim_seconds)
    procs, logs = {}, {}
    results = {}
    try:
        for name in names:  # started one after the other: each builds its model and engine alone
            cmd = [sys.executable, __file__, "--one", f"{name}:{running}", "--new-tokens", str(args.new_tokens)]
            log = tempfile.TemporaryFile("w+")  # vLLM's log, shown if it fails
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                    env=env)
            logs[name] = log
            procs[name] = proc
            _expect(proc, ("ready",), name, running, logs)
        while procs:
            for name in list(procs):
                proc = procs[name]
                proc.stdin.write("\n")
                proc.stdin.flush()
                line = _expect(proc, ("stepped", "{"), name, running, logs)
                if line.startswith("{"):  # finished: its results
                    results[name] = {**json.loads(line), "round": rnd}
                    proc.wait()
                    del procs[name]
    finally:  # one failed: the others' engines go too
        for proc in procs.values():
            proc.kill()
        for log in logs.values():
            log.close()
    return [results[name] for name in names]


def _expect(proc: subprocess.Popen, starts: tuple[str, ...], name: str, running: int, logs: dict) -> str:
    """The config's next line that begins with one of `starts` (vLLM's own lines skipped)."""
    for line in proc.stdout:
        if line.startswith(starts):
            return line
    logs[name].seek(0)
    sys.stderr.write(logs[name].read()[-3000:])
    raise SystemExit(f"{name} at {running} failed")


def run_all(args) -> list[dict]:
    results = []
    for running in args.running:
        for rnd in range(args.rounds):
            shift = rnd % len(args.configs)
            for r in run_round(args, running, args.configs[shift:] + args.configs[:shift], rnd):
                results.append(r)
                print(f"round {rnd} {r['config']:22s} {running:5d}  schedule {r['schedule']['median_ms']:7.2f} ms "
                      f"(p99 {r['schedule']['p99_ms']:7.2f}), host {r['host']['median_ms']:7.2f} ms, added "
                      f"{r['added']['median_ms']:7.2f} ms, step {r['step']['median_ms']:8.2f} ms, "
                      f"wall {r['wall_s']:.1f} s", flush=True)
    return results


def _spread(values: list[float], fmt: str) -> str:
    """The median of the rounds' values, and their range where there are several."""
    mid = format(statistics.median(values), fmt)
    return mid if len(values) == 1 else f"{mid} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def table(results: list[dict]) -> str:
    """One row per batch size and config over its rounds. Ratios are taken
    within a round (a plugin run against the vanilla run beside it) and shown
    as the median over rounds with their range; p99 is over every step of
    every round."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["running"], r["config"]), []).append(r)
    rows = ["| running | config | rounds | schedule() median (ms) | vs vanilla, median | "
            "schedule() p99 / max (ms, all rounds' steps) | vs vanilla, p99 | "
            "schedule() median, all running (vs vanilla) | update (ms) | worker host (ms) | "
            "added host per step (ms, median) | vs vanilla step | added max (ms) | heap trims (n, slowest ms) | "
            "kernels (ms) | step median (ms) | wall (s) |", "|" + "---|" * 17]
    for (running, name), runs in groups.items():
        vanilla = {r.get("round", 0): r for r in groups.get((running, "vanilla"), [])}
        pairs = [(r, vanilla[r.get("round", 0)]) for r in runs if r.get("round", 0) in vanilla]
        plugin = name != "vanilla" and bool(pairs)

        ratios = [r["schedule"]["median_ms"] / v["schedule"]["median_ms"] for r, v in pairs]
        steps = [t for r in runs for t in r.get("schedule_steps_ms", [])]
        vsteps = [t for _, v in pairs for t in v.get("schedule_steps_ms", [])]
        if steps and vsteps:
            p99, vp99 = _percentile(steps, 0.99), _percentile(vsteps, 0.99)
        else:  # results written before every step was kept: the rounds' own p99s
            p99 = statistics.median(r["schedule"]["p99_ms"] for r in runs)
            vp99 = statistics.median(v["schedule"]["p99_ms"] for _, v in pairs) if pairs else float("nan")
        added = [r["added"]["median_ms"] - v["added"]["median_ms"] for r, v in pairs]
        share = [100 * a / v["step"]["median_ms"] for a, (_, v) in zip(added, pairs)]
        steady = [r["schedule"]["median_full_ms"] / v["schedule"]["median_full_ms"] for r, v in pairs
                  if r["schedule"].get("median_full_ms") and v["schedule"].get("median_full_ms")]
        mid = {key: _spread([r[key]["median_ms"] for r in runs], ".2f")
               for key in ("schedule", "update", "host", "kernels", "step")}
        rows.append(
            f"| {running} | {name} | {len(runs)} | {mid['schedule']} | "
            f"{_spread(ratios, '.2f') + 'x' if plugin else ''} | "
            f"{p99:.2f} / {max(r['schedule']['max_ms'] for r in runs):.1f} | "
            f"{f'{p99 / vp99:.2f}x' if plugin else ''} | {_spread(steady, '.2f') + 'x' if plugin and steady else ''} | "
            f"{mid['update']} | {mid['host']} | {_spread(added, '+.2f') if plugin else ''} | "
            f"{_spread(share, '+.1f') + '%' if plugin else ''} | {max(r['added']['max_ms'] for r in runs):.1f} | "
            f"{sum(r.get('heap_trims', 0) for r in runs)}, {max(r.get('heap_trim_max_ms', 0.0) for r in runs):.1f} | "
            f"{mid['kernels']} | {mid['step']} | {_spread([r['wall_s'] for r in runs], '.1f')} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["config"] for r in results):
        per_size: dict[int, list[float]] = {}
        for r in results:
            if r["config"] == name:
                per_size.setdefault(r["running"], []).append(r["added"]["median_ms"])
        sizes = sorted(per_size)
        mids = [statistics.median(per_size[n]) for n in sizes]
        # The line through the rounds' medians, the bars their range.
        ax.errorbar(sizes, mids, yerr=[[m - min(per_size[n]) for n, m in zip(sizes, mids)],
                                       [max(per_size[n]) - m for n, m in zip(sizes, mids)]],
                    marker="o", capsize=3, label=name)
    ax.set_xlabel("running requests")
    ax.set_ylabel("host ms per step (schedule + update + worker, median; bars: rounds' range)")
    ax.set_title("Host work per engine step")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args)))
        return
    out = Path(args.out)
    if args.plot:
        results = json.loads(out.with_suffix(".json").read_text())["results"]
    else:
        from machine import machine_info

        results = run_all(args)
        out.with_suffix(".json").write_text(json.dumps(
            {"machine": machine_info(), "command": " ".join(sys.argv), "results": results}, indent=1))
    out.with_suffix(".md").write_text(table(results) + "\n")
    print(table(results))
    try:
        plot(results, out.with_suffix(".svg"))
    except ImportError:
        print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
