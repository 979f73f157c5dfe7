"""MiniCache: adjacent layers' KV merged across depth, with the memory given back.

The tiny model has 4 layers; one engine has one KV cache group per layer.
A merged pair's lower layer keeps its slots (merged directions times its own
norms), its upper layer's group keeps only the retained tokens; the upper
layer's attention reads the rest from the lower layer's cache. Greedy tokens
must equal the reference decoder, which applies the same merge to dense
tensors, and the blocks held must be what the design says.
"""

from __future__ import annotations

import pytest
import torch

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.merge import MiniCache, merge_tensor, restore
from vllm_kvcompress.planner import cdiv

NEW_TOKENS = 36
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def reference(tiny_model):
    from vllm_kvcompress.reference import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.fixture(scope="module")
def per_layer(start_engine, tiny_model):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=NUM_LAYERS))


def finished_by_length(engine) -> dict[int, dict]:
    return {r["prefill_len"]: r for r in engine.stats()["requests"].values() if r["finished"]}


def expected_blocks(config: dict, prompt_len: int) -> tuple[int, ...]:
    """Blocks per layer group at the end: the pair's kept tokens in the lower
    layer, the retained ones in the upper layer, plus the tokens cached since."""
    cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS})
    parts = cfg.components()
    assert parts is not None
    kept = cfg.resolve_budget(prompt_len, parts.scorer.min_budget()) if parts.scorer.evicts else prompt_len
    kept = min(kept, prompt_len)
    uppers = {up for _, up in parts.merge.pairs(NUM_LAYERS)}
    since = NEW_TOKENS - 1
    return tuple(cdiv((parts.merge.retained(kept) if layer in uppers else kept) + since, BLOCK_SIZE)
                 for layer in range(NUM_LAYERS))


CONFIGS = [
    {"policy": "minicache"},
    {"policy": "minicache", "start_layer": 0, "retain_ratio": 0.1, "t": 0.5},
    None,
    {"policy": "snapkv", "merge": "minicache", "budget": 64, "window": 16},
    {"policy": "snapkv", "merge": "minicache", "budget": 96, "window": 8, "start_layer": 0, "selection": "span"},
    {"policy": "snapkv", "budget": 64, "window": 16},
    {"policy": "minicache", "retain_ratio": 0.0},
]


def test_merged_requests_match_reference_beside_unmerged_ones(per_layer, reference):
    prompts = random_prompts((300, 250, 140, 280, 220, 190, 260), seed=61)
    got = per_layer.generate(prompts, NEW_TOKENS, CONFIGS)
    finished = finished_by_length(per_layer)
    for prompt, config, tokens in zip(prompts, CONFIGS, got):
        cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS}) if config else None
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)
        assert tokens == want["tokens"], f"{config} prompt {len(prompt)}"
        if cfg is not None and cfg.components().merge.merges:
            held = tuple(finished[len(prompt)]["blocks_held_per_group"])
            assert held == expected_blocks(config, len(prompt)), config
    assert per_layer.stats()["free_blocks"] == per_layer.stats()["total_blocks"]


def test_merging_changes_the_answer_and_retaining_everything_does_not(per_layer):
    prompts = random_prompts((300, 240), seed=67)
    plain = per_layer.generate(prompts, NEW_TOKENS)
    everything = per_layer.generate(prompts, NEW_TOKENS, [{"policy": "minicache", "retain_ratio": 1.0}] * 2)
    assert everything == plain
    merged = per_layer.generate(prompts, NEW_TOKENS, [{"policy": "minicache", "start_layer": 0,
                                                       "retain_ratio": 0.0}] * 2)
    assert merged != plain  # the merge really changes the cache the model reads
