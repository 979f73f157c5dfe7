"""Model families beyond Llama and Gemma 3 (issue 50): what is served and what is refused.

Phi-4-mini and Phi-3.5-mini declare a sliding window (262,144) longer than
their context on every layer: a window that never slides is full attention,
and its layers compress. A window shorter than the context on every layer
leaves nothing to compress: refused by name. (The features the scorers would
not reproduce, gpt-oss's sinks, Gemma 2's soft cap and ALiBi, are refused in
tests/test_cli.py.)
"""

from __future__ import annotations

import pytest

from helpers import Engine, engine_kwargs, random_prompts

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def phi3():
    from kvc_tools.models import build_tiny_phi3, default_cache_root

    return str(build_tiny_phi3(default_cache_root() / "models" / "tiny-phi3-seed0"))


def test_a_window_longer_than_the_context_compresses(phi3):
    """Phi-3-style: served; a budget above the need gives the uncompressed
    tokens, a small one evicts and returns blocks mid-request."""
    engine = Engine(in_process=True, **engine_kwargs(phi3, kv_compress="none"))
    try:
        config = engine.llm.llm_engine.vllm_config.model_config
        assert config.get_sliding_window() is None  # full attention: vLLM's disable_sliding_window
        prompts = random_prompts((300, 300, 300), seed=5)
        prompts = [prompts[0]] * 3
        settings = [None, {"policy": "snapkv", "budget": 1000}, {"policy": "snapkv", "budget": 64}]
        got = engine.generate(prompts, NEW_TOKENS, settings)
        stats = engine.stats()
    finally:
        engine.close()
    assert got[1] == got[0], "a budget above the need changed the tokens"
    compressed = [r for r in stats["requests"].values() if r["tokens_evicted"] > 0]
    assert len(compressed) == 1 and compressed[0]["blocks_freed"] > 0, stats["requests"]
    assert stats["free_blocks"] == stats["total_blocks"]


def test_a_window_shorter_than_the_context_is_refused(tmp_path):
    from vllm import LLM

    from kvc_tools.models import build_tiny_phi3
    from vllm_kvcompress import KVCompressConfigError

    model = str(build_tiny_phi3(tmp_path / "phi3-window64", sliding_window=64))
    with pytest.raises(KVCompressConfigError, match="a model without full-attention layers"):
        LLM(**engine_kwargs(model, kv_compress="snapkv", kv_compress_budget=64))
