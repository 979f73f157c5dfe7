"""Measure a model's retrieval-head profile (allocation `retrieval`), offline.

A few attention heads do the copying when a model quotes its context (a
needle's digits, a variable's value): Wu et al. (2024) call them retrieval
heads, and DuoAttention, RazorAttention and HeadKV give them the cache the
other heads can do without. Allocation `retrieval` (budgets.py) reads such a
profile and moves budget to the layers that hold these heads.

A profile is measured once per model by

    python -m kvc_tools.calibrate_profile MODEL --out PROFILE.json
        [--tasks niah_single,niah_multikey,niah_multivalue,niah_multiquery,vt]
        [--length 1024] [--samples 4] [--seed 1] [--max-tokens 32]

on the synthetic RULER-style prompts of `kvc_tools.longctx` (a seed other
than the evaluation's 0), with the full KV cache. The model answers greedily;
at every *copy step* (a generated token that occurs among the tokens of an
answer's first occurrence in the prompt) each query head's attention mass on
the answer's context is recorded: the answer's tokens and the
`CONTEXT_CHARS` characters before them (a needle's "for KEY is:", a
variable's "VAR X ="), which the model must find before it copies. A query
head's score is its mean mass over the copy steps; a KV head's the most among
its query heads (it keeps the tokens any of them reads). Plain torch and
transformers: no vLLM.

The mass on the context, rather than Wu et al.'s top-1 copy hit (the head's
strongest attention on the very token being copied), is what holds the
answers at kept 1/8 on SmolLM2-135M: a copy-hit profile names five heads in
four layers (18.2, 17.1, 23.0, 6.0, 21.2), and budgets that follow it keep
multi-query needles whole in those heads and still lose them (0.48 of full
KV's 0.75); the mass also ranks the heads that look the needles up (docs/
evaluation.md, Quality).


The file's format and loader: `vllm_kvcompress.retrieval_profile`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from vllm_kvcompress.retrieval_profile import FORMAT

CONTEXT_CHARS = 40  # of the prompt before each answer: what a model looks up before it copies
DEFAULT_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt")


def answer_mass(attention: torch.Tensor, context: list[int]) -> torch.Tensor:
    """[Hq, P] attention of a copy step's query -> [Hq]: each head's mass on the answer's context tokens."""
    return attention[:, context].sum(dim=-1)


def tokens_overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    """Indices of the tokens (character offsets) that overlap any of the character spans."""
    return [t for t, (a, b) in enumerate(offsets) if any(a < end and b > start for start, end in spans)]


def _answer_tokens(tokenizer: Any, sample: dict) -> tuple[list[int], set[int], list[int]]:
    """The prompt's ids, the token ids of the answers' first occurrences, and the
    indices of those tokens with the `CONTEXT_CHARS` characters before each."""
    enc = tokenizer(sample["input"], return_offsets_mapping=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    spans = []
    for answer in sample["outputs"]:
        start = sample["input"].find(answer)
        if start >= 0:
            spans.append((start, start + len(answer)))
    answer_ids = {ids[t] for t in tokens_overlapping(offsets, spans)}
    return ids, answer_ids, tokens_overlapping(offsets, [(max(0, a - CONTEXT_CHARS), b) for a, b in spans])


@torch.no_grad()
def calibrate(model_path: str, tasks: tuple[str, ...] = DEFAULT_TASKS, length: int = 1024, samples: int = 4,
              seed: int = 1, max_tokens: int = 32, log=print) -> dict:
    """Measure a profile (the JSON-ready dict) on `samples` prompts of each task."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvc_tools import longctx

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    cfg = getattr(model.config, "text_config", model.config)
    num_q, num_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    full = [i for i, t in enumerate(layer_types) if t == "full_attention"]  # the layers that compress
    count_tokens, _ = longctx.make_token_counter(model_path)
    mass = torch.zeros(len(full), num_q)
    steps = 0
    for task in tasks:
        for sample in longctx.generate_samples(task, length, samples, seed=seed, count_tokens=count_tokens):
            ids, answer_ids, context = _answer_tokens(tokenizer, sample)
            prompt = torch.tensor([ids])
            seq = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_tokens,
                                 do_sample=False)[0]
            attentions = model(seq.unsqueeze(0), output_attentions=True).attentions
            for g in range(len(ids), len(seq)):
                if int(seq[g]) not in answer_ids:
                    continue
                steps += 1  # the query at g - 1 produced the copied token
                for row, layer in enumerate(full):
                    mass[row] += answer_mass(attentions[layer][0, :, g - 1].float(), context)
            log(f"{task} #{sample['index']}: {steps} copy steps so far")
    if steps == 0:
        raise ValueError("no copy steps: the model quoted no answer token on the calibration prompts")
    kv_scores = (mass / steps).view(len(full), num_kv, num_q // num_kv).amax(dim=-1)
    return {
        "format": FORMAT,
        "model": Path(model_path).name,
        "num_layers": len(full),
        "num_kv_heads": num_kv,
        "kv_head_scores": [[round(float(x), 4) for x in row] for row in kv_scores],
        "calibration": {"tasks": list(tasks), "length": length, "samples": samples, "seed": seed,
                        "max_tokens": max_tokens, "context_chars": CONTEXT_CHARS, "copy_steps": steps},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Measure a model's retrieval-head profile (allocation 'retrieval').")
    parser.add_argument("model", help="a Hugging Face model folder")
    parser.add_argument("--out", required=True, help="the profile file to write (JSON)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma list of kvc_tools.longctx tasks")
    parser.add_argument("--length", type=int, default=1024, help="prompt + answer tokens")
    parser.add_argument("--samples", type=int, default=4, help="prompts per task")
    parser.add_argument("--seed", type=int, default=1, help="prompt seed (the evaluation suite uses 0)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    args = parser.parse_args(argv)
    profile = calibrate(args.model, tuple(args.tasks.split(",")), args.length, args.samples, args.seed,
                        args.max_tokens)
    Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    ranked = sorted(((s, f"{layer}.{head}") for layer, row in enumerate(profile["kv_head_scores"])
                     for head, s in enumerate(row)), reverse=True)
    print(f"wrote {args.out}: {profile['calibration']['copy_steps']} copy steps; strongest KV heads "
          + ", ".join(f"{name} {s:.2f}" for s, name in ranked[:8]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
