"""Shared fixtures: the tiny random Llama, and real vLLM engines shared per module.

An engine takes ~30-40 s to start on these machines, so each configuration is
started once (module or session scope) and shut down when its tests are done.
"""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32  # small blocks: evictions free blocks at small budgets


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from vllm_kvcompress.models import build_tiny_llama, default_cache_root

    return str(build_tiny_llama(default_cache_root() / "models" / "tiny-llama-seed0", seed=0))


def engine_kwargs(model: str, **overrides) -> dict:
    kwargs = dict(
        model=model, dtype="float32", enforce_eager=True, block_size=BLOCK_SIZE,
        max_model_len=1024, seed=0,
    )
    kwargs.update(overrides)
    return kwargs


class Engine:
    """A started `LLM`, closed by `close()` (fixtures call it at teardown)."""

    def __init__(self, **kwargs) -> None:
        from vllm import LLM

        import vllm_kvcompress  # noqa: F401  (LLM(kv_compress=...) keywords)

        self.llm = LLM(**kwargs)

    def generate(self, prompts: list[list[int]], max_tokens: int = 40, overrides=None) -> list[list[int]]:
        """Greedy tokens per prompt; `overrides[i]` is prompt i's kv_compress extra_args."""
        from vllm import SamplingParams

        overrides = overrides or [None] * len(prompts)
        params = [
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                           extra_args=None if o is None else {"kv_compress": o})
            for o in overrides
        ]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def stats(self) -> dict:
        import vllm_kvcompress

        return vllm_kvcompress.stats(self.llm)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        gc.collect()


@pytest.fixture(scope="module")
def start_engine():
    """Factory fixture: engines started through it are closed after the module."""
    engines: list[Engine] = []

    def start(**kwargs) -> Engine:
        engines.append(Engine(**kwargs))
        return engines[-1]

    yield start
    for e in engines:
        e.close()


def random_prompts(lengths, seed: int = 0, vocab: int = 2000) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
