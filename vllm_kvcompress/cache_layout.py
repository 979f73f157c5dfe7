"""Where one layer's K and V sit in vLLM's paged cache, per attention backend.

Every backend's cache is read through the same views, `[num_blocks,
block_size, num_kv_heads, head_dim]` for K and for V, so that the kernel ops
(`vllm_kvcompress.kernels`: Triton on CUDA, torch elsewhere) gather, score
and compact any of them. The worker checks the views at startup against
vLLM's own cache writer and refuses to run on a cache they do not match: a
wrong reader would silently corrupt output.

vLLM's CPU attention (CPU_ATTN, "vec" instruction-set path) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`; inside each
(block, head) slab the first half is K *transposed* (`[head_size, block_size]`)
and the second half is V (`[block_size, head_size]`).

vLLM 0.32's GPU FlashAttention (FLASH_ATTN) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` (logical shape; the
physical dim order is NHD or HND), K in the first half of the last dim, and
splits it as `kernels.reference.split_kv_cache` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernels.torch_ops import split_kv_cache

KVViews = tuple[torch.Tensor, torch.Tensor]


def cpu_attn_views(kv_cache: torch.Tensor) -> KVViews:
    """CPU_ATTN's K and V as [N, B, H, D] views sharing the cache's memory."""
    n, h, b, two_d = kv_cache.shape
    d = two_d // 2
    slab = kv_cache.view(n, h, 2, b * d)
    keys = slab[:, :, 0].view(n, h, d, b).permute(0, 3, 1, 2)
    values = slab[:, :, 1].view(n, h, b, d).permute(0, 2, 1, 3)
    return keys, values


# attention backend name -> its K/V views
LAYOUTS: dict[str, Callable[[torch.Tensor], KVViews]] = {
    "CPU_ATTN": cpu_attn_views,
    "FLASH_ATTN": split_kv_cache,
}
