"""kvpress side by side: the plugin and NVIDIA kvpress on the same prompts, model, budget and protocol.

Both sides get the eval suite's prompts (``eval/tasks/data/kvc_<task>_<len>.jsonl``,
built by ``kvc_tools.longctx``; the files are checked against ``MANIFEST.json``),
as the same token ids, and SmolLM2-135M-Instruct (``kvc_tools.models``) in float32:

- plugin: vLLM offline, ONE engine started with ``kv_compress="none"``, every request
  picking its policy through ``SamplingParams(extra_args={"kv_compress": {...}})``
  (``benchmarks/quality.py``'s engine settings and ``kv_args``); raw completion
  prompts, greedy, ``max_tokens`` = the task's ``max_gen_toks``, stop at a blank line;
- kvpress: ``benchmarks/kvpress_worker.py`` in ``.cache/kvpress-venv``
  (``bash scripts/kvpress_venv.sh``), fed the token ids vLLM tokenized: the whole
  prompt is the context kvpress compresses at prefill (no question part), then greedy
  decoding on the compressed cache with the original positions, as kvpress's pipeline
  does; same ``max_tokens`` and stop string.

Budget: ``compression_ratio = 1 - kept`` on both sides. Every row compresses the
prompt ONCE, after prefill (the first token comes from the full-KV prefill on both
sides), and decodes without further eviction: kvpress presses only compress the
prompt, so the plugin's rolling policies (streamingllm, tova, h2o) run with
``trigger: once``.

Methods (kvpress press <-> plugin policy; parameters read from kvpress's own
dataclass defaults in its venv and passed explicitly to both sides):

    snapkv        SnapKVPress(window_size, kernel_size)  <-> snapkv, window, kernel_size
    streamingllm  StreamingLLMPress(n_sink)              <-> streamingllm, sink_tokens, trigger once
    tova          TOVAPress                              <-> tova, trigger once
    h2o           ObservedAttentionPress (eager attn)    <-> h2o (recent_ratio 0.5), trigger once
    chunkkv       ChunkKVPress(SnapKVPress, chunk_length) <-> snapkv, selection chunk, chunk_length

Scores: RULER's ``string_match_all`` (``kvc_tools.longctx``), mean over prompts (equal
counts per task and length). Also counted: prompts whose generations are identical
on the two sides.

    bash scripts/kvpress_venv.sh
    python benchmarks/kvpress_compare.py --tasks niah_single --lengths 1k --samples 2      # smoke
    python benchmarks/kvpress_compare.py --lengths 1k,2k --samples 4 --kept 0.5,0.25

Writes OUT.md (tables, protocol, versions, machine, command, wall time), OUT.csv (one
row per method, kept fraction, task and length), OUT_predictions.jsonl (both
generations of every prompt) and OUT_kvpress_raw.json (the worker's output, reused
by ``--resume``), with OUT = ``--out`` (default benchmarks/results/kvpress_compare).
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]

import quality  # noqa: E402  (benchmarks/quality.py: engine settings, kv_args, formatting)
from machine import machine_info  # noqa: E402

from kvc_tools import longctx  # noqa: E402

DATA = ROOT / "eval" / "tasks" / "data"
KVPRESS_PYTHON = ROOT / ".cache" / "kvpress-venv" / "bin" / "python"
WORKER = ROOT / "benchmarks" / "kvpress_worker.py"
FULL = "full KV"
LENGTHS = {"1k": 1024, "2k": 2048, "4k": 4096}
DEFAULT_METHODS = "snapkv,streamingllm,tova,h2o,chunkkv"


# ------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    name: str
    press: str  # how the kvpress side is described in the tables
    plugin: str  # how the plugin side is described in the tables
    plugin_label: str  # quality.py policy label: "policy:key=value:..."

    def kvpress_spec(self, ratio: float, d: dict, chunk_length: int) -> dict:
        snap = {"class": "SnapKVPress", "kwargs": {"compression_ratio": ratio,
                                                   "window_size": d["SnapKVPress"]["window_size"],
                                                   "kernel_size": d["SnapKVPress"]["kernel_size"]}}
        return {
            "snapkv": snap,
            "streamingllm": {"class": "StreamingLLMPress",
                             "kwargs": {"compression_ratio": ratio, "n_sink": d["StreamingLLMPress"]["n_sink"]}},
            "tova": {"class": "TOVAPress", "kwargs": {"compression_ratio": ratio}},
            "h2o": {"class": "ObservedAttentionPress", "kwargs": {"compression_ratio": ratio}},
            "chunkkv": {"class": "ChunkKVPress", "kwargs": {"press": snap, "chunk_length": chunk_length}},
        }[self.name]


def methods(d: dict, chunk_length: int) -> dict[str, Method]:
    """The five comparisons, with kvpress's defaults ``d`` (``kvpress_worker.py --describe``)."""
    w, k = d["SnapKVPress"]["window_size"], d["SnapKVPress"]["kernel_size"]
    sink = d["StreamingLLMPress"]["n_sink"]
    c = chunk_length
    return {m.name: m for m in (
        Method("snapkv", f"SnapKVPress(window_size={w}, kernel_size={k})",
               f"snapkv, window {w}, kernel_size {k}", f"snapkv:window={w}:kernel_size={k}"),
        Method("streamingllm", f"StreamingLLMPress(n_sink={sink})",
               f"streamingllm, sink_tokens {sink}, trigger once", f"streamingllm:sink_tokens={sink}:trigger=once"),
        Method("tova", "TOVAPress", "tova, trigger once", "tova:trigger=once"),
        Method("h2o", "ObservedAttentionPress (eager attention)", "h2o (recent_ratio 0.5), trigger once",
               "h2o:trigger=once"),
        Method("chunkkv", f"ChunkKVPress(SnapKVPress(window_size={w}, kernel_size={k}), chunk_length={c})",
               f"snapkv, window {w}, kernel_size {k}, selection chunk, chunk_length {c}",
               f"snapkv:window={w}:kernel_size={k}:selection=chunk:chunk_length={c}"),
    )}


