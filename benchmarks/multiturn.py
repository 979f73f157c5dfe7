"""Conversations over one haystack: memory per turn, prefill saved, answers per turn.

In the spirit of SCBench (one shared context, several queries): a haystack of
essay sentences (kvc_tools.longctx) hides `--turns` needles, "One of the special
magic numbers for {key} is: {value}."; the first user message is the haystack
and a question for the first key, each later message asks for the next key,
and the model's own answers stay in the conversation (turn n+1's prompt is
turn n's prompt, its answer and the new message, rendered by the model's chat
template). Greedy, `--max-tokens` per answer; a turn scores 1 when the value
is in the answer (RULER's string_match_all).

Two measurements, one engine each, prefix caching on (vLLM's default):

- `--memory` (offline `LLM`): per turn, the KV blocks the turn's request holds
  when it finishes (the plugin's stats) and the prompt tokens it computed
  (prompt minus its prefix-cache hit), for full KV and each setting. Run it
  with PYTHONPATH pointing at another checkout of the plugin to measure that
  version (the notes compare the plugin before prefix-cache hits were
  compressed).
- default (`vllm serve`, chat completions): the score per turn for full KV and
  each setting, with a paired bootstrap interval of the difference to full KV
  over the conversations, like the quality tables.

Settings: the recommended `snapkv-span` at kept 1/4 (compression_ratio 0.75)
and at kept 1/8 recipes/snapkv-retrieval.yaml (its engine settings: one KV
cache group per layer and the SmolLM2-135M profile; the engine starts with it
and requests switch policy through `vllm_xargs`), or on another model
(`--model`, no retrieval profile) snapkv-span at compression_ratio 0.875.

    python benchmarks/multiturn.py --memory --conversations 2 --length 2048
    python benchmarks/multiturn.py --conversations 8 --length 2048 --turns 5
    python benchmarks/multiturn.py --model ~/.cache/vllm_kvcompress/models/gemma-3-270m \
        --completion --length 4096   # a base model: plain-text turns (after scripts/gemma3_setup.sh)

Writes benchmarks/results/multiturn[-memory].{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK_SIZE = 32
RECIPE_EIGHTH = ROOT / "recipes" / "snapkv-retrieval.yaml"
# label -> the request's kv_compress settings (None: the engine's, the 1/8 recipe).
SETTINGS: dict[str, dict | None] = {
    "full KV": {"policy": "none"},
    "snapkv-span, kept 1/4": {"policy": "snapkv-span", "compression_ratio": 0.75},
    "snapkv-retrieval, kept 1/8": None,
}
# On a model without a retrieval profile: the engine starts with plain
# snapkv-span, and the 1/8 setting is a request's.
OTHER_MODEL_SETTINGS: dict[str, dict | None] = {
    "full KV": {"policy": "none"},
    "snapkv-span, kept 1/4": {"policy": "snapkv-span", "compression_ratio": 0.75},
    "snapkv-span, kept 1/8": {"policy": "snapkv-span", "compression_ratio": 0.875},
}


def engine_recipe(args) -> tuple[list[str], dict, dict[str, dict | None]]:
    """The engine's kv_compress settings as `vllm serve` flags and as `LLM`
    keywords, and the requests' settings: the 1/8 recipe on SmolLM2,
    snapkv-span at kept 1/4 elsewhere."""
    if args.model is None:
        return (["--kv-compress-config", str(RECIPE_EIGHTH)], {"kv_compress_config": str(RECIPE_EIGHTH)},
                SETTINGS)
    return (["--kv-compress", "snapkv-span", "--kv-compress-ratio", "0.75"],
            {"kv_compress": {"policy": "snapkv-span", "compression_ratio": 0.75}}, OTHER_MODEL_SETTINGS)


INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
         "I will quiz you about the numbers afterwards.")
QUESTION = "What is the special magic number for {key} mentioned in the provided text?"
NEEDLE = "One of the special magic numbers for {key} is: {value}."
ANSWER = "The special magic number for {key} mentioned in the provided text is"  # --completion


def conversation(index: int, length: int, turns: int, count_tokens, seed: int = 0) -> dict:
    """One haystack of about `length` tokens with `turns` needles, and the questions."""
    from kvc_tools import longctx

    rng = random.Random(f"{seed}-{index}-{length}")
    words = longctx.word_lists()
    keys: list[str] = []
    while len(keys) < turns:
        key = f"{rng.choice(words['adjectives'])}-{rng.choice(words['nouns'])}"
        if key not in keys:
            keys.append(key)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in keys]
    sentences = longctx.essay_sentences()
    start = rng.randrange(len(sentences))
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    depths = sorted(rng.uniform(0.05, 0.95) for _ in keys)
    rng.shuffle(needles)

    def text(n: int) -> str:
        body = [sentences[(start + i) % len(sentences)] for i in range(n)]
        for depth, needle in sorted(zip(depths, needles), reverse=True):
            body.insert(int(depth * len(body)), needle)
        return " ".join(body)

    n = 8
    while count_tokens(text(n * 2)) < length - 64:
        n *= 2
    lo, hi = n, n * 2
    while lo < hi - 1:  # the most sentences that fit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if count_tokens(text(mid)) < length - 64 else (lo, mid)
    first = f"{INTRO}\n{text(lo)}\n{QUESTION.format(key=keys[0])}"
    return {"keys": keys, "values": values,
            "messages": [first] + [QUESTION.format(key=k) for k in keys[1:turns]]}


def score(answer: str, value: str) -> float:
    from kvc_tools.longctx import string_match_all

    return string_match_all(answer, [value])


# ------------------------------------------------------------------------- memory (offline)


def run_memory(args, model: str, convs: list[dict]) -> dict:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import vllm_kvcompress

    tokenizer = AutoTokenizer.from_pretrained(model)
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template.read_text()
    _, engine, settings = engine_recipe(args)
    llm = LLM(model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE, seed=0,
              max_model_len=args.length + args.turns * (args.max_tokens + 64) + BLOCK_SIZE,
              gpu_memory_utilization=0.3, **engine)
    rows = []
    for label, setting in settings.items():
        llm.reset_prefix_cache()  # each setting's conversations hit only their own turns
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                extra_args=None if setting is None else {"kv_compress": setting})
        for c, conv in enumerate(convs):
            chat: list[dict] = []
            for t, message in enumerate(conv["messages"]):
                chat.append({"role": "user", "content": message})
                # As the server renders a chat: the template's text, tokenized without added specials.
                text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
                before = set(vllm_kvcompress.stats(llm)["requests"])
                out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
                answer = out.outputs[0].text
                chat.append({"role": "assistant", "content": answer})
                stats = vllm_kvcompress.stats(llm)["requests"]
                (rid,) = [r for r in stats if r not in before and stats[r]["finished"]]
                rows.append({"setting": label, "conversation": c, "turn": t + 1, "prompt_tokens": len(ids),
                             "cached_tokens": out.num_cached_tokens or 0,
                             "computed_tokens": len(ids) - (out.num_cached_tokens or 0),
                             "blocks_held": stats[rid]["blocks_held"],
                             "score": score(answer, conv["values"][t])})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows, "plugin": str(Path(vllm_kvcompress.__file__).parent)}


def render_memory(result: dict) -> str:
    rows = result["rows"]
    turns = sorted({r["turn"] for r in rows})
    out = [f"# Conversations: KV blocks held and prompt tokens computed per turn ({result['label']})", "",
           f"Plugin: `{result['plugin']}`.", "",
           f"`{result['command']}` on {machine_line(result)}; {result['model_name']}, {result['conversations']} "
           f"conversation(s) of {len(turns)} turns over a {result['length']}-token haystack, "
           f"{result['max_tokens']}-token answers, block {BLOCK_SIZE}, prefix caching on; "
           f"{result['wall_s']:.0f} s. Blocks are summed over the engine's KV cache groups (the 1/8 recipe's on "
           f"SmolLM2: one per layer, so a block holds {BLOCK_SIZE} tokens of one layer), held by the turn's request "
           f"when it finishes; tokens computed = the turn's prompt minus its prefix-cache hit. Mean over conversations "
           f"(min .. max).", "",
           "| setting | " + " | ".join(f"turn {t}: blocks held / tokens computed" for t in turns) + " |",
           "|---|" + "---|" * len(turns)]
    for label in dict.fromkeys(r["setting"] for r in rows):
        cells = []
        for t in turns:
            sel = [r for r in rows if r["setting"] == label and r["turn"] == t]
            held = [r["blocks_held"] for r in sel]
            computed = [r["computed_tokens"] for r in sel]
            cells.append(f"{statistics.mean(held):.0f} ({min(held)} .. {max(held)}) / "
                         f"{statistics.mean(computed):.0f} ({min(computed)} .. {max(computed)})")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    prompt = [statistics.mean(r["prompt_tokens"] for r in rows if r["turn"] == t) for t in turns]
    out += ["", "Prompt tokens per turn (mean): " + ", ".join(f"{p:.0f}" for p in prompt) + "."]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------- quality (server)


def run_quality(args, model: str, convs: list[dict]) -> dict:
    import requests

    sys.path.insert(0, str(ROOT / "tests"))
    from server_utils import Server

    log = Path(tempfile.mkdtemp(prefix="multiturn-")) / "serve.log"
    print(f"server log: {log}", file=sys.stderr, flush=True)
    flags, _, settings = engine_recipe(args)
    server = Server(model, *flags,
                    "--max-model-len", str(args.length + args.turns * (args.max_tokens + 64) + BLOCK_SIZE),
                    "--max-num-seqs", str(args.concurrency),
                    *(["--chat-template", str(args.chat_template)] if args.chat_template else []), log=log, timeout=600,
                    env={"VLLM_CPU_KVCACHE_SPACE": "4"})

    def converse(job: tuple[str, int]) -> list[dict]:
        label, c = job
        conv, chat, text, rows = convs[c], [], "", []
        for t, message in enumerate(conv["messages"]):
            body = {"model": server.model, "max_tokens": args.max_tokens, "temperature": 0}
            if args.completion:
                # A base model's turns as plain text, each question followed by RULER's answer prefix.
                text += ("\n" if text else "") + message + " " + ANSWER.format(key=conv["keys"][t])
                body.update(prompt=text, stop=["\n"])
            else:
                chat.append({"role": "user", "content": message})
                body["messages"] = chat
            setting = settings[label]
            if setting is not None:
                body["vllm_xargs"] = vllm_xargs(setting)
            endpoint = "/v1/completions" if args.completion else "/v1/chat/completions"
            response = requests.post(server.url + endpoint, json=body, timeout=3600)
            response.raise_for_status()
            choice = response.json()["choices"][0]
            answer = (choice["text"] if args.completion else choice["message"]["content"]) or ""
            text += answer
            chat.append({"role": "assistant", "content": answer})  # unused by --completion
            rows.append({"setting": label, "conversation": c, "turn": t + 1, "answer": answer,
                         "value": conv["values"][t], "score": score(answer, conv["values"][t])})
        print(f"{label} #{c}: {[r['score'] for r in rows]}", file=sys.stderr, flush=True)
        return rows

    try:
        jobs = [(label, c) for c in range(len(convs)) for label in settings]
        with ThreadPoolExecutor(args.concurrency) as pool:
            rows = [r for rows in pool.map(converse, jobs) for r in rows]
    finally:
        server.stop()
    return {"rows": rows}


def vllm_xargs(setting: dict) -> dict:
    """A request's kv_compress settings as the server's `vllm_xargs` (flat `kv_compress_<field>` keys)."""
    return {"kv_compress" if k == "policy" else f"kv_compress_{k}": v for k, v in setting.items()}


def machine_line(result: dict) -> str:
    m = result["machine"]
    return f"{m['cpu_model']} ({m['usable_cpus']} cores, {m['mem_gib']} GiB), vLLM CPU, float32"


def paired_interval(diffs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(diffs, k=len(diffs))) for _ in range(reps))
    return means[int(0.025 * reps)], means[int(0.975 * reps) - 1]


def render_quality(result: dict) -> str:
    rows = result["rows"]
    turns = sorted({r["turn"] for r in rows})
    full = {(r["conversation"], r["turn"]): r["score"] for r in rows if r["setting"] == "full KV"}
    out = [f"# Conversations over one haystack: score per turn ({result['model_name']}, {result['length']} tokens)",
           "", f"`{result['command']}` on {machine_line(result)}; {result['conversations']} conversations of "
           f"{len(turns)} turns through `vllm serve` {result['endpoint']}, prefix caching on, "
           f"{result['max_tokens']}-token answers; {result['wall_s']:.0f} s. A turn scores 1 when its needle's "
           f"value is in the answer; mean over conversations (difference to full KV, 95% paired-bootstrap "
           f"interval).", "",
           "| setting | " + " | ".join(f"turn {t}" for t in turns) + " | all turns |",
           "|---|" + "---|" * (len(turns) + 1)]
    for label in dict.fromkeys(r["setting"] for r in rows):
        cells = []
        for t in list(turns) + [None]:
            sel = [r for r in rows if r["setting"] == label and (t is None or r["turn"] == t)]
            mean = statistics.mean(r["score"] for r in sel)
            if label == "full KV":
                cells.append(f"{mean:.3f}")
                continue
            diffs = [r["score"] - full[r["conversation"], r["turn"]] for r in sel]
            lo, hi = paired_interval(diffs)
            cells.append(f"{mean:.3f} ({statistics.mean(diffs):+.3f}, {lo:+.3f} .. {hi:+.3f})")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------- main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--memory", action="store_true", help="blocks held and tokens computed (offline engine)")
    p.add_argument("--label", default="this checkout", help="what is measured (--memory), e.g. a commit")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--length", type=int, default=2048, help="haystack tokens (the first message)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=6, help="conversations in flight (server)")
    p.add_argument("--completion", action="store_true",
                   help="turns as plain text through /v1/completions, each question followed by an answer prefix "
                        "(a base model, e.g. gemma-3-270m); default: chat completions")
    p.add_argument("--chat-template", type=Path, default=None,
                   help="a Jinja chat template for a model without one")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout of the plugin given there is the one measured
    from kvc_tools.longctx import make_token_counter
    from kvc_tools.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    count_tokens, _ = make_token_counter(model)
    convs = [conversation(i, args.length, args.turns, count_tokens) for i in range(args.conversations)]
    t0 = time.perf_counter()
    result = run_memory(args, model, convs) if args.memory else run_quality(args, model, convs)
    given = argv if argv is not None else sys.argv[1:]
    result.update(command=shlex.join(["python", "benchmarks/multiturn.py", *given]),
                  machine=machine_info(), model=model, model_name=Path(model).name, length=args.length,
                  conversations=args.conversations, max_tokens=args.max_tokens, label=args.label,
                  endpoint="completions (plain-text turns)" if args.completion else "chat completions",
                  wall_s=time.perf_counter() - t0)
    name = "multiturn-memory" if args.memory else "multiturn"
    out = args.out or RESULTS / name
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    text = render_memory(result) if args.memory else render_quality(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
