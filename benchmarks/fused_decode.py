"""Fused decode attention + scoring against attention followed by a separate scoring pass, in the engine.

A decode query that a plain-softmax scorer observes (h2o, tova, rkv) gets its
attention and its scores from one op, `decode_attention_with_scores`, while
vLLM's kernel attends one key for that row (see docs/internals.md, "Fused decode"). This
script times that against the path it replaced (vLLM's attention, then the
scoring op over the same keys) on one in-process engine, switching between
the two between runs of the same requests (the switch is this script's: it
empties the step's fused list, so the worker scores those queries with
`window_scores_batched` after vLLM's full attention, as before).

Per mode and repeat: a prefill-only run (max_tokens 1) and a full run; the
decode phase is their difference, for the generate wall time and the time
spent in the attention layers (vLLM's kernel plus the plugin's hooks). Modes
alternate within each repeat, so drift on a shared machine hits both alike.
Greedy tokens of the two modes are compared (different summation orders may
flip a near-tie; the count is reported).

    python benchmarks/fused_decode.py                       # h2o, 16 x 512-1024 tokens, 128 new, 3 repeats
    python benchmarks/fused_decode.py --policy tova --repeats 5

On CPU both paths run the torch ops (CPU_ATTN is vLLM's kernel); on CUDA the
Triton ops and FLASH_ATTN.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("fused", "separate")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="h2o", help="a policy whose scorer observes decode queries (h2o, tova, rkv)")
    p.add_argument("--ratio", type=float, default=0.875)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", default="512-1024", help="min-max prompt tokens (random token ids)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default=None, help="model folder (default: prepare_smollm2())")
    p.add_argument("--out", type=Path, default=RESULTS / "fused_decode.md")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from vllm import LLM, SamplingParams

    import vllm_kvcompress  # noqa: F401  (LLM(kv_compress=...) keywords)
    from kvc_tools.models import prepare_smollm2
    from vllm_kvcompress.vllm_seam import attention
    from vllm_kvcompress.vllm_seam.worker import step_inputs

    fuse = {"on": True}
    step_passes = step_inputs.step_passes

    def switched(worker, *a, **k):
        step = step_passes(worker, *a, **k)
        if step is not None and not fuse["on"]:
            step.fused, step.fused_rows = [], []
        return step

    step_inputs.step_passes = switched
    attention_s = {"total": 0.0}
    impl = attention.KVCompressFlashImpl if _cuda() else attention.KVCompressCPUImpl
    forward = impl.forward

    def timed(self, *a, **k):
        start = time.perf_counter()
        out = forward(self, *a, **k)
        if _cuda():
            import torch

            torch.cuda.synchronize()
        attention_s["total"] += time.perf_counter() - start
        return out

    impl.forward = timed  # type: ignore[method-assign]

    model = args.model or str(prepare_smollm2())
    lo, hi = (int(x) for x in args.prompt_len.split("-"))
    llm = LLM(model=model, dtype="float32" if not _cuda() else "bfloat16", enforce_eager=True, block_size=32,
              max_model_len=hi + args.new_tokens + 32, seed=0, enable_prefix_caching=False,
              kv_compress=args.policy, kv_compress_ratio=args.ratio)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(rng.randint(lo, hi))]}
               for _ in range(args.num_requests)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)

    def run(max_tokens: int):
        attention_s["total"] = 0.0
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                            use_tqdm=False)
        return time.perf_counter() - start, attention_s["total"], [list(o.outputs[0].token_ids) for o in outs]

    decode: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            fuse["on"] = mode == "fused"
            prefill_s, prefill_attn, _ = run(1)
            full_s, full_attn, tokens[mode] = run(args.new_tokens + 1)
            decode[mode].append((full_s - prefill_s, full_attn - prefill_attn))
            print(f"repeat {rep} {mode}: decode {full_s - prefill_s:.2f} s, of it attention layers "
                  f"{full_attn - prefill_attn:.2f} s", flush=True)
    same = sum(a == b for a, b in zip(tokens["fused"], tokens["separate"]))
    steps = args.new_tokens * args.num_requests
    lines = [
        "# Fused decode attention + scoring vs attention then a separate scoring pass (engine)",
        "",
        f"- command: `python benchmarks/fused_decode.py --policy {args.policy} --ratio {args.ratio} "
        f"--num-requests {args.num_requests} --prompt-len {args.prompt_len} --new-tokens {args.new_tokens} "
        f"--repeats {args.repeats}`",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {_machine()}",
        f"- model: {Path(model).name}; {args.num_requests} requests, random prompts of {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens each, greedy; decode phase = full run - prefill-only run",
        "",
        "| mode | decode s, median (range) | attention layers s, median (range) | attention ms per decoded token |",
        "|---|---:|---:|---:|",
    ]
    for mode in MODES:
        wall = [d[0] for d in decode[mode]]
        attn = [d[1] for d in decode[mode]]
        lines.append(f"| {mode} | {statistics.median(wall):.2f} ({min(wall):.2f}-{max(wall):.2f}) | "
                     f"{statistics.median(attn):.2f} ({min(attn):.2f}-{max(attn):.2f}) | "
                     f"{1000 * statistics.median(attn) / steps:.3f} |")
    ratio = statistics.median(d[1] for d in decode["fused"]) / statistics.median(d[1] for d in decode["separate"])
    lines += ["", f"Attention layers in the decode phase, fused / separate: {ratio:.2f}. "
              f"Greedy outputs identical in both modes: {same} of {len(prompts)}.", ""]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                         "decode": decode, "identical": same}, indent=1))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    return f"{cpu}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end"


if __name__ == "__main__":
    main()
