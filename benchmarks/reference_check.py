"""Does the plain-torch reference decoder reproduce a quality run's generations?

Re-decodes the prompts of one task from a `quality.py` run with
`kvc_tools.reference_decoder.ReferenceDecoder` (same policy, kept fraction and
KV cache groups) and checks that its greedy text starts with what the engine
generated (the engine stops at the task's stop strings). A match says a score
is the method's behaviour on the model, not the plugin's.

    cd benchmarks && python reference_check.py results/quality-per-layer/quality_predictions.jsonl \\
        --policies adaptive,adakv,adakv:alpha=0.8 --kept 0.5 --task niah_single --layer-groups 30
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("predictions", type=Path, help="quality_predictions.jsonl of the run")
    p.add_argument("--policies", required=True, help="comma list of the run's policy labels")
    p.add_argument("--kept", type=float, required=True)
    p.add_argument("--task", required=True)
    p.add_argument("--length", type=int, default=1024, help="the run's --length")
    p.add_argument("--seed", type=int, default=0, help="the run's --seed")
    p.add_argument("--layer-groups", type=int, default=1, help="the run's --layer-groups")
    p.add_argument("--model", default=None)
    args = p.parse_args()

    from quality import kv_args  # benchmarks/quality.py
    from transformers import AutoTokenizer

    from kvc_tools import longctx
    from kvc_tools.models import prepare_smollm2
    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.config import KVCompressConfig

    rows = [json.loads(line) for line in args.predictions.read_text().splitlines()]
    model = args.model or str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    count_tokens, _ = longctx.make_token_counter(model)
    num_samples = 1 + max(r["index"] for r in rows if r["task"] == args.task)
    samples = longctx.generate_samples(args.task, args.length, num_samples, seed=args.seed,
                                       count_tokens=count_tokens)
    reference = ReferenceDecoder(model)
    mismatches = 0
    for policy in args.policies.split(","):
        config = KVCompressConfig.from_dict({**kv_args(policy, args.kept), "layer_groups": args.layer_groups})
        for row in rows:
            if (row["policy"], row["kept_fraction"], row["task"]) != (policy, args.kept, args.task):
                continue
            prompt = tokenizer(samples[row["index"]]["input"]).input_ids
            tokens = reference.generate(prompt, row["output_tokens"], config)["tokens"]
            text = tokenizer.decode(tokens)
            same = text.startswith(row["prediction"])
            mismatches += not same
            print(f"{policy} sample {row['index']}: {'same' if same else 'DIFFERENT'} "
                  f"engine {row['prediction'][:24]!r} reference {text[:24]!r}", flush=True)
    print(f"{mismatches} mismatch(es)")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
