"""MiniCache: KV memory per request and output speed, against snapkv alone at the same kept tokens.

One engine (in-process engine core, one KV cache group per layer, SmolLM2-135M
fp32); each configuration is a per-request `extra_args` choice, timed on its
own `llm.generate` call (medians of --repeats):

    full KV                    no compression
    snapkv                     budget B per layer
    snapkv + minicache         the same B tokens per layer, then pairs merged
    minicache                  nothing evicted, pairs merged

Memory a request holds when it finishes, from the plugin's stats: blocks per
KV cache group x the bytes of one layer's block, plus, for merged pairs, the
per-token side tables the worker keeps (per KV head, for K and for V: a
retained-slot index, int64, and a norm ratio, float32).

    python benchmarks/minicache.py                # 16 x 1024 + 64, budget 256
    python benchmarks/minicache.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK_SIZE = 32
SIDE_BYTES = 8 + 4  # per merged token, KV head and tensor: slot index (int64) + norm ratio (float32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--retain-ratio", type=float, default=0.05)
    p.add_argument("--start-layer", type=int, default=-1, help="first layer of the first pair (-1: half the depth)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="4 requests x 512 + 16, 1 repeat (smoke test)")
    p.add_argument("--model", default=None)
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.new_tokens, args.budget, args.repeats = 4, 512, 16, 128, 1
    return args


def main() -> None:
    args = parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import random

    from vllm import LLM, SamplingParams

    import vllm_kvcompress
    from kvc_tools.models import prepare_smollm2
    from vllm_kvcompress.merge import MiniCache

    model = args.model or str(prepare_smollm2())
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model)
    layers, heads = hf.num_hidden_layers, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    layer_block_bytes = 2 * heads * head_dim * BLOCK_SIZE * 4
    started = time.time()
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, seed=0,
              enable_prefix_caching=False, max_model_len=args.prompt_len + args.new_tokens + 16,
              disable_log_stats=True, kv_compress="none", kv_compress_layer_groups=layers)
    rng = random.Random(0)
    snap = {"policy": "snapkv", "budget": args.budget, "window": args.window}
    merge = {"merge": "minicache", "retain_ratio": args.retain_ratio, "start_layer": args.start_layer}
    configs = [("full KV", None), ("snapkv", snap), ("snapkv + minicache", {**snap, **merge}),
               ("minicache", {"policy": "minicache", "retain_ratio": args.retain_ratio,
                              "start_layer": args.start_layer})]
    pairs = MiniCache(start_layer=args.start_layer).pairs(layers)
    rows = []
    for c, (label, config) in enumerate(configs):
        # Prompt lengths tell the configurations' requests apart in the stats.
        length = args.prompt_len - c
        prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(length)]}
                   for _ in range(args.num_requests)]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True,
                                extra_args=None if config is None else {"kv_compress": config})
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, extra_args=params.extra_args), use_tqdm=False)
        walls = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            walls.append(time.perf_counter() - start)
        stats = vllm_kvcompress.stats(llm)
        done = [r for r in stats["requests"].values() if r["finished"] and r["prefill_len"] == length]
        if config is None:  # uncompressed requests are not in the plugin's stats
            blocks = -(-(length + args.new_tokens - 1) // BLOCK_SIZE) * layers
        else:
            blocks = statistics.mean(r["blocks_held"] for r in done)
        merged = config is not None and ("merge" in config or config["policy"] == "minicache")
        # A merged pair's tokens: its lower layer's (the largest group length).
        side = len(pairs) * 2 * heads * max(done[-1]["tokens_kept_per_group"]) * SIDE_BYTES if merged else 0
        wall = statistics.median(walls)
        rows.append(dict(label=label, config=config, prompt_len=length, blocks=blocks,
                         kv_mib=(blocks * layer_block_bytes + side) / 2**20, side_mib=side / 2**20,
                         tokens_kept_per_group=done[-1]["tokens_kept_per_group"] if done else None,
                         wall_s=wall, walls=[round(w, 2) for w in walls],
                         out_tok_per_s=args.num_requests * args.new_tokens / wall))
        print(f"{label}: {rows[-1]['kv_mib']:.2f} MiB/request, {rows[-1]['out_tok_per_s']:.1f} tok/s {walls}",
              flush=True)
    token_bytes = 2 * heads * head_dim * 4  # one layer, K and V, fp32
    pair_bytes = token_bytes * (1 + args.retain_ratio) + 2 * heads * SIDE_BYTES
    header = [
        "# MiniCache: memory and speed", "",
        f"- command: `{' '.join([Path(sys.executable).name, 'benchmarks/minicache.py'] + sys.argv[1:])}`",
        f"- machine: {', '.join(f'{k} {v}' for k, v in machine_info().items())}",
        f"- {args.num_requests} requests x {args.prompt_len} prompt tokens + {args.new_tokens} new, snapkv budget "
        f"{args.budget} per layer, window {args.window}, minicache retain_ratio {args.retain_ratio}, t 0.6, "
        f"pairs {pairs[0]}..{pairs[-1]} ({len(pairs)} of {layers} layers' pairs); SmolLM2-135M fp32, block "
        f"{BLOCK_SIZE}, one KV cache group per layer, in-process engine core; wall times are medians of "
        f"{args.repeats} runs per configuration; {time.time() - started:.0f} s in all",
        f"- bytes per token of one layer (K+V, fp32): {token_bytes}; of a merged pair: {pair_bytes:.0f} "
        f"(lower layer {token_bytes}, upper layer {args.retain_ratio:g} x {token_bytes} in retained slots, "
        f"side tables {2 * heads * SIDE_BYTES}) instead of {2 * token_bytes}", "",
    ]
    base = next(r for r in rows if r["label"] == "full KV")
    lines = header + ["| configuration | KV blocks held/request | KV MiB/request (side tables) | vs full KV "
                      "| out tok/s | runs (s) |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['blocks']:.0f} | {r['kv_mib']:.2f} ({r['side_mib']:.3f}) "
                     f"| {r['kv_mib'] / base['kv_mib']:.3f} | {r['out_tok_per_s']:.1f} | {r['walls']} |")
    text = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "minicache.md").write_text(text)
    (args.out_dir / "minicache.json").write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
