"""Hybrid models: sliding-window layers beside full-attention ones (Gemma 2/3 style).

The tiny random Gemma 3 has 6 layers, sliding-window (64) and full attention
interleaved (s, s, f, s, s, f). Only the full-attention layers compress; vLLM's
own sliding-window manager keeps the others. The reference decoder runs the
same model in plain torch (sliding layers masked by logical distance, never
compacted), so greedy tokens must match for every policy, and the sliding
groups must hold exactly the blocks they hold without compression.
"""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, engine_kwargs, preempted_second_turns, random_prompts, reused_turns
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.registry import POLICIES
from vllm_kvcompress.schedule import cdiv

NEW_TOKENS = 40
WINDOW = 64
FULL_LAYERS = 2
PER_LAYER_ALLOCATIONS = ("pyramid", "adaptive")
POLICY_NAMES = sorted(name for name, c in POLICIES.items()
                      if name != "none" and c.allocation not in PER_LAYER_ALLOCATIONS and c.merge == "none")


@pytest.fixture(scope="module")
def gemma_model() -> str:
    from kvc_tools.models import build_tiny_gemma3, default_cache_root

    return str(build_tiny_gemma3(default_cache_root() / "models" / "tiny-gemma3-seed0", seed=0,
                                 sliding_window=WINDOW))


@pytest.fixture(scope="module")
def engine(start_engine, gemma_model):
    return start_engine(**engine_kwargs(gemma_model, kv_compress="none"))


