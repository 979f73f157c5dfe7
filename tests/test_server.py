"""The real OpenAI server with compression: endpoints, per-request control, metrics, shutdown.

Every check runs against one rank, against tensor parallelism over two
(`--tensor-parallel-size 2`, a CPU core per rank) and against data parallelism
over two engine cores (`--data-parallel-size 2`: two schedulers behind one API
server and vLLM's DP coordinator, /metrics summed over both). Each server takes its settings
as users give them: a recipe (`--kv-compress-config`) with flags over it, and
the resolved settings must reach every scheduler and worker process."""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from helpers import random_prompts, vllm_at_least
from server_utils import Server

TIMEOUT = 120


PARALLEL = {"tp1": [], "tp2": ["--tensor-parallel-size", "2"], "dp2": ["--data-parallel-size", "2"]}


# The recipe's budget and window, with flags over it: budget 64 replaces the
# recipe's 96, kernel_size 3 is added. ENGINE is what every process must hold.
RECIPE = "kv_compress:\n  policy: snapkv\n  budget: 96\n  window: 8\n"
FLAGS = ["--kv-compress-budget", "64", "--kv-compress-kernel-size", "3"]
ENGINE = {"policy": "snapkv", "budget": 64, "window": 8, "kernel_size": 3}


# Data parallelism also on Model Runner V2: an idle rank's dummy runs build
# attention metadata with no step of the plugin's (the tests marked mrv2).
# Several ranks or engines: in the extended run (`.ci/run`), as every server test runs on one rank by default.
@pytest.fixture(scope="module", params=[pytest.param(p, marks=[pytest.mark.extended, *([pytest.mark.mrv2] if p == "dp2"
                                                                                        else [])])
                                        if p != "tp1" else p for p in sorted(PARALLEL)])
def server(request, tiny_model, tmp_path_factory):
    # Prefix caching on (vLLM's default): a repeated prompt hits it (reported
    # in the usage), and its answer is the same.
    folder = tmp_path_factory.mktemp("serve")
    (folder / "recipe.yaml").write_text(RECIPE)
    srv = Server(tiny_model, "--kv-compress-config", str(folder / "recipe.yaml"), *FLAGS, "--max-num-seqs", "8",
                 "--enable-prompt-tokens-details", *PARALLEL[request.param], log=folder / "serve.log",
                 env=parallel_env(request.param))
    srv.parallel = request.param
    yield srv
    srv.stop()


