"""Per-layer KV cache groups: each layer (or tier of layers) frees its own blocks.

The tiny model has 4 layers. One engine splits them into 4 KV cache groups
(one per layer), another into 2 tiers; requests pick their policy through
extra_args. PyramidKV gives every layer its own budget; the reference decoder
applies the same per-group lengths, so greedy tokens must match.
"""

from __future__ import annotations

import pytest

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig
from vllm_kvcompress.plan import resolve_plan
from vllm_kvcompress.schedule import RequestSchedule, cdiv, layer_groups

NEW_TOKENS = 36
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.fixture(scope="module")
def per_layer(start_engine, tiny_model):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS))


@pytest.fixture(scope="module")
def tiers(start_engine, tiny_model):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=2))


def check_against_reference(engine, reference, groups, prompts, configs):
    got = engine.generate(prompts, NEW_TOKENS, configs)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": groups}) if config else None
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"]
        assert tokens == want, f"{config} prompt {len(prompt)}"


def test_kv_cache_groups_are_per_layer(per_layer, tiers):
    assert len(per_layer.llm.llm_engine.vllm_config.additional_config) > 0
    assert per_layer.stats()["total_blocks"] > tiers.stats()["total_blocks"]  # smaller blocks, more of them


@pytest.mark.mrv2
def test_pyramidkv_and_uniform_policies_match_reference_per_layer(per_layer, reference):
    prompts = random_prompts((300, 230, 120, 260, 180), seed=41)
    configs = [
        {"policy": "pyramidkv", "budget": 96, "window": 16},
        {"policy": "pyramidkv", "budget": 64, "window": 8, "beta": 4},
        None,
        {"policy": "snapkv", "budget": 64, "window": 16},
        {"policy": "h2o", "budget": 64},
    ]
    check_against_reference(per_layer, reference, NUM_LAYERS, prompts, configs)


def test_budgets_from_attention_match_reference_and_are_kept(per_layer, reference):
    """adaptive (per layer) and adakv (per head) budgets are derived by the
    worker from the window's attention and reported to the scheduler, which
    frees each layer's tail: the lengths kept per layer must be the
    reference's, and so must the tokens (adakv's masked heads included)."""
    prompts = random_prompts((310, 250, 95, 205, 280, 170), seed=53)
    configs = [
        {"policy": "adaptive", "budget": 64, "window": 16},
        {"policy": "adaptive", "budget": 48, "window": 8, "coverage": 0.8, "floor": 16},
        {"policy": "adaptive", "budget": 64, "window": 16},
        {"policy": "pyramidkv", "budget": 80, "window": 16},
        {"policy": "adakv", "budget": 48, "window": 8},
        {"policy": "adakv", "budget": 64, "window": 16, "alpha": 0.5},
    ]
    got = per_layer.generate(prompts, NEW_TOKENS, configs)
    finished = {r["prefill_len"]: r for r in per_layer.stats()["requests"].values() if r["finished"]}
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS})
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)
        assert tokens == want["tokens"], f"{config} prompt {len(prompt)}"
        (lengths,) = want["compressed_lengths"]
        assert tuple(finished[len(prompt)]["tokens_kept_per_group"]) == lengths
        if config["policy"] == "adaptive":
            assert sum(lengths) <= NUM_LAYERS * config["budget"]  # shares of the total, rounded down
        if config["policy"] == "adakv":
            assert max(lengths) > config["budget"] and sum(want["dead_slots"]) > 0  # heads keep unequal counts
    assert per_layer.stats()["free_blocks"] == per_layer.stats()["total_blocks"]