@pytest.fixture(scope="module")
def reference(gemma_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(gemma_model)


def check(engine, reference, prompts, configs, layer_groups: int = 1):
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": layer_groups}) if config else None
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"]
        assert tokens == want, f"{config} prompt {len(prompt)}"


def group_kinds(engine) -> list[str]:
    """vLLM's KV cache groups in order, as the stats name them."""
    return engine.stats()["kv_cache_groups"]


def test_only_full_attention_groups_compress(engine):
    kinds = group_kinds(engine)
    assert sorted(kinds) == ["compressed", "sliding_window", "sliding_window"], kinds


@pytest.mark.extended
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_policy_matches_reference(engine, reference, policy):
    prompts = random_prompts((210, 97, 160, 260), seed=100 + POLICY_NAMES.index(policy))
    configs = [
        {"policy": policy, "budget": 64},
        None,  # uncompressed, in the same batch
        {"policy": policy, "compression_ratio": 0.5},
        {"policy": policy, "budget": 48},
    ]
    if POLICIES[policy].trigger == "decode":  # the prompt stays whole: budgets of generated tokens
        configs = [{"policy": policy, "budget": 16, "interval": 8}, None,
                   {"policy": policy, "budget": 8, "interval": 4}, {"policy": policy, "budget": 12}]
    before = engine.stats()["tokens_evicted"]
    check(engine, reference, prompts, configs)
    assert engine.stats()["tokens_evicted"] > before


@pytest.mark.mrv2
def test_selection_and_streaming_match_reference(engine, reference):
    prompts = random_prompts((230, 190, 260), seed=7)
    configs = [
        {"policy": "snapkv", "budget": 64, "window": 8, "selection": "span", "span": 8},
        {"policy": "h2o", "budget": 48, "selection": "chunk", "chunk_length": 10},
        {"policy": "streamingllm", "budget": 48, "prompt_chunk": 40},
    ]
    check(engine, reference, prompts, configs)


def test_sliding_window_groups_hold_what_vanilla_holds(engine):
    """Per KV cache group, blocks held when the request ends: the sliding-window
    groups hold exactly what they hold uncompressed (vLLM's own manager drops
    what leaves the window), the full-attention group only its budget."""
    prompt = random_prompts((300,), seed=11)
    budget = 64
    engine.generate(prompt, NEW_TOKENS, [{"policy": "snapkv", "budget": budget}])
    engine.generate(prompt, NEW_TOKENS)
    finished = [r for r in engine.stats()["requests"].values() if r["finished"] and r["prefill_len"] == 300]
    compressed, plain = finished[-2], finished[-1]
    full = group_kinds(engine).index("compressed")
    total = 300 + NEW_TOKENS - 1  # tokens whose KV was written
    for g, (c, p) in enumerate(zip(compressed["blocks_held_per_group"], plain["blocks_held_per_group"])):
        if g == full:
            assert p == cdiv(total, BLOCK_SIZE)
            assert c == cdiv(budget + NEW_TOKENS - 1, BLOCK_SIZE)
        else:
            assert c == p
            assert c <= cdiv(WINDOW, BLOCK_SIZE) + 1  # the window's blocks, not the sequence's


def test_budget_above_need_equals_vanilla(engine, start_engine, gemma_model):
    """A budget no request reaches leaves vLLM's output unchanged (vanilla: no plugin config)."""
    prompts = random_prompts((120, 45, 200), seed=5)
    roomy = [{"policy": p, "budget": len(q) + NEW_TOKENS + 32} for p, q in zip(("snapkv", "h2o", "tova"), prompts)]
    ours = engine.generate(prompts, NEW_TOKENS, roomy)
    plain = engine.generate(prompts, NEW_TOKENS)
    vanilla = start_engine(**engine_kwargs(gemma_model)).generate(prompts, NEW_TOKENS)
    assert ours == plain == vanilla


@pytest.fixture(scope="module")
def per_layer(start_engine, gemma_model):
    return start_engine(**engine_kwargs(gemma_model, kv_compress="none", kv_compress_layer_groups=FULL_LAYERS))


def test_per_layer_groups_match_reference(per_layer, reference):
    """One KV cache group per full-attention layer (the sliding layers regrouped
    beside them): per-layer and per-head budgets free each layer's own blocks."""
    assert group_kinds(per_layer).count("compressed") == FULL_LAYERS
    prompts = random_prompts((300, 230, 120, 260, 180), seed=13)
    configs = [
        {"policy": "pyramidkv", "budget": 96, "window": 16},
        {"policy": "adaptive", "budget": 64, "window": 16},
        None,
        {"policy": "adakv", "budget": 48, "window": 8},
        {"policy": "snapkv", "budget": 64, "window": 16},
    ]
    check(per_layer, reference, prompts, configs, layer_groups=FULL_LAYERS)
    finished = {r["prefill_len"]: r for r in per_layer.stats()["requests"].values() if r["finished"]}
    pyramid = finished[300]["tokens_kept_per_group"]
    assert len(pyramid) == FULL_LAYERS and pyramid[0] != pyramid[1], "pyramid keeps layers apart"


@pytest.fixture(scope="module")
def cached(start_engine, gemma_model):
    """Prefix caching on, as Gemma deployments run; chunks of 64 tokens (a
    streamed prompt compresses between them)."""
    return start_engine(**engine_kwargs(gemma_model, kv_compress="none", enable_prefix_caching=True,
                                        max_num_batched_tokens=64))


def test_prefix_caching_on_a_hybrid_model(cached, reference):
    """Gemma-style deployments keep prefix caching on: requests sharing a system
    prompt hit it in every group, the full-attention group compresses only
    what follows the hit, and each equals the reference that protects it.

    vLLM's sliding-window groups retain blocks sparsely (Marconi-style): the
    second request that shares a prefix finds it only in the full-attention
    group, misses, and pins the junction; from the third on, all hit (as
    without the plugin)."""
    engine = cached
    system = random_prompts((256,), seed=61)[0]
    prompts = [system + p for p in random_prompts((120, 150, 90, 170, 130), seed=62)]
    configs = [{"policy": "snapkv", "budget": 48, "window": 8}, {"policy": "h2o", "budget": 48},
               {"policy": "rkv", "budget": 16, "interval": 8}, {"policy": "streamingllm", "budget": 40},
               {"policy": "snapkv", "budget": 32, "window": 8, "selection": "span", "span": 8}]
    got = [engine.generate_with_hits([p], NEW_TOKENS, [c])[0] for p, c in zip(prompts[:2], configs[:2])]
    got += engine.generate_with_hits(prompts[2:], NEW_TOKENS, configs[2:])
    assert all(cached >= len(system) for _, cached in got[2:]), [c for _, c in got]
    for prompt, config, (tokens, cached) in zip(prompts, configs, got):
        want = reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(config), block_size=BLOCK_SIZE)
        assert tokens == want["tokens"], f"{config} hit {cached}"
        assert want["compressed_at"]


