"""Python entry points: LLM(kv_compress=...), additional_config, and the plugin staying inert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress import KVCompressConfigError

SCRIPT = Path(__file__).parent / "scripts" / "generate.py"
PROMPTS = random_prompts((150, 40, 90), seed=31)


def run_script(model: str, env: dict | None = None, **kwargs) -> dict:
    # The core in the script's process: one vLLM import instead of three
    # (script, spawned core, spawned worker); the plugin loading checked here
    # is the script process's own.
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
    out = subprocess.run(
        [sys.executable, str(SCRIPT), model, json.dumps(PROMPTS), json.dumps(kwargs)],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def scripts(tiny_model):
    """The module's two script runs, started at once (each starts its own
    engine); tests take `.result()`."""
    with ThreadPoolExecutor(2) as pool:
        yield {
            "additional_config": pool.submit(run_script, tiny_model, additional_config={"kv_compress": CONFIG}),
            # Only vLLM's own plugins: the package is never loaded.
            "without_plugin": pool.submit(run_script, tiny_model, env={"VLLM_PLUGINS": "lora_filesystem_resolver"}),
        }


CONFIG = {"policy": "streamingllm", "budget": 48, "sink_tokens": 2}


@pytest.mark.parametrize("kwargs, needle", [
    ({"kv_compress": "bogus"}, "kv_compress.policy: unknown policy 'bogus'"),
    ({"kv_compress": "snapkv"}, "kv_compress.budget"),
    ({"kv_compress": "snapkv", "kv_compress_ratio": 1.0}, "kv_compress.compression_ratio: must be in [0, 1)"),
    ({"kv_compress": "snapkv", "kv_compress_budget": 64, "kv_compress_pooling": "mode"},
     "kv_compress.pooling: must be one of"),
    ({"kv_compress": {"policy": "h2o", "budget": 64, "window": 3}}, "kv_compress.window"),
    ({"additional_config": {"kv_compress": {"policy": "snapkv", "compression_ratio": 1.2}}},
     "kv_compress.compression_ratio"),
])
def test_bad_python_config_fails_before_the_engine_starts(tiny_model, kwargs, needle):
    from vllm import LLM

    import vllm_kvcompress  # noqa: F401

    with pytest.raises(KVCompressConfigError) as e:
        LLM(**engine_kwargs(tiny_model, **kwargs))
    assert needle in str(e.value)


@pytest.mark.extended
def test_additional_config_works_without_importing_the_package(tiny_model, scripts):
    from kvc_tools.reference_decoder import ReferenceDecoder
    from vllm_kvcompress.config import KVCompressConfig

    config = CONFIG
    result = scripts["additional_config"].result()
    # The script never imports the package: vLLM's plugin loader did.
    assert result["imported_plugin"]
    assert result["stats"]["tokens_evicted"] > 0
    ref = ReferenceDecoder(tiny_model)
    for prompt, tokens in zip(PROMPTS, result["tokens"]):
        assert tokens == ref.generate(prompt, 40, KVCompressConfig.from_dict(config))["tokens"]


@pytest.mark.mrv2
@pytest.mark.extended
def test_plugin_is_inert_without_kv_compress(start_engine, tiny_model, scripts):
    """Installed but not configured: token-for-token what vLLM gives without the plugin."""
    engine = start_engine(**engine_kwargs(tiny_model))
    with_plugin = engine.generate(PROMPTS, 40)
    assert engine.stats() is None  # no compression machinery in the engine
    without = scripts["without_plugin"].result()
    assert not without["imported_plugin"]
    assert with_plugin == without["tokens"]
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="started without kv_compress"):
        engine.generate(PROMPTS[:1], 4, [{"policy": "snapkv", "budget": 64}])
