"""vllm-kvcompress: KV-cache compression for vLLM that gives blocks back.

    import vllm_kvcompress                      # enables LLM(kv_compress=...)
    llm = LLM(model, kv_compress="snapkv", kv_compress_budget=256)
    vllm_kvcompress.stats(llm)                  # tokens evicted, blocks freed

Without the import, `LLM(..., additional_config={"kv_compress": {...}})` and
`vllm serve MODEL --kv-compress POLICY` work through the vLLM plugin entry point.
"""

from __future__ import annotations

from .config import KVCompressConfig, KVCompressConfigError
from .policies import POLICIES

__version__ = "0.1.0"
__all__ = ["KVCompressConfig", "KVCompressConfigError", "POLICIES", "enable", "stats"]


def enable() -> None:
    """Install the vLLM seam in this process (idempotent)."""
    from .vllm_seam import patches

    patches.apply_all()


def stats(llm) -> dict | None:
    """Compression statistics of an `LLM`'s engine: totals and per request.

    Keys: total_blocks, free_blocks, tokens_evicted, blocks_freed,
    compressions, requests_compressed, preemptions, and `requests` (id ->
    policy, prefill_len, tokens_evicted, blocks_freed, compressions,
    blocks_held, tokens_kept, finished). None when compression is off.
    """
    client = llm.llm_engine.engine_core
    if hasattr(client, "call_utility"):
        return client.call_utility("kv_compress_stats")
    return client.engine_core.kv_compress_stats()  # in-process engine


try:
    import vllm  # noqa: F401
except ImportError:  # plain use (config, policies, reference) without vLLM
    pass
else:
    enable()
