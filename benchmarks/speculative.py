"""Speculative decoding (n-gram lookup, a draft model) with and without compression: tokens/s and acceptance.

A workload where n-gram drafts are worth something: each prompt holds a list of
items and asks for it back, so the answer copies the prompt (SmolLM2-135M-Instruct,
greedy, ``ignore_eos``). Each configuration runs without speculation and with
each proposer of ``--proposers``: ``ngram`` (``{"method": "ngram",
"num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 2}``)
and ``draft_model`` (SmolLM2 cut to its first ``--draft-layers`` layers,
``kvc_tools.models.prepare_smollm2_draft``, drafting K tokens; with compression
its cache keeps the target's kept positions), each in its own subprocess (one
engine per process, its core in it: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), prefix
caching off, the KV cache large enough for every request (this measures
speculation, not memory). Reported per configuration: output tokens/s of the timed
generate (startup and a warmup excluded; median and range over ``--repeats``),
vLLM's acceptance counters (accepted / drafted tokens, and accepted tokens per
draft), and whether speculation left every request's tokens as they were without
it (it must: tests/test_speculative.py).

    python benchmarks/speculative.py                # ~20 min on 2 idle cores
    python benchmarks/speculative.py --repeats 3 --num-requests 32
    python benchmarks/speculative.py --runner mrv2 --repeats 1 --num-requests 8 --configs vanilla,snapkv

``--runner mrv2`` runs vLLM's Model Runner V2 (on CPU through the test-only
Triton stub and Triton's interpreter, ``kvc_tools/runners.py``): its acceptance
and tokens compare with the V1 runner's; its tokens/s on CPU do not (the
interpreter runs MRV2's kernels).

Writes ``benchmarks/results/speculative.md`` and ``.json`` (with the machine and
the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {
    "vanilla": None,
    "snapkv": {"policy": "snapkv", "budget": 96},
    "h2o": {"policy": "h2o", "budget": 96, "interval": 16},
}


def list_prompts(tokenizer, count: int, items: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    words = "apple banana cherry grape lemon mango orange peach pear plum melon kiwi lime fig date".split()
    prompts = []
    for _ in range(count):
        chosen = [f"{rng.choice(words)} {rng.randrange(100)}" for _ in range(items)]
        text = f"Here is a list: {', '.join(chosen)}.\nRepeat the list exactly: {', '.join(chosen[:2])}"
        prompts.append(tokenizer(text).input_ids)
    return prompts


def run_one(args) -> dict:
    """One configuration, one engine, in this process."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.v1.metrics.reader import Counter

    import vllm_kvcompress  # noqa: F401

    config = CONFIGS[args.one]
    spec = None
    if args.proposer == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens, "prompt_lookup_max": 3,
                "prompt_lookup_min": 2}
    elif args.proposer == "draft_model":
        from kvc_tools.models import prepare_smollm2_draft

        spec = {"model": str(prepare_smollm2_draft(args.draft_layers)),
                "num_speculative_tokens": args.num_speculative_tokens}
    kwargs = dict(model=args.model, dtype="float32", enforce_eager=True, block_size=32, max_model_len=2048, seed=0,
                  enable_prefix_caching=False, disable_log_stats=False, speculative_config=spec)
    if config is not None:
        kwargs["kv_compress"] = config
    llm = LLM(**kwargs)
    prompts = list_prompts(AutoTokenizer.from_pretrained(args.model), args.num_requests, args.items, args.seed)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warmup

    def counters() -> dict[str, float]:
        return {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
                if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode_")}

    runs = []
    for _ in range(args.repeats):
        before = counters()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = counters()
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        runs.append({"wall_s": wall, "output_tokens": sum(map(len, tokens)),
                     **{k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens",
                                                                       "num_accepted_tokens")}})
    return {"config": args.one, "proposer": args.proposer, "runs": runs, "tokens": tokens,
            "prompt_lens": [len(p) for p in prompts]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of: {', '.join(CONFIGS)}")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--items", type=int, default=60, help="list items per prompt")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--proposers", default="ngram,draft_model", help="comma list of: ngram, draft_model")
    p.add_argument("--draft-layers", type=int, default=26, help="the draft model: SmolLM2's first N layers")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runner", choices=("v1", "mrv2"), default="v1", help="vLLM's model runner (default: V1)")
    p.add_argument("--model", default=None, help="model folder (default: prepare_smollm2())")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--one", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--proposer", default="off", help=argparse.SUPPRESS)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from kvc_tools.models import prepare_smollm2

        args.model = str(prepare_smollm2())
    if args.one:
        print("RESULT " + json.dumps(run_one(args)))
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import machine_info

    from kvc_tools.runners import runner_env

    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **runner_env(args.runner)}
    forwarded = ["--num-requests", str(args.num_requests), "--items", str(args.items), "--new-tokens",
                 str(args.new_tokens), "--num-speculative-tokens", str(args.num_speculative_tokens), "--repeats",
                 str(args.repeats), "--seed", str(args.seed), "--model", args.model, "--draft-layers",
                 str(args.draft_layers)]
    results = []
    for name in args.configs.split(","):
        for proposer in ("off", *args.proposers.split(",")):
            cmd = [sys.executable, __file__, "--one", name, *forwarded, "--proposer", proposer]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{name} (proposer {proposer}) failed:\n{out.stderr[-3000:]}")
            results.append(json.loads(line[len("RESULT "):]))
            print(f"{name} proposer={proposer}: done", file=sys.stderr)

    rows = []
    for r in results:
        plain = next(x for x in results if x["config"] == r["config"] and x["proposer"] == "off")
        rates = [run["output_tokens"] / run["wall_s"] for run in r["runs"]]
        last = r["runs"][-1]
        drafted, accepted = last["num_draft_tokens"], last["num_accepted_tokens"]
        rows.append({
            "config": r["config"], "proposer": r["proposer"],
            "tok_s_median": statistics.median(rates), "tok_s_min": min(rates), "tok_s_max": max(rates),
            "acceptance": accepted / drafted if drafted else None,
            "accepted_per_draft": accepted / last["num_drafts"] if last["num_drafts"] else None,
            "same_tokens_as_without": r["tokens"] == plain["tokens"],
        })
    machine = machine_info()
    lines = [
        "# Speculative decoding (n-gram, a draft model) with and without compression",
        "",
        f"`{' '.join(['python', 'benchmarks/speculative.py', *sys.argv[1:]])}` on {machine.get('cpu_model')} "
        f"({machine.get('usable_cpus')} cores); "
        f"SmolLM2-135M-Instruct float32, {args.num_requests} requests (prompts "
        f"{min(results[0]['prompt_lens'])}-{max(results[0]['prompt_lens'])} tokens, lists of {args.items} items), "
        f"{args.new_tokens} new tokens, greedy; drafts of {args.num_speculative_tokens} tokens (n-gram; "
        f"draft model: SmolLM2's first {args.draft_layers} of 30 layers); "
        f"{args.repeats} timed runs per row (median, range); {args.runner.upper()} model runner"
        + (" (CPU: Triton's interpreter runs its kernels, so its tokens/s are not comparable)."
           if args.runner == "mrv2" else "."),
        "",
        "| config | speculation | output tok/s (median, range) | acceptance (accepted / drafted) | "
        "accepted per draft | tokens as without speculation |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        config = CONFIGS[row["config"]]
        name = "vanilla" if config is None else ", ".join(f"{k} {v}" for k, v in config.items())
        acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
        per = "-" if row["accepted_per_draft"] is None else f"{row['accepted_per_draft']:.2f}"
        lines.append(f"| {name} | {row['proposer']} | {row['tok_s_median']:.1f} "
                     f"({row['tok_s_min']:.1f}-{row['tok_s_max']:.1f}) | {acc} | {per} | "
                     f"{'yes' if row['same_tokens_as_without'] else 'NO'} |")
    table = "\n".join(lines) + "\n"
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "speculative.md").write_text(table)
    (args.out_dir / "speculative.json").write_text(json.dumps(
        {"machine": machine, "argv": sys.argv, "rows": rows,
         "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in results]}, indent=1))


if __name__ == "__main__":
    main()
