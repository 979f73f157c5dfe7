"""Conversations under memory pressure: compressed states reused across turns (`reuse`) against recompression.

Many conversations at once over one engine whose KV cache is too small to
keep every history uncompressed (`--blocks` of 32 tokens): each conversation's first
message is a haystack with `--turns` needles (benchmarks/multiturn.py's
conversations), each later message asks for the next key, the model's own
answers stay in the conversation. Through `vllm serve` chat completions,
streamed (time to first token), prefix caching on, one server per setting:

- full KV: vanilla vLLM (no --kv-compress), its own prefix cache;
- recompressed: each turn compresses its whole prompt again (what the plugin
  did before `reuse`: the history's uncompressed blocks are hit only while
  vLLM still caches them);
- reuse: each turn starts from the last turn's compressed state.

Per turn: the score (the needle's value in the answer), the prompt tokens
computed (prompt minus cached, vLLM's `prompt_tokens_details`), time to first
token; per setting the wall time of the whole set. The scores' differences to
full KV come with a paired-bootstrap interval over conversations.

`--document`: one long document (a haystack with `--questions` needles)
compressed once and asked many different questions: the document alone
first (two tokens generated, so that it compresses; with `reuse` its compressed
prompt stays), then
every question at once, each prompt the document's tokens and the question's
(completions with token ids, the chat template written out), at kept 1/4 ..
1/32: full KV (vanilla vLLM), each question compressing document and
question again (snapkv-span, which sees the question), and `reuse` of the
document's state (snapkv-span, which chose for the document's end,
expected attention and KVzip, which need no question). One plugin server for
the compressed settings (their states are keyed apart), one vanilla server;
`--only` picks compressed settings by label (full KV always runs).

    python benchmarks/reuse_turns.py --conversations 8 --turns 3 --length 2048 --blocks 256
    python benchmarks/reuse_turns.py --document --questions 16 --length 2048
    python benchmarks/reuse_turns.py --document --only kvzip --out benchmarks/results/reuse_document_kvzip

Writes benchmarks/results/reuse_turns.{json,md} (reuse_document.* with --document).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)
from multiturn import conversation, machine_line, paired_interval, score, vllm_xargs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def settings(ratio: float) -> dict[str, dict | None]:
    """label -> the requests' kv_compress settings (None: a vanilla server)."""
    kept = f"kept 1/{round(1 / (1 - ratio))}"
    return {
        "full KV (vanilla vLLM)": None,
        f"snapkv-span, {kept}, recompressed": {"policy": "snapkv-span", "compression_ratio": ratio},
        f"snapkv-span, {kept}, reuse": {"policy": "snapkv-span", "compression_ratio": ratio, "reuse": 1},
        f"expected_attention, {kept}, recompressed": {"policy": "expected_attention", "compression_ratio": ratio},
        f"expected_attention, {kept}, reuse": {"policy": "expected_attention", "compression_ratio": ratio,
                                              "reuse": 1},
        # Recompressed: each turn's repeat passes score its whole history; reused: only turn 1's prompt.
        f"kvzip, {kept}, recompressed": {"policy": "kvzip", "compression_ratio": ratio},
        f"kvzip, {kept}, reuse": {"policy": "kvzip", "compression_ratio": ratio, "reuse": 1},
    }


