"""Which answer tokens a policy keeps: a trace with the reference decoder.

    python benchmarks/needle_trace.py [--task niah_multiquery] [--length 1024] [--samples 12]
        [--kept 0.125] [--policies snapkv-span,snapkv-span:gqa_reduce=max] [--max-tokens 40] [--top-heads 8]

For each prompt of the suite (`kvc_tools.longctx`, seed 0, the prompts of
`quality.py`) and each policy, the reference decoder (plain torch, the
engine's selection math; its greedy tokens equal the engine's) compresses
the whole prompt to the kept fraction and generates. For every reference
answer string found in the prompt (a needle's value, a variable's value) it
prints the share of the compressed layers' KV heads that kept all the tokens
of its first occurrence, beside the generation's score. That tells a selection that
dropped the answer apart from a model that had it and did not use it.
The score is that of the first --max-tokens generated tokens (no stop
strings); with per-head budgets (adakv) a head's masked padding slots count
as kept. Last, the KV heads (layer.head) that kept the most answers whole.
No vLLM engine: it runs anywhere the reference decoder does.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="niah_multiquery")
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kept", type=float, default=0.125, help="kept fraction of the prompt")
    parser.add_argument("--policies", default="snapkv-span",
                        help="comma list, quality.py's form: policy[:param=value...]")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--top-heads", type=int, default=8, help="list this many KV heads that keep most answers")
    args = parser.parse_args()

    from quality import kv_args
    from transformers import AutoTokenizer

    from kvc_tools import longctx
    from kvc_tools.calibrate_profile import tokens_overlapping
    from kvc_tools.models import prepare_smollm2
    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.config import KVCompressConfig

    if args.task not in longctx.TASKS:
        raise SystemExit(f"--task: unknown task {args.task!r}; valid: {', '.join(longctx.TASKS)}")
    model = str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    count_tokens, _ = longctx.make_token_counter(model)
    samples = longctx.generate_samples(args.task, args.length, args.samples, seed=args.seed,
                                       count_tokens=count_tokens)
    decoder = ReferenceDecoder(model)
    print(f"{args.task} at {args.length} tokens, {len(samples)} prompts, kept {args.kept}; per prompt: "
          f"score, then per answer string the share of (layer, KV head) that kept all its tokens")
    for label in args.policies.split(","):
        config = KVCompressConfig.from_dict(kv_args(label, args.kept))
        scores, shares = [], []
        per_head: dict[tuple[int, int], list[bool]] = {}  # (layer, KV head) -> kept each answer whole
        for i, sample in enumerate(samples):
            enc = tokenizer(sample["input"], return_offsets_mapping=True)
            out = decoder.generate(enc["input_ids"], args.max_tokens, config)
            score = longctx.string_match_all(tokenizer.decode(out["tokens"]), sample["outputs"])
            kept = [set(row.tolist()) for layer in out["kept_positions"] for row in layer]
            heads = [(layer, head) for layer, rows in enumerate(out["kept_positions"]) for head in range(len(rows))]
            row_shares = []
            for answer in sample["outputs"]:
                # Its first occurrence: the needle or assignment (a question may repeat it later).
                start = sample["input"].find(answer)
                if start < 0:  # not quoted in the prompt
                    continue
                tokens = tokens_overlapping(enc["offset_mapping"], [(start, start + len(answer))])
                whole = [all(t in k for t in tokens) for k in kept]
                row_shares.append(sum(whole) / len(kept))
                for head, w in zip(heads, whole):
                    per_head.setdefault(head, []).append(w)
            scores.append(score)
            shares += row_shares
            print(f"{label} #{i}: score {score:.2f}, kept whole by " + " ".join(f"{s:.0%}" for s in row_shares),
                  flush=True)
        if shares:
            spread = f"{sum(shares) / len(shares):.0%} (min {min(shares):.0%}, max {max(shares):.0%})"
        else:
            spread = "- (no answer string in the prompts)"
        print(f"{label}: mean score {sum(scores) / len(scores):.3f}, mean share keeping an answer whole {spread}")
        if per_head:
            best = sorted(per_head.items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))[: args.top_heads]
            print(f"{label}: the (layer, KV head) keeping most answers whole: "
                  + ", ".join(f"{layer}.{head} {sum(w) / len(w):.0%}" for (layer, head), w in best))


if __name__ == "__main__":
    main()
