"""A preempted request gives the answer it gives alone.

vLLM preempts a running request when the KV cache runs out: it frees all of
the request's blocks and later recomputes prompt and outputs as one prefill.
The plugin then recomputes in chunks that end at the request's first-life
compression points, so the same tokens are kept. Here a small cache (48
blocks of 32 tokens) and long uncompressed neighbours force preemptions; every
policy's request must equal the same request run alone (no preemption) and the
reference decoder, and the pool must be whole afterwards.
"""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.registry import POLICIES

NUM_BLOCKS = 48
NEW_TOKENS = 160
NUM_LAYERS = 4
# Long uncompressed neighbours, added first: vLLM preempts the newest requests.
FILLERS = 4
# With prefix caching (a test that also runs on Model Runner V2 by default,
# where each step costs more): fewer tokens still overrun the cache.
PREFIX_NEW_TOKENS = 96

SINGLE_GROUP = [
    {"policy": name, "budget": 64, "window": 8} if name in ("snapkv", "adakv", "tova", "keyformer", "random")
    else {"policy": name, "budget": 64}
    for name, c in sorted(POLICIES.items())
    if name != "none" and c.allocation not in ("pyramid", "adaptive") and c.merge == "none"
] + [
    {"policy": "streamingllm", "budget": 48, "prompt_chunk": 64},
    {"policy": "h2o", "allocation": "per_head", "trigger": "once", "budget": 64},
    {"policy": "snapkv", "compression_ratio": 0.75, "window": 8},
]
PER_LAYER = [
    {"policy": "pyramidkv", "budget": 80, "window": 8},
    {"policy": "adaptive", "budget": 64, "window": 8},
    {"policy": "tova", "allocation": "pyramid", "budget": 64, "window": 4, "interval": 16},
    {"policy": "minicache", "start_layer": 0, "retain_ratio": 0.1},
    {"policy": "snapkv", "merge": "minicache", "budget": 64, "window": 8},
]


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


def check(engine, reference, configs, groups, seed):
    fillers = random_prompts([220] * FILLERS, seed=seed)
    prompts = random_prompts([180 + 7 * i for i in range(len(configs))], seed=seed + 1)
    before = engine.stats()["preemptions"]
    got = engine.generate(fillers + prompts, NEW_TOKENS, [None] * FILLERS + configs)[FILLERS:]
    stats = engine.stats()
    assert stats["preemptions"] > before, "the cache was meant to be too small"
    preempted = {k.split("#")[0] for k in stats["requests"] if "#preempted" in k}
    lengths = {len(p) for p in prompts}
    resumed = [r for k, r in stats["requests"].items()
               if k in preempted and r["finished"] and r["prefill_len"] not in lengths]
    assert resumed, "some compressed requests were meant to be preempted and resumed"
    assert stats["free_blocks"] == stats["total_blocks"]
    alone = [engine.generate([p], NEW_TOKENS, [c])[0] for p, c in zip(prompts, configs)]
    assert engine.stats()["preemptions"] == stats["preemptions"]  # alone: never preempted
    for prompt, config, tokens, single in zip(prompts, configs, got, alone):
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": groups})
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"]
        assert single == want, f"alone: {config}"
        assert tokens == want, f"preempted: {config}"
    assert engine.stats()["free_blocks"] == engine.stats()["total_blocks"]


@pytest.mark.extended
def test_every_policy_survives_preemption(start_engine, tiny_model, reference):
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", num_gpu_blocks_override=NUM_BLOCKS))
    check(engine, reference, SINGLE_GROUP, 1, seed=71)


@pytest.mark.mrv2
def test_prefix_cached_requests_survive_preemption(start_engine, tiny_model, reference):
    """With prefix caching on, requests share a system prompt (hits as long as
    each policy allows); a preempted one replays its first life, and each
    equals the reference run cold and alone."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", num_gpu_blocks_override=NUM_BLOCKS,
                                          enable_prefix_caching=True))
    system = random_prompts((96,), seed=80)[0]
    fillers = random_prompts([220] * FILLERS, seed=81)
    # The first to compute the system prompt is an uncompressed filler; the
    # compressed ones copy what they keep of the shared blocks, and one with
    # no room to copy is preempted (and replays exactly).
    fillers[0] = system + fillers[0][len(system):]
    prompts = [system + p for p in random_prompts([90 + 7 * i for i in range(7)], seed=82)]
    # KVzip: its repeat passes are requests of their own, preempted like any (and waited for).
    configs = [{"policy": "h2o", "budget": 64}, {"policy": "snapkv", "budget": 64, "window": 8},
               {"policy": "tova", "budget": 48, "window": 4}, {"policy": "rkv", "budget": 16, "interval": 8},
               {"policy": "streamingllm", "budget": 48}, {"policy": "snapkv", "compression_ratio": 0.5, "window": 8},
               {"policy": "kvzip", "budget": 64, "chunk_size": 96}]
    before = engine.stats()["preemptions"]
    got = engine.generate_with_hits(fillers + prompts, PREFIX_NEW_TOKENS, [None] * FILLERS + configs)[FILLERS:]
    stats = engine.stats()
    assert stats["preemptions"] > before, "the cache was meant to be too small"
    # All but h2o (a scorer of every prompt query: no hit) hit the system prompt.
    assert sum(cached >= len(system) for _, cached in got) >= len(prompts) - 1
    preempted = {k.split("#")[0] for k in stats["requests"] if "#preempted" in k}
    assert any(r["finished"] for k, r in stats["requests"].items() if k in preempted)
    for prompt, config, (tokens, cached) in zip(prompts, configs, got):
        want = reference.generate(prompt, PREFIX_NEW_TOKENS, KVCompressConfig.from_dict(config),
                                  block_size=BLOCK_SIZE)["tokens"]
        assert tokens == want, f"{config} hit {cached}"


@pytest.mark.extended  # the default run keeps preemption with prefix caching (both runners)
def test_per_layer_budgets_survive_preemption(start_engine, tiny_model, reference):
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS,
                                          num_gpu_blocks_override=NUM_BLOCKS * NUM_LAYERS))
    check(engine, reference, PER_LAYER, NUM_LAYERS, seed=73)
