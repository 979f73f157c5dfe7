"""Cost and memory of per-layer KV cache groups (--kv-compress-layer-groups).

Same requests, one configuration per process (in-process engine core, so the
scheduler and the executor can be timed directly):

    single table, snapkv       layer_groups 1  (today's layout: one block table)
    per-layer tables, snapkv   layer_groups N  (the groups' overhead alone)
    pyramidkv, G tiers         layer_groups G for each G in --tiers
    adaptive, per-layer        layer_groups N  (budgets from the window's attention)
    adakv, per-layer           layer_groups N  (per-head budgets: fullest head held, others masked)

Reports wall time, output tok/s, mean scheduler and executor (forward) ms per
step, and the KV memory a request holds once compressed (blocks x the bytes
of one block of the group's layers), measured from the plugin's stats.

    python benchmarks/layer_groups.py                 # SmolLM2 (30 layers), tiers 30,10,6,3
    python benchmarks/layer_groups.py --quick
    python benchmarks/layer_groups.py --configs adaptive:30 --reuse benchmarks/results/layer_groups.json
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

from machine import machine_info  # benchmarks/machine.py

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "LAYER_GROUPS_RESULT "
BLOCK_SIZE = 32


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per configuration (same engine); times are their medians")
    p.add_argument("--tiers", default="30,10,6,3", help="layer_groups values for pyramidkv")
    p.add_argument("--configs", default=None, metavar="POLICY:GROUPS,...",
                   help="run only these (default: snapkv:1, snapkv:N, pyramidkv per tier, adaptive:N, adakv:N)")
    p.add_argument("--reuse", type=Path, default=None, metavar="JSON",
                   help="take the other configurations' rows from an earlier run's layer_groups.json "
                        "(same settings); the header says which rows were reused")
    p.add_argument("--quick", action="store_true", help="4 requests x 512 + 16 (smoke test)")
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--report-only", type=Path, default=None, metavar="JSON",
                   help="re-render the table from an earlier run's layer_groups.json")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: policy:groups
    args = p.parse_args(argv)
    if args.quick and not args.one:
        args.num_requests, args.prompt_len, args.new_tokens = 4, 512, 16
    return args


def run_one(args) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import random

    from vllm import LLM, SamplingParams

    import vllm_kvcompress
    from kvc_tools.models import prepare_smollm2

    policy, groups = args.one.split(":")
    groups = int(groups)
    model = args.model or str(prepare_smollm2())
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, seed=0,
              enable_prefix_caching=False,  # repeated prompts: each computes its own prefill
              max_model_len=args.prompt_len + args.new_tokens + 16, disable_log_stats=True,
              kv_compress=policy, kv_compress_budget=args.budget, kv_compress_window=args.window,
              kv_compress_layer_groups=groups)
    core = llm.llm_engine.engine_core.engine_core
    timings = {"schedule": [], "execute": []}

    def timed(obj, name, key):
        original = getattr(obj, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                timings[key].append(time.perf_counter() - start)

        setattr(obj, name, wrapper)

    timed(core.scheduler, "schedule", "schedule")
    timed(core.model_executor, "execute_model", "execute")
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.prompt_len)]}
               for _ in range(args.num_requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    # Warm-up one token shorter: the memory figures below select requests by prompt length.
    llm.generate([{"prompt_token_ids": prompts[0]["prompt_token_ids"][1:]}], SamplingParams(max_tokens=2),
                 use_tqdm=False)
    runs = []  # (wall s, steps, mean schedule s, mean execute s) per repeat
    for _ in range(args.repeats):
        for v in timings.values():
            v.clear()
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        runs.append((time.perf_counter() - start, len(timings["schedule"]),
                     statistics.mean(timings["schedule"]), statistics.mean(timings["execute"])))
    wall, steps, schedule_s, execute_s = (statistics.median(col) for col in zip(*runs))
    steps = int(steps)
    stats = vllm_kvcompress.stats(llm)
    cfg = llm.llm_engine.vllm_config
    hf = cfg.model_config.hf_config
    layers = hf.num_hidden_layers
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    layer_block_bytes = 2 * hf.num_key_value_heads * head_dim * BLOCK_SIZE * 4
    finished = [r for r in stats["requests"].values() if r["finished"] and r["prefill_len"] == args.prompt_len]
    held = statistics.mean(r["blocks_held"] for r in finished)
    return dict(
        policy=policy, layer_groups=groups, wall_s=wall, repeats=args.repeats,
        out_tok_per_s=args.num_requests * args.new_tokens / wall,
        steps=steps, schedule_ms=1e3 * schedule_s, execute_ms=1e3 * execute_s,
        execute_ms_runs=[round(1e3 * r[3], 1) for r in runs],
        blocks_held=held, kv_mib_held=held * (layers // groups) * layer_block_bytes / 2**20,
        full_kv_mib=-(-(args.prompt_len + args.new_tokens - 1) // BLOCK_SIZE) * layers * layer_block_bytes / 2**20,
        tokens_kept_per_group=finished[-1]["tokens_kept_per_group"],
        total_blocks=stats["total_blocks"], layers=layers, layer_block_bytes=layer_block_bytes,
        new_tokens=args.new_tokens,
    )


def single_table_mib(r: dict) -> float:
    """What one shared block table would hold: every layer at the largest group's length."""
    longest = max(r["tokens_kept_per_group"]) + r["new_tokens"] - 1
    return -(-longest // BLOCK_SIZE) * r["layers"] * r["layer_block_bytes"] / 2**20


def report(args, results: list[dict], header: list[str]) -> str:
    base = results[0]
    lines = header + [
        "| policy | layer groups | KV blocks | steps | scheduler ms/step | forward ms/step | out tok/s "
        "| KV MiB held/request | one shared table would hold | vs uniform snapkv, 1 table | vs full KV |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['policy']} | {r['layer_groups']} | {r['total_blocks']} | {r['steps']} | {r['schedule_ms']:.2f} "
            f"| {r['execute_ms']:.1f} | {r['out_tok_per_s']:.1f} | {r['kv_mib_held']:.2f} "
            f"| {single_table_mib(r):.2f} | {r['kv_mib_held'] / base['kv_mib_held']:.2f} "
            f"| {r['kv_mib_held'] / r['full_kv_mib']:.3f} |")
    lines += ["", "forward ms/step of each run:", ""]
    lines += [f"- {r['policy']} x {r['layer_groups']}: {r.get('execute_ms_runs', '-')}" for r in results]
    lines += ["", "tokens kept per group (last request):", ""]
    lines += [f"- {r['policy']} x {r['layer_groups']}: {r['tokens_kept_per_group']}" for r in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if args.one:
        print(MARKER + json.dumps(run_one(args)), flush=True)
        return
    if args.report_only:
        data = json.loads(args.report_only.read_text())
        print(report(args, data["results"], data["header"]))
        return
    tiers = [int(t) for t in args.tiers.split(",") if t]
    configs = ([("snapkv", 1), ("snapkv", max(tiers))] + [("pyramidkv", g) for g in tiers]
               + [("adaptive", max(tiers)), ("adakv", max(tiers))])
    run = configs if args.configs is None else [
        (c.split(":")[0], int(c.split(":")[1])) for c in args.configs.split(",")]
    reused = {}
    if args.reuse:
        old = json.loads(args.reuse.read_text())
        reused = {(r["policy"], r["layer_groups"]): r for r in old["results"]}
    results = []
    started = time.time()
    for policy, groups in configs + [c for c in run if c not in configs]:
        if (policy, groups) not in run:
            if (policy, groups) in reused:
                results.append({**reused[(policy, groups)], "reused": True})
            continue
        cmd = [sys.executable, __file__, "--one", f"{policy}:{groups}",
               "--num-requests", str(args.num_requests), "--prompt-len", str(args.prompt_len),
               "--new-tokens", str(args.new_tokens), "--budget", str(args.budget), "--window", str(args.window),
               "--repeats", str(args.repeats)]
        cmd += ["--model", args.model] if args.model else []
        print(f"[{policy} layer_groups={groups}] running ...", flush=True)
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith(MARKER)), None)
        if line is None:
            sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
            raise SystemExit(f"{policy}:{groups} failed")
        results.append(json.loads(line[len(MARKER):]))
    header = [
        "# Per-layer KV cache groups: cost and memory", "",
        f"- command: `{' '.join([Path(sys.executable).name, 'benchmarks/layer_groups.py'] + sys.argv[1:])}`",
        f"- machine: {', '.join(f'{k} {v}' for k, v in machine_info().items())}",
        f"- {args.num_requests} requests x {args.prompt_len} prompt tokens + {args.new_tokens} new, "
        f"budget {args.budget} (mean per layer), window {args.window}; SmolLM2-135M fp32, block {BLOCK_SIZE}, "
        f"in-process engine core; times are medians of {args.repeats} runs per configuration; "
        f"{time.time() - started:.0f} s in all", "",
    ]
    if any(r.get("reused") for r in results):
        header[-1:-1] = [f"- rows reused from an earlier run ({args.reuse}): "
                         + ", ".join(f"{r['policy']}:{r['layer_groups']}" for r in results if r.get("reused"))]
    text = report(args, results, header)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "layer_groups.md").write_text(text)
    (args.out_dir / "layer_groups.json").write_text(json.dumps({"header": header, "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
