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
timed directly.

    python benchmarks/host_cost.py                         # 64 256 512 1024, ~8 min on 2 cores
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
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        current.clear()
        begin = time.perf_counter()
        engine.step()
        current["step"] = time.perf_counter() - begin
        if "schedule" in current:
            steps.append({**{k: 0.0 for k in times}, **current, "running": len(core.scheduler.running)})
    wall = time.perf_counter() - start
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
    return out


def run_all(args) -> list[dict]:
    results = []
    for running in args.running:
        for name in args.configs:
            cmd = [sys.executable, __file__, "--one", f"{name}:{running}", "--new-tokens", str(args.new_tokens)]
            env = dict(os.environ)
            if args.trim_seconds is not None:
                env["VLLM_KVCOMPRESS_TRIM_SECONDS"] = str(args.trim_seconds)
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                sys.stderr.write(proc.stderr[-3000:])
                raise SystemExit(f"{name} at {running} failed")
            results.append(json.loads(lines[-1]))
            r = results[-1]
            print(f"{name:22s} {running:5d}  schedule {r['schedule']['median_ms']:7.2f} ms (p99 "
                  f"{r['schedule']['p99_ms']:7.2f}), host {r['host']['median_ms']:7.2f} ms, added "
                  f"{r['added']['median_ms']:7.2f} ms, step {r['step']['median_ms']:8.2f} ms, wall {r['wall_s']:.1f} s",
                  flush=True)
    return results


def table(results: list[dict]) -> str:
    vanilla = {r["running"]: r for r in results if r["config"] == "vanilla"}
    rows = ["| running | config | schedule() median / p99 / max (ms) | vs vanilla median / p99 | "
            "schedule() median, all running (ms, vs vanilla) | update (ms) | "
            "worker host (ms) | added host per step (ms, median) | vs vanilla step | added max (ms) | "
            "heap trims (n, slowest ms) | kernels (ms) | step median (ms) | wall (s) |", "|" + "---|" * 14]
    for r in results:
        v = vanilla.get(r["running"])
        s = r["schedule"]
        ratio = (f"{s['median_ms'] / v['schedule']['median_ms']:.2f}x / {s['p99_ms'] / v['schedule']['p99_ms']:.2f}x"
                 if v and r is not v else "")
        added = (r["added"]["median_ms"] - v["added"]["median_ms"]) if v else float("nan")
        share = f"{100 * added / v['step']['median_ms']:+.1f}%" if v and r is not v else ""
        full, vfull = s.get("median_full_ms"), v["schedule"].get("median_full_ms") if v else None
        steady = "" if full is None else f"{full:.2f}" + (f" ({full / vfull:.2f}x)" if vfull and r is not v else "")
        rows.append(f"| {r['running']} | {r['config']} | {s['median_ms']:.2f} / {s['p99_ms']:.2f} / {s['max_ms']:.1f} "
                    f"| {ratio} | {steady} | {r['update']['median_ms']:.2f} | {r['host']['median_ms']:.2f} | "
                    f"{added:+.2f} | {share} | {r['added']['max_ms']:.1f} | "
                    f"{r.get('heap_trims', 0)}, {r.get('heap_trim_max_ms', 0.0):.1f} | "
                    f"{r['kernels']['median_ms']:.2f} | {r['step']['median_ms']:.1f} | {r['wall_s']:.1f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["config"] for r in results):
        rs = sorted((r for r in results if r["config"] == name), key=lambda r: r["running"])
        ax.plot([r["running"] for r in rs], [r["added"]["median_ms"] for r in rs], marker="o", label=name)
    ax.set_xlabel("running requests")
    ax.set_ylabel("host ms per step (schedule + update + worker, median)")
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