def run_setting(args, model: str, convs: list[dict], label: str, setting: dict | None) -> dict:
    import requests

    sys.path.insert(0, str(ROOT / "tests"))
    from server_utils import Server

    log = Path(tempfile.mkdtemp(prefix="reuse-turns-")) / "serve.log"
    print(f"{label}: server log {log}", file=sys.stderr, flush=True)
    flags = ["--kv-compress", "none"] if setting is not None else []
    server = Server(model, *flags, "--enable-prompt-tokens-details",
                    "--max-model-len", str(args.length + args.turns * (args.max_tokens + 64) + 64),
                    "--max-num-seqs", str(args.conversations), "--num-gpu-blocks-override", str(args.blocks),
                    log=log, timeout=600)

    def converse(c: int) -> list[dict]:
        conv, chat, rows = convs[c], [], []
        for t, message in enumerate(conv["messages"]):
            chat.append({"role": "user", "content": message})
            body: dict = {"model": server.model, "messages": chat, "max_tokens": args.max_tokens, "temperature": 0,
                          "stream": True, "stream_options": {"include_usage": True}}
            if setting is not None:
                body["vllm_xargs"] = vllm_xargs(setting)
            start = time.perf_counter()
            first, answer, usage = None, "", {}
            with requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=3600) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        text = choice.get("delta", {}).get("content")
                        if text:
                            first = first or time.perf_counter()
                            answer += text
            end = time.perf_counter()
            chat.append({"role": "assistant", "content": answer})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            rows.append({"setting": label, "conversation": c, "turn": t + 1, "prompt_tokens": usage["prompt_tokens"],
                         "cached_tokens": cached, "computed_tokens": usage["prompt_tokens"] - cached,
                         "ttft_s": (first or end) - start, "latency_s": end - start,
                         "score": score(answer, conv["values"][t]), "answer": answer})
        print(f"{label} #{c}: scores {[r['score'] for r in rows]}, computed {[r['computed_tokens'] for r in rows]}",
              file=sys.stderr, flush=True)
        return rows

    try:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            rows = [r for rows in pool.map(converse, range(len(convs))) for r in rows]
        wall = time.perf_counter() - t0
    finally:
        server.stop()
    return {"rows": rows, "wall_s": wall}


def render(result: dict) -> str:
    rows = result["rows"]
    turns = sorted({r["turn"] for r in rows})
    labels = list(dict.fromkeys(r["setting"] for r in rows))
    full_label = labels[0]
    full = {(r["conversation"], r["turn"]): r["score"] for r in rows if r["setting"] == full_label}
    out = [f"# Conversations under memory pressure: reusing compressed states ({result['model_name']})", "",
           f"`{result['command']}` on {machine_line(result)}; {result['conversations']} conversations at once, "
           f"{len(turns)} turns over a {result['length']}-token haystack, {result['max_tokens']}-token answers, "
           f"`vllm serve` chat completions streamed, prefix caching on, a KV cache of {result['blocks']} blocks of 32 "
           f"tokens (too small for every history uncompressed); one server per setting, one run each. Per turn: "
           f"mean over conversations of the score (difference to full KV, 95% paired-bootstrap interval), the "
           f"prompt tokens computed (prompt minus vLLM's cached tokens) and the time to first token (median, "
           f"max).", "",
           "| setting | turn | score | prompt tokens | computed | TTFT median / max (s) |",
           "|---|---|---|---|---|---|"]
    for label in labels:
        for t in turns:
            sel = [r for r in rows if r["setting"] == label and r["turn"] == t]
            mean = statistics.mean(r["score"] for r in sel)
            cell = f"{mean:.3f}"
            if label != full_label:
                diffs = [r["score"] - full[r["conversation"], r["turn"]] for r in sel]
                lo, hi = paired_interval(diffs)
                cell += f" ({statistics.mean(diffs):+.3f}, {lo:+.3f} .. {hi:+.3f})"
            ttft = [r["ttft_s"] for r in sel]
            out.append(f"| {label} | {t} | {cell} | {statistics.mean(r['prompt_tokens'] for r in sel):.0f} | "
                       f"{statistics.mean(r['computed_tokens'] for r in sel):.0f} | "
                       f"{statistics.median(ttft):.1f} / {max(ttft):.1f} |")
    out += ["", "| setting | wall (s) | prompt tokens computed, all turns | conversations per minute |",
            "|---|---|---|---|"]
    for label in labels:
        sel = [r for r in rows if r["setting"] == label]
        wall = result["walls"][label]
        out.append(f"| {label} | {wall:.0f} | {sum(r['computed_tokens'] for r in sel)} | "
                   f"{60 * result['conversations'] / wall:.1f} |")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------- one document, many questions


