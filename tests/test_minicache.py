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

from helpers import BLOCK_SIZE, engine_kwargs, in_process_engine, random_prompts
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.merge import MiniCache, merge_tensor, restore
from vllm_kvcompress.schedule import cdiv

NEW_TOKENS = 36
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def reference(tiny_model):
    from kvc_tools.reference_decoder import ReferenceDecoder

    return ReferenceDecoder(tiny_model)


@pytest.fixture(scope="module")
def per_layer(tiny_model):
    with in_process_engine(**engine_kwargs(tiny_model, kv_compress="none",
                                           kv_compress_layer_groups=NUM_LAYERS)) as engine:
        yield engine


def finished_by_length(engine) -> dict[int, dict]:
    return {r["prefill_len"]: r for r in engine.stats()["requests"].values() if r["finished"]}


def expected_blocks(config: dict, prompt_len: int) -> tuple[int, ...]:
    """Blocks per layer group at the end: the pair's kept tokens in the lower
    layer, the retained ones in the upper layer, plus the tokens cached since."""
    cfg = KVCompressConfig.from_dict({**config, "layer_groups": NUM_LAYERS})
    parts = cfg.components()
    assert parts is not None
    kept = cfg.resolve_budget(prompt_len, parts.scorer.min_budget()) if parts.scorer.name != "keep_all" else prompt_len
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


@pytest.mark.mrv2
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


def test_merged_pair_holds_its_blocks_mid_request_and_gives_them_back_on_abort(per_layer):
    """After prefill every layer holds the prompt; the step that merges gives
    the upper layer's blocks back (it keeps its retained tokens), the next
    steps hold what the design says, and an abort returns everything."""
    from vllm import SamplingParams

    core = per_layer.llm.llm_engine
    free = per_layer.stats()["free_blocks"]
    assert free == per_layer.stats()["total_blocks"]
    (prompt,) = random_prompts((300,), seed=71)
    config = {"policy": "snapkv", "merge": "minicache", "budget": 128, "window": 16, "retain_ratio": 0.2}
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, extra_args={"kv_compress": config})
    core.add_request("merged", {"prompt_token_ids": prompt}, params)
    core.step()  # prefill: 10 blocks in each of the 4 layers' groups
    assert per_layer.stats()["free_blocks"] == free - NUM_LAYERS * cdiv(300, BLOCK_SIZE)
    core.step()  # evict to 128 tokens, merge layers 2 and 3 (26 retained), decode one token
    held = [cdiv(128 + 1, BLOCK_SIZE)] * 3 + [cdiv(26 + 1, BLOCK_SIZE)]
    assert per_layer.stats()["free_blocks"] == free - sum(held)
    for _ in range(40):
        core.step()
    held = [cdiv(128 + 41, BLOCK_SIZE)] * 3 + [cdiv(26 + 41, BLOCK_SIZE)]
    assert per_layer.stats()["free_blocks"] == free - sum(held)
    core.abort_request(["merged"])
    core.step()
    assert not core.has_unfinished_requests()
    assert per_layer.stats()["free_blocks"] == free


# Every kind of compaction in one batch: rolling, once, per-layer budgets,
# per-head budgets (reported from the prompt), span selection, MiniCache.
MIXED = [
    {"policy": "h2o", "budget": 64, "interval": 16},
    {"policy": "snapkv", "budget": 64, "window": 16},
    {"policy": "adakv", "budget": 64, "window": 16},
    {"policy": "pyramidkv", "budget": 64, "window": 16},
    {"policy": "snapkv-span", "budget": 96},
    {"policy": "snapkv", "merge": "minicache", "budget": 64, "window": 16},
    {"policy": "tova", "budget": 48, "interval": 8},
    {"policy": "rkv", "budget": 48, "interval": 8},
]


def reads_per_step(engine, requests: int, seed: int) -> tuple[list[int], int]:
    """Host reads (host_reads.COUNTS) in each step of a batch of `requests`
    requests cycling through MIXED, and the compressions they made."""
    from vllm import SamplingParams

    from vllm_kvcompress import host_reads

    core = engine.llm.llm_engine
    before = engine.stats()["compressions"]
    for i, prompt in enumerate(random_prompts([150 + 10 * i for i in range(requests)], seed=seed)):
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                extra_args={"kv_compress": MIXED[i % len(MIXED)]})
        core.add_request(f"reads-{seed}-{i}", {"prompt_token_ids": prompt}, params)
    per_step = []
    while core.has_unfinished_requests():
        start = sum(host_reads.COUNTS.values())
        core.step()
        per_step.append(sum(host_reads.COUNTS.values()) - start)
    return per_step, engine.stats()["compressions"] - before


