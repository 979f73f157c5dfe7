"""Allocation `retrieval`: layer budgets from a measured retrieval-head profile.

Unit checks of the formula (hand-written expectations), the profile file's
checks and its place in the configuration (an engine setting, relative to a
recipe), the calibration's measure (attention mass on the answer's context),
a calibration of SmolLM2 on one prompt, and a real engine with per-layer KV cache groups against the
reference decoder.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import BLOCK_SIZE, engine_kwargs, random_prompts
from kvc_tools.calibrate_profile import answer_mass
from vllm_kvcompress.budgets import Retrieval, water_fill
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.retrieval_profile import FORMAT, load_profile
from vllm_kvcompress.schedule import cdiv

NUM_LAYERS = 4  # the tiny model's
NEW_TOKENS = 24
SCORES = [[0.0, 0.0], [1.0, 0.2], [0.0, 0.0], [0.3, 0.0]]  # layer scores 0, 1.2, 0, 0.3


def write_profile(path: Path, rows=SCORES) -> str:
    path.write_text(json.dumps({"format": FORMAT, "model": "test", "num_layers": len(rows),
                                "num_kv_heads": len(rows[0]), "kv_head_scores": rows}))
    return str(path)


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    return write_profile(tmp_path_factory.mktemp("profile") / "profile.json")


def test_layer_budgets_follow_the_profile(profile):
    # budget 64, protected 16: 48 beyond them; share 0.5 -> 24 each, plus
    # 0.5 * 48 * 4 = 96 split as 0 : 1.2 : 0 : 0.3.
    allocation = Retrieval(profile=profile, share=0.5)
    assert allocation.layer_budgets(64, NUM_LAYERS, None, 16) == [16 + 24, 16 + 24 + 76, 16 + 24, 16 + 24 + 19]
    # A prompt of 100 compressible tokens caps layer 1 at 100: its 16.8 extra
    # go to the others in proportion to their 24, 24 and 43.2.
    assert allocation.layer_budgets(64, NUM_LAYERS, 100, 16) == [16 + 28, 100, 16 + 28, 16 + 51]
    assert Retrieval(profile=profile, share=0.0).layer_budgets(64, NUM_LAYERS, None, 16) == [64] * 4
    assert Retrieval(profile=profile, share=1.0).layer_budgets(64, NUM_LAYERS, None, 16) == [16, 16 + 153, 16, 16 + 38]


def test_water_fill_keeps_the_total_under_the_cap():
    assert water_fill([10.0, 50.0, 40.0], 45.0) == pytest.approx([10 + 5 / 50 * 10, 45.0, 40 + 5 / 50 * 40])
    assert water_fill([60.0, 60.0], 45.0) == [45.0, 45.0]  # nowhere to go: both capped


def test_profile_checks_name_the_field(tmp_path, profile):
    def message(**params) -> str:
        with pytest.raises(KVCompressConfigError) as e:
            KVCompressConfig.from_dict({"policy": "snapkv", "allocation": "retrieval", "budget": 64,
                                        "layer_groups": 4, **params})
        return str(e.value)

    assert message().startswith("kv_compress.profile: must name a retrieval profile file")
    assert "cannot read" in message(profile=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    assert "is not JSON" in message(profile=str(tmp_path / "bad.json"))
    (tmp_path / "other.json").write_text('{"format": "something else"}')
    assert "is not a retrieval profile" in message(profile=str(tmp_path / "other.json"))
    negative = write_profile(tmp_path / "negative.json", [[0.5, -1.0]])
    assert "finite scores >= 0" in message(profile=negative)
    assert message(profile=profile, share=1.5).startswith("kv_compress.share: must be in [0, 1]")
    with pytest.raises(KVCompressConfigError, match="kv_compress.layer_groups: allocation 'retrieval'"):
        KVCompressConfig.from_dict({"policy": "snapkv", "allocation": "retrieval", "budget": 64, "profile": profile})


def test_profile_is_an_engine_setting(tmp_path, profile):
    engine = KVCompressConfig.from_dict({"policy": "snapkv", "allocation": "retrieval", "profile": profile,
                                         "budget": 64, "layer_groups": 4})
    other = write_profile(tmp_path / "other.json")
    with pytest.raises(KVCompressConfigError, match="kv_compress.profile: an engine setting"):
        engine.merged({"profile": other})
    assert engine.merged({"profile": other}, startup=True).params["profile"] == other
    # A request may change the share, leave the allocation and come back to it;
    # the engine's profile follows wherever the composition has it.
    assert engine.merged({"share": 0.8}).params == {"profile": profile, "share": 0.8}
    assert "profile" not in engine.merged({"allocation": "uniform"}).params
    assert engine.merged({"policy": "tova", "allocation": "retrieval"}).params["profile"] == profile


def test_recipe_profile_is_relative_to_the_recipe(tmp_path):
    write_profile(tmp_path / "p.json")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kv_compress:\n  policy: snapkv\n  allocation: retrieval\n  profile: p.json\n"
                      "  budget: 64\n  layer_groups: 4\n")
    assert KVCompressConfig.from_yaml(recipe).params["profile"] == str(tmp_path / "p.json")


def test_answer_mass_sums_each_heads_attention_on_the_context():
    attention = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1],
                              [0.4, 0.0, 0.1, 0.2, 0.3]])
    assert answer_mass(attention, [1, 2]).tolist() == pytest.approx([0.7, 0.1])


def test_answer_context_is_the_answer_and_what_precedes_it():
    from transformers import AutoTokenizer

    from kvc_tools.calibrate_profile import CONTEXT_CHARS, _answer_tokens
    from kvc_tools.models import prepare_smollm2

    tokenizer = AutoTokenizer.from_pretrained(str(prepare_smollm2()))
    text = "x " * 40 + "The special magic number for blue-moon is: 4821734. " + "y " * 40
    ids, answer_ids, context = _answer_tokens(tokenizer, {"input": text, "outputs": ["4821734"]})
    start = text.index("4821734")
    spans = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    assert answer_ids == {ids[t] for t, (a, b) in enumerate(spans) if a < start + 7 and b > start}
    covered = "".join(text[a:b] for a, b in (spans[t] for t in context))
    assert "blue-moon is: 4821734" in covered and "y" not in covered
    first = context[0]  # the first token reaching into the CONTEXT_CHARS before the answer
    assert spans[first][1] > start - CONTEXT_CHARS >= spans[first - 1][1]
    assert context == list(range(first, context[-1] + 1))


@pytest.mark.extended
def test_calibration_finds_copying_heads_on_smollm2(tmp_path):
    from kvc_tools.calibrate_profile import main
    from kvc_tools.models import prepare_smollm2

    out = tmp_path / "smollm2.json"
    assert main([str(prepare_smollm2()), "--out", str(out), "--tasks", "niah_single", "--samples", "1",
                 "--max-tokens", "12"]) == 0
    data = json.loads(out.read_text())
    assert (data["num_layers"], data["num_kv_heads"]) == (30, 3) and data["calibration"]["copy_steps"] > 0
    scores = sorted(load_profile(str(out)).layer_scores())
    assert scores[-1] > 4 * scores[len(scores) // 2] > 0  # a few layers read the answer, most hardly


def test_shipped_smollm2_profile_loads():
    root = Path(__file__).resolve().parents[1]
    config = KVCompressConfig.from_yaml(root / "recipes" / "snapkv-retrieval.yaml")
    assert load_profile(config.params["profile"]).num_layers == 30


@pytest.fixture(scope="module")
def retrieval_engine(start_engine, tiny_model, profile):
    return start_engine(**engine_kwargs(tiny_model, kv_compress="snapkv-span", kv_compress_allocation="retrieval",
                                        kv_compress_profile=profile, kv_compress_budget=64,
                                        kv_compress_layer_groups=NUM_LAYERS))


def test_engine_matches_reference_and_each_layer_holds_its_budget(retrieval_engine, tiny_model, profile):
    from kvc_tools.reference_decoder import ReferenceDecoder

    reference = ReferenceDecoder(tiny_model)
    prompts = random_prompts((300, 240, 90, 270), seed=61)
    configs = [None, {"share": 1.0, "budget": 48}, None, {"policy": "tova", "window": 8, "interval": 16}]
    got = retrieval_engine.generate(prompts, NEW_TOKENS, configs)
    finished = {r["prefill_len"]: r for r in retrieval_engine.stats()["requests"].values() if r["finished"]}
    engine_config = retrieval_engine.llm.llm_engine.vllm_config.additional_config["kv_compress"]
    base = KVCompressConfig.from_dict(engine_config)
    for prompt, config, tokens in zip(prompts, configs, got):
        cfg = base.merged(config or {})
        want = reference.generate(prompt, NEW_TOKENS, cfg, block_size=BLOCK_SIZE)
        assert tokens == want["tokens"], f"{config} prompt {len(prompt)}"
        last = want["compressed_lengths"][-1]
        stats = finished[len(prompt)]
        assert tuple(stats["tokens_kept_per_group"]) == tuple(last), config
        cached_since = len(prompt) + NEW_TOKENS - 1 - want["compressed_at"][-1]
        assert stats["blocks_held"] == sum(cdiv(n + cached_since, BLOCK_SIZE) for n in last), config
        if len(prompt) > 200 and cfg.policy == "snapkv-span":
            assert last[1] > last[3] > last[0] == last[2]  # the profile's order: layer 1 first, then 3
    assert retrieval_engine.stats()["free_blocks"] == retrieval_engine.stats()["total_blocks"]


def test_a_profile_of_another_model_is_refused_at_startup(tmp_path, tiny_model):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_kvcompress  # noqa: F401

    wrong = write_profile(tmp_path / "three.json", SCORES[:3])
    with pytest.raises(KVCompressConfigError, match=r"kv_compress.allocation: profile .* has 3 layers, this model 4"):
        EngineArgs(**engine_kwargs(tiny_model, kv_compress="snapkv", kv_compress_allocation="retrieval",
                                   kv_compress_profile=wrong, kv_compress_budget=64,
                                   kv_compress_layer_groups=NUM_LAYERS)).create_engine_config()