def parallel_env(parallel: str) -> dict[str, str] | None:
    """Tensor parallelism on CPU needs a core per rank. Data parallelism from
    vLLM 0.34 on gives each engine a NUMA node of its own, which this machine
    (one node) lacks: VLLM_CPU_SIM_MULTI_NUMA, vLLM's switch for such hosts,
    splits the node's cores between the engines (with its automatic binding)."""
    if parallel == "tp2":
        return {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    if parallel == "dp2":  # vLLM's binding over both cores (not the one this xdist worker is pinned to)
        return {"VLLM_CPU_OMP_THREADS_BIND": "auto", **({"VLLM_CPU_SIM_MULTI_NUMA": "1"} if vllm_at_least("0.34")
                                                        else {})}
    return None


def complete(server, prompt, **kw):
    body = {"model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, **kw}
    return requests.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=TIMEOUT).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out


def cached_tokens(usage: dict) -> int:
    """Prompt tokens the server took from its prefix cache."""
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def expected_text(tiny_model, prompt, config: dict | None, new_tokens: int = 16) -> str:
    return _expected_text(tiny_model, tuple(prompt), json.dumps(config, sort_keys=True), new_tokens)


@functools.cache  # the same answers are wanted from each of the three servers
def _expected_text(tiny_model, prompt, config_json: str, new_tokens: int) -> str:
    from transformers import AutoTokenizer

    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.config import KVCompressConfig

    config = json.loads(config_json)
    cfg = KVCompressConfig.from_dict(config) if config else None
    tokens = ReferenceDecoder(tiny_model).generate(list(prompt), new_tokens, cfg)["tokens"]
    return AutoTokenizer.from_pretrained(tiny_model).decode(tokens)


def test_settings_reach_every_scheduler_and_worker(server):
    """The recipe with flags over it, resolved once, is what each engine core's
    scheduler and each worker (every tensor-parallel rank, every data-parallel
    engine) logs when it is ready."""
    cores, ranks = (2, 1) if server.parallel == "dp2" else (1, 2 if server.parallel == "tp2" else 1)
    ready = [line for line in server.output().splitlines() if "kv_compress" in line and "ready" in line]
    schedulers = [ln for ln in ready if re.search(r"EngineCore.*scheduler ready", ln)]
    workers = [ln for ln in ready if re.search(r"Worker.*worker ready", ln)]
    assert len(schedulers) == cores and len(workers) == cores * ranks, ready
    assert all(str(ENGINE) in ln for ln in schedulers + workers), ready
    assert {re.search(r"rank (\d) of", ln).group(1) for ln in workers} == {str(r) for r in range(ranks)}


def test_completion_chat_and_streaming(server, tiny_model):
    """The same prompt plain and streamed: the second hits the prefix cache, and
    both equal the reference decoder (a hit never changes the answer)."""
    (prompt,) = random_prompts((300,), seed=41)
    plain = complete(server, prompt)
    assert plain.status_code == 200, plain.text
    body = plain.json()
    want = expected_text(tiny_model, prompt, ENGINE)
    assert body["choices"][0]["text"] == want
    streamed = requests.post(server.url + "/v1/completions", stream=True, timeout=TIMEOUT, json={
        "model": server.model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in streamed.iter_lines(decode_unicode=True)
              if line.startswith("data: ") and line != "data: [DONE]"]
    usage = next(c["usage"] for c in chunks if c.get("usage"))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    if server.parallel != "dp2":  # under data parallelism it may go to the other engine
        assert cached_tokens(usage) > 0, usage
    assert text == want
    chat = requests.post(server.url + "/v1/chat/completions", timeout=TIMEOUT, json={
        "model": server.model, "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "tell me a long story " * 60}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["completion_tokens"] == 12


def test_per_request_control_through_vllm_xargs(server, tiny_model):
    (prompt,) = random_prompts((260,), seed=43)
    off = complete(server, prompt, vllm_xargs={"kv_compress": "none"}, ignore_eos=True)
    h2o = complete(server, prompt, vllm_xargs={"kv_compress": "h2o", "kv_compress_budget": 48}, ignore_eos=True)
    # KVzip's repeat passes are requests of the engine's own: their outputs never reach a client.
    kvzip = complete(server, prompt, vllm_xargs={"kv_compress": "kvzip", "kv_compress_budget": 48,
                                                 "kv_compress_chunk_size": 100}, ignore_eos=True)
    assert off.status_code == h2o.status_code == kvzip.status_code == 200, (off.text, h2o.text, kvzip.text)
    for response, config in ((off, None), (h2o, {"policy": "h2o", "budget": 48}),
                             (kvzip, {"policy": "kvzip", "budget": 48, "chunk_size": 100})):
        body = response.json()
        assert body["choices"][0]["text"] == expected_text(tiny_model, prompt, config)


@pytest.mark.parametrize("xargs, field", [
    ({"kv_compress": "snapkv", "kv_compress_budget": 4}, "kv_compress.budget"),
    ({"kv_compress": "h2o", "kv_compress_budget": 64, "kv_compress_pooling": "avg"}, "kv_compress.pooling"),
    ({"kv_compress": "wat"}, "kv_compress.policy"),
    ({"kv_compress_ratio": 1.5}, "kv_compress.compression_ratio"),
    ({"kv_compress_protect_prefix": -1}, "kv_compress.protect_prefix"),
    ({"kv_compress_protect_prefix": "all"}, "kv_compress.protect_prefix"),
    ({"kv_compress_protect_prefix": 4}, "kv_compress.protect_prefix: 4 is longer than the prompt (3 tokens)"),
])
def test_invalid_per_request_values_are_400_and_the_server_keeps_serving(server, xargs, field):
    bad = complete(server, [5, 6, 7], vllm_xargs=xargs)
    assert bad.status_code == 400, bad.text
    assert field in bad.json()["error"]["message"]
    assert complete(server, [5, 6, 7]).status_code == 200


def test_many_concurrent_requests_and_metrics(server):
    prompts = random_prompts([40 + 23 * i for i in range(20)], seed=47)
    xargs = [None, {"kv_compress": "h2o", "kv_compress_budget": 48}, {"kv_compress": "none"},
             {"kv_compress": "streamingllm", "kv_compress_ratio": 0.5},
             {"kv_compress": "kvzip", "kv_compress_ratio": 0.5}]

    def one(i):
        return complete(server, prompts[i], max_tokens=24, ignore_eos=True, vllm_xargs=xargs[i % len(xargs)])

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        results = list(pool.map(one, range(len(prompts))))
    assert [r.status_code for r in results] == [200] * len(prompts)
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in results)
    m = metrics(server)
    assert m["vllm:kv_compress_tokens_evicted_total"] > 0
    assert m["vllm:kv_compress_blocks_freed_total"] > 0
    assert m["vllm:kv_compress_compressions_total"] >= m["vllm:kv_compress_requests_compressed_total"] > 0
    assert m["vllm:kv_compress_request_compression_ratio_count"] > 0
    assert m["vllm:kv_compress_seconds_total{phase=scoring}"] > 0
    assert m["vllm:kv_compress_seconds_total{phase=compaction}"] > 0
    # Idle again: every block is back in the pool.
    assert m["vllm:kv_compress_free_blocks"] == m["vllm:kv_compress_total_blocks"] > 0
    # The counters are the sum over engine cores (two schedulers under data parallelism).
    logged = [int(n) for n in re.findall(r"evicted (\d+) in \d+ compression", server.output())]
    assert m["vllm:kv_compress_tokens_evicted_total"] >= sum(logged) > 0
    if server.parallel == "dp2":
        cores = set(re.findall(r"EngineCore_DP(\d)[^\n]*kv_compress \w+ \S+: prompt", server.output()))
        assert cores == {"0", "1"}, "both engine cores compressed requests"


def test_clean_shutdown(server):
    assert server.stop() == 0
    log = server.output()
    # vLLM's abort-mode shutdown logs the killed engine's output handler; what
    # matters is that nothing failed while serving.
    serving = log.split("shutdown triggered")[0]
    assert "Traceback" not in serving and "EngineDeadError" not in serving