DOCUMENT_SETTINGS = {
    "recompressed, snapkv-span": {"policy": "snapkv-span"},
    "reuse, snapkv-span": {"policy": "snapkv-span", "reuse": 1},
    "reuse, expected_attention": {"policy": "expected_attention", "reuse": 1},
    # The document's repeat passes score it once; the questions run none (they continue its state).
    "reuse, kvzip": {"policy": "kvzip", "reuse": 1},
}
RATIOS = (0.75, 0.875, 0.9375, 0.96875)  # kept 1/4 .. 1/32


def document_prompts(model: str, args) -> tuple[list[int], list[list[int]], list[str]]:
    """The document's tokens (a user turn left open) and each question's
    (closing the turn and opening the answer), as the chat template renders
    `[user: intro, haystack, question]`; and the values asked for."""
    from multiturn import INTRO, QUESTION
    from transformers import AutoTokenizer

    from kvc_tools.longctx import make_token_counter

    tokenizer = AutoTokenizer.from_pretrained(model)
    count_tokens, _ = make_token_counter(model)
    conv = conversation(0, args.length, args.questions, count_tokens)
    marker = "\u0000QUESTION\u0000"
    haystack = conv["messages"][0].removeprefix(INTRO + "\n").rsplit("\n", 1)[0]
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{INTRO}\n{haystack}\n{marker}"}],
                                         add_generation_prompt=True, tokenize=False)
    head, tail = text.split(marker)
    document = tokenizer(head, add_special_tokens=False)["input_ids"]
    questions = [tokenizer(QUESTION.format(key=k) + tail, add_special_tokens=False)["input_ids"]
                 for k in conv["keys"]]
    return document, questions, conv["values"]


def complete(server, setting: dict | None, prompt: list[int], max_tokens: int) -> tuple[str, dict, float]:
    """(text, usage, latency) of a completion of token ids, with these kv_compress settings."""
    import requests

    body: dict = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if setting is not None:
        body["vllm_xargs"] = vllm_xargs(setting)
    start = time.perf_counter()
    r = requests.post(server.url + "/v1/completions", json=body, timeout=3600)
    r.raise_for_status()
    out = r.json()
    return out["choices"][0]["text"], out["usage"], time.perf_counter() - start