# ------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(longctx.TASKS),
                   help=f"comma list of eval-suite tasks (default: all, {','.join(longctx.TASKS)})")
    p.add_argument("--lengths", default="1k,2k", help="comma list of suite lengths, of 1k,2k,4k (default 1k,2k)")
    p.add_argument("--samples", type=int, default=4, help="first N prompts of each task and length (default 4)")
    p.add_argument("--kept", default="0.5,0.25", help="kept fractions, comma list; compression_ratio = 1 - kept")
    p.add_argument("--presses", default=DEFAULT_METHODS, help=f"comma list of methods (default {DEFAULT_METHODS})")
    p.add_argument("--chunk-length", type=int, default=10,
                   help="chunkkv: tokens per chunk on both sides (default 10; kvpress's own default is 20)")
    p.add_argument("--no-full", action="store_true", help="leave out the full-KV reference")
    p.add_argument("--out", type=Path, default=quality.RESULTS / "kvpress_compare",
                   help="output path prefix (default benchmarks/results/kvpress_compare)")
    p.add_argument("--kvpress-python", type=Path, default=KVPRESS_PYTHON,
                   help="python of the kvpress venv (default .cache/kvpress-venv/bin/python)")
    p.add_argument("--kvpress-threads", type=int, default=1,
                   help="torch threads of the kvpress worker (default 1: on a shared 2-core machine two "
                        "threads ran 4-10x slower than one)")
    p.add_argument("--resume", action="store_true",
                   help="reuse kvpress generations from OUT_kvpress_raw.json whose request is unchanged")
    p.add_argument("--model", default=None, help="model folder (default: kvc_tools.models.prepare_smollm2())")
    p.add_argument("--kv-space-gib", default="4", help="VLLM_CPU_KVCACHE_SPACE (GiB) unless already set")
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    for t in args.tasks:
        if t not in longctx.TASKS:
            p.error(f"--tasks: unknown task {t!r}; valid: {', '.join(longctx.TASKS)}")
    args.lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
    for x in args.lengths:
        if x not in LENGTHS:
            p.error(f"--lengths: {x!r} is not one of {', '.join(LENGTHS)}")
    args.kept = sorted({float(x) for x in args.kept.split(",") if x.strip()}, reverse=True)
    for k in args.kept:
        if not 0.0 < k < 1.0:
            p.error(f"--kept: {k} is not in (0, 1)")
    args.presses = [x.strip() for x in args.presses.split(",") if x.strip()]
    for m in args.presses:
        if m not in DEFAULT_METHODS.split(","):
            p.error(f"--presses: unknown method {m!r}; valid: {DEFAULT_METHODS}")
    if args.samples < 1:
        p.error("--samples must be >= 1")
    if not args.presses and args.no_full:
        p.error("nothing to run: no methods and --no-full")
    return args


