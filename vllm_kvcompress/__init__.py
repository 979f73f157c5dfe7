"""vllm-kvcompress: KV-cache compression for vLLM that gives blocks back.

    import vllm_kvcompress                      # enables LLM(kv_compress=...)
    llm = LLM(model, kv_compress="snapkv", kv_compress_budget=256)
    vllm_kvcompress.stats(llm)                  # tokens evicted, blocks freed

Without the import, `LLM(..., additional_config={"kv_compress": {...}})` and
`vllm serve MODEL --kv-compress POLICY` work through the vLLM plugin entry point.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from .config import KVCompressConfig, KVCompressConfigError
from .registry import POLICIES

__version__ = "0.1.0"
__all__ = ["KVCompressConfig", "KVCompressConfigError", "POLICIES", "enable", "stats"]


def enable() -> None:
    """Install the whole vLLM seam in this process now (idempotent).

    Not needed normally: vLLM's plugin loader does it in every process.
    """
    from .vllm_seam import patches

    patches.apply_all()


def stats(llm) -> dict | None:
    """Compression statistics of an `LLM`'s engine: totals and per request.

    Keys: total_blocks, free_blocks, block_bytes, total_bytes, free_bytes,
    tokens_evicted, blocks_freed, compressions, requests_compressed,
    preemptions, and `requests` (id -> policy, prefill_len, tokens_evicted,
    blocks_freed, compressions, blocks_held, bytes_held, tokens_kept,
    finished). None when compression is off.
    """
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("kv_compress_stats")
    return client.engine_core.kv_compress_stats()  # in-process engine


class _KeywordsWhenVLLMLoads(importlib.abc.MetaPathFinder):
    """Patch EngineArgs the moment vLLM defines it.

    `import vllm_kvcompress` must make `LLM(kv_compress=...)` work without
    importing vLLM itself (that takes seconds and would make every plain use
    of this package, from model preparation to eval data, pay for it).
    """

    TARGET = "vllm.engine.arg_utils"

    def find_spec(self, name, path, target=None):
        if name != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            from .vllm_seam import patches

            patches.apply_keyword_support()

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


if _KeywordsWhenVLLMLoads.TARGET in sys.modules:
    from .vllm_seam import patches as _patches

    _patches.apply_keyword_support()
else:
    sys.meta_path.insert(0, _KeywordsWhenVLLMLoads())
