"""Chunked prefill: observation windows and accumulated scores span chunks.

The engine is configured through `LLM(kv_compress=..., kv_compress_budget=...)`
(the Python keyword route); requests without extra_args use that default.
"""

from __future__ import annotations

import pytest

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig

CHUNK = 48  # tokens per step: a 200-token prompt takes 5 chunks; the window spans 2


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    return start_engine(**engine_kwargs(
        tiny_model, kv_compress="snapkv", kv_compress_budget=64, kv_compress_window=32,
        max_num_batched_tokens=CHUNK, enable_chunked_prefill=True,
    ))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.mark.parametrize("override", [
    None, {"policy": "h2o", "budget": 64}, {"policy": "keyformer", "budget": 80},
    # A streamed prompt whose evictions (every 56 tokens) fall inside vLLM's 48-token chunks.
    {"policy": "streamingllm", "budget": 40, "prompt_chunk": 56},
    # Lengths derived by the worker once the window (spread over two chunks) is seen.
    {"policy": "adakv", "budget": 64, "window": 32},
])
def test_chunked_prefill_matches_reference(engine, reference, override):
    prompts = random_prompts((200, 170, 61), seed=21)
    got = engine.generate(prompts, 36, [override] * len(prompts))
    config = KVCompressConfig.from_dict(override or {"policy": "snapkv", "budget": 64, "window": 32})
    for prompt, tokens in zip(prompts, got):
        assert tokens == reference.generate(prompt, 36, config, block_size=32)["tokens"], len(prompt)
    assert engine.stats()["tokens_evicted"] > 0


@pytest.mark.mrv2
@pytest.mark.parametrize("override", [None, {"policy": "h2o", "budget": 64}, {"policy": "tova", "budget": 40}])
def test_a_one_token_last_chunk_matches_reference(engine, reference, override):
    """97 tokens alone in 48-token steps: the prompt's last chunk is its one
    observed query, attended and scored by the fused decode op."""
    prompt = random_prompts((2 * CHUNK + 1,), seed=5)[0]
    got = engine.generate([prompt], 36, [override])[0]
    config = KVCompressConfig.from_dict(override or {"policy": "snapkv", "budget": 64, "window": 32})
    assert got == reference.generate(prompt, 36, config, block_size=32)["tokens"]