# ------------------------------------------------------------------------- data


def load_prompts(tasks: list[str], lengths: list[str], n: int) -> tuple[list[dict], dict]:
    """The first ``n`` prompts of each committed suite file, checked against MANIFEST.json."""
    manifest = json.loads((DATA / "MANIFEST.json").read_text())
    out = []
    for length in lengths:
        for task in tasks:
            rel = f"data/{longctx.task_name(task, LENGTHS[length])}.jsonl"
            path = DATA.parent / rel
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if manifest["files"].get(rel) != digest:
                raise SystemExit(f"{path}: sha256 {digest} does not match MANIFEST.json (rebuild the suite)")
            lines = path.read_text().splitlines()
            if len(lines) < n:
                raise SystemExit(f"{path}: {len(lines)} prompts, --samples {n} asked")
            for line in lines[:n]:
                s = json.loads(line)
                s["length_label"] = length
                s["max_tokens"] = manifest["gen_toks"][task]
                s["stop"] = list(longctx.STOPS[task])
                out.append(s)
    return out, manifest


def describe_kvpress(python: Path) -> dict:
    if not Path(python).exists():
        raise SystemExit(f"{python} not found: run `bash scripts/kvpress_venv.sh` first")
    r = subprocess.run([str(python), str(WORKER), "--describe"], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"kvpress worker --describe failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------- plugin side


def run_plugin(args, model: str, prompts: list[dict], cfgs: list[tuple[str, float]], mdefs: dict) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as quality.py: in-process engine core

    import vllm
    from vllm import LLM, SamplingParams

    import vllm_kvcompress

    reqs, meta = [], []
    for method, kept in cfgs:
        label = "none" if method == "none" else mdefs[method].plugin_label
        for s in prompts:
            reqs.append(SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], stop=s["stop"],
                                       extra_args={"kv_compress": quality.kv_args(label, kept)}))
            meta.append((method, kept, s))
    max_model_len = max(LENGTHS[x] for x in args.lengths) + quality.BLOCK_SIZE
    t0 = time.perf_counter()
    llm = LLM(model=model, kv_compress="none", dtype=quality.DTYPE, enforce_eager=True,
              block_size=quality.BLOCK_SIZE, max_model_len=max_model_len, seed=0, max_num_seqs=256,
              enable_prefix_caching=False,  # methods share prompts: each computes its own prefill
              kv_compress_layer_groups=1)
    startup_s = time.perf_counter() - t0
    print(f"[compare] plugin: engine up in {startup_s:.0f} s; {len(reqs)} requests ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    outputs = llm.generate([m[2]["input"] for m in meta], reqs, use_tqdm=True)
    generate_s = time.perf_counter() - t0
    try:
        st = vllm_kvcompress.stats(llm) or {}
    except Exception as e:  # a sanity check, not the result
        print(f"[compare] stats unavailable: {e!r}", file=sys.stderr)
        st = {}
    per_req = {}
    for key, r in (st.get("requests") or {}).items():
        per_req.setdefault(str(key), r)
        per_req.setdefault(str(key).split("-")[0], r)
    results = {}
    for out, (method, kept, s) in zip(outputs, meta):
        r = per_req.get(str(out.request_id)) or per_req.get(str(out.request_id).split("-")[0]) or {}
        o = out.outputs[0]
        n_out = len(o.token_ids)
        # The plugin's tokens_kept: prompt tokens the compression kept (the whole prompt for full KV).
        kept_tok = r.get("tokens_kept") if method != "none" else len(out.prompt_token_ids)
        results[(method, kept, s["task"], s["length_label"], s["index"])] = dict(
            text=o.text, token_ids=list(o.token_ids), prompt_token_ids=list(out.prompt_token_ids),
            finish_reason=o.finish_reason, output_tokens=n_out, prompt_kv_kept=kept_tok)
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    return dict(results=results, startup_s=startup_s, generate_s=generate_s, requests=len(reqs),
                vllm_version=getattr(vllm, "__version__", "?"), max_model_len=max_model_len,
                totals={k: v for k, v in st.items() if k != "requests"})


# ------------------------------------------------------------------------- kvpress side


def request_id(method: str, kept: float, s: dict, spec, ids: list[int], model: str) -> str:
    h = hashlib.sha256(json.dumps([spec, ids, s["max_tokens"], s["stop"], model]).encode()).hexdigest()[:12]
    return f"{method}@{kept:g}/{s['task']}_{s['length_label']}/{s['index']}#{h}"


def run_kvpress(args, model: str, prompts: list[dict], cfgs: list, mdefs: dict, defaults: dict,
                prompt_ids: dict) -> dict:
    raw_path = Path(f"{args.out}_kvpress_raw.json")
    previous = {}
    if args.resume and raw_path.exists():
        previous = json.loads(raw_path.read_text()).get("results", {})
    reqs, ids = [], {}
    for method, kept in cfgs:
        spec = None if method == "none" else mdefs[method].kvpress_spec(round(1.0 - kept, 10), defaults,
                                                                         args.chunk_length)
        for s in prompts:
            key = (s["task"], s["length_label"], s["index"])
            rid = request_id(method, kept, s, spec, prompt_ids[key], model)
            ids[(method, kept, *key)] = rid
            if rid not in previous:
                reqs.append(dict(id=rid, prompt_token_ids=prompt_ids[key], max_new_tokens=s["max_tokens"],
                                 stop=s["stop"], press=spec))
    # Group by attention implementation: the eager model is loaded only when needed.
    reqs.sort(key=lambda r: json.dumps(r["press"] or {}).count("ObservedAttentionPress"))
    t0 = time.perf_counter()
    worker_out: dict = {"results": {}}
    if reqs:
        print(f"[compare] kvpress: {len(reqs)} requests ({len(ids) - len(reqs)} reused) in "
              f"{args.kvpress_python} ...", file=sys.stderr, flush=True)
        # Worker files in the git-ignored .cache/, not beside the results.
        work = ROOT / ".cache" / "kvpress_compare"
        work.mkdir(parents=True, exist_ok=True)
        tmp_in, tmp_out = work / f"{args.out.name}_in.json", work / f"{args.out.name}_out.json"
        tmp_in.write_text(json.dumps(dict(model=model, dtype=quality.DTYPE, threads=args.kvpress_threads,
                                          requests=reqs)))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
                   HF_HUB_DISABLE_PROGRESS_BARS="1", TOKENIZERS_PARALLELISM="false",
                   OMP_NUM_THREADS=str(args.kvpress_threads))
        try:
            subprocess.run([str(args.kvpress_python), str(WORKER), str(tmp_in), str(tmp_out)], env=env, check=True)
            worker_out = json.loads(tmp_out.read_text())
        finally:
            if tmp_out.exists():  # keep what a failed or interrupted run finished, for --resume
                partial = json.loads(tmp_out.read_text())
                merged = {**previous, **partial.get("results", {})}
                raw_path.write_text(json.dumps({**partial, "results": merged}))
                tmp_out.unlink()
            tmp_in.unlink(missing_ok=True)
    else:
        worker_out = json.loads(raw_path.read_text())
    wall_s = time.perf_counter() - t0
    merged = {**previous, **worker_out.get("results", {})}
    results = {k: merged[rid] for k, rid in ids.items()}
    return dict(results=results, wall_s=wall_s, requests=len(reqs), reused=len(ids) - len(reqs),
                threads=worker_out.get("threads"))


