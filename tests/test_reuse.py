"""Compressed states reused across requests (`reuse`): a conversation's next
turn starts from the previous turn's compressed cache instead of computing
its history again.

A turn's greedy tokens equal the reference decoder's continuing from the
reference's own compressed state of the previous turn (`generate(...,
resume=...)`), and only the new tokens are computed (the rest is the
state's hit). Anything but an exact match of the history's tokens, the
settings and the salt starts from nothing (its answer then equals a fresh
request's).
"""

from __future__ import annotations

import pytest

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def engine(start_engine, tiny_model):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", enable_prefix_caching=True))


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


def run(engine, prompts, configs, salts=None):
    """(tokens, cached prompt tokens) per prompt, greedy, with each prompt's settings and cache_salt."""
    from vllm import SamplingParams

    params = [SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                             extra_args=None if c is None else {"kv_compress": c}) for c in configs]
    inputs = [{"prompt_token_ids": p, **({"cache_salt": s} if s else {})}
              for p, s in zip(prompts, salts or [None] * len(prompts))]
    outs = engine.llm.generate(inputs, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens or 0) for o in outs]


def reused(engine) -> dict[int, int]:
    """Finished requests' reused tokens by prompt length."""
    return {r["prefill_len"]: r["tokens_reused"] for r in engine.stats()["requests"].values() if r["finished"]}


@pytest.mark.mrv2
def test_next_turns_continue_the_compressed_state(engine, reference):
    """Three turns of three conversations (different policies), batched: each
    later turn computes only its new tokens and answers as the reference
    continuing its own compressed state of the turn before."""
    firsts = random_prompts((200, 170, 230), seed=81)
    configs = [{"policy": "snapkv", "budget": 64, "reuse": True},
               {"policy": "h2o", "budget": 48, "reuse": True},
               {"policy": "expected_attention", "budget": 56, "selection": "span", "span": 8, "reuse": True}]
    extra = random_prompts((40, 35, 50, 30, 45, 38), seed=82)
    prompts, wants = firsts, [None] * 3
    before = engine.stats()
    for turn in range(3):
        got = run(engine, prompts, configs)
        lengths = reused(engine)
        for i, (prompt, config, (tokens, cached)) in enumerate(zip(prompts, configs, got)):
            cfg = KVCompressConfig.from_dict(config)
            want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=32, resume=wants[i])
            assert tokens == want["tokens"], (turn, config)
            if turn:  # the history (all but the last output of the turn before) came from the state
                history = len(wants[i]["resume"]["history"])
                assert cached == history and lengths[len(prompt)] == history, (turn, config, cached)
            wants[i] = want
        prompts = [p + tokens + extra[2 * i + turn % 2] for i, (p, (tokens, _)) in enumerate(zip(prompts, got))]
    stats = engine.stats()
    assert stats["states_reused"] - before["states_reused"] == 6
    assert stats["states_saved"] - before["states_saved"] >= 6


def test_only_an_exact_match_hits(engine, reference):
    """After a saved turn: a one-token difference in the history, other
    settings, another salt, and reuse off each start from nothing (and
    answer as a fresh request); the exact match hits."""
    first = random_prompts((190,), seed=83)[0]
    config = {"policy": "snapkv", "budget": 64, "reuse": True}
    (tokens, _), = run(engine, [first], [config], ["a"])
    tail = random_prompts((30,), seed=84)[0]
    follow = first + tokens + tail
    changed = list(follow)
    changed[100] = (changed[100] + 1) % 1000 + 3
    cases = [(follow, config, "a", True), (changed, config, "a", False),
             (follow, {**config, "budget": 72}, "a", False), (follow, config, "b", False),
             (follow, {**config, "reuse": False}, "a", False)]
    # One after the other: each must meet the saved state as the first turn left it.
    for prompt, cfg, salt, hits in cases:
        (got, cached), = run(engine, [prompt], [cfg], [salt])
        fresh = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(cfg), block_size=32)
        if hits:
            turn1 = reference.generate(first, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)
            want = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(cfg), block_size=32,
                                      resume=turn1)
            assert cached == len(first) + len(tokens) - 1
            assert got == want["tokens"]
        else:
            # vLLM's own prefix cache may still serve the uncompressed prompt blocks of the first turn.
            assert cached < len(first) + len(tokens) - 1, (cfg, salt)
            assert got == fresh["tokens"], (cfg, salt)