def test_host_reads_per_step_do_not_grow_with_requests_or_layers(per_layer, monkeypatch):
    """On CUDA each host read of device data stalls the batch: compaction and
    scoring make none per request or layer, only one per step for the layer
    budgets that prompts report (per-head budgets here). A layer's
    compacting requests are selected in batches (one per kind of allocation
    and selection), not one by one."""
    from vllm_kvcompress import budgets

    rows: list[int] = []
    for cls in (budgets.Allocation, budgets.PerHead):
        def recording(self, layers, original=cls.select_batch):
            rows.append(len(layers))
            return original(self, layers)

        monkeypatch.setattr(cls, "select_batch", recording)
    few, few_compressions = reads_per_step(per_layer, len(MIXED), seed=81)
    many, many_compressions = reads_per_step(per_layer, 3 * len(MIXED), seed=82)
    assert few_compressions >= len(MIXED) and many_compressions >= 3 * len(MIXED)  # they compacted
    assert max(few) == max(many) == 1, (few, many)  # the reports' one read, whatever the batch
    assert max(rows) >= 3 and sum(rows) > len(rows), rows  # several requests per selection


# ------------------------------------------------------------------ the math, without vLLM


def slerp_by_hand(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """methods.md's SLERP of one pair of rows, written out."""
    u1, u2 = a / a.norm(), b / b.norm()
    omega = torch.arccos(torch.clamp(u1 @ u2, -1, 1))
    if omega < 1e-7:
        m = (1 - t) * u1 + t * u2
        return m / m.norm()
    return (torch.sin((1 - t) * omega) * u1 + torch.sin(t * omega) * u2) / torch.sin(omega)


def test_merge_tensor_follows_methods_md():
    gen = torch.Generator().manual_seed(0)
    lower, upper = torch.randn(2, 40, 8, generator=gen), torch.randn(2, 40, 8, generator=gen)
    upper[0, 3] = 2.5 * lower[0, 3]  # parallel: the normalised linear interpolation
    merged = merge_tensor(lower, upper, 0.6, 4)
    for h in range(2):
        angles = torch.stack([torch.arccos(torch.clamp((lower[h, i] / lower[h, i].norm())
                                                       @ (upper[h, i] / upper[h, i].norm()), -1, 1))
                              for i in range(40)])
        chosen = sorted(angles.topk(4).indices.tolist())
        assert (merged.slot[h] >= 0).nonzero().flatten().tolist() == chosen
        assert merged.slot[h, chosen].tolist() == [0, 1, 2, 3]
        for i in range(40):
            if i in chosen:  # retained: both layers exact
                torch.testing.assert_close(merged.lower[h, i], lower[h, i])
                torch.testing.assert_close(merged.retained[h, chosen.index(i)], upper[h, i])
            else:  # merged: one direction, each layer's own norm
                d = slerp_by_hand(lower[h, i], upper[h, i], 0.6)
                torch.testing.assert_close(merged.lower[h, i], lower[h, i].norm() * d)
                torch.testing.assert_close(merged.scale[h, i], upper[h, i].norm() / lower[h, i].norm())
    restored = restore(merged.lower, merged.retained, merged.slot, merged.scale)
    for h, i in ((0, 3), (1, 7)):
        if merged.slot[h, i] < 0:
            torch.testing.assert_close(restored[h, i], upper[h, i].norm() * slerp_by_hand(lower[h, i], upper[h, i],
                                                                                          0.6))
    torch.testing.assert_close(restored[0, 3], upper[0, 3])  # parallel, same direction: exact
    everything = merge_tensor(lower, upper, 0.6, 40)
    torch.testing.assert_close(everything.lower, lower)
    torch.testing.assert_close(restore(everything.lower, everything.retained, everything.slot, everything.scale),
                               upper)


def test_slerp_commutes_with_a_rotation_applied_to_both():
    """Why post-RoPE keys can be merged: rotating both inputs rotates the result."""
    gen = torch.Generator().manual_seed(1)
    lower, upper = torch.randn(1, 5, 6, generator=gen), torch.randn(1, 5, 6, generator=gen)
    rotation, _ = torch.linalg.qr(torch.randn(6, 6, generator=gen))
    plain = merge_tensor(lower, upper, 0.3, 0)
    rotated = merge_tensor(lower @ rotation, upper @ rotation, 0.3, 0)
    torch.testing.assert_close(rotated.lower, plain.lower @ rotation, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotated.scale, plain.scale)


def test_pairs_and_retained_counts():
    assert MiniCache().pairs(30) == tuple((lo, lo + 1) for lo in range(15, 29, 2))
    assert MiniCache(start_layer=0).pairs(4) == ((0, 1), (2, 3))
    assert MiniCache().pairs(5) == ((2, 3),)
    assert MiniCache(start_layer=3).pairs(4) == ()
    assert [MiniCache(retain_ratio=0.05).retained(n) for n in (100, 101, 20, 0)] == [5, 6, 1, 0]
    assert MiniCache(retain_ratio=1.0).retained(77) == 77


@pytest.mark.parametrize("config, field", [
    ({"policy": "minicache"}, "layer_groups"),
    ({"policy": "minicache", "layer_groups": 4, "budget": 64}, "budget"),
    ({"policy": "minicache", "layer_groups": 4, "retain_ratio": 1.5}, "retain_ratio"),
    ({"policy": "minicache", "layer_groups": 4, "t": -0.1}, "t"),
    ({"policy": "minicache", "layer_groups": 4, "start_layer": -2}, "start_layer"),
    ({"policy": "h2o", "merge": "minicache", "budget": 64, "layer_groups": 4}, "trigger"),
    ({"policy": "pyramidkv", "merge": "minicache", "budget": 64, "layer_groups": 4}, "allocation"),
    ({"policy": "snapkv", "merge": "minicache", "trigger": "once", "allocation": "per_head", "budget": 64,
      "layer_groups": 4}, "allocation"),
    ({"policy": "rkv", "trigger": "once", "merge": "minicache", "budget": 64, "layer_groups": 4}, "merge"),
    ({"policy": "snapkv", "merge": "minimal", "budget": 64}, "merge"),
])
def test_bad_merge_configs_name_the_field(config, field):
    with pytest.raises(KVCompressConfigError, match=rf"^kv_compress\.{field}: "):
        KVCompressConfig.from_dict(config)


def test_prefix_caching_merged_blocks_are_never_hits(start_engine, tiny_model, reference):
    """With prefix caching on, a merged request rewrites its blocks: none of
    them may serve a later request with the same prompt (which must then give
    the plain answer); a merged request that hits the prefix cache merges a
    copy of the hit and answers as it did cold (the shared originals stay
    whole: the plain request after it hits them and answers the same)."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", enable_prefix_caching=True,
                                          kv_compress_layer_groups=NUM_LAYERS))
    prompt, other = random_prompts((256, 200), seed=73)
    merged = {"policy": "minicache", "start_layer": 0, "retain_ratio": 0.0}
    plain = engine.generate_with_hits([other], NEW_TOKENS)[0][0]
    ((first, hit),) = engine.generate_with_hits([prompt], NEW_TOKENS, [merged])
    assert hit == 0
    cfg = KVCompressConfig.from_dict({**merged, "layer_groups": NUM_LAYERS})
    assert first == reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)["tokens"]
    ((again, hit),) = engine.generate_with_hits([prompt], NEW_TOKENS)
    assert again == reference.generate(prompt, NEW_TOKENS, None, block_size=BLOCK_SIZE)["tokens"]
    # The unmerged run cached the prompt; a merged request hitting it merges as cold.
    ((hitting, hit),) = engine.generate_with_hits([prompt], NEW_TOKENS, [merged])
    assert hit > 0 and hitting == first
    assert engine.generate_with_hits([prompt], NEW_TOKENS) == [(again, hit)]
    assert engine.generate_with_hits([other], NEW_TOKENS)[0][0] == plain


@pytest.mark.parametrize("extra, needle", [
    ({"kv_compress_layer_groups": 2}, "needs one KV cache group per layer (--kv-compress-layer-groups 4)"),
    ({"kv_compress_layer_groups": 4, "kv_compress_start_layer": 3},
     "kv_compress.start_layer: 3 is out of range; valid values: -1 .. 2"),
])
def test_engines_that_cannot_merge_are_refused_at_startup(tiny_model, extra, needle):
    from vllm import LLM

    with pytest.raises(KVCompressConfigError) as e:
        LLM(**engine_kwargs(tiny_model, kv_compress="minicache", **extra))
    assert needle in str(e.value)


def test_a_request_the_engine_cannot_merge_runs_uncompressed(start_engine, tiny_model):
    """Two tiers of two layers: a request asking for minicache runs as it would uncompressed."""
    engine = start_engine(**engine_kwargs(tiny_model, kv_compress="none", kv_compress_layer_groups=2))
    prompts = random_prompts((200,), seed=79)
    assert engine.generate(prompts, NEW_TOKENS, [{"policy": "minicache"}]) == engine.generate(prompts, NEW_TOKENS)
    assert engine.stats()["free_blocks"] == engine.stats()["total_blocks"]
