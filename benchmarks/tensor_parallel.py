"""Tensor parallelism: TP=2 against TP=1, plugin against vanilla, same KV memory per rank.

A seeded random Llama with 4 KV heads (2 per rank at TP=2; SmolLM2-135M has 3
KV heads, which 2 ranks cannot split) serves the same batch of long prompts
in each configuration, each in a fresh engine started in its own process:

    python benchmarks/tensor_parallel.py                 # 2 repeats, 12 x 1024-token prompts, 64 new tokens
    python benchmarks/tensor_parallel.py --repeats 3 --requests 16

On CPU each rank is bound to its own core (VLLM_CPU_OMP_THREADS_BIND="0|1"
at TP=2); TP=1 uses the default binding. VLLM_CPU_KVCACHE_SPACE (GiB per
rank) is the same in every configuration. Reports wall time, output tokens
per second, the plugin's tokens evicted and blocks freed, and the peak of
running requests, as medians over the repeats with every run listed; writes
benchmarks/results/tensor_parallel.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))


def run_one(conn, model: str, tp: int, plugin: bool, args) -> None:
    """In a fresh process: start the engine, time the batch, report."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_space_gib)
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i) for i in range(tp))
    import random

    from vllm import LLM, SamplingParams

    import vllm_kvcompress

    kwargs = dict(model=model, dtype="float32", enforce_eager=True, block_size=32, seed=0,
                  max_model_len=args.prompt_len + args.new_tokens + 32, tensor_parallel_size=tp,
                  distributed_executor_backend="mp" if tp > 1 else None)
    if plugin:
        kwargs.update(kv_compress="snapkv", kv_compress_ratio=args.ratio, kv_compress_window=16)
    llm = LLM(**kwargs)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 2000) for _ in range(args.prompt_len)]}
               for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = vllm_kvcompress.stats(llm) if plugin else {}
    conn.send({"wall_s": wall, "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
               "tokens_evicted": stats.get("tokens_evicted", 0), "blocks_freed": stats.get("blocks_freed", 0),
               "total_blocks": stats.get("total_blocks")})
    llm.llm_engine.engine_core.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--ratio", type=float, default=0.75, help="the plugin's compression_ratio (snapkv)")
    p.add_argument("--kv-space-gib", type=int, default=1, help="KV cache per rank (GiB, whole)")
    p.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel.md")
    args = p.parse_args()

    from kvc_tools.models import build_tiny_llama, default_cache_root

    model = str(build_tiny_llama(default_cache_root() / "models" / "tiny-llama-bench-4kv", seed=2, num_layers=8,
                                 hidden_size=512, num_heads=8, num_kv_heads=4, head_dim=64,
                                 intermediate_size=1536))
    ctx = mp.get_context("spawn")
    rows = {}
    for tp in (1, 2):
        for plugin in (False, True):
            runs = []
            for _ in range(args.repeats):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=run_one, args=(child, model, tp, plugin, args))
                proc.start()
                runs.append(parent.recv())
                proc.join()
            rows[(tp, plugin)] = runs
            print(f"TP={tp} {'plugin' if plugin else 'vanilla'}: {json.dumps(runs)}", flush=True)
    m = machine_info()
    lines = [
        "# Tensor parallelism: TP=2 vs TP=1, plugin vs vanilla",
        "",
        f"- command: `python benchmarks/tensor_parallel.py --repeats {args.repeats} --requests {args.requests} "
        f"--prompt-len {args.prompt_len} --new-tokens {args.new_tokens} --ratio {args.ratio} "
        f"--kv-space-gib {args.kv_space_gib}`",
        f"- machine: {m.get('cpu_model')}, {m.get('usable_cpus')} usable CPUs, {m.get('mem_gib')} GiB RAM",
        "- model: seeded random Llama, 8 layers, hidden 512, 8 query / 4 KV heads, float32, block 32",
        f"- workload: {args.requests} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens each, "
        f"greedy; plugin: snapkv, compression_ratio {args.ratio}, window 16; KV cache "
        f"{args.kv_space_gib} GiB per rank in every configuration; TP=2 binds one core per rank",
        f"- medians over {args.repeats} runs (each run in brackets); a warm-up request excluded",
        "",
        "| TP | KV compression | wall s | out tok/s | tokens evicted | blocks freed |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for (tp, plugin), runs in rows.items():
        def med(key, runs=runs):
            return statistics.median(r[key] for r in runs)
        each = ", ".join(f"{r['out_tok_s']:.1f}" for r in runs)
        lines.append(f"| {tp} | {'snapkv' if plugin else 'none (vanilla)'} | {med('wall_s'):.1f} | "
                     f"{med('out_tok_s'):.1f} [{each}] | {med('tokens_evicted'):.0f} | {med('blocks_freed'):.0f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
