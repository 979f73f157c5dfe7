"""KVCompressConfig: one validation for CLI, Python, YAML and per-request use."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError
from vllm_kvcompress.registry import POLICIES

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml"))


def error(data) -> str:
    with pytest.raises(KVCompressConfigError) as e:
        KVCompressConfig.from_dict(data)
    return str(e.value)


def test_defaults_and_round_trip():
    cfg = KVCompressConfig.from_dict({"policy": "snapkv", "budget": 256, "window": 16})
    assert cfg.enabled and cfg.params == {"window": 16}
    assert KVCompressConfig.from_dict(cfg.to_dict()) == cfg
    assert not KVCompressConfig.from_dict({}).enabled


@pytest.mark.parametrize("data, field, hint", [
    ({"policy": "snapkvv", "budget": 8}, "kv_compress.policy", "'snapkv'"),
    ({"policy": "snapkv"}, "kv_compress.budget", "compression_ratio"),
    ({"policy": "snapkv", "budget": 64, "compression_ratio": 0.5}, "kv_compress.budget", "exactly one"),
    ({"policy": "snapkv", "compression_ratio": 1.0}, "kv_compress.compression_ratio", "[0, 1)"),
    ({"policy": "snapkv", "compression_ratio": -0.1}, "kv_compress.compression_ratio", "[0, 1)"),
    ({"policy": "snapkv", "budget": 16, "window": 32}, "kv_compress.budget", ">= 32"),
    ({"policy": "snapkv", "budget": 12, "window": 64, "kept_window": 16}, "kv_compress.budget", ">= 16"),
    ({"policy": "snapkv", "budget": 64, "window": 32, "kept_window": 40}, "kept_window", "[1, window=32]"),
    ({"policy": "streamingllm", "budget": 4}, "kv_compress.budget", ">= 5"),
    ({"policy": "snapkv", "budget": 64, "sink_tokens": 4}, "kv_compress.sink_tokens", "'window'"),
    ({"policy": "snapkv", "budget": 64, "bogus": 1}, "kv_compress.bogus", "valid fields"),
    ({"policy": "snapkv", "budget": "64"}, "kv_compress.budget", "expected int"),
    ({"policy": "snapkv", "budget": True}, "kv_compress.budget", "expected int"),
    ({"policy": "snapkv", "budget": 64, "pooling": "median"}, "pooling", "['avg', 'max']"),
    ({"policy": "snapkv", "budget": 64, "kernel_size": 4}, "kernel_size", "odd"),
    ({"policy": "h2o", "budget": 64, "recent_ratio": 2.0}, "recent_ratio", "[0, 1]"),
    ({"policy": "none", "budget": 64}, "kv_compress.policy", "other than 'none'"),
    ({"policy": "h2o", "budget": 64, "interval": 0}, "kv_compress.interval", "valid values: 1 .."),
    ({"compression_ratio": 1.5}, "kv_compress.compression_ratio", "[0, 1)"),  # the value, not the missing policy
])
def test_errors_name_the_field_and_the_valid_values(data, field, hint):
    message = error(data)
    assert field in message and hint in message, message


def test_float_fields_accept_ints():
    assert KVCompressConfig.from_dict({"policy": "h2o", "budget": 64, "recent_ratio": 1}).params["recent_ratio"] == 1.0


def test_merged_per_request_overrides():
    base = KVCompressConfig.from_dict({"policy": "snapkv", "budget": 256, "window": 16})
    assert base.merged({"budget": 128}).to_dict() == {"policy": "snapkv", "budget": 128, "window": 16}
    assert base.merged({"compression_ratio": 0.5}).budget is None
    # Switching policy drops the old policy's parameters, keeps the budget.
    assert base.merged({"policy": "h2o"}).to_dict() == {"policy": "h2o", "budget": 256}
    assert base.merged({"policy": "none"}) == KVCompressConfig()
    with pytest.raises(KVCompressConfigError, match="kv_compress.kernel_size"):
        base.merged({"policy": "h2o", "kernel_size": 3})
    # A request may restate the engine's layer groups (none given means 1), not change them.
    assert base.merged({"layer_groups": 1}).num_layer_groups == 1
    with pytest.raises(KVCompressConfigError, match="kv_compress.layer_groups: an engine setting"):
        base.merged({"layer_groups": 2})


def test_ratio_budget_resolution():
    cfg = KVCompressConfig.from_dict({"policy": "snapkv", "compression_ratio": 0.75, "window": 8})
    assert cfg.resolve_budget(1000, 8) == 250
    assert cfg.resolve_budget(10, 8) == 8  # never below the protected tokens
    assert KVCompressConfig.from_dict({"policy": "snapkv", "compression_ratio": 0.0}).resolve_budget(77, 32) == 77


def test_every_policy_has_a_recipe_that_validates():
    names = {KVCompressConfig.from_yaml(p).policy for p in RECIPES}
    assert names >= set(POLICIES) - {"none"}


def test_compositions_from_every_entry_point_shape():
    """allocation and trigger replace a policy's own; their parameters join the policy's."""
    cfg = KVCompressConfig.from_dict({"policy": "h2o", "allocation": "per_head", "trigger": "once",
                                      "budget": 64, "alpha": 0.5})
    parts = cfg.components()
    assert (parts.scorer.name, parts.allocation.name, parts.trigger.name) == ("h2o", "per_head", "once")
    assert parts.allocation.alpha == 0.5 and KVCompressConfig.from_dict(cfg.to_dict()) == cfg
    # Per request: switching the allocation drops the inherited allocation's parameters.
    pyramid = KVCompressConfig.from_dict({"policy": "tova", "allocation": "pyramid", "budget": 64, "beta": 4,
                                          "layer_groups": 4})
    assert pyramid.merged({"allocation": "uniform"}).to_dict() == {
        "policy": "tova", "allocation": "uniform", "budget": 64, "layer_groups": 4}
    # A prompt chunk alone streams the prompt; 0 means "do not stream".
    assert KVCompressConfig.from_dict({"policy": "window", "budget": 64, "prompt_chunk": 32}).trigger == "streamed"
    assert KVCompressConfig.from_dict({"policy": "window", "budget": 64, "prompt_chunk": 0}).trigger is None
    names = {p.stem for p in RECIPES}
    assert {"h2o-per-head", "tova-pyramid"} <= names


@pytest.mark.parametrize("data, field, hint", [
    ({"policy": "h2o", "allocation": "heads", "budget": 64}, "kv_compress.allocation", "'per_head'"),
    ({"policy": "h2o", "trigger": "never", "budget": 64}, "kv_compress.trigger", "'rolling'"),
    ({"policy": "h2o", "allocation": "per_head", "budget": 64}, "kv_compress.trigger", "'once'"),
    ({"policy": "streamingllm", "allocation": "per_head", "budget": 64}, "kv_compress.allocation",
     "observes no attention"),
    ({"policy": "snapkv", "trigger": "streamed", "budget": 64}, "kv_compress.trigger", "no attention"),
    ({"policy": "tova", "allocation": "pyramid", "budget": 64}, "kv_compress.layer_groups", "per-layer"),
    ({"policy": "snapkv", "budget": 64, "alpha": 0.5}, "kv_compress.alpha", "valid fields"),
    ({"policy": "none", "allocation": "pyramid"}, "kv_compress.allocation", "other than 'none'"),
    ({"policy": "keyformer", "budget": 64, "tau_init": float("nan")}, "kv_compress.tau_init", "finite"),
    ({"policy": "h2o", "budget": 64, "recent_ratio": float("inf")}, "kv_compress.recent_ratio", "finite"),
])
def test_composition_errors_name_the_field(data, field, hint):
    message = error(data)
    assert message.startswith(field + ":") and hint in message, message


def test_yaml_errors_are_clear(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_compress:\n  policy: h2o\n  budget: 64\n  window: 8\n")
    with pytest.raises(KVCompressConfigError, match="kv_compress.window"):
        KVCompressConfig.from_yaml(bad)
    bad.write_text("- snapkv\n")
    with pytest.raises(KVCompressConfigError, match="mapping"):
        KVCompressConfig.from_yaml(bad)
    bad.write_text("kv_compress: {policy: [snapkv\n")
    with pytest.raises(KVCompressConfigError, match="kv_compress.config: the recipe .* is not valid YAML"):
        KVCompressConfig.from_yaml(bad)
    with pytest.raises(KVCompressConfigError, match="kv_compress.config: cannot read the recipe .*missing.yaml"):
        KVCompressConfig.from_yaml(tmp_path / "missing.yaml")


def test_request_overrides_from_extra_args():
    from vllm_kvcompress.config import request_overrides

    assert request_overrides(None) is None and request_overrides({"other": 1}) is None
    assert request_overrides({"kv_compress": {"policy": "h2o", "budget": 8}}) == {"policy": "h2o", "budget": 8}
    # The OpenAI server's vllm_xargs carries flat values only.
    assert request_overrides({"kv_compress": "h2o", "kv_compress_budget": 64, "kv_compress_ratio": 0.5}) == {
        "policy": "h2o", "budget": 64, "compression_ratio": 0.5}
    with pytest.raises(KVCompressConfigError, match="kv_compress.policy"):
        request_overrides({"kv_compress": 3})
