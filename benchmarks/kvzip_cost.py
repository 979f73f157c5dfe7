"""What KVzip's repeat passes cost: tokens computed and time, against SnapKV and expected attention.

KVzip scores a prompt by passes that repeat it (scorers/kvzip.py): each pass
is a request of its own that computes the instruction and the prompt again
(the prompt's own blocks come from vLLM's prefix cache), and the request
waits for its passes before its second token. This runs `--requests` prompts
of `--length` tokens at once on one in-process engine (SmolLM2-135M-Instruct,
float32, prefix caching on, the cache emptied between settings), `--new-tokens`
each, for vanilla vLLM, snapkv-span, expected attention and kvzip at
`--ratio`, and reports per setting: the tokens the engine computed (every
scheduled token: prompts, repeat passes, decode), the wall time, and per
request the time to its first and to its second token (the first comes from
the prefill as in every setting; the second waits for the passes). Each
setting runs `--rounds` times in turn; medians with their range.

    python benchmarks/kvzip_cost.py                           # 8 x 1024 tokens, 3 rounds
    python benchmarks/kvzip_cost.py --length 2048 --requests 4
    python benchmarks/kvzip_cost.py --scoring                 # one layer's pass scoring against its attention

`--scoring` times, on one layer of SmolLM2's shapes (9 query heads, 3 KV
heads, head size 64), the scoring of one repeat pass of a `--length`-token
prompt (`paged_repeat_scores`) beside torch's `scaled_dot_product_attention`
of the same queries over the same keys (what the pass's attention computes),
seven times each, medians and ranges.

Writes benchmarks/results/kvzip_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
RESULTS = HERE / "results"

SETTINGS = {
    "vanilla": None,
    "snapkv-span": {"policy": "snapkv-span"},
    "expected_attention": {"policy": "expected_attention"},
    "kvzip": {"policy": "kvzip"},
}


def _spread(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def run_setting(llm, prompts: list[list[int]], override: dict | None, new_tokens: int) -> dict:
    from vllm import SamplingParams

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    computed = [0]
    original = scheduler.schedule

    def counted(*a, **k):
        out = original(*a, **k)
        computed[0] += out.total_num_scheduled_tokens
        return out

    scheduler.schedule = counted
    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True,
                            extra_args=None if override is None else {"kv_compress": override})
    begin = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    first: dict[str, float] = {}
    second: dict[str, float] = {}
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                now = time.perf_counter() - begin
                if n >= 1:
                    first.setdefault(out.request_id, now)
                if n >= 2:
                    second.setdefault(out.request_id, now)
    finally:
        scheduler.schedule = original
    wall = time.perf_counter() - begin
    return {"tokens_computed": computed[0], "wall_s": wall,
            "first_token_s": statistics.median(first.values()), "second_token_s": statistics.median(second.values())}


def time_scoring(length: int) -> str:
    import torch

    from vllm_kvcompress.scorers.kvzip import RepeatPass, paged_repeat_scores

    torch.manual_seed(0)
    n, q_heads, kv_heads, head_dim, block = length + 14, 9, 3, 64, 32  # a pass: instruction, suffix, the prompt
    rp = RepeatPass(length, 0, length, 4, tuple(range(n)))
    total = length + n
    blocks = -(-total // block)
    cache = torch.randn(blocks, block, kv_heads, head_dim)
    query, slots = torch.randn(n, q_heads, head_dim), torch.arange(length, length + n)
    keys = cache.reshape(-1, kv_heads, head_dim)[:total].permute(1, 0, 2).repeat_interleave(q_heads // kv_heads, 0)
    mask = torch.ones(n, total, dtype=torch.bool).tril(length)
    scoring, attention = [], []
    for _ in range(7):
        t = time.perf_counter()
        paged_repeat_scores(query, cache, torch.arange(blocks), slots, total - 1, rp, head_dim ** -0.5)
        scoring.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1), keys, keys, attn_mask=mask)
        attention.append(time.perf_counter() - t)
    return (f"one layer, a pass of {n} queries over {total} keys (torch threads: {torch.get_num_threads()}): "
            f"scoring {_spread(scoring, '.3f')} s, attention {_spread(attention, '.3f')} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--ratio", type=float, default=0.875)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "kvzip_cost"))
    ap.add_argument("--scoring", action="store_true", help="time one layer's pass scoring and attention only")
    args = ap.parse_args()
    if args.scoring:
        print(time_scoring(args.length))
        return
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the scheduler in this process
    from vllm import LLM

    import vllm_kvcompress  # noqa: F401
    from kvc_tools.models import default_smollm2_dir

    model = str(default_smollm2_dir())
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=32, seed=0, enable_prefix_caching=True,
              max_model_len=2 * args.length + 256, max_num_seqs=max(2 * args.requests, 16),
              gpu_memory_utilization=0.3, kv_compress="none", disable_log_stats=True)
    rng = random.Random(0)
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for rnd in range(args.rounds):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.length)] for _ in range(args.requests)]
        for name, setting in SETTINGS.items():
            override = None if setting is None else {**setting, "compression_ratio": args.ratio}
            results[name].append(run_setting(llm, prompts, override, args.new_tokens))
            print(rnd, name, results[name][-1], flush=True)
    vanilla = results["vanilla"]
    lines = [f"# KVzip's cost: {args.requests} prompts of {args.length} tokens at once, {args.new_tokens} new "
             f"tokens, ratio {args.ratio}", "",
             f"`python benchmarks/kvzip_cost.py --requests {args.requests} --length {args.length} "
             f"--new-tokens {args.new_tokens} --ratio {args.ratio} --rounds {args.rounds}` "
             f"(SmolLM2-135M-Instruct, float32, vLLM CPU, prefix caching on). Medians over {args.rounds} rounds "
             "(range).", "",
             "| setting | tokens computed | vs vanilla | wall (s) | vs vanilla | first token (s, median request) "
             "| second token (s, median request) |", "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        tokens = [r["tokens_computed"] for r in runs]
        wall_ratio = [r["wall_s"] / v["wall_s"] for r, v in zip(runs, vanilla)]
        token_ratio = [r["tokens_computed"] / v["tokens_computed"] for r, v in zip(runs, vanilla)]
        lines.append(f"| {name} | {statistics.median(tokens):.0f} | {_spread(token_ratio, '.2f')}x | "
                     f"{_spread([r['wall_s'] for r in runs], '.1f')} | {_spread(wall_ratio, '.2f')}x | "
                     f"{_spread([r['first_token_s'] for r in runs], '.2f')} | "
                     f"{_spread([r['second_token_s'] for r in runs], '.2f')} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
