"""Prefix caching stays on: hits are the protected start, rewritten blocks are never hits.

A prompt's tokens served from vLLM's prefix cache are kept whole (their
blocks may be shared with other requests) and compression works on the rest;
a compaction copies what it would rewrite of a cached or shared block into
fresh blocks, leaving the originals cached. vLLM reports each request's hit
(`RequestOutput.num_cached_tokens`); the reference decoder given that hit as
its protected start must produce the same tokens.
"""

from __future__ import annotations

import random

import pytest
import torch

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig

NEW_TOKENS = 32
PREFIX = 1024  # a shared system prompt, 32 blocks


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", enable_prefix_caching=True,
                                        max_model_len=2048, disable_log_stats=False))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


def generate(engine, prompts, configs):
    """(tokens, prefix-cache hit) per prompt."""
    return engine.generate_with_hits(prompts, NEW_TOKENS, configs)


def prefix_cache_hits(engine) -> float:
    """vLLM's own counter of prompt tokens served from the prefix cache."""
    return sum(m.value for m in engine.llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def check(reference, prompt, config, tokens, cached):
    cfg = KVCompressConfig.from_dict(config) if config else None
    want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE, cached_len=cached)
    assert tokens == want["tokens"], f"{config} prompt {len(prompt)} hit {cached}"
    return want


def test_shared_system_prompt_hits_and_matches_reference(engine, reference):
    """20 requests share a 1k-token system prompt: they hit it in the prefix
    cache (vLLM's counters), compress only what follows it, and each equals
    the reference that protects its hit."""
    rng = random.Random(5)
    system = random_prompts((PREFIX,), seed=3)[0]
    prompts = [system + [rng.randrange(3, 2000) for _ in range(rng.randrange(100, 180))] for _ in range(20)]
    policies = [{"policy": "snapkv", "budget": 48, "window": 8}, {"policy": "h2o", "budget": 48},
                {"policy": "streamingllm", "budget": 48}, {"policy": "tova", "budget": 40},
                {"policy": "snapkv", "budget": 32, "window": 8, "selection": "span", "span": 8}]
    configs = [policies[i % len(policies)] if i % 7 != 3 else None for i in range(20)]
    hits_before = prefix_cache_hits(engine)
    got = generate(engine, prompts, configs)
    assert prefix_cache_hits(engine) - hits_before >= 19 * PREFIX
    assert sum(cached >= PREFIX for _, cached in got) >= 19, [c for _, c in got]
    compressed = 0
    for prompt, config, (tokens, cached) in zip(prompts, configs, got):
        want = check(reference, prompt, config, tokens, cached)
        compressed += bool(want["compressed_at"])
        if config is not None and cached:
            kept = want["kept_positions"][0]
            assert bool((kept[:, :cached] == torch.arange(cached)).all()), "the hit stays whole"
    assert compressed >= 15, "the tokens after the shared prefix were compressed"


def test_rewritten_blocks_are_never_hits(engine, reference):
    """A compressed request's compaction rewrote its prompt's blocks into fresh
    ones: the originals stay cached (a repeat of the prompt hits them and equals
    the reference), while nothing the compaction wrote is ever a hit: a
    follow-up turn (prompt + answer + more) hits only the original prompt's
    full blocks, and its tokens equal the uncompressed reference (a hit on a
    rewritten block would feed it other tokens' keys)."""
    prompt = random_prompts((300,), seed=21)[0]
    config = {"policy": "snapkv", "budget": 64, "window": 8}
    [(answer, cached)] = generate(engine, [prompt], [config])
    assert cached == 0
    check(reference, prompt, config, answer, 0)
    full_blocks = len(prompt) // BLOCK_SIZE * BLOCK_SIZE
    # The same prompt again: the original blocks are hits, and the protected start.
    [(again, cached)] = generate(engine, [prompt], [config])
    assert cached == full_blocks
    check(reference, prompt, config, again, cached)
    # The next turn of the conversation, uncompressed and compressed (another
    # next turn: the first one's own blocks are cached by now).
    for seed, cfg in ((22, None), (23, {"policy": "h2o", "budget": 64})):
        follow_up = prompt + answer + random_prompts((40,), seed=seed)[0]
        [(tokens, cached)] = generate(engine, [follow_up], [cfg])
        assert full_blocks <= cached <= len(prompt + answer) and (cfg or cached == full_blocks), cached
        check(reference, follow_up, cfg, tokens, cached)


def test_decode_trigger_with_prefix_cache(engine, reference):
    """Trigger 'decode' never compacts the prompt: prefix-cached prompts keep
    all their hits, generated tokens roll within their budget."""
    system = random_prompts((PREFIX // 2,), seed=8)[0]
    prompts = [system + p for p in random_prompts((60, 90, 75), seed=9)]
    configs = [{"policy": "rkv", "budget": 16, "interval": 8},
               {"policy": "h2o", "trigger": "decode", "budget": 12, "interval": 8},
               {"policy": "rkv", "budget": 8, "interval": 4}]
    got = generate(engine, [prompts[0]], configs[:1]) + generate(engine, prompts[1:], configs[1:])
    assert all(cached >= len(system) for _, cached in got[1:])
    for prompt, config, (tokens, cached) in zip(prompts, configs, got):
        want = check(reference, prompt, config, tokens, cached)
        assert want["compressed_at"], "generated tokens were evicted"
