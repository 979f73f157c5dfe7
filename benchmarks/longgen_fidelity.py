"""Long-generation fidelity: how far does a compressed cache drift from the
full cache over a long answer, position by position?

Greedy outputs of a compressed cache part from uncompressed vLLM's within a
few tokens and never meet again, so "identical outputs" says little about a
1000-token answer. This benchmark asks instead, at every generated position,
what the model predicts next when its cache is compressed versus whole, along
one and the same trajectory (teacher forcing):

1. vanilla vLLM (whole cache) samples a long continuation of each prompt
   (``--temperature``, the engine's seed) and records, at every position,
   its own top-1 token and the log-probability of the token it sampled;
2. each compression setting is then forced along that same continuation
   (a per-request logits processor allows only the next reference token) and
   records its raw top-1 token and the log-probability it gives the forced
   token (vLLM's default ``raw_logprobs``: before any logits processor).
   The plugin compresses exactly as it would while generating: the forced
   tokens are its outputs, scored, kept or evicted like any others.

Reported per setting and per range of generated positions: top-1 agreement
with the whole cache (the fraction of positions where both predict the same
next token) and the log-perplexity gap (mean NLL of the reference tokens,
compressed minus whole: 0 is no loss). Each cell is the mean over requests
with the range over requests. The first row forces vanilla along its own
sample: agreement 1 and gap 0 up to batch numerics (the check that the method
itself adds nothing).

Every setting runs in its own subprocess with the engine in process and a KV
cache that holds every request whole (no preemption; what is measured is the
compression, not the memory pressure).

    cd benchmarks && python longgen_fidelity.py                 # 8 requests, 1024 new tokens
    python longgen_fidelity.py --quick                          # smoke check, a few minutes
    python longgen_fidelity.py --settings "snapkv-span@0.875,snapkv-span-window@0.875:decode_window=512"

A setting is ``POLICY@RATIO`` (the fraction removed) with optional
``:NAME=VALUE`` policy parameters. Writes ``results/longgen_fidelity.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "FIDELITY_RESULT "
BLOCK_SIZE = 32
DTYPE = "float32"
DEFAULT_SETTINGS = ("snapkv-span@0.875,snapkv-span-window@0.875,snapkv-span-window@0.875:decode_window=512,"
                    "streamingllm@0.875")
RANGES = ((0, 128), (128, 256), (256, 512), (512, 1024), (1024, 2048), (2048, 4096))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help="comma list of POLICY@RATIO[:NAME=VALUE...] (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=8)
    p.add_argument("--prompt-len", default="512,1024", help="min,max prompt tokens (essay excerpts)")
    p.add_argument("--max-tokens", type=int, default=1024, help="generated tokens per request")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="the reference's sampling temperature (0: greedy; a sample avoids the loops "
                        "a small model falls into over long greedy continuations)")
    p.add_argument("--quick", action="store_true", help="4 requests of 128 new tokens (smoke check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: prepare_smollm2())")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--timeout", type=float, default=3600, help="seconds allowed per setting")
    # Internal: one setting in this process.
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--work-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.max_tokens = 4, 128
    if args.model is None:
        from kvc_tools.models import prepare_smollm2

        args.model = str(prepare_smollm2())
    return args


def parse_setting(spec: str) -> tuple[str, dict]:
    """'POLICY@RATIO:NAME=VALUE' -> (label, LLM keyword arguments)."""
    from vllm_kvcompress.config import composition_params

    head, *params = spec.split(":")
    policy, sep, ratio = head.partition("@")
    kwargs: dict = {"kv_compress": policy}
    if sep:
        kwargs["kv_compress_compression_ratio"] = float(ratio)
    fields = composition_params(policy)
    for item in params:
        name, eq, value = item.partition("=")
        if not eq or name not in fields:
            raise SystemExit(f"--settings {spec!r}: expected NAME=VALUE with NAME in {sorted(fields)}")
        kind = {"int": int, "float": float, "str": str}.get(fields[name].type, fields[name].type)
        kwargs[f"kv_compress_{name}"] = kind(value)
    return spec, kwargs


# ------------------------------------------------------------------------- one setting


def forced_tokens_processor():
    """A vLLM logits processor class: a request whose ``extra_args`` carry
    ``forced_tokens`` may only emit the next of them."""
    import torch
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ForcedTokens(AdapterLogitsProcessor):
        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get("forced_tokens")
            if forced is None:
                return None

            def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
                if len(output_ids) >= len(forced):
                    return logits
                only = torch.full_like(logits, float("-inf"))
                only[forced[len(output_ids)]] = 0.0
                return only

            return force

    return ForcedTokens


def per_position(output, forced: list[int] | None) -> dict:
    """Top-1 token and the NLL of the emitted token at every position, from
    the raw logprobs vLLM returns (the emitted token and the top 1)."""
    seq = output.outputs[0]
    tokens = list(seq.token_ids)
    top1, nll = [], []
    for t, entry in zip(tokens, seq.logprobs):
        top1.append(next(tok for tok, lp in entry.items() if lp.rank == 1))
        nll.append(-entry[t].logprob)
    if forced is not None and tokens != forced[:len(tokens)]:
        raise RuntimeError("the forced run left the reference trajectory")
    return dict(tokens=tokens, top1=top1, nll=nll)


def run_one(args) -> None:
    work = json.loads(args.work_file.read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    blocks = work["blocks"]
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(blocks * 1.5 * 2**20 / 2**30)))
    from vllm import LLM, SamplingParams

    reference = args.one == "reference"
    kwargs = dict(model=args.model, dtype=DTYPE, enforce_eager=True, block_size=BLOCK_SIZE, seed=args.seed,
                  max_model_len=work["max_model_len"], num_gpu_blocks_override=blocks,
                  max_num_seqs=len(work["prompts"]), enable_prefix_caching=False,
                  logits_processors=[forced_tokens_processor()])
    if args.one not in ("reference", "vanilla"):
        kwargs.update(parse_setting(args.one)[1])
    llm = LLM(**kwargs)
    n = work["max_tokens"]
    if reference:
        # The engine's seed, not one per request: vLLM 0.32's CPU runner fails
        # on per-request generators once a prompt is chunked (set_offset).
        params = [SamplingParams(max_tokens=n, temperature=work["temperature"], ignore_eos=True, logprobs=1)
                  for _ in work["prompts"]]
        forced = [None] * len(params)
    else:
        forced = work["reference_tokens"]
        params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1,
                                 extra_args={"forced_tokens": f}) for f in forced]
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in work["prompts"]], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    args.result_file.write_text(json.dumps(dict(
        setting=args.one, wall_s=wall, requests=[per_position(o, f) for o, f in zip(outputs, forced)])))
    print(MARKER + json.dumps(dict(setting=args.one, wall_s=wall)), flush=True)


# ------------------------------------------------------------------------- orchestration


def build_work(args) -> dict:
    from throughput import essay_tokens
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    stream = essay_tokens(tokenizer)
    lo, hi = map(int, args.prompt_len.split(","))
    rng = random.Random(f"{args.seed}-longgen-fidelity")
    prompts = []
    for _ in range(args.num_requests):
        length = rng.randint(lo, hi)
        start = rng.randrange(0, len(stream) - length)
        prompts.append(stream[start:start + length])
    blocks = sum(cdiv(len(p) + args.max_tokens, BLOCK_SIZE) for p in prompts) + 1
    return dict(prompts=prompts, max_tokens=args.max_tokens, max_model_len=hi + args.max_tokens,
                blocks=blocks, temperature=args.temperature)


def run_setting(args, setting: str, work: dict, tmp: Path) -> dict:
    work_file, result_file = tmp / "work.json", tmp / "result.json"
    work_file.write_text(json.dumps(work))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", setting, "--work-file", str(work_file),
           "--result-file", str(result_file), "--model", args.model, "--seed", str(args.seed)]
    print(f"[{setting}] running ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT / "benchmarks")
    if proc.returncode != 0 or MARKER not in proc.stdout:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise SystemExit(f"[{setting}] failed (rc {proc.returncode}):\n{tail}")
    result = json.loads(result_file.read_text())
    print(f"[{setting}] {result['wall_s']:.0f} s generate ({time.perf_counter() - t0:.0f} s with startup)",
          file=sys.stderr, flush=True)
    return result


def compare(reference: dict, forced: dict, ranges) -> dict:
    """Per range of positions: per-request top-1 agreement and NLL gap."""
    out = {}
    for lo, hi in ranges:
        agree, gap = [], []
        for ref, got in zip(reference["requests"], forced["requests"]):
            idx = range(lo, min(hi, len(ref["top1"])))
            if not idx:
                continue
            agree.append(sum(ref["top1"][i] == got["top1"][i] for i in idx) / len(idx))
            gap.append(sum(got["nll"][i] - ref["nll"][i] for i in idx) / len(idx))
        if agree:
            out[f"{lo}-{hi}"] = dict(agreement=agree, nll_gap=gap)
    return out


def cell(values: list[float], digits: int) -> str:
    mean = sum(values) / len(values)
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def markdown(meta: dict, table: dict, ranges: list[str]) -> str:
    m = meta["machine"]
    lines = [
        "# Long-generation fidelity (teacher-forced along vanilla's sample)", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {m['cpu_model']}, usable CPUs {m['usable_cpus']}, {m['mem_gib']} GiB",
        f"- model: {meta['model_name']}, dtype {DTYPE}, block size {BLOCK_SIZE}, enforce_eager, prefix caching off",
        f"- {meta['num_requests']} requests: Paul Graham essay excerpts of {meta['prompt_len']} tokens (raw text, "
        f"continued), {meta['max_tokens']} generated tokens; reference sampled by vanilla vLLM at temperature "
        f"{meta['temperature']} (the engine's seed), every setting forced along it", "",
        "Top-1 agreement with the whole cache (fraction of positions where both predict the same next token; "
        "1 is no change), mean over requests (range over requests):", "",
        "| setting | " + " | ".join(f"positions {r}" for r in ranges) + " | all |",
        "|---|" + "---:|" * (len(ranges) + 1),
    ]
    for name, rows in table.items():
        lines.append(f"| {name} | " + " | ".join(cell(rows[r]["agreement"], 3) if r in rows else "-"
                                                 for r in ranges) + f" | {cell(rows['all']['agreement'], 3)} |")
    lines += ["", "Log-perplexity gap (mean NLL of the reference tokens, compressed minus whole cache, nats per "
              "token; 0 is no loss), mean over requests (range over requests):", "",
              "| setting | " + " | ".join(f"positions {r}" for r in ranges) + " | all |",
              "|---|" + "---:|" * (len(ranges) + 1)]
    for name, rows in table.items():
        lines.append(f"| {name} | " + " | ".join(cell(rows[r]["nll_gap"], 3) if r in rows else "-"
                                                 for r in ranges) + f" | {cell(rows['all']['nll_gap'], 3)} |")
    lines += ["", f"The reference's own mean NLL: {meta['reference_nll']:.3f} nats per token. Generate time per "
              "setting (s): " + ", ".join(f"{k} {v:.0f}" for k, v in meta["wall_s"].items()) + ".", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.one:
        return run_one(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started, machine = time.time(), machine_info()
    settings = [s for s in args.settings.split(",") if s]
    for s in settings:
        parse_setting(s)  # a bad setting fails before any engine starts
    work = build_work(args)
    ranges = [(lo, hi) for lo, hi in RANGES if lo < args.max_tokens]
    labels = [f"{lo}-{min(hi, args.max_tokens)}" for lo, hi in ranges]
    ranges = [(lo, min(hi, args.max_tokens)) for lo, hi in ranges]
    with tempfile.TemporaryDirectory(prefix="kvc-fidelity-") as tmp:
        reference = run_setting(args, "reference", work, Path(tmp))
        work["reference_tokens"] = [r["tokens"] for r in reference["requests"]]
        table, wall = {}, {"reference": reference["wall_s"]}
        for setting in ["vanilla", *settings]:
            forced = run_setting(args, setting, work, Path(tmp))
            rows = compare(reference, forced, ranges)
            rows["all"] = compare(reference, forced, [(0, args.max_tokens)])[f"0-{args.max_tokens}"]
            table["vanilla (forced, the method's check)" if setting == "vanilla" else setting] = rows
            wall[setting] = forced["wall_s"]
    ref_nll = [sum(r["nll"]) / len(r["nll"]) for r in reference["requests"]]
    meta = dict(command=" ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                date=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), machine=machine,
                model=args.model, model_name=Path(args.model).name, num_requests=args.num_requests,
                prompt_len=args.prompt_len.replace(",", "-"), max_tokens=args.max_tokens,
                temperature=args.temperature, seed=args.seed, settings=settings,
                reference_nll=sum(ref_nll) / len(ref_nll), wall_s=wall, total_s=time.time() - started)
    text = markdown(meta, table, labels)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "longgen_fidelity.md").write_text(text)
    (args.out_dir / "longgen_fidelity.json").write_text(json.dumps(dict(meta=meta, table=table), indent=1))
    print(text)


if __name__ == "__main__":
    main()
