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

from helpers import engine_kwargs, preempted_second_turns, random_prompts
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
    return engine.generate_with_hits(prompts, NEW_TOKENS, configs, salts)


def reused(engine) -> dict[int, int]:
    """Finished requests' reused tokens by prompt length."""
    return {r["prefill_len"]: r["tokens_reused"] for r in engine.stats()["requests"].values() if r["finished"]}


@pytest.mark.mrv2
def test_next_turns_continue_the_compressed_state(engine, reference):
    """Three turns of three conversations (different policies), batched: each
    later turn computes only its new tokens and answers as the reference
    continuing its own compressed state of the turn before."""
    firsts = random_prompts((200, 170, 230, 190), seed=81)
    # KVzip: the first turn's repeat passes score its prompt; a later turn's
    # new tokens are kept before the state's, which keep their scores.
    configs = [{"policy": "snapkv", "budget": 64, "reuse": True},
               {"policy": "h2o", "budget": 48, "reuse": True},
               {"policy": "expected_attention", "budget": 56, "selection": "span", "span": 8, "reuse": True},
               {"policy": "kvzip", "budget": 96, "chunk_size": 80, "reuse": True}]
    extra = random_prompts((40, 35, 50, 30, 45, 38, 33, 41), seed=82)
    prompts, wants = firsts, [None] * len(firsts)
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
    assert stats["states_reused"] - before["states_reused"] == 2 * len(firsts)
    assert stats["states_saved"] - before["states_saved"] >= 2 * len(firsts)


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


def test_a_saved_state_is_a_copy_the_next_turn_does_not_change(reference):
    """`RequestTokens.continue_from`: the continued state starts with the
    saved one's positions, scores and query moments, and what it then
    observes and compacts leaves the saved state as it was (several turns
    may continue one state)."""
    import torch

    from vllm_kvcompress.plan import resolve_plan
    from vllm_kvcompress.token_state import RequestTokens

    prompt = random_prompts((180,), seed=85)[0]
    first = reference.generate(prompt, 8, KVCompressConfig.from_dict({"policy": "h2o", "budget": 48}), block_size=32)
    saved = first["resume"]["state"]
    before = [saved.positions(layer).clone() for layer in range(saved.num_layers)], \
        [a.clone() for a in saved.attention if a is not None]
    config = KVCompressConfig.from_dict({"policy": "h2o", "budget": 48})
    plan = resolve_plan(config, len(first["resume"]["history"]) + 20, saved.num_layers, 32)
    state = RequestTokens(plan, saved.num_layers, saved.num_kv_heads, saved.num_q_heads)
    state.continue_from(saved)
    assert state.logical_len == saved.logical_len and state.num_compressions == saved.num_compressions
    for layer in range(saved.num_layers):
        assert torch.equal(state.positions(layer), saved.positions(layer))
        assert torch.equal(state.attention[layer], saved.attention[layer])
    state.append(torch.arange(state.logical_len, state.logical_len + 20))
    for layer in range(saved.num_layers):
        state.accumulate(layer, torch.ones(saved.num_q_heads, state.num_tokens(layer)))
        state.keep_selected(layer, state.select(layer, 40))
    state.finish_compaction()
    assert all(torch.equal(saved.positions(layer), p) for layer, p in enumerate(before[0]))
    assert all(torch.equal(a, b) for a, b in zip([a for a in saved.attention if a is not None], before[1]))


def test_preempted_turns_resume_from_their_state(start_engine, tiny_model, reference):
    """A pool too small for the second turns beside long uncompressed
    neighbours: second turns are preempted and resumed, each from the state
    it started from (held until it ends), and answer as the reference
    continuing the first turn's; the pool is whole afterwards."""
    # vLLM's admission (no growth reserved): the second turns start at once,
    # holding their states, and are preempted as the batch grows.
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", enable_prefix_caching=True,
                                          num_gpu_blocks_override=48, kv_compress_reserve_growth=0))
    configs = [{"policy": "snapkv", "budget": 64, "reuse": True}, {"policy": "h2o", "budget": 48, "reuse": True},
               {"policy": "tova", "budget": 56, "reuse": True}]
    preempted_second_turns(engine, reference, random_prompts((190, 210, 170), seed=86), configs,
                           random_prompts((40, 30, 50), seed=87), random_prompts([220] * 3, seed=88),
                           first_tokens=NEW_TOKENS, filler_tokens=160)