def test_new_compositions_match_reference_and_free_their_blocks(per_layer, reference):
    """Compositions no paper names: H2O's accumulated attention with AdaKV's
    per-head budgets (compressing once), TOVA's newest-query attention with
    PyramidKV's layer budgets (rolling), a streamed random baseline, and
    expected attention with PyramidKV's budgets and chunk selection. Each
    equals the reference decoder token for token, keeps the lengths the
    reference keeps per layer, and holds exactly the blocks those lengths need."""
    prompts = random_prompts((300, 260, 240, 280, 270), seed=59)
    configs = [
        {"policy": "h2o", "allocation": "per_head", "trigger": "once", "budget": 64, "alpha": 0.3},
        {"policy": "tova", "allocation": "pyramid", "budget": 80, "window": 8, "beta": 4, "interval": 16},
        {"policy": "keyformer", "allocation": "adaptive", "budget": 64, "window": 8},
        {"policy": "random", "trigger": "streamed", "prompt_chunk": 64, "budget": 48, "window": 4},
        {"policy": "expected_attention", "allocation": "pyramid", "budget": 64, "selection": "chunk",
         "chunk_length": 8},
    ]
    got = per_layer.generate(prompts, NEW_TOKENS, configs)
    finished = {r["prefill_len"]: r for r in per_layer.stats()["requests"].values() if r["finished"]}
    wants = {}
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS})
        want = wants[config["policy"]] = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)
        assert tokens == want["tokens"], f"{config} prompt {len(prompt)}"
        stats = finished[len(prompt)]
        last = want["compressed_lengths"][-1]
        assert tuple(stats["tokens_kept_per_group"]) == tuple(last), config
        assert stats["compressions"] == len(want["compressed_lengths"]), config
        # Held at the end: each layer's own blocks, for what it kept at the
        # last compression plus the tokens cached since.
        cached_since = len(prompt) + NEW_TOKENS - 1 - want["compressed_at"][-1]
        assert stats["blocks_held"] == sum(cdiv(n + cached_since, BLOCK_SIZE) for n in last), config
    assert sum(wants["h2o"]["dead_slots"]) > 0  # heads really kept unequal counts
    assert len(set(wants["tova"]["compressed_lengths"][-1])) == NUM_LAYERS  # a pyramid: each layer its own length
    assert len(set(wants["expected_attention"]["compressed_lengths"][-1])) == NUM_LAYERS
    assert len(wants["tova"]["compressed_lengths"]) > 1  # and rolling
    assert len(wants["random"]["compressed_at"]) > 1 and wants["random"]["compressed_at"][0] < len(prompts[3])
    assert per_layer.stats()["free_blocks"] == per_layer.stats()["total_blocks"]


def test_budget_above_need_equals_vanilla(per_layer):
    prompts = random_prompts((120, 45), seed=49)
    plain = per_layer.generate(prompts, NEW_TOKENS)
    for policy in ("pyramidkv", "adaptive", "adakv"):
        roomy = per_layer.generate(prompts, NEW_TOKENS, [{"policy": policy, "budget": len(p), "window": 8}
                                                         for p in prompts])
        assert roomy == plain, policy


def test_per_layer_policies_match_reference_with_tiers(tiers, reference):
    prompts = random_prompts((280, 150, 210, 190), seed=43)
    configs = [{"policy": "pyramidkv", "budget": 80, "window": 16}, None,
               {"policy": "streamingllm", "budget": 48}, {"policy": "adaptive", "budget": 64, "window": 16}]
    check_against_reference(tiers, reference, 2, prompts, configs)


@pytest.mark.mrv2
def test_each_layer_holds_its_own_blocks(per_layer):
    """A pyramid request holds sum over layers of cdiv(budget_l, block) blocks of one
    layer each, where one shared table would hold num_layers * cdiv(max budget, block)."""
    (prompt,) = random_prompts((600,), seed=47)
    config = {"policy": "pyramidkv", "budget": 128, "window": 16}
    per_layer.generate([prompt], 2, [config])  # compressed before the 2nd token is decoded
    plan = resolve_plan(KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS}), 600, NUM_LAYERS,
                        BLOCK_SIZE)
    budgets = RequestSchedule.create(plan, layer_groups(NUM_LAYERS, NUM_LAYERS)).budgets
    assert len(set(budgets)) == NUM_LAYERS and budgets[0] > budgets[-1]
    finished = [r for r in per_layer.stats()["requests"].values() if r["finished"] and r["prefill_len"] == 600]
    stats = finished[-1]
    assert tuple(stats["tokens_kept_per_group"]) == budgets
    # Each layer holds its budget plus the one decoded token, in its own blocks.
    per_layer_blocks = sum(cdiv(b + 1, BLOCK_SIZE) for b in budgets)
    assert stats["blocks_held"] == per_layer_blocks
    assert per_layer_blocks < NUM_LAYERS * cdiv(max(budgets) + 1, BLOCK_SIZE)
    assert per_layer.stats()["free_blocks"] == per_layer.stats()["total_blocks"]


def test_layer_groups_must_divide_the_layers(tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_kvcompress  # noqa: F401

    with pytest.raises(ValueError, match=r"layer_groups: 3 does not divide .* 4 layers; valid values: \[1, 2, 4\]"):
        EngineArgs(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=3)).create_engine_config()
