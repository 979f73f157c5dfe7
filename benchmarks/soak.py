"""Soak: does a compressing server's memory grow with the requests it serves?

One `vllm serve` with compression (`--compress`, `--ratio`; prefix caching on,
a small pool so that requests are preempted) under mixed traffic for
`--duration` minutes, split into phases: `--phases` compressed phases, then
`--control-phases` phases on the same server in which every request asks for
`kv_compress: none`. Clients (`--clients` at once) send completions with token
prompts: `--stream` of them streamed, `--abort` of the streamed ones dropped
mid-stream, a third starting with one of a few shared prefixes (prefix-cache
hits), policies per request through `vllm_xargs` (16 settings), and
`--hostile` of them a bad request that must get a 400. At the end of each
phase (once the server is idle) every process's RSS is read with psutil: the
API server (the `vllm serve` process), `VLLM::EngineCore` and `VLLM::Worker`
(by process title). Prints a Markdown table of RSS per phase per process and
the phase's request counts.

    python benchmarks/soak.py --duration 6 --phases 4 --control-phases 2
    python benchmarks/soak.py --model ~/.cache/vllm_kvcompress/models/smollm2-135m-instruct \\
        --duration 180 --phases 12 --control-phases 4 --clients 24   # hours elsewhere
    python benchmarks/soak.py --env MALLOC_ARENA_MAX=2   # the server's environment

A server that runs for days must not grow: compare the last compressed
phases with the first ones (after warm-up) and with the control phases.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # server_utils: the tests' `vllm serve` starter

# Per-request settings, as `vllm_xargs` (16 of them, drawn at random).
POLICIES: list[dict] = [
    {"kv_compress": "snapkv-span"},
    {"kv_compress": "snapkv-span", "kv_compress_ratio": 0.5},
    {"kv_compress": "snapkv", "kv_compress_budget": 64},
    {"kv_compress": "snapkv", "kv_compress_ratio": 0.875},
    {"kv_compress": "h2o", "kv_compress_budget": 96, "kv_compress_interval": 16},
    {"kv_compress": "h2o", "kv_compress_ratio": 0.75},
    {"kv_compress": "tova", "kv_compress_budget": 64},
    {"kv_compress": "tova", "kv_compress_ratio": 0.5, "kv_compress_interval": 8},
    {"kv_compress": "keyformer", "kv_compress_budget": 96},
    {"kv_compress": "rkv", "kv_compress_budget": 96, "kv_compress_interval": 16},
    {"kv_compress": "streamingllm", "kv_compress_budget": 64},
    {"kv_compress": "adakv", "kv_compress_budget": 96},
    {"kv_compress": "knorm", "kv_compress_ratio": 0.5},
    {"kv_compress": "random", "kv_compress_budget": 64},
    {"kv_compress": "snapkv-span", "kv_compress_protect_prefix": 32},
    {},  # the engine's own setting
]
CONTROL = {"kv_compress": "none"}
# Bad requests: each must be a 400, never a 5xx.
HOSTILE: list[dict] = [
    {"kv_compress": "snapkv", "kv_compress_budget": True},
    {"kv_compress": "no-such-policy"},
    {"kv_compress": "snapkv", "kv_compress_budget": 10**12},
    {"kv_compress": "snapkv", "kv_compress_interval": -3},
    {"kv_compress": "x" * 100_000},
    {"kv_compress.budget": 64},
]
PROCESS_KINDS = ("API server", "EngineCore", "Worker")


def process_kind(proc, root_pid: int) -> str | None:
    """Which of the server's processes this is (None: a helper, not sampled apart)."""
    import psutil

    try:
        if proc.pid == root_pid:
            return "API server"
        title = " ".join([proc.name()] + proc.cmdline())
    except psutil.Error:
        return None
    for kind in ("EngineCore", "Worker"):
        if f"VLLM::{kind}" in title:
            return kind
    return None


def sample_rss(root_pid: int) -> dict[str, float]:
    """MB of RSS per process kind, and the process tree's total."""
    import psutil

    out = dict.fromkeys(PROCESS_KINDS, 0.0)
    total = 0.0
    root = psutil.Process(root_pid)
    for proc in [root, *root.children(recursive=True)]:
        try:
            rss = proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
        total += rss
        kind = process_kind(proc, root_pid)
        if kind is not None:
            out[kind] += rss
    out["total"] = total
    return out


