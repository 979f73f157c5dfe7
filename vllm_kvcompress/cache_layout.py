"""Reading and compacting one request's tokens in a paged KV cache layout.

Two layouts, one interface (`gather`, `gather_keys`, `compact`); the worker
picks one at startup by attention backend and self-tests it against vLLM's own
cache writer before serving.

vLLM's CPU attention (CPU_ATTN, "vec" instruction-set path) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`; inside each
(block, head) slab the first half is K *transposed* (`[head_size, block_size]`)
and the second half is V (`[block_size, head_size]`). The worker checks this
at startup against vLLM's own writer and refuses to run on any cache that
does not match: a wrong reader would silently corrupt output.

vLLM 0.32's GPU FlashAttention (FLASH_ATTN) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` (logical shape; the
physical dim order is NHD or HND), K in the first half of the last dim. It is
read through `vllm_kvcompress.kernels`: Triton on CUDA, torch elsewhere.
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

    @staticmethod
    def plan_moves(block_ids: torch.Tensor, keep_idx: torch.Tensor, block_size: int):
        """Where each moving token goes, computed once for every layer that keeps the same.

        Slot j of head h must hold token keep_idx[h, j]; only tokens not already
        there move (see `hole_filling_order`).
        """
        dst = torch.arange(keep_idx.shape[1]).expand_as(keep_idx)
        heads, slots = (keep_idx != dst).nonzero(as_tuple=True)
        src = keep_idx[heads, slots]
        return (heads, block_ids[src // block_size], src % block_size,
                block_ids[slots // block_size], slots % block_size)

    @classmethod
    def move(cls, kv_cache: torch.Tensor, moves) -> None:
        """Apply `plan_moves` to one layer; the gather copies before the scatter writes."""
        heads, src_blk, src_off, dst_blk, dst_off = moves
        if heads.numel() == 0:
            return
        k_view, v_view = cls.views(kv_cache)
        keys = k_view[src_blk, heads, :, src_off]  # [n, D] copies
        values = v_view[src_blk, heads, src_off, :]
        k_view[dst_blk, heads, :, dst_off] = keys
        v_view[dst_blk, heads, dst_off, :] = values

    @classmethod
    def compact(cls, kv_cache: torch.Tensor, block_ids: torch.Tensor, keep_idx: torch.Tensor) -> None:
        """Make slot j of each head hold token keep_idx[h, j], j < keep."""
        cls.move(kv_cache, cls.plan_moves(block_ids, keep_idx, kv_cache.shape[2]))


class PagedLayout:
    """vLLM 0.32's FLASH_ATTN cache, read and compacted by the kernel ops."""

    name = "FLASH_ATTN"

    def __init__(self, ops, device: torch.device | str = "cpu") -> None:
        self.ops = ops  # vllm_kvcompress.kernels.get_ops(device): Triton or torch
        self.device = device

    def views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views [N, B, H, D], split the way FlashAttention splits them."""
        return self.ops.split_kv_cache(kv_cache)

    def gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int):
        """(K, V) of physical positions [0, num_tokens), each [H, T, D]."""
        k_view, v_view = self.views(kv_cache)
        return (self.ops.gather_dense(k_view, block_ids, num_tokens),
                self.ops.gather_dense(v_view, block_ids, num_tokens))

    def gather_keys(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int):
        return self.ops.gather_dense(self.views(kv_cache)[0], block_ids, num_tokens)

    def plan_moves(self, block_ids: torch.Tensor, keep_idx: torch.Tensor, block_size: int):
        return block_ids.to(self.device), keep_idx.to(self.device)

    def move(self, kv_cache: torch.Tensor, moves) -> None:
        """Slot j of each head gets token keep_idx[h, j] (one kernel launch)."""
        k_view, v_view = self.views(kv_cache)
        self.ops.compact_kv(k_view, v_view, *moves)

    def compact(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, keep_idx: torch.Tensor) -> None:
        self.move(kv_cache, self.plan_moves(block_ids, keep_idx, kv_cache.shape[2]))
