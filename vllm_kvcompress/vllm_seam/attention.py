"""Attention backend subclasses: the one place that sees post-RoPE queries.

vLLM's attention kernels do not return attention probabilities, so after the
regular forward the queries a policy observes are scored against the request's
cached keys (read back through the block table); a decode query a plain
softmax scorer observes (H2O, TOVA, ...) gets its attention and its scores
from one op instead, vLLM's kernel attending a single key for that row
(worker/step_inputs.MetadataEdits). Nor do vLLM's kernels take a length
per KV head: requests whose heads keep different counts get their rows redone
with those heads' evicted slots masked; and the upper layer of a MiniCache
pair reads most of its keys and values from the lower layer's cache, so
its rows are redone too. One subclass per supported
backend, registered under the backend's own name so vLLM picks it as usual:
CPU_ATTN on CPU, FLASH_ATTN on CUDA (whose metadata builder is subclassed
too: it must build each KV cache group's metadata, not copy the first's).
"""

from __future__ import annotations

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from ..config import CONFIG_KEY
from .worker.state import attached


class ObserveQueries:
    """Attention impl mixin: after the forward, mask per-head evicted slots,
    redo merged layers' rows, attend fused decode rows (kernel ops), and
    score the step's observed queries."""

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        output = super().forward(  # type: ignore[misc]  # a mixin before vLLM's impl class
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        worker = attached(layer)  # the model runner's WorkerCompression
        step = None if worker is None else worker.step
        if step is not None and attn_metadata is not None:
            step.after_attention(layer.layer_name, query, kv_cache, output)
        return output


class KVCompressCPUImpl(ObserveQueries, CPUAttentionBackendImpl):
    pass


class KVCompressCPUBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return KVCompressCPUImpl


class KVCompressFlashImpl(ObserveQueries, FlashAttentionImpl):
    pass


class KVCompressFlashMetadataBuilder(FlashAttentionMetadataBuilder):
    """FLASH_ATTN's builder, building every KV cache group's metadata.

    vLLM's runner builds the first group of a KV cache spec and, for a builder
    that `supports_update_block_table`, gives the next groups of that spec a
    copy with only their block table and slot mapping changed: the same
    seq_lens for every group. Compressed groups hold different physical
    lengths (per-layer budgets, MiniCache, a hybrid model's several groups),
    so with compression on each group is built on its own, through
    `AttentionGroup.build_metadata`, where the seam sets its seq_lens
    (worker/step_inputs.MetadataEdits). vLLM's own GDN builder turns the
    attribute off per instance the same way.
    """

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.supports_update_block_table = CONFIG_KEY not in (vllm_config.additional_config or {})


class KVCompressFlashBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return KVCompressFlashImpl

    @staticmethod
    def get_builder_cls():
        return KVCompressFlashMetadataBuilder


def register_backends(platform) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.KVCompressCPUBackend")
    elif platform.is_cuda():
        register_backend(AttentionBackendEnum.FLASH_ATTN, f"{__name__}.KVCompressFlashBackend")