@pytest.mark.mrv2
def test_blocks_computed_after_a_compaction_are_never_cached(cached, reference):
    """A sliding-window block holds keys computed from the full-attention
    layers before it: from a request's first compaction on, from a compressed
    cache. vLLM's own cache names blocks by their tokens alone, so such a
    block must never be found by them: here a streamed prompt compresses
    between its chunks, an uncompressed request with the same prompt computes
    it whole (its full-attention blocks cached), and a third with that prompt
    and more hits them; it must answer as the reference without compression.
    (Without the limit, the third found the streamed request's sliding-window
    blocks first and answered otherwise.)"""
    prompt, extra = random_prompts((330, 40), seed=65)
    streamed = {"policy": "streamingllm", "budget": 64, "trigger": "streamed"}
    cached.generate([prompt], 4, [streamed])
    cached.generate([prompt], 4)
    (tokens, hit), = cached.generate_with_hits([prompt + extra], NEW_TOKENS)
    assert hit >= 256, hit  # the uncompressed request's blocks
    assert tokens == reference.generate(prompt + extra, NEW_TOKENS, None, block_size=BLOCK_SIZE)["tokens"]


@pytest.mark.mrv2
def test_next_turns_continue_the_compressed_state(cached, reference):
    """`reuse` on a hybrid: a finished turn's state is its compressed
    full-attention blocks and its sliding-window groups' last window (their
    keys computed from the compressed layers). The next turn of each
    conversation (batched, other policies beside) hits its whole history in
    every group, computes only its new message, and answers as the
    reference continuing its own state; a turn whose history differs by one
    token starts from nothing and answers as a fresh request."""
    firsts = random_prompts((200, 230, 170), seed=67)
    configs = [{"policy": "snapkv", "budget": 64, "window": 8, "reuse": True},
               {"policy": "h2o", "budget": 48, "selection": "span", "span": 8, "reuse": True},
               {"policy": "kvzip", "budget": 96, "chunk_size": 80, "reuse": True}]
    extra = random_prompts((40, 35, 50, 30, 45, 38), seed=68)
    prompts = reused_turns(cached, reference, firsts, configs,
                           [[extra[2 * i + turn % 2] for i in range(len(firsts))] for turn in range(3)], NEW_TOKENS)
    # One token of the last history changed: no state, as a fresh request.
    prompt = list(prompts[0])
    prompt[len(firsts[0]) + 3] = (prompt[len(firsts[0]) + 3] + 1) % 1000
    (tokens, hit), = cached.generate_with_hits([prompt], NEW_TOKENS, configs[:1])
    assert hit <= len(firsts[0]) + 3, hit
    assert tokens == reference.generate(prompt, NEW_TOKENS, KVCompressConfig.from_dict(configs[0]),
                                        block_size=BLOCK_SIZE)["tokens"]


def test_a_document_compressed_once_serves_many_questions(cached, reference):
    """A document's compressed prompt (its answer shorter than the window,
    whose blocks of the prompt's end it still holds) serves questions on it."""
    from kvc_tools.reference_decoder import at_length

    document = random_prompts((300,), seed=69)[0]
    config = {"policy": "snapkv", "budget": 64, "window": 8, "reuse": True}
    cfg = KVCompressConfig.from_dict(config)
    cached.generate([document], 8, [config])
    questions = random_prompts((20, 33, 41), seed=70)
    got = cached.generate_with_hits([document + q for q in questions], NEW_TOKENS, [config] * len(questions))
    base = at_length(reference.generate(document, 8, cfg, block_size=BLOCK_SIZE), len(document))
    for question, (tokens, hit) in zip(questions, got):
        assert hit == len(document)
        assert tokens == reference.generate(document + question, NEW_TOKENS, cfg, block_size=BLOCK_SIZE,
                                            resume=base)["tokens"]


def test_preempted_turns_resume_from_their_state(start_engine, gemma_model, reference):
    """A pool too small for the second turns beside long uncompressed
    neighbours: second turns are preempted and resume from the state they
    started from (its sliding-window blocks held with its compressed ones),
    answer as the reference continuing the first turn's, and the pool is
    whole afterwards."""
    engine = start_engine(**engine_kwargs(gemma_model, kv_compress="none", enable_prefix_caching=True,
                                          num_gpu_blocks_override=80, kv_compress_reserve_growth=0,
                                          max_model_len=512))
    configs = [{"policy": "snapkv", "budget": 64, "reuse": True}, {"policy": "h2o", "budget": 48, "reuse": True},
               {"policy": "tova", "budget": 56, "reuse": True}]
    # Short uncompressed prompts that grow long: every second turn starts
    # at once on its state, and the newest are preempted as the batch grows.
    preempted_second_turns(engine, reference, random_prompts((190, 210, 170), seed=71), configs,
                           random_prompts((40, 30, 50), seed=72), random_prompts([40] * 3, seed=73),
                           first_tokens=NEW_TOKENS, filler_tokens=400)
