"""The KV cache vLLM sizes on CUDA leaves room for the plugin's scores.

vLLM's CUDA worker gives the KV cache what its profiling run leaves free;
the plugin's accumulated scores (float32 per query head and cached token)
were never in that run, so the worker's `determine_available_memory` is
wrapped to keep their worst case out of the cache. No CUDA build of vLLM
runs here: the wrapper is driven with vLLM's real config objects' methods
replaced by what a CUDA worker would answer, and the CPU worker's own method
(which sizes the cache from VLLM_CPU_KVCACHE_SPACE) is checked to be the one
vLLM calls on CPU.
"""

from __future__ import annotations

import types

import torch

from vllm_kvcompress.config import CONFIG_KEY, KVCompressConfig
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.scorers.rkv import REDUNDANCY_ELEMENTS
from vllm_kvcompress.token_state import (
    SELECTION_BATCH_TOKENS,
    RequestTokens,
    score_bytes_per_kv_byte,
    selection_scratch_bytes,
)
from vllm_kvcompress.vllm_seam.patches import PATCHES
from vllm_kvcompress.vllm_seam.worker import startup

GIB = 1 << 30


def test_score_bytes_match_what_a_request_holds():
    """A rolling request's scores, per layer, against its K and V per layer."""
    hq, hkv, d, tokens = 8, 2, 16, 40
    plan = resolve_plan(KVCompressConfig.from_dict({"policy": "h2o", "budget": 32, "interval": 1}), 64, 1, 16)
    state = RequestTokens(plan, 1, hkv, hq)
    state.accumulate(0, torch.rand(hq, tokens))
    score_bytes = state.attention[0][:, :tokens].numel() * 4
    kv_bytes = 2 * hkv * tokens * d * 2  # bf16 K and V
    assert score_bytes / kv_bytes == score_bytes_per_kv_byte(hq, hkv, d, 2) == 0.25


MAX_LEN = 32768


NUM_LAYERS, MAX_SEQS = 32, 64


def _cuda_worker(additional_config, kv_cache_memory_bytes=None, device="cuda"):
    model = types.SimpleNamespace(dtype=torch.bfloat16, get_head_size=lambda: 128, max_model_len=MAX_LEN,
                                  get_num_attention_heads=lambda parallel: 32, get_num_kv_heads=lambda parallel: 8,
                                  hf_text_config=types.SimpleNamespace(), get_sliding_window=lambda: None,
                                  get_num_layers=lambda parallel: NUM_LAYERS)
    cache = types.SimpleNamespace(cache_dtype="auto", kv_cache_memory_bytes=kv_cache_memory_bytes)
    config = types.SimpleNamespace(
        additional_config=additional_config, model_config=model, parallel_config=None, cache_config=cache,
        scheduler_config=types.SimpleNamespace(max_num_seqs=MAX_SEQS),
        device_config=types.SimpleNamespace(device_type=device))
    return types.SimpleNamespace(vllm_config=config, model_config=model, parallel_config=None, cache_config=cache)


def _engine(settings: dict) -> dict:
    return {CONFIG_KEY: KVCompressConfig.from_dict(settings).to_dict()}


def test_query_moments_bytes_match_what_a_request_holds():
    """Expected attention's moments after every layer observed queries,
    with the covariance and the mean alone, against the formula; none for
    scorers that observe attention."""
    hq, hkv, d, layers = 8, 2, 16, 3
    for statistics in ("covariance", "mean"):
        config = KVCompressConfig.from_dict({"policy": "expected_attention", "budget": 32, "statistics": statistics})
        state = RequestTokens(resolve_plan(config, 64, layers, 16), layers, hkv, hq)
        for layer in range(layers):
            state.observe_queries(layer, torch.randn(5, hq, d))
        held = sum(t.numel() * t.element_size() for m in state.moments for t in (m.total, m.outer) if t is not None)
        assert held == config.components().scorer.query_moments_bytes(layers, hq, d) > 0, statistics
    snapkv = KVCompressConfig.from_dict({"policy": "snapkv", "budget": 32}).components().scorer
    assert snapkv.query_moments_bytes(layers, hq, d) == 0