# ------------------------------------------------------------------------- report

# What still differs between the two sides of a row (from kvpress 0.5.5's source and the plugin's).
DIFFERENCES = [
    "## Known differences within a row", "",
    "- every row: the attention kernels differ (vLLM's CPU attention vs transformers' sdpa / eager), so even "
    "full KV can diverge where two tokens are nearly tied; the full-KV row measures this floor.",
    "- h2o vs ObservedAttentionPress: kvpress scores a token by its attention averaged over the prompt queries "
    "that see it (sum / number of queries) and keeps no recent window; the plugin's h2o sums the attention (no "
    "division) and keeps the newest `recent_ratio` = 0.5 of the budget (H2O's recent window).",
    "- chunkkv: kvpress's ChunkKVPress cuts the whole prompt (observation window included, scored max) into "
    "chunks, keeps the same chunks for every KV head (scores summed over heads) and keeps int(n_chunks * kept) "
    "whole chunks (a few tokens under the budget); the plugin protects the window, ranks chunks per KV head and "
    "fills the budget exactly (the last chunk truncated).",
    "- tova: kvpress always keeps the last prompt token; the plugin's tova (window 0) keeps it only by score.",
    "- snapkv and streamingllm: the same algorithm on both sides (window, kernel, sinks passed explicitly).",
    "",
]


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def build_rows(cfgs, prompts, plugin, kvp) -> list[dict]:
    """One row per (method, kept, task, length), with per-prompt details kept aside."""
    rows = {}
    for method, kept in cfgs:
        for s in prompts:
            key = (method, kept, s["task"], s["length_label"], s["index"])
            p, k = plugin[key], kvp[key]
            cell = rows.setdefault((method, kept, s["task"], s["length_label"]), dict(
                method=method, kept_fraction=kept, task=s["task"], length=s["length_label"], pl=[], kv=[],
                same=0, pl_kv=[], kv_kv=[], prompt=[]))
            cell["pl"].append(longctx.string_match_all(p["text"], s["outputs"]))
            cell["kv"].append(longctx.string_match_all(k["text"], s["outputs"]))
            cell["same"] += int(p["text"] == k["text"])
            cell["prompt"].append(len(p["prompt_token_ids"]))
            if p.get("prompt_kv_kept") is not None:
                cell["pl_kv"].append(p["prompt_kv_kept"])
            kv_pre = k["kv_tokens_after_prefill"]
            cell["kv_kv"].append(kv_pre if isinstance(kv_pre, int) else mean(kv_pre))
    out = []
    for c in rows.values():
        out.append(dict(method=c["method"], kept_fraction=c["kept_fraction"], task=c["task"], length=c["length"],
                        n=len(c["pl"]), plugin_score=round(mean(c["pl"]), 4), kvpress_score=round(mean(c["kv"]), 4),
                        identical=c["same"], mean_prompt_tokens=round(mean(c["prompt"]), 1),
                        plugin_mean_prompt_kv_kept=round(mean(c["pl_kv"]), 1) if c["pl_kv"] else None,
                        kvpress_mean_prompt_kv_kept=round(mean(c["kv_kv"]), 1)))
    return out


