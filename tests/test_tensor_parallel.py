"""Tensor parallelism: each rank scores, selects and compacts its own KV heads.

A tiny Llama with 4 KV heads (2 per rank, so per-head budgets really differ
within a rank) on TP=2 (one CPU core per rank, vLLM's multiprocessing
executor) against TP=1: the same greedy tokens, the same tokens evicted and
blocks freed per request, for every policy and composition, with per-layer KV
cache groups; on TP=2 also the reference decoder's tokens, and with prefix-cache
hits. The TP=2 engine has a small cache, so requests are preempted (and one is
aborted) on the way; the pool is whole afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import BLOCK_SIZE, Engine, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig

NUM_LAYERS = 4
NEW_TOKENS = 48
CONFIGS = [
    {"policy": "snapkv", "budget": 64, "window": 8},
    {"policy": "h2o", "budget": 64},
    {"policy": "tova", "budget": 64, "window": 4},
    {"policy": "keyformer", "budget": 64, "window": 8},
    {"policy": "streamingllm", "budget": 48, "prompt_chunk": 64},
    {"policy": "window", "budget": 48},
    {"policy": "random", "budget": 64, "window": 4},
    {"policy": "adakv", "budget": 64, "window": 8},
    {"policy": "pyramidkv", "budget": 80, "window": 8},
    {"policy": "adaptive", "budget": 64, "window": 8},
    {"policy": "h2o", "allocation": "per_head", "trigger": "once", "budget": 64},
    {"policy": "tova", "allocation": "pyramid", "budget": 64, "window": 4},
    {"policy": "snapkv", "selection": "span", "span": 8, "compression_ratio": 0.75, "window": 8},
    # Budgets from the repeat passes' scores, reported by every rank from its heads' scores gathered.
    {"policy": "kvzip", "allocation": "per_head", "budget": 64},
    {"policy": "kvzip", "allocation": "adaptive", "budget": 64},
    None,
]


@pytest.fixture(scope="module")
def model():
    from kvc_tools.models import build_tiny_llama, default_cache_root

    return str(build_tiny_llama(default_cache_root() / "models" / "tiny-llama-4kv-seed1", seed=1,
                                num_heads=8, num_kv_heads=4))


@pytest.fixture(scope="module")
def tp1(model):
    engine = Engine(in_process=True, **engine_kwargs(model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def tp2(model):
    import vllm.envs

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a core per rank (NUMA binding fails otherwise)
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: step by step
        engine = Engine(**engine_kwargs(model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS,
                                        tensor_parallel_size=2, distributed_executor_backend="mp",
                                        num_gpu_blocks_override=44 * NUM_LAYERS, enable_prefix_caching=True))
        yield engine
        engine.close()
    vllm.envs.disable_envs_cache()


def by_prompt_len(stats: dict, lengths: set[int]) -> dict[int, dict]:
    return {r["prefill_len"]: r for r in stats["requests"].values() if r["finished"] and r["prefill_len"] in lengths}


@pytest.mark.mrv2
def test_tensor_parallel_equals_one_device(tp1, tp2, model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    prompts = random_prompts([180 + 5 * i for i in range(len(CONFIGS))], seed=83)
    lengths = {len(p) for p in prompts}
    one = tp1.generate(prompts, NEW_TOKENS, CONFIGS)
    before = tp2.stats()["preemptions"]
    two = tp2.generate(prompts, NEW_TOKENS, CONFIGS)
    assert tp2.stats()["preemptions"] > before, "the TP=2 cache was meant to be too small"
    s1, s2 = by_prompt_len(tp1.stats(), lengths), by_prompt_len(tp2.stats(), lengths)
    reference = ReferenceDecoder(model)
    for prompt, config, a, b in zip(prompts, CONFIGS, one, two):
        assert b == a, f"TP=2 differs from TP=1: {config}"
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS}) if config else None
        assert b == reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"], config
        if config is not None and len(prompt) in s2 and s2[len(prompt)]["compressions"]:
            # A preempted request's second life: compare what it evicted overall.
            r1, r2 = s1[len(prompt)], s2[len(prompt)]
            assert (tuple(r2["tokens_kept_per_group"]), r2["compressions"]) == \
                (tuple(r1["tokens_kept_per_group"]), r1["compressions"]), config
    end = tp2.stats()
    assert end["free_blocks"] == end["total_blocks"]


@pytest.mark.extended
def test_prefix_cache_hits_on_two_ranks(tp1, tp2):
    """Prompts sent again on TP=2 hit its prefix cache, compress the hit on
    both ranks and answer as TP=1 (prefix caching off) does cold."""
    configs = [CONFIGS[0], CONFIGS[7], CONFIGS[12], CONFIGS[2]]  # snapkv, adakv, span carry, tova
    prompts = random_prompts([200, 215, 230, 245], seed=84)
    want = tp1.generate(prompts, NEW_TOKENS, configs)
    first = tp2.generate_with_hits(prompts, NEW_TOKENS, configs)
    again = tp2.generate_with_hits(prompts, NEW_TOKENS, configs)
    assert all(hit >= 128 for _, hit in again), [hit for _, hit in again]
    assert [t for t, _ in first] == want == [t for t, _ in again]


@pytest.mark.extended
def test_abort_and_preemption_leave_the_pool_whole(tp2):
    from vllm import SamplingParams

    core = tp2.llm.llm_engine
    prompts = random_prompts([230, 200, 210, 220, 190], seed=89)
    configs = [None, {"policy": "adakv", "budget": 64, "window": 8}, None,
               {"policy": "h2o", "budget": 64}, {"policy": "pyramidkv", "budget": 80, "window": 8}]
    for i, (prompt, config) in enumerate(zip(prompts, configs)):
        params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True,
                                extra_args=None if config is None else {"kv_compress": config})
        core.add_request(f"a{i}", {"prompt_token_ids": prompt}, params)
    step = 0
    while core.has_unfinished_requests():
        if step == 30:
            core.abort_request(["a1"])
        core.step()
        step += 1
    end = tp2.stats()
    assert end["free_blocks"] == end["total_blocks"]


@pytest.mark.extended
def test_a_draft_model_on_two_ranks(tp1, model):
    """Speculative decoding with a draft model on TP=2: the tiny Llama cut to
    its first 3 layers drafts (split over the ranks as the target), each
    rank's draft layers follow its own heads' compaction and write at its
    physical slots. The tokens of TP=1 without speculation, per-layer groups,
    drafts both accepted and rejected; the pool whole after."""
    import vllm.envs
    from vllm.v1.metrics.reader import Counter

    from kvc_tools.models import cut_layers

    source = Path(model)
    draft = cut_layers(source, NUM_LAYERS - 1, source.parent / f"{source.name}-first{NUM_LAYERS - 1}")
    configs = [CONFIGS[0], CONFIGS[1], CONFIGS[2], CONFIGS[8]]  # snapkv, h2o (rolling), tova, pyramidkv
    prompts = random_prompts([190, 205, 220, 235], seed=85)
    want = tp1.generate(prompts, NEW_TOKENS, configs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine = Engine(**engine_kwargs(model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS,
                                        tensor_parallel_size=2, distributed_executor_backend="mp",
                                        disable_log_stats=False,
                                        speculative_config={"model": str(draft), "num_speculative_tokens": 3}))
        try:
            got = engine.generate(prompts, NEW_TOKENS, configs)
            counters = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in engine.llm.get_metrics()
                        if isinstance(m, Counter) and m.name.startswith("vllm:spec_decode_")}
            end = engine.stats()
        finally:
            engine.close()
    vllm.envs.disable_envs_cache()
    assert counters["num_accepted_tokens"] > 0, "no draft was accepted"
    assert counters["num_draft_tokens"] > counters["num_accepted_tokens"], "no draft was rejected"
    for config, a, b in zip(configs, got, want):
        assert a == b, f"a draft model on TP=2 changed the tokens: {config}"
    assert end["free_blocks"] == end["total_blocks"]


@pytest.mark.extended
def test_reused_states_on_two_ranks(tp2, model):
    """`reuse` on TP=2 (per-layer KV cache groups): each rank keeps its own
    heads' saved token state; the next turns start from it and answer as the
    reference continuing its own."""
    from kvc_tools.reference_decoder import ReferenceDecoder

    reference = ReferenceDecoder(model)
    configs = [{"policy": "snapkv", "budget": 64, "window": 8, "reuse": True},
               {"policy": "pyramidkv", "budget": 80, "window": 8, "reuse": True}]
    prompts, resume = random_prompts([190, 220], seed=92), [None, None]
    before = tp2.stats()["states_reused"]
    for turn in range(2):
        got = tp2.generate(prompts, 24, configs)
        for i, (prompt, config, tokens) in enumerate(zip(prompts, configs, got)):
            cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS})
            want = reference.generate(prompt, 24, cfg, block_size=BLOCK_SIZE, resume=resume[i])
            assert tokens == want["tokens"], (turn, config)
            resume[i] = want
        prompts = [p + t + tail for p, t, tail in zip(prompts, got, random_prompts([30, 40], seed=93 + turn))]
    assert tp2.stats()["states_reused"] - before == 2
