"""One compaction step: R requests x L layers x T cached tokens, selected and compacted.

What the worker does when the scheduler's step plan names R requests in its
compactions (`vllm_seam/worker/compaction.compact_requests`), without vLLM:
per layer, each request scored (`RequestTokens.to_select`: its scorer's
`score()` on the accumulated scores), one selection over all of them (the
allocation's `select_batch`: protection, the selection modifier, the top-k
and the hole-filling order on a padded [R, Hkv, T] batch), one
`compact_kv_batched` op for all of them, and the bookkeeping
(`keep_selected`). `--per-request` selects one request at a time instead
(the path before the batched selection, one small selection per request
and layer). The cache has vLLM 0.32's FLASH_ATTN shape; on CUDA it is
timed with CUDA events after a warm-up (and counts the host reads through
`host_reads`, when the checked-out code has it), on CPU with wall time.

Only the APIs both the per-request host path (before issue 29) and the device
path share are used, so the same script times either checkout:

    python benchmarks/compaction.py                          # h2o, R 16, L 8, T 2048, 3 repeats
    python benchmarks/compaction.py --per-request            # the same, one request's selection at a time
    python benchmarks/compaction.py --policy snapkv --requests 64 --layers 32 --tokens 8192 --device cuda
    git worktree add /tmp/before <rev> && PYTHONPATH=/tmp/before python /tmp/before/benchmarks/compaction.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

from vllm_kvcompress.config import KVCompressConfig  # noqa: E402
from vllm_kvcompress.kernels import get_ops  # noqa: E402
from vllm_kvcompress.plan import resolve_plan  # noqa: E402
from vllm_kvcompress.token_state import RequestTokens  # noqa: E402

BLOCK = 16


def step(args, device: torch.device, seed: int) -> tuple[float, int]:
    """Seconds of one compaction step (the states and cache built before the clock starts), and host reads."""
    gen = torch.Generator().manual_seed(seed)
    config = KVCompressConfig.from_dict({"policy": args.policy, "budget": args.budget})
    hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
    blocks_per = -(-args.tokens // BLOCK)
    cache = torch.randn(args.requests * blocks_per, 2, BLOCK, hkv, d, generator=gen).to(device, torch.float16)
    keys, values = cache[:, 0], cache[:, 1]
    tables = torch.arange(args.requests * blocks_per, device=device).view(args.requests, blocks_per)
    states = []
    for _ in range(args.requests):
        plan = resolve_plan(config, args.tokens, args.layers, BLOCK)
        state = RequestTokens(plan, args.layers, hkv, hq, device=device)
        state.append(torch.arange(args.tokens))
        if state.scorer.observe.attends():
            for layer in range(args.layers):
                state.accumulate(layer, torch.rand(hq, args.tokens, generator=gen).to(device))
        states.append(state)
    ops = get_ops(device.type)
    keep = states[0].plan.protected_len + states[0].plan.layer_budgets[0]
    counts = torch.full((args.requests, hkv), keep, dtype=torch.int64, device=device)
    try:
        from vllm_kvcompress import host_reads
        reads_before = sum(host_reads.COUNTS.values())
    except ImportError:  # the checkout before host_reads: its reads were not counted
        host_reads, reads_before = None, 0
    if device.type == "cuda":
        torch.cuda.synchronize()
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
    begin = time.perf_counter()
    batched = not args.per_request and hasattr(RequestTokens, "to_select")
    for layer in range(args.layers):
        if batched:  # the worker's way: one selection over every request of the layer
            pending = [s.to_select(layer, keep) for s in states]
            rows = [p for p in pending if p is not None]
            picked = iter(states[0].plan.allocation.select_batch(rows) if rows else [])
            kept = [s.take_selection(layer, keep, None if p is None else next(picked))
                    for s, p in zip(states, pending)]
        else:  # one request at a time
            kept = [s.select(layer, keep) for s in states]
        keep_idx = torch.stack([k.to(device) for k in kept])
        ops.compact_kv_batched(keys, values, tables, keep_idx, counts)
        for s, k in zip(states, kept):
            s.keep_selected(layer, k)
    for s in states:
        s.finish_compaction()
    if device.type == "cuda":
        end_event.record()
        torch.cuda.synchronize()
        seconds = start_event.elapsed_time(end_event) / 1000.0
    else:
        seconds = time.perf_counter() - begin
    reads = sum(host_reads.COUNTS.values()) - reads_before if host_reads else -1
    return seconds, reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--per-request", action="store_true",
                        help="select one request at a time (as before the batched selection) instead of one batch "
                             "per layer")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    step(args, device, seed=0)  # warm-up (allocator, Triton compilation)
    runs = [step(args, device, seed=1 + r) for r in range(args.repeats)]
    seconds = [s for s, _ in runs]
    result = {
        "policy": args.policy, "requests": args.requests, "layers": args.layers, "tokens": args.tokens,
        "budget": args.budget, "heads": [args.q_heads, args.kv_heads, args.head_dim], "device": args.device,
        "selection": "per request" if args.per_request else "batched per layer",
        "seconds": seconds, "median_s": statistics.median(seconds),
        "spread_s": [min(seconds), max(seconds)], "host_reads_per_step": runs[-1][1],
        "machine": machine_info(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