CSV_FIELDS = ["method", "kept_fraction", "task", "length", "n", "plugin_score", "kvpress_score", "identical",
              "mean_prompt_tokens", "plugin_mean_prompt_kv_kept", "kvpress_mean_prompt_kv_kept"]


def aggregate(rows, key) -> dict:
    """Sum of n / identical and n-weighted mean scores, grouped by key(row)."""
    g = {}
    for r in rows:
        a = g.setdefault(key(r), dict(n=0, pl=0.0, kv=0.0, same=0))
        a["n"] += r["n"]
        a["pl"] += r["plugin_score"] * r["n"]
        a["kv"] += r["kvpress_score"] * r["n"]
        a["same"] += r["identical"]
    return {k: dict(n=a["n"], pl=a["pl"] / a["n"], kv=a["kv"] / a["n"], same=a["same"]) for k, a in g.items()}


def markdown(run: dict, rows: list[dict], cfgs: list, mdefs: dict) -> str:
    m, kp = run["machine"], run["kvpress_info"]
    kept = run["kept"]
    names = ([] if run["no_full"] else ["none"]) + run["methods"]
    by_mk = aggregate(rows, lambda r: (r["method"], r["kept_fraction"]))
    fmt = quality.fmt

    def name(method):
        return FULL if method == "none" else method

    def ks(method):
        return [1.0] if method == "none" else kept

    lines = [
        "# Plugin vs NVIDIA kvpress, side by side", "",
        f"- command: `{run['command']}`",
        f"- date: {run['date']}; wall time {run['wall_s']:.0f} s "
        f"(plugin: engine start {run['plugin_startup_s']:.0f} s, "
        f"generate {run['plugin_generate_s']:.0f} s for {run['plugin_requests']} requests in one `llm.generate`; "
        f"kvpress: {run['kvpress_wall_s']:.0f} s for {run['kvpress_requests']} requests one by one, "
        f"{run['kvpress_reused']} reused, torch threads {run['kvpress_threads']})",
        f"- machine: {m['cpu_model']}, {m['cpuinfo_processors']} processors, {m['usable_cpus']} usable, "
        f"{m['mem_gib']} GiB RAM, load average at start {m['loadavg_at_start']} (shared with other jobs); "
        f"{m['platform']}, Python {m['python']}",
        f"- model: {run['model_name']} (`{run['model']}`), float32, greedy, on both sides",
        f"- plugin: vLLM {run['vllm_version']} (CPU), one engine `kv_compress=\"none\"`, policy per request via "
        f"`extra_args`, block size {quality.BLOCK_SIZE}, enforce_eager, max_model_len {run['max_model_len']}",
        f"- kvpress: kvpress {kp['kvpress']}, transformers {kp['transformers']}, torch {kp['torch']} "
        "(`.cache/kvpress-venv`, `bash scripts/kvpress_venv.sh`), `benchmarks/kvpress_worker.py`; sdpa attention, "
        "eager for ObservedAttentionPress",
        f"- prompts: eval suite `eval/tasks/data` (checked against MANIFEST.json), first {run['samples']} of each of "
        f"{', '.join(run['tasks'])} at {', '.join(run['lengths'])} tokens = {run['prompts']} prompts; raw completion "
        "prompts, the same token ids on both sides; `max_tokens` = the task's max_gen_toks, stop at a blank line; "
        "score = RULER string_match_all, mean over prompts",
        "- protocol: the WHOLE prompt is compressed once after prefill, `compression_ratio = 1 - kept` on both "
        "sides (first token from the full-KV prefill), then greedy decoding on the compressed cache with the "
        "original positions and no further eviction; the plugin's rolling policies (streamingllm, tova, h2o) run "
        "with `trigger: once` for this",
        "- budget rounding: kvpress keeps int(L * kept) tokens, the plugin L - floor(L * ratio): they differ by "
        "one token when L * kept is not whole",
    ]
    if run["prompts"] < 6:
        lines.append(f"- **{run['prompts']} prompts: a smoke test, the scores mean little**")
    else:
        lines.append(f"- {run['samples']} prompts per task and length, {run['prompts']} per cell of the first two "
                     f"tables: a coarse picture (one prompt moves a cell by up to 1/{run['prompts']})")
    def method_table(title: str, note: str, cell) -> list[str]:
        """One row per method, one column per kept fraction; `cell(a)` renders a cell's aggregate."""
        out = ["", title, "", note, "", "| method | " + " | ".join(f"kept {quality.frac(k)}" for k in kept) + " |",
               "|---|" + "---:|" * len(kept)]
        for meth in names:
            cells = [by_mk.get((meth, 1.0 if meth == "none" else k)) for k in kept]
            out.append(f"| {name(meth)} | " + " | ".join("-" if a is None else cell(a) for a in cells) + " |")
        return out

    lines += method_table("## Score: plugin / kvpress",
                          "Mean string_match_all over all prompts; each cell is `plugin / kvpress`.",
                          lambda a: f"{fmt(a['pl'])} / {fmt(a['kv'])}")
    lines += method_table("## Identical generations",
                          "Prompts whose generated text is the same on both sides (out of the prompts run).",
                          lambda a: f"{a['same']}/{a['n']}")
    lines += ["", "Differing generations on prompts where the two sides kept a different number of prompt tokens "
              "(budget rounding; ChunkKVPress's whole chunks): "
              + ", ".join(f"{name(meth)} {run['other_budget'].get(meth, [0, 0])[0]} of "
                          f"{run['other_budget'].get(meth, [0, 0])[1]}" for meth in names) + "."]
    lines += ["", "## Methods", "", "| method | kvpress press | plugin policy (`extra_args`) |", "|---|---|---|"]
    if not run["no_full"]:
        lines.append(f"| {FULL} | no press | `{json.dumps(quality.kv_args('none', 1.0))}` |")
    for meth in run["methods"]:
        md = mdefs[meth]
        spec = json.dumps(quality.kv_args(md.plugin_label, kept[0]))
        lines.append(f"| {meth} | {md.press} | {md.plugin}: `{spec}` (kept {quality.frac(kept[0])}) |")

    tasks, lengths = run["tasks"], run["lengths"]
    by_task = aggregate(rows, lambda r: (r["method"], r["kept_fraction"], r["task"]))
    by_len = aggregate(rows, lambda r: (r["method"], r["kept_fraction"], r["length"]))
    lines += ["", "## Per task (plugin / kvpress, lengths pooled)", "",
              "| method | kept | " + " | ".join(tasks) + " |", "|---|---|" + "---:|" * len(tasks)]
    for meth in names:
        for k in ks(meth):
            cells = [by_task.get((meth, k, t)) for t in tasks]
            lines.append(f"| {name(meth)} | {quality.frac(k)} | "
                         + " | ".join("-" if a is None else f"{fmt(a['pl'], 2)} / {fmt(a['kv'], 2)}" for a in cells)
                         + " |")
    kv_end = {}
    for r in rows:
        e = kv_end.setdefault((r["method"], r["kept_fraction"], r["length"]), dict(p=[], pl=[], kv=[]))
        e["p"].append(r["mean_prompt_tokens"])
        if r["plugin_mean_prompt_kv_kept"] is not None:
            e["pl"].append(r["plugin_mean_prompt_kv_kept"])
        e["kv"].append(r["kvpress_mean_prompt_kv_kept"])
    lines += ["", "## Per length (plugin / kvpress, tasks pooled)", "",
              "| method | kept | " + " | ".join(f"{x} score" for x in lengths) + " | "
              + " | ".join(f"{x} identical" for x in lengths) + " | "
              + " | ".join(f"{x} prompt tok: kept plugin / kvpress" for x in lengths) + " |",
              "|---|---|" + "---:|" * (3 * len(lengths))]
    for meth in names:
        for k in ks(meth):
            sc, same, kv = [], [], []
            for x in lengths:
                a = by_len.get((meth, k, x))
                sc.append("-" if a is None else f"{fmt(a['pl'])} / {fmt(a['kv'])}")
                same.append("-" if a is None else f"{a['same']}/{a['n']}")
                e = kv_end.get((meth, k, x))
                kv.append("-" if e is None else f"{fmt(mean(e['p']), 0)}: {fmt(mean(e['pl']), 0)} / "
                          f"{fmt(mean(e['kv']), 0)}")
            lines.append(f"| {name(meth)} | {quality.frac(k)} | " + " | ".join(sc + same + kv) + " |")
    lines += ["",
              "Prompt tokens and the prompt KV kept by the compression (mean per layer and head): plugin (its "
              "`tokens_kept` stat) / kvpress (cache length after the prefill).", "",
              *DIFFERENCES,
              f"Per-prompt generations of both sides: `{Path(run['predictions']).name}`; per task and length: "
              f"`{Path(run['csv']).name}`.", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------- main


def main(argv=None) -> int:
    t_start = time.perf_counter()
    args = parse_args(argv)
    command = " ".join(shlex.quote(a) for a in (["python", "benchmarks/kvpress_compare.py"]
                                                 + (sys.argv[1:] if argv is None else list(argv))))
    date = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    machine = machine_info()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    kvpress_info = describe_kvpress(args.kvpress_python)
    mdefs = methods(kvpress_info["defaults"], args.chunk_length)
    prompts, _ = load_prompts(args.tasks, args.lengths, args.samples)
    cfgs = ([] if args.no_full else [("none", 1.0)]) + [(m, k) for m in args.presses for k in args.kept]
    from kvc_tools.models import prepare_smollm2

    model = args.model or str(prepare_smollm2())
    print(f"[compare] {len(prompts)} prompts x {len(cfgs)} configs per side; kvpress {kvpress_info['kvpress']}, "
          f"transformers {kvpress_info['transformers']}", file=sys.stderr, flush=True)

    plugin = run_plugin(args, model, prompts, cfgs, mdefs)
    prompt_ids = {}
    for (_, _, task, length, index), r in plugin["results"].items():
        prompt_ids.setdefault((task, length, index), r["prompt_token_ids"])
    kvp = run_kvpress(args, model, prompts, cfgs, mdefs, kvpress_info["defaults"], prompt_ids)

    rows = build_rows(cfgs, prompts, plugin["results"], kvp["results"])
    csv_path, md_path = Path(f"{args.out}.csv"), Path(f"{args.out}.md")
    pred_path = Path(f"{args.out}_predictions.jsonl")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r[k]) for k in CSV_FIELDS})
    with open(pred_path, "w") as f:
        for method, kept in cfgs:
            for s in prompts:
                key = (method, kept, s["task"], s["length_label"], s["index"])
                p, k = plugin["results"][key], kvp["results"][key]
                f.write(json.dumps(dict(
                    method=method, kept_fraction=kept, task=s["task"], length=s["length_label"], index=s["index"],
                    outputs=s["outputs"], prompt_tokens=len(p["prompt_token_ids"]),
                    plugin=p["text"], kvpress=k["text"], identical=p["text"] == k["text"],
                    plugin_score=longctx.string_match_all(p["text"], s["outputs"]),
                    kvpress_score=longctx.string_match_all(k["text"], s["outputs"]),
                    plugin_prompt_kv_kept=p["prompt_kv_kept"],
                    kvpress_kv_tokens_after_prefill=k["kv_tokens_after_prefill"])) + "\n")
    other_budget: dict[str, list[int]] = {}  # method -> [differing with other kept counts, differing]
    for method, kept in cfgs:
        for s in prompts:
            key = (method, kept, s["task"], s["length_label"], s["index"])
            p, k = plugin["results"][key], kvp["results"][key]
            if p["text"] != k["text"]:
                c = other_budget.setdefault(method, [0, 0])
                c[1] += 1
                c[0] += int(p["prompt_kv_kept"] != k["kv_tokens_after_prefill"])
    wall_s = time.perf_counter() - t_start
    run = dict(command=command, date=date, machine=machine, model=model, model_name=Path(model).name,
               kvpress_info=kvpress_info, vllm_version=plugin["vllm_version"], max_model_len=plugin["max_model_len"],
               samples=args.samples, tasks=args.tasks, lengths=args.lengths, kept=args.kept, methods=args.presses,
               no_full=args.no_full, prompts=len(prompts), wall_s=wall_s, plugin_startup_s=plugin["startup_s"],
               plugin_generate_s=plugin["generate_s"], plugin_requests=plugin["requests"],
               kvpress_wall_s=kvp["wall_s"], kvpress_requests=kvp["requests"], kvpress_reused=kvp["reused"],
               kvpress_threads=kvp["threads"], csv=str(csv_path), predictions=str(pred_path),
               other_budget=other_budget)
    md = markdown(run, rows, cfgs, mdefs)
    md_path.write_text(md)
    print("\n" + md.split("## Methods")[0])
    print(f"wrote {md_path}, {csv_path}, {pred_path}; total wall time {wall_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