class Traffic:
    """The clients of one phase and what their requests got."""

    def __init__(self, url: str, model: str, args, control: bool, rng: random.Random,
                 prefixes: list[list[int]]) -> None:
        self.url, self.model, self.args, self.control, self.rng = url, model, args, control, rng
        self.prefixes = prefixes
        self.counts = dict.fromkeys(("ok", "streamed", "aborted", "hostile 400", "prefix", "unexpected"), 0)
        self.problems: list[str] = []

    def body(self) -> tuple[dict, bool]:
        rng, args = self.rng, self.args
        prompt = [rng.randrange(3, args.vocab) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        if rng.random() < 1 / 3:
            prompt = rng.choice(self.prefixes) + prompt[: args.max_prompt - args.prefix_len]
            self.counts["prefix"] += 1
        hostile = rng.random() < args.hostile
        if hostile:
            xargs = rng.choice(HOSTILE)
        else:
            xargs = CONTROL if self.control else rng.choice(POLICIES)
        body = {"model": self.model, "prompt": prompt, "max_tokens": rng.randint(8, args.max_tokens),
                "temperature": rng.choice((0, 0.8)), "ignore_eos": True}
        if xargs:
            body["vllm_xargs"] = xargs
        return body, hostile

    async def one(self, session) -> None:
        body, hostile = self.body()
        stream = not hostile and self.rng.random() < self.args.stream
        abort_after = self.rng.randint(1, 8) if stream and self.rng.random() < self.args.abort else None
        body["stream"] = stream
        async with session.post(self.url + "/v1/completions", json=body) as response:
            if hostile:
                await response.read()
                if response.status == 400:
                    self.counts["hostile 400"] += 1
                else:
                    self.counts["unexpected"] += 1
                    self.problems.append(f"hostile {str(body.get('vllm_xargs'))[:80]}: HTTP {response.status}")
                return
            if response.status != 200:
                self.counts["unexpected"] += 1
                self.problems.append(f"HTTP {response.status}: {(await response.text())[:200]}")
                return
            if not stream:
                await response.read()
                self.counts["ok"] += 1
                return
            events = 0
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    self.counts["unexpected"] += 1
                    self.problems.append(f"stream error: {str(data['error'])[:200]}")
                    return
                events += 1
                if abort_after is not None and events >= abort_after:
                    response.close()  # the client goes away mid-stream: vLLM aborts the request
                    self.counts["aborted"] += 1
                    return
            self.counts["streamed"] += 1

    async def client(self, session, deadline: float) -> None:
        import aiohttp

        while time.monotonic() < deadline:
            try:
                await self.one(session)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.counts["unexpected"] += 1
                self.problems.append(f"{type(e).__name__}: {e}"[:200])

    async def run(self, seconds: float) -> None:
        import aiohttp

        deadline = time.monotonic() + seconds
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self.client(session, deadline) for _ in range(self.args.clients)))


def wait_idle(url: str, timeout: float = 120) -> None:
    """Until the server runs and waits for no request (its /metrics gauges)."""
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = requests.get(url + "/metrics", timeout=30).text
        busy = 0.0
        for line in text.splitlines():
            if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        time.sleep(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="default: the seeded tiny Llama (kvc_tools.models.build_tiny_llama)")
    p.add_argument("--duration", type=float, default=6.0, help="minutes of traffic, all phases together")
    p.add_argument("--phases", type=int, default=4, help="compressed phases")
    p.add_argument("--control-phases", type=int, default=2, help="kv_compress none phases, after them")
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--compress", default="snapkv-span")
    p.add_argument("--ratio", type=float, default=0.75)
    p.add_argument("--stream", type=float, default=0.75, help="share of requests streamed")
    p.add_argument("--abort", type=float, default=0.4, help="share of streamed requests dropped mid-stream")
    p.add_argument("--hostile", type=float, default=0.04, help="share of bad requests (400s)")
    p.add_argument("--min-prompt", type=int, default=64)
    p.add_argument("--max-prompt", type=int, default=700)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--prefix-len", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=160, help="KV blocks of 32 tokens (a small pool preempts)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server's environment")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the phases here too")
    args = p.parse_args()

    from server_utils import Server

    if args.model is None:
        from kvc_tools.models import build_tiny_llama, default_cache_root

        args.model = str(build_tiny_llama(default_cache_root() / "models" / "tiny-llama-seed0", seed=0))
    config = json.loads((Path(args.model) / "config.json").read_text())
    args.vocab = min(config.get("vocab_size", 2000), 2000)
    env = dict(kv.split("=", 1) for kv in args.env)
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "serve.log"
    flags = ["--kv-compress", args.compress, "--kv-compress-ratio", str(args.ratio),
             "--num-gpu-blocks-override", str(args.num_blocks), "--enable-prefix-caching",
             "--max-model-len", str(args.max_model_len)]
    print(f"vllm serve {args.model} {' '.join(flags)} (env {env or '-'}; log {log})", file=sys.stderr, flush=True)
    started = time.monotonic()
    server = Server(args.model, *flags, log=log, env=env)
    print(f"server up in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(3, args.vocab) for _ in range(args.prefix_len)] for _ in range(4)]
    phases: list[dict] = []
    try:
        start_rss = sample_rss(server.proc.pid)
        phases.append({"phase": "start", "kind": "-", "seconds": 0, **start_rss})
        seconds = args.duration * 60 / (args.phases + args.control_phases)
        for i in range(args.phases + args.control_phases):
            control = i >= args.phases
            traffic = Traffic(server.url, args.model, args, control, rng, prefixes)
            t0 = time.monotonic()
            asyncio.run(traffic.run(seconds))
            wait_idle(server.url)
            rss = sample_rss(server.proc.pid)
            row = {"phase": str(i + 1), "kind": "none (control)" if control else "compressed",
                   "seconds": round(time.monotonic() - t0), **traffic.counts, **rss}
            phases.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            for problem in traffic.problems[:5]:
                print(f"  problem: {problem}", file=sys.stderr, flush=True)
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server died:\n{server.output()[-3000:]}")
    finally:
        server.stop()
    print(table(phases, args, env))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "env": env, "machine": machine_info(), "phases": phases}, indent=1))


def table(phases: list[dict], args, env: dict) -> str:
    counts = ("ok", "streamed", "aborted", "prefix", "hostile 400", "unexpected")
    head = ["phase", "traffic", "s", *counts, "served so far", *(f"{k} MB" for k in PROCESS_KINDS), "all MB"]
    lines = [f"`--kv-compress {args.compress} --kv-compress-ratio {args.ratio}`, {args.clients} clients, "
             f"{args.num_blocks} blocks, model {Path(args.model).name}" + (f", env {env}" if env else ""),
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    served = 0
    for row in phases:
        served += sum(row.get(c, 0) for c in ("ok", "streamed", "aborted", "hostile 400", "unexpected"))
        cells = [row["phase"], row["kind"], str(row["seconds"]), *(str(row.get(c, "")) for c in counts),
                 str(served), *(f"{row[k]:.0f}" for k in PROCESS_KINDS), f"{row['total']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