def test_evicted_states_are_never_used(start_engine, tiny_model, reference):
    """Uncompressed requests that need the whole pool evict the saved state
    (vLLM's LRU): the next turn then starts from nothing and answers as a
    fresh request."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", enable_prefix_caching=True,
                                          num_gpu_blocks_override=40))
    first = random_prompts((200,), seed=89)[0]
    config = {"policy": "snapkv", "budget": 64, "reuse": True}
    (tokens, _), = run(engine, [first], [config])
    engine.generate(random_prompts([600, 580], seed=90), 8)  # every free block, the saved ones too
    second = first + tokens + random_prompts((30,), seed=91)[0]
    before = engine.stats()["states_reused"]
    (got, cached), = run(engine, [second], [config])
    assert engine.stats()["states_reused"] == before and cached < len(first)
    assert got == reference.generate(second, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=32)["tokens"]


def test_reuse_settings_are_checked():
    """`reuse` takes true or false (words and 0/1 too: a server's vllm_xargs
    carry no booleans), and is refused beside a merge stage."""
    from vllm_kvcompress.config import KVCompressConfigError

    for value, want in ((True, True), ("true", True), ("no", False), (1, True), (0, False)):
        assert KVCompressConfig.from_dict({"policy": "snapkv", "budget": 64, "reuse": value}).reuse is want
    with pytest.raises(KVCompressConfigError, match=r"^kv_compress.reuse: expected true or false, got str 'maybe'"):
        KVCompressConfig.from_dict({"policy": "snapkv", "budget": 64, "reuse": "maybe"})
    with pytest.raises(KVCompressConfigError, match=r"^kv_compress.reuse: a state whose layers were merged"):
        KVCompressConfig.from_dict({"policy": "minicache", "reuse": True, "layer_groups": 4})


def test_reuse_without_prefix_caching_is_refused(start_engine, tiny_model):
    """An engine started with reuse and prefix caching off is refused at
    startup; on an engine without prefix caching, a request asking for reuse
    fails alone with the field named, and the engine serves the next one."""
    from vllm import LLM, SamplingParams
    from vllm.exceptions import VLLMValidationError

    from vllm_kvcompress.config import KVCompressConfigError

    with pytest.raises(KVCompressConfigError, match=r"kv_compress.reuse: needs prefix caching"):
        LLM(**engine_kwargs(tiny_model, kv_compress="snapkv", kv_compress_budget=64, kv_compress_reuse=True))
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none"))
    params = SamplingParams(max_tokens=4, extra_args={"kv_compress": {"policy": "snapkv", "budget": 32, "reuse": True}})
    with pytest.raises(VLLMValidationError, match=r"kv_compress.reuse: needs prefix caching"):
        engine.llm.generate([{"prompt_token_ids": [5] * 40}], params, use_tqdm=False)
    assert len(engine.generate([[5] * 40], 4, [{"policy": "snapkv", "budget": 32}])[0]) == 4


@pytest.mark.parametrize("policy", ["snapkv", "expected_attention", "kvzip"])
def test_a_document_compressed_once_serves_many_questions(engine, reference, policy):
    """A document sent alone (a few tokens generated, so that it compresses)
    keeps its compressed prompt too: questions on it, all at once, start from
    that state (the document's tokens hit, only the question is computed) and
    answer as the reference continuing its own compressed document."""
    from kvc_tools.reference_decoder import at_length

    document = random_prompts((300,), seed=94)[0]
    config = {"policy": policy, "budget": 64, "reuse": True}
    cfg = KVCompressConfig.from_dict(config)
    run(engine, [document], [config])
    questions = random_prompts((20, 25, 30, 35), seed=95)
    got = run(engine, [document + q for q in questions], [config] * len(questions))
    base = at_length(reference.generate(document, NEW_TOKENS, cfg, block_size=32), len(document))
    for question, (tokens, cached) in zip(questions, got):
        assert cached == len(document)
        assert tokens == reference.generate(document + question, NEW_TOKENS, cfg, block_size=32,
                                            resume=base)["tokens"]