def run_document(args, model: str) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from server_utils import Server

    document, questions, values = document_prompts(model, args)
    jobs: list[tuple[str, float | None, dict | None]] = [("full KV (vanilla vLLM)", None, None)]
    jobs += [(label, ratio, {**setting, "compression_ratio": ratio})
             for ratio in RATIOS for label, setting in DOCUMENT_SETTINGS.items()
             if not args.only or any(o in label for o in args.only)]
    rows = []
    servers: dict[bool, Server] = {}
    longest = len(document) + max(map(len, questions)) + args.max_tokens + 64
    if any(setting and setting["policy"] == "kvzip" for _, _, setting in jobs):
        longest += len(document) + 64  # a repeat pass: the document, an instruction and the document again
    max_len = str(longest)
    try:
        for label, ratio, setting in jobs:
            plugin = setting is not None
            if plugin not in servers:
                for old in servers.values():
                    old.stop()
                servers.clear()
                log = Path(tempfile.mkdtemp(prefix="reuse-document-")) / "serve.log"
                print(f"server log {log}", file=sys.stderr, flush=True)
                servers[plugin] = Server(model, *(["--kv-compress", "none"] if plugin else []),
                                         "--enable-prompt-tokens-details", "--max-model-len", max_len,
                                         "--max-num-seqs", str(len(questions)), log=log, timeout=600)
            server = servers[plugin]

            # The document alone, two tokens generated: it compresses (at its first decode step), and with reuse
            # its compressed prompt stays.
            _, usage, first = complete(server, setting, document, 2)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(questions)) as pool:
                answers = list(pool.map(lambda q, s=server, c=setting: complete(s, c, document + q, args.max_tokens),
                                        questions))
            wall = time.perf_counter() - t0
            for q, (answer, usage, latency), value in zip(range(len(questions)), answers, values):
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                rows.append({"setting": label, "ratio": ratio, "question": q, "score": score(answer, value),
                             "prompt_tokens": usage["prompt_tokens"],
                             "computed_tokens": usage["prompt_tokens"] - cached, "latency_s": latency,
                             "wall_s": wall, "document_s": first, "answer": answer})
            sel = rows[-len(questions):]
            print(f"{label} {ratio}: score {statistics.mean(r['score'] for r in sel):.3f}, computed "
                  f"{statistics.mean(r['computed_tokens'] for r in sel):.0f}, wall {wall:.1f} s",
                  file=sys.stderr, flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return {"rows": rows, "document_tokens": len(document), "questions": len(questions)}


def render_document(result: dict) -> str:
    rows = result["rows"]
    full = {r["question"]: r["score"] for r in rows if r["ratio"] is None}
    out = [f"# One document, many questions: its compressed state reused ({result['model_name']})", "",
           f"`{result['command']}` on {machine_line(result)}; a {result['document_tokens']}-token document (a "
           f"haystack of essay sentences with {result['questions']} needles) sent alone first, then "
           f"{result['questions']} different questions at once (each prompt the document's tokens and the "
           f"question's, `vllm serve` completions, prefix caching on, {result['max_tokens']}-token answers); one run. "
           f"Score: mean over questions (difference to full KV, 95% paired-bootstrap interval); computed: prompt "
           f"tokens minus vLLM's cached ones, mean per question; wall: the questions' batch.", "",
           "| setting | kept | score | computed per question | wall (s) |", "|---|---|---|---|---|"]
    for label, ratio in dict.fromkeys((r["setting"], r["ratio"]) for r in rows):
        sel = [r for r in rows if r["setting"] == label and r["ratio"] == ratio]
        mean = statistics.mean(r["score"] for r in sel)
        cell = f"{mean:.3f}"
        if ratio is not None:
            diffs = [r["score"] - full[r["question"]] for r in sel]
            lo, hi = paired_interval(diffs)
            cell += f" ({statistics.mean(diffs):+.3f}, {lo:+.3f} .. {hi:+.3f})"
        kept = "all" if ratio is None else f"1/{round(1 / (1 - ratio))}"
        out.append(f"| {label} | {kept} | {cell} | {statistics.mean(r['computed_tokens'] for r in sel):.0f} | "
                   f"{sel[0]['wall_s']:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--length", type=int, default=2048, help="haystack tokens (the first message)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--ratio", type=float, default=0.875, help="compression_ratio of the compressed settings")
    p.add_argument("--blocks", type=int, default=256, help="KV cache blocks of each server (32 tokens each)")
    p.add_argument("--only", action="append", default=None, help="run only settings whose label has this text")
    p.add_argument("--document", action="store_true", help="one document, many questions")
    p.add_argument("--questions", type=int, default=16, help="--document: questions (needles) on the document")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.append(str(ROOT))
    from kvc_tools.longctx import make_token_counter
    from kvc_tools.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    given = argv if argv is not None else sys.argv[1:]
    common = {"command": shlex.join(["python", "benchmarks/reuse_turns.py", *given]), "machine": machine_info(),
              "model": model, "model_name": Path(model).name, "length": args.length, "max_tokens": args.max_tokens}
    if args.document:
        result = {**run_document(args, model), **common}
        write(args.out or RESULTS / "reuse_document", result, render_document(result))
        return 0
    count_tokens, _ = make_token_counter(model)
    convs = [conversation(i, args.length, args.turns, count_tokens) for i in range(args.conversations)]
    rows, walls = [], {}
    for label, setting in settings(args.ratio).items():
        if args.only and not any(o in label for o in args.only):
            continue
        done = run_setting(args, model, convs, label, setting)
        rows += done["rows"]
        walls[label] = done["wall_s"]
    result = {"rows": rows, "walls": walls, **common, "conversations": args.conversations, "blocks": args.blocks}
    write(args.out or RESULTS / "reuse_turns", result, render(result))
    return 0


def write(out: Path, result: dict, text: str) -> None:
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
