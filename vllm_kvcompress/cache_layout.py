"""Reading and compacting one request's tokens in a paged KV cache layout.

vLLM's CPU attention (CPU_ATTN, "vec" instruction-set path) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`; inside each
(block, head) slab the first half is K *transposed* (`[head_size, block_size]`)
and the second half is V (`[block_size, head_size]`). The worker checks this
at startup against vLLM's own writer (`check_layout`) and refuses to run on
any cache that does not match: a wrong reader would silently corrupt output.
"""

from __future__ import annotations

import torch


class CPUAttnLayout:
    name = "CPU_ATTN"

    @staticmethod
    def views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K view [N, H, D, B], V view [N, H, B, D]) sharing the cache's memory."""
        n, h, b, two_d = kv_cache.shape
        d = two_d // 2
        slab = kv_cache.view(n, h, 2, b * d)
        return slab[:, :, 0].view(n, h, d, b), slab[:, :, 1].view(n, h, b, d)

    @classmethod
    def gather(cls, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int):
        """(K, V) of physical positions [0, num_tokens), each [H, T, D]."""
        k_view, v_view = cls.views(kv_cache)
        block_size = k_view.shape[-1]
        pos = torch.arange(num_tokens, device=kv_cache.device)
        blk, off = block_ids[pos // block_size], pos % block_size
        # Advanced indices split by a slice put the token dim first: [T, H, D].
        return k_view[blk, :, :, off].transpose(0, 1), v_view[blk, :, off, :].transpose(0, 1)

    @classmethod
    def gather_keys(cls, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int):
        """K of physical positions [0, num_tokens): [H, T, D] (scoring reads no V)."""
        k_view, _ = cls.views(kv_cache)
        block_size = k_view.shape[-1]
        pos = torch.arange(num_tokens, device=kv_cache.device)
        return k_view[block_ids[pos // block_size], :, :, pos % block_size].transpose(0, 1)

    @classmethod
    def compact(cls, kv_cache: torch.Tensor, block_ids: torch.Tensor, keep_idx: torch.Tensor) -> None:
        """Move each head's kept tokens (keep_idx [H, keep]) to positions [0, keep).

        The gather copies before the scatter writes, so overlapping source and
        destination slots are safe.
        """
        k_view, v_view = cls.views(kv_cache)
        block_size = k_view.shape[-1]
        heads = torch.arange(keep_idx.shape[0], device=kv_cache.device).unsqueeze(1)
        src_blk, src_off = block_ids[keep_idx // block_size], keep_idx % block_size
        keys = k_view[src_blk, heads, :, src_off]  # [H, keep, D]
        values = v_view[src_blk, heads, src_off, :]  # [H, keep, D]
        dst = torch.arange(keep_idx.shape[1], device=kv_cache.device).expand_as(keep_idx)
        dst_blk, dst_off = block_ids[dst // block_size], dst % block_size
        k_view[dst_blk, heads, :, dst_off] = keys
        v_view[dst_blk, heads, dst_off, :] = values
