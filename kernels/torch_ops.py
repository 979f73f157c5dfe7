"""Plain-torch references for the KV-compression kernels.

These functions are both the *test oracle* for the Triton kernels in
``triton_kernels.py`` and the *CPU production path*: they use dense, batched torch ops
(no Python loop over tokens; at most a loop over requests or head chunks to bound
memory). Nothing here imports Triton. The cache operations live in ``torch_paged``,
the scoring in ``torch_scores``; this module names them.

Paged KV layout (what vLLM 0.32's FlashAttention reads, one layer):

* ``key_cache``, ``value_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``
  views, any strides but the last (vLLM 0.32 keeps one ``kv_cache`` tensor
  ``[num_blocks, H, block_size, 2 * D]``, K in the first half of the last dim; its
  physical dim order depends on the KV layout, NHD or HND. :func:`split_kv_cache`
  takes the same views FlashAttention takes). Keys are stored post-RoPE.
* Token at physical position ``p`` of request ``r`` lives in block
  ``block_tables[r, p // block_size]`` at offset ``p % block_size``.
* Queries: ``[num_tokens, num_q_heads, head_dim]`` with ``num_q_heads = G * num_kv_heads``;
  query head ``h`` uses kv head ``h // G``.

vLLM's CPU backend (CPU_ATTN) uses another layout (``[N, H, B, 2*D]`` with K stored
transposed); these functions do not read it: convert, or gather with a layout-aware reader.

Scores are always float32. All math is done in float32 on the (up-cast) stored values,
so the references and the kernels agree up to summation order.
"""

from __future__ import annotations

from .torch_paged import LogitsTransform as LogitsTransform
from .torch_paged import check_keep_idx as check_keep_idx
from .torch_paged import compact_kv_batched as compact_kv_batched
from .torch_paged import gather_dense as gather_dense
from .torch_paged import merged_attention as merged_attention
from .torch_paged import split_kv_cache as split_kv_cache
from .torch_scores import accumulate_decode_scores as accumulate_decode_scores
from .torch_scores import decode_attention_with_scores as decode_attention_with_scores
from .torch_scores import pool_scores as pool_scores
from .torch_scores import reduce_gqa as reduce_gqa
from .torch_scores import window_scores as window_scores
from .torch_scores import window_scores_batched as window_scores_batched

# The operations every backend provides (torch here, Triton in triton_kernels):
# what the worker calls, on CPU and on CUDA alike.
OP_NAMES = (
    "split_kv_cache",
    "gather_dense",
    "window_scores_batched",
    "accumulate_decode_scores",
    "decode_attention_with_scores",
    "compact_kv_batched",
    "merged_attention",
)

__all__ = [*OP_NAMES, "OP_NAMES", "check_keep_idx", "window_scores", "reduce_gqa", "pool_scores"]
