"""Configurations compression cannot serve are refused at startup, by name."""

from __future__ import annotations

import json
import shutil

import pytest

from helpers import engine_kwargs
from vllm_kvcompress import KVCompressConfigError

SNAPKV = dict(kv_compress="snapkv", kv_compress_budget=64)


@pytest.mark.parametrize("extra, needle", [
    ({"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}}, "KV connector"),
    ({"tensor_parallel_size": 4}, "over 2 KV heads"),  # ranks would hold copies of a head
    ({"pipeline_parallel_size": 2}, "pipeline parallelism"),
    ({"scheduler_cls": "my.Scheduler"}, "custom scheduler_cls"),
])
def test_unsupported_engine_features_are_refused(tiny_model, extra, needle):
    from vllm import LLM

    with pytest.raises(KVCompressConfigError) as e:
        LLM(**engine_kwargs(tiny_model, **SNAPKV, **extra))
    assert needle in str(e.value)


def test_all_sliding_window_model_is_refused(tiny_model, tmp_path):
    """Every layer sliding-window (Mistral style): nothing to compress. Hybrid
    models (sliding beside full attention) are served: tests/test_hybrid.py."""
    from vllm import LLM

    model = tmp_path / "sliding"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    with pytest.raises(KVCompressConfigError, match="every layer is sliding-window"):
        LLM(**engine_kwargs(str(model), **SNAPKV))


def test_unsupported_features_are_fine_without_compression(tiny_model):
    """The checks only apply when kv_compress is configured."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_kvcompress.vllm_seam.engine_checks import prepare_engine_args

    args = EngineArgs(model=tiny_model, tensor_parallel_size=2, enable_prefix_caching=True)
    assert prepare_engine_args(args) is None and args.enable_prefix_caching


def test_unchecked_kv_cache_dtypes_are_refused(tiny_model):
    """fp8 is served (tests/test_fp8_cache.py); a cache dtype whose rounding
    the plugin has not checked is refused with the valid values."""
    from vllm import LLM

    for dtype in ("fp8_per_token_head", "fp8_ds_mla"):
        with pytest.raises(KVCompressConfigError, match=rf"kv_cache_dtype={dtype} \(valid with compression here: "
                                                        r"auto, fp8, fp8_e4m3, fp8_e5m2"):
            LLM(**engine_kwargs(tiny_model, **SNAPKV, kv_cache_dtype=dtype))