def test_cuda_kv_cache_leaves_room_for_query_moments():
    """An engine running expected attention holds its moments aside for
    max_num_seqs requests (32 layers x 32 heads x 128 x 129 x 4 B: 64.5 MiB
    each with the covariance)."""
    determine = startup.wrap_determine_available_memory(lambda self: 33 * GIB)
    scratch = selection_scratch_bytes(MAX_LEN, 32, 8, 128)
    for statistics, per_request in (("covariance", NUM_LAYERS * 32 * 128 * 129 * 4),
                                    ("mean", NUM_LAYERS * 32 * 128 * 4)):
        worker = _cuda_worker(_engine({"policy": "expected_attention", "budget": 256, "statistics": statistics}))
        kept = determine(worker)
        assert kept == int((33 * GIB - scratch - MAX_SEQS * per_request) / (1 + 1 / 32)), statistics


def test_a_request_needing_more_moments_than_held_is_refused_on_cuda():
    """Per request, expected attention where the engine runs another scorer,
    or its covariance where the engine keeps the mean, would take KV cache
    memory on CUDA: refused naming the field; served where the engine holds
    as much, on CPU, and where the user sized the cache in bytes."""
    from vllm_kvcompress.vllm_seam.engine_checks import query_moments_problem

    snapkv = KVCompressConfig.from_dict({"policy": "snapkv", "budget": 64})
    ea = KVCompressConfig.from_dict({"policy": "expected_attention", "budget": 64})
    ea_mean = KVCompressConfig.from_dict({"policy": "expected_attention", "budget": 64, "statistics": "mean"})
    config = _cuda_worker({}).vllm_config
    problem = query_moments_problem(config, snapkv, ea)
    assert problem is not None and problem.startswith("kv_compress.policy: 'expected_attention'") and "MiB" in problem
    problem = query_moments_problem(config, ea_mean, ea)
    assert problem is not None and problem.startswith("kv_compress.statistics: 'covariance'")
    assert query_moments_problem(config, ea, ea_mean) is None
    assert query_moments_problem(config, ea, ea) is None
    assert query_moments_problem(config, ea, snapkv) is None
    assert query_moments_problem(_cuda_worker({}, device="cpu").vllm_config, snapkv, ea) is None
    assert query_moments_problem(_cuda_worker({}, kv_cache_memory_bytes=GIB).vllm_config, snapkv, ea) is None


def test_cuda_kv_cache_leaves_room_for_scores():
    determine = startup.wrap_determine_available_memory(lambda self: 33 * GIB)
    on = _engine({"policy": "h2o", "budget": 256})
    # 32 query heads, 8 KV heads, head_dim 128, bf16: scores are 1/32 of the KV
    # bytes; the selection's scratch at max_model_len is held aside first.
    scratch = selection_scratch_bytes(MAX_LEN, 32, 8, 128)
    # Scoring one request at a time, then a batch of at most SELECTION_BATCH_TOKENS padded tokens: 342 MiB at 32k.
    assert scratch == (MAX_LEN * (16 * 32 + 8 * 8 * 128) + 8 * REDUNDANCY_ELEMENTS
                       + max(MAX_LEN, SELECTION_BATCH_TOKENS) * 76 * 8)
    kept = determine(_cuda_worker(on))
    assert kept == int((33 * GIB - scratch) / (1 + 1 / 32)) and kept + kept / 32 + scratch <= 33 * GIB
    assert determine(_cuda_worker({})) == 33 * GIB  # compression off: vLLM's number
    assert determine(_cuda_worker(on, kv_cache_memory_bytes=GIB)) == 33 * GIB  # sized by the user


def test_the_wrap_is_listed_and_inert_on_cpu():
    from vllm.v1.worker.cpu_worker import CPUWorker

    assert any(p.owner == "Worker" and p.attr == "determine_available_memory" for p in PATCHES)
    assert "determine_available_memory" in vars(CPUWorker)  # the CPU worker's own method runs there
