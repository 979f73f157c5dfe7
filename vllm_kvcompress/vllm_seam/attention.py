"""Attention backend subclass: the one place that sees post-RoPE queries.

vLLM's attention kernels do not return attention probabilities, so after the
regular forward the queries a policy observes are scored against the request's
cached keys (read back through the block table).
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from . import worker


class KVCompressCPUImpl(CPUAttentionBackendImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        step = worker.active_observation()
        if step is not None and attn_metadata is not None:
            step.observe(layer.layer_name, query, kv_cache)
        return output


class KVCompressCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return KVCompressCPUImpl


def register_backend() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVCompressCPUBackend")
