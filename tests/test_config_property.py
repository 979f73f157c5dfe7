"""Property test of the configuration: any value in any field, from any entry
point, gives a config that round-trips or raises the plugin's config error
naming a field; never anything else."""

from __future__ import annotations

import math
import re

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_kvcompress.budgets import ALLOCATIONS
from vllm_kvcompress.config import (
    COMMON_FIELDS,
    KVCompressConfig,
    KVCompressConfigError,
    all_params,
    request_overrides,
)
from vllm_kvcompress.registry import POLICIES
from vllm_kvcompress.triggers import TRIGGERS
from vllm_kvcompress.vllm_seam.engine_args import config_from_options

# "kv_compress.<field>: <problem>"; a key that cannot be a field name is quoted.
# A field named as `limits.shown` echoes it: an integer past 30 digits cut to its first 12 and its length.
NAMED = re.compile(r"^kv_compress\.(?:[A-Za-z_]\w*|'.*'|\".*\"|-?\d+|-?\d{1,12}\.\.\. \(\d+ digits\)|"
                   r"an integer of about \d+ digits|None): \S")
FIELDS = [f for f in COMMON_FIELDS if f != "policy"] + sorted(all_params()) + ["ratio", "bogus", ""]
WORDS = sorted(POLICIES) + sorted(ALLOCATIONS) + sorted(TRIGGERS) + ["avg", "max", "mean", "snapkvv"]

values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.integers(0, 600),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.sampled_from(WORDS), st.text(max_size=6),
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
policies = st.one_of(st.sampled_from(sorted(POLICIES)), values)
configs = st.builds(lambda policy, rest: {"policy": policy, **rest},
                    policies, st.dictionaries(st.sampled_from(FIELDS), values, max_size=6))
# Keys as a hostile caller may send them: not only field names, not only strings.
odd_keys = st.dictionaries(st.one_of(st.text(max_size=8), st.integers(), st.none()), values, max_size=3)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def served_or_named(build) -> KVCompressConfig | None:
    try:
        cfg = build()
    except KVCompressConfigError as e:
        assert NAMED.match(str(e)), str(e)
        return None
    assert isinstance(cfg, KVCompressConfig)
    assert KVCompressConfig.from_dict(cfg.to_dict()) == cfg  # round-trips
    for value in cfg.params.values():
        assert not (isinstance(value, float) and not math.isfinite(value))
    return cfg


@SETTINGS
@given(configs)
def test_python_and_additional_config(data):
    served_or_named(lambda: KVCompressConfig.from_dict(data))


@SETTINGS
@given(configs, odd_keys)
def test_hostile_keys(data, extra):
    served_or_named(lambda: KVCompressConfig.from_dict({**data, **extra}))


@pytest.fixture(scope="module")
def recipe_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recipes")


@SETTINGS
@given(data=configs)
def test_yaml_recipe(recipe_dir, data):
    path = recipe_dir / "recipe.yaml"
    path.write_text(yaml.safe_dump({"kv_compress": data}))
    served_or_named(lambda: KVCompressConfig.from_yaml(path))


ENGINE = KVCompressConfig.from_dict({"policy": "snapkv", "budget": 64})


@SETTINGS
@given(configs)
def test_per_request_nested_and_flat(data):
    served_or_named(lambda: ENGINE.merged(request_overrides({"kv_compress": data}) or {}))
    flat = {f"kv_compress_{k}": v for k, v in data.items() if k != "policy"}
    flat["kv_compress"] = data["policy"]
    served_or_named(lambda: ENGINE.merged(request_overrides(flat) or {}))


@SETTINGS
@given(configs)
def test_cli_flags_and_llm_keywords(data):
    """What --kv-compress-* flags and LLM(kv_compress_*=...) keywords become."""
    options = {f"kv_compress_{k}": v for k, v in data.items() if k != "policy"}
    options["kv_compress"] = data["policy"]

    def build():
        raw = config_from_options(dict(options))
        return KVCompressConfig() if raw is None else KVCompressConfig.from_dict(raw)

    served_or_named(build)
