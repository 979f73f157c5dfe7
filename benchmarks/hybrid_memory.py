"""KV blocks a request holds on a hybrid model, per KV cache group, with and without compression.

On Gemma 3 (sliding-window layers beside full-attention ones) only the
full-attention layers compress; the sliding-window groups hold what vLLM's
own manager keeps (the window). For each prompt length, one request runs
uncompressed and one compressed (`--policy`, `--ratio`: 0.75 is 4x), with
prefix caching off (each request computes its own prompt); the
plugin's stats give the blocks each group held when the request finished.

    python benchmarks/hybrid_memory.py                       # Gemma 3 270M (scripts/gemma3_setup.sh)
    python benchmarks/hybrid_memory.py --lengths 1024,4096 --policy h2o

Writes benchmarks/results/hybrid_memory.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: prepare_gemma3_270m())")
    p.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens")
    p.add_argument("--policy", default="snapkv")
    p.add_argument("--ratio", type=float, default=0.75, help="compression_ratio (0.75 = 4x)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    sys.path.insert(0, str(ROOT))
    from vllm import LLM, SamplingParams

    import vllm_kvcompress
    from kvc_tools.models import prepare_gemma3_270m

    model = args.model or str(prepare_gemma3_270m())
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, seed=0,
              max_model_len=max(lengths) + args.new_tokens + BLOCK_SIZE, enable_prefix_caching=False,
              kv_compress="none")
    rng = random.Random(0)
    rows = []
    for length in lengths:
        prompt = [rng.randrange(1000, 200000) for _ in range(length)]
        held = {}
        for label, extra in (("full", None), ("compressed", {"policy": args.policy,
                                                             "compression_ratio": args.ratio})):
            params = SamplingParams(max_tokens=args.new_tokens, temperature=0, ignore_eos=True,
                                    extra_args=None if extra is None else {"kv_compress": extra})
            t0 = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            stats = vllm_kvcompress.stats(llm)
            record = [r for k, r in stats["requests"].items() if r["finished"]][-1]
            held[label] = dict(per_group=record["blocks_held_per_group"], seconds=time.perf_counter() - t0,
                               request=out.request_id)
        rows.append(dict(length=length, groups=stats["kv_cache_groups"], **held))
        print(json.dumps(rows[-1]), flush=True)
    llm.llm_engine.engine_core.shutdown()

    kinds = rows[0]["groups"]
    lines = [
        f"# KV blocks held per request by KV cache group: {Path(model).name}", "",
        f"- command: `python benchmarks/hybrid_memory.py {' '.join(argv or sys.argv[1:])}`",
        f"- machine: {machine_info()['cpu_model']}; vLLM CPU, float32, block size {BLOCK_SIZE}, "
        f"prefix caching off; {args.new_tokens} new tokens, greedy, ignore_eos; random prompt tokens",
        f"- compressed: {args.policy}, compression_ratio {args.ratio} ({1 / (1 - args.ratio):.3g}x); "
        f"only the full-attention groups compress", "",
        "| prompt | " + " | ".join(f"group {g} ({k})" for g, k in enumerate(kinds)) + " | total | vs full |",
        "|---|" + "---|" * (len(kinds) + 2),
    ]
    for r in rows:
        for label in ("full", "compressed"):
            per = r[label]["per_group"]
            ratio = sum(per) / sum(r["full"]["per_group"])
            lines.append(f"| {r['length']} {label} | " + " | ".join(map(str, per)) + f" | {sum(per)} | {ratio:.2f} |")
    text = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "hybrid_memory.md").write_text(text)
    (args.out_dir / "hybrid_memory.json").write_text(json.dumps(dict(model=model, rows=rows), indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
