"""What selection could keep at best: the answer's tokens kept first, in every head.

    python benchmarks/oracle_selection.py [--length 1024] [--samples 12] [--kept 0.125]
        [--policy snapkv-span] [--tasks niah_single,...] [--out-dir results/oracle-eighth-1k]
    python benchmarks/quality_spread.py results/oracle-eighth-1k --full-from results/quality-main

A bound for a budget, not a method: for each prompt of the suite
(`kvc_tools.longctx`, seed 0, quality.py's prompts) the reference decoder
(plain torch, the engine's selection math) compresses the prompt with the
policy, except that the tokens carrying the answer rank first in every layer
and KV head, after the policy's protected tokens (window, sinks); the rest of
the budget goes by the policy's own scores. The tokens carrying the answer,
by task kind (from the sample's reference outputs):

  niah_*  "for KEY is: VALUE." of each needle whose value is an answer
  vt      each assignment "VAR X = ..." of an answer variable X
  cwe     every occurrence of an answer word

If these do not all fit beside the protected tokens, the budget holds as many
as fit (the count is printed). Generation: greedy, the task's max_gen_toks,
cut at the end-of-sequence token and at the suite's stop string, scored with
RULER's string_match_all, as quality.py scores the engine; compare with quality.py's full KV and policy
cells on the same prompts (`--samples 12` = indices 0..11); `--plain` runs the
policy as it is, which gives quality.py's scores (the reference decoder's
tokens equal the engine's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from kvc_tools import longctx
from vllm_kvcompress.registry import POLICIES, Composition
from vllm_kvcompress.selection import SELECTIONS, SpanCarry

# The logical positions of the running prompt's answer tokens (one prompt at a
# time, in this process: the reference decoder runs here).
_answer_positions = torch.zeros(0, dtype=torch.int64)


@dataclass(frozen=True)
class AnswerFirst(SpanCarry):
    """Span carry, then the answer's tokens above every other unprotected token."""

    name = "answer_first"

    def adjust(self, scores, positions, protected):
        adjusted = super().adjust(scores, positions, protected)
        forced = torch.isin(positions, _answer_positions) & ~protected
        top = adjusted.masked_fill(torch.isinf(adjusted), float("-inf")).max()
        return adjusted.masked_fill(forced, float(top) + 1e6)


def answer_spans(task: str, text: str, outputs: list[str]) -> list[tuple[int, int]]:
    """Character spans of the prompt that carry the answer (see the module docstring)."""
    if task.startswith("niah"):
        found = re.finditer(r"for [^.\n]*? is: (\d+)\.", text)
        return [m.span() for m in found if m.group(1) in outputs]
    if task == "vt":
        found = re.finditer(r"VAR ([A-Z]+) = (?:VAR [A-Z]+|\d+)", text)
        return [m.span() for m in found if m.group(1) in outputs]
    if task == "cwe":
        return [m.span() for word in outputs for m in re.finditer(rf"\b{re.escape(word)}\b", text)]
    raise SystemExit(f"no answer spans for task {task!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(longctx.TASKS))
    parser.add_argument("--length", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kept", type=float, default=0.125, help="kept fraction of the prompt")
    parser.add_argument("--policy", default="snapkv-span",
                        help="a registered policy with span selection, quality.py's form: policy[:param=value...]")
    parser.add_argument("--plain", action="store_true",
                        help="the policy as it is (no answer first): checks that this protocol gives "
                             "quality.py's scores")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="also write quality_predictions.jsonl here (quality.py's form, for quality_spread.py)")
    args = parser.parse_args()

    from quality import kv_args, policy_spec
    from transformers import AutoTokenizer

    from kvc_tools.calibrate_profile import tokens_overlapping
    from kvc_tools.models import prepare_smollm2
    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.config import KVCompressConfig

    global _answer_positions
    spec = policy_spec(args.policy)
    base = POLICIES[spec["policy"]]
    if base.selection != "span" and spec.get("selection") != "span":
        raise SystemExit(f"--policy: {args.policy!r} does not select with span carry")
    SELECTIONS[AnswerFirst.name] = AnswerFirst
    POLICIES["answer-first"] = Composition(base.scorer, base.allocation, base.trigger, AnswerFirst.name,
                                           base.merge, base.defaults)
    label = args.policy if args.plain else ":".join(["answer-first", *args.policy.split(":")[1:]])
    config = KVCompressConfig.from_dict(kv_args(label, args.kept))

    model = str(prepare_smollm2())
    tokenizer = AutoTokenizer.from_pretrained(model)
    count_tokens, _ = longctx.make_token_counter(model)
    decoder = ReferenceDecoder(model)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    out = (args.out_dir / "quality_predictions.jsonl").open("w") if args.out_dir else None
    means = {}
    for task in args.tasks.split(","):
        samples = longctx.generate_samples(task, args.length, args.samples, seed=args.seed,
                                           count_tokens=count_tokens)
        scores = []
        for sample in samples:
            text = sample["input"]
            enc = tokenizer(text, return_offsets_mapping=True)
            spans = answer_spans(task, text, sample["outputs"])
            tokens = tokens_overlapping(enc["offset_mapping"], spans)
            _answer_positions = torch.tensor(tokens, dtype=torch.int64)
            result = decoder.generate(enc["input_ids"], sample["max_gen_toks"], config)
            tokens_out = result["tokens"]
            if tokenizer.eos_token_id in tokens_out:  # vLLM stops there (the reference decoder does not)
                tokens_out = tokens_out[: tokens_out.index(tokenizer.eos_token_id)]
            generated = tokenizer.decode(tokens_out)
            for stop in longctx.STOPS[task]:
                generated = generated.split(stop)[0]
            score = longctx.string_match_all(generated, sample["outputs"])
            kept = result["kept_positions"]
            held = sum(bool(torch.isin(torch.tensor(tokens), row).all()) for layer in kept for row in layer)
            heads = sum(len(layer) for layer in kept)
            scores.append(score)
            line = {"policy": label, "kept_fraction": args.kept, "task": task, "index": sample["index"],
                    "score": score, "answer_tokens": len(tokens),
                    "kept_per_head": result["compressed_lengths"][0], "heads_holding_all": held / heads,
                    "prediction": generated}
            print(json.dumps(line), flush=True)
            if out:
                out.write(json.dumps(line) + "\n")
        means[task] = sum(scores) / len(scores)
    print(f"{label} kept {args.kept}: " + ", ".join(f"{t} {m:.3f}" for t, m in means.items())
          + f"; mean {sum(means.values()) / len(means):.3f}")


if __name__ == "__main__":
    main()
