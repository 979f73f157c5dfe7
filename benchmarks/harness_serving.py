"""Serving at the same KV memory, compressed and not, on the GPU harness (no vLLM).

vLLM's CUDA build cannot be installed on the GPU machine this project borrows,
so this decodes with `kvc_tools.paged_decoder` at serving scale instead: a
random-weight Llama of a real attention shape (Llama-3.1-8B's 32 query and 8
KV heads of 128, fewer layers), the plugin's worker code doing the
compression, vLLM's FLASH_ATTN cache layout, and a pool of KV blocks shared by
every setting. Requests are admitted in order while the blocks they may still
need fit the pool (a compressed request's bound comes from its plan; after
its prompt it needs only its budget), prompts are chunked to a token budget
per step, as vLLM schedules them. Compression lets more requests decode at
once in the same memory; this measures what that buys and what it costs:

- tokens/s over the whole run (prompts included) and in decode-only steps;
- the decode step split into attention (the model's kernel), the plugin's
  hooks after it (fused decode attention + scores, observation), compaction
  (the step's selections and `compact_kv_batched`) and the rest (projections,
  MLP, sampling), the device synchronised around each part;
- most requests running at once, and peak device memory (CUDA).

    python benchmarks/harness_serving.py                 # GPU sizes: 64 requests x 8k context, 4 layers, bf16
    python benchmarks/harness_serving.py --smoke         # toy sizes on CPU (CI runs this)

Settings: `none` (uncompressed), `snapkv-span` (kept 1/8 at prompt end, span
selection) and `h2o` (kept 1/8, rolling every 32 tokens). Prints a Markdown
table (written to --out when given) and JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvc_tools.paged_decoder import PagedDecoder, StepTimes, random_llama  # noqa: E402
from vllm_kvcompress.config import KVCompressConfig  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMOKE = dict(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256, requests=6,
             context=256, new_tokens=8, block_size=16, concurrent=2, max_batched_tokens=512, dtype="fp32")


def settings(context: int, names: list[str]) -> dict[str, KVCompressConfig | None]:
    """The compared settings at a kept fraction of 1/8 of the context."""
    budget = max(context // 8, 16)
    every = {
        "none": None,
        "snapkv-span": KVCompressConfig.from_dict({"policy": "snapkv", "selection": "span", "budget": budget,
                                                    "window": 32}),
        "h2o": KVCompressConfig.from_dict({"policy": "h2o", "budget": budget, "interval": 32}),
    }
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"--settings: unknown {unknown}; valid values: {sorted(every)}")
    return {name: every[name] for name in names}


def run_setting(decoder: PagedDecoder, prompts, new_tokens: int, config, max_batched_tokens: int) -> dict:
    device = decoder.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = StepTimes()
    start = time.perf_counter()
    out = decoder.generate(prompts, new_tokens, config, max_batched_tokens=max_batched_tokens, times=times)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    sec, cnt = times.seconds, times.counts
    decode_steps = cnt.get("decode_steps", 0)
    decode_time = sec.get("decode_step", 0.0)
    # Attention, hooks and compaction are timed in every step: their split is a
    # mean over all steps (prompt steps included), as the table says.
    steps = max(cnt.get("steps", 0), 1)
    row = {
        "requests": len(prompts),
        "new_tokens": new_tokens * len(prompts),
        "wall_s": wall,
        "tokens_per_s": new_tokens * len(prompts) / wall,
        "decode_steps": decode_steps,
        "decode_tokens_per_s": cnt.get("decode_tokens", 0) / decode_time if decode_time else None,
        "decode_step_ms": 1e3 * decode_time / decode_steps if decode_steps else None,
        "attention_ms_per_step": 1e3 * sec.get("attention", 0.0) / steps,
        "hooks_ms_per_step": 1e3 * sec.get("hooks", 0.0) / steps,
        "compaction_ms_per_step": 1e3 * sec.get("compaction", 0.0) / steps,
        "steps": cnt.get("steps", 0),
        "most_running": cnt.get("most_running", 0),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "blocks_at_end": sum(sum(r["blocks"]) for r in out),
    }
    return row


def fmt(value, digits=2):
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def render(rows: dict[str, dict], meta: dict) -> str:
    lines = [
        f"# Serving on the GPU harness at the same KV memory ({meta['device']})",
        "",
        f"- model: random Llama, {meta['layers']} layers, hidden {meta['hidden']}, {meta['heads']} query / "
        f"{meta['kv_heads']} KV heads of {meta['head_dim']}, {meta['dtype']}; block size {meta['block_size']}",
        f"- {meta['requests']} requests x {meta['context']}-token prompts, {meta['new_tokens']} new tokens each; "
        f"KV pool {meta['pool_blocks']} blocks per layer group = {meta['concurrent']} uncompressed requests; "
        f"prompt tokens per step <= {meta['max_batched_tokens']}",
        f"- machine: {meta['machine']}; torch {meta['torch']}; command: `{meta['command']}`",
        "- per-step parts: mean over all steps (prompt steps included), the device synchronised around each",
        "",
        "| setting | tokens/s | decode tokens/s | decode step ms | attention ms | hooks ms | compaction ms "
        "| most running | peak GiB | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {fmt(r['tokens_per_s'], 1)} | {fmt(r['decode_tokens_per_s'], 1)} | "
            f"{fmt(r['decode_step_ms'])} | {fmt(r['attention_ms_per_step'])} | {fmt(r['hooks_ms_per_step'])} | "
            f"{fmt(r['compaction_ms_per_step'])} | {r['most_running']} | {fmt(r['peak_memory_gib'])} | "
            f"{fmt(r['wall_s'], 1)} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="toy sizes (CPU, CI); other size flags are ignored")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--concurrent", type=int, default=8,
                   help="the KV pool holds this many uncompressed requests (prompt + new tokens)")
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--settings", default="none,snapkv-span,h2o")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the Markdown table here (and .json beside it)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    from machine import machine_info

    chosen = settings(args.context, args.settings.split(","))
    cfg, weights = random_llama(seed=args.seed, std=0.02, vocab_size=args.vocab, hidden_size=args.hidden,
                                intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                head_dim=args.head_dim)
    per_request = -(-(args.context + args.new_tokens) // args.block_size)
    pool = args.concurrent * per_request
    decoder = PagedDecoder(cfg, weights, device=args.device, dtype=DTYPES[args.dtype], block_size=args.block_size,
                           num_blocks=pool)
    del weights
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, args.vocab, (args.context,), generator=gen).tolist() for _ in range(args.requests)]
    rows = {}
    for name, config in chosen.items():
        rows[name] = run_setting(decoder, prompts, args.new_tokens, config, args.max_batched_tokens)
        print(name, json.dumps(rows[name], default=str), flush=True)
    info = machine_info()
    meta = dict(device=str(decoder.device) + (f" {torch.cuda.get_device_name(decoder.device)}"
                                              if decoder.device.type == "cuda" else ""),
                layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                head_dim=args.head_dim, dtype=args.dtype, block_size=args.block_size, requests=args.requests,
                context=args.context, new_tokens=args.new_tokens, pool_blocks=pool, concurrent=args.concurrent,
                max_batched_tokens=args.max_batched_tokens, torch=torch.__version__,
                machine=f"{info.get('cpu_model')}, {info.get('os_cpu_count')} CPUs",
                command="python benchmarks/harness_serving.py " + " ".join(sys.argv[1:] if argv is None else argv))
    table = render(rows, meta)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
