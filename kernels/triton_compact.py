"""Triton compaction kernel (c): kept tokens moved to the front of their blocks."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .triton_common import (
    _as_i32,
    _check_cache,
    _load_kv_tile,
    _next_pow2,
)

# ---------------------------------------------------------------------------------------
# (c) compaction
# ---------------------------------------------------------------------------------------


@triton.jit
def _compact_kernel(
    k_ptr, v_ptr, bt_ptr, idx_ptr, cnt_ptr, sc_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    stride_ir, stride_ih, stride_cr, stride_ch, stride_sr, stride_sh,
    KMAX, T_SCORES,
    G: tl.constexpr, G_BLK: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_J: tl.constexpr,
    HAS_COUNTS: tl.constexpr, HAS_SCORES: tl.constexpr, ZERO_TAIL: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    r64 = r.to(tl.int64)
    if HAS_COUNTS:
        count = tl.load(cnt_ptr + r64 * stride_cr + kvh * stride_ch)
    else:
        count = KMAX
    bt_row = bt_ptr + r64 * stride_btb
    offs_d = tl.arange(0, D_BLK)
    d_ok = offs_d < HEAD_DIM
    gg = tl.arange(0, G_BLK)
    g_ok = gg < G
    sc_row = sc_ptr + r64 * stride_sr + (kvh * G + gg)[:, None] * stride_sh
    for j0 in range(0, count, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        j_ok = j < count
        src = tl.load(idx_ptr + r64 * stride_ir + kvh * stride_ih + j, mask=j_ok, other=0)
        j_ok = j_ok & (src != j)  # a token already in its slot is not copied
        kt = _load_kv_tile(k_ptr, bt_row, src, j_ok, kvh, offs_d, d_ok, stride_kb, stride_ks, stride_kh, PAGE)
        vt = _load_kv_tile(v_ptr, bt_row, src, j_ok, kvh, offs_d, d_ok, stride_vb, stride_vs, stride_vh, PAGE)
        if HAS_SCORES:
            st = tl.load(sc_row + src[None, :], mask=g_ok[:, None] & j_ok[None, :], other=0.0)
        # every thread's loads of this tile complete before any thread stores it
        tl.debug_barrier()
        dblk = tl.load(bt_row + j // PAGE, mask=j_ok, other=0).to(tl.int64)
        doff = (j % PAGE)[:, None]
        m2 = j_ok[:, None] & d_ok[None, :]
        tl.store(k_ptr + dblk[:, None] * stride_kb + doff * stride_ks + kvh * stride_kh + offs_d[None, :], kt, mask=m2)
        tl.store(v_ptr + dblk[:, None] * stride_vb + doff * stride_vs + kvh * stride_vh + offs_d[None, :], vt, mask=m2)
        if HAS_SCORES:
            tl.store(sc_row + j[None, :], st, mask=g_ok[:, None] & j_ok[None, :])
    if HAS_SCORES:
        if ZERO_TAIL:
            tl.debug_barrier()
            for j0 in range(count, T_SCORES, BLOCK_J):
                j = j0 + tl.arange(0, BLOCK_J)
                tl.store(sc_row + j[None, :], tl.zeros([G_BLK, BLOCK_J], tl.float32),
                         mask=g_ok[:, None] & (j < T_SCORES)[None, :])


def compact_kv_batched(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    keep_idx: torch.Tensor,
    keep_counts: Optional[torch.Tensor] = None,
    scores: Optional[torch.Tensor] = None,
    zero_score_tail: bool = True,
    *,
    block_j: int = 32,
) -> None:
    """Triton version of :func:`torch_ops.compact_kv_batched` (one launch per layer).

    Only entries with ``idx[j] != j`` are copied. Hole-filling ``keep_idx`` (the
    plugin's order: every entry ``j`` or ``>= count``) is safe in any order: no source
    is a destination. Strictly ascending ``keep_idx`` is safe as follows, without a
    temporary buffer. Requirements: ``idx[j] >= j`` per (request, head); requests own disjoint
    blocks; a kv head only touches its own elements. One program handles one (request,
    kv head) and walks destination tiles ``[t*B, (t+1)*B)`` in increasing ``t``. Per tile:
    load all sources (K, V, score columns), ``debug_barrier`` (all threads of the
    program), then store. Proof that no source is overwritten before it is read:

    * later tiles ``t' > t`` read ``idx[j] >= j >= t'*B >= (t+1)*B``, never a destination
      of tile ``t``;
    * earlier tiles ``t' < t`` may read positions in ``[t*B, ...)``, but their loads
      precede their barrier, which precedes tile ``t``'s stores in every thread;
    * inside tile ``t``, sources and destinations may overlap, and the barrier orders
      all loads before all stores.

    The kernel is launched with ``num_stages=1`` so the software pipeliner cannot turn
    the loads into asynchronous copies that complete after the barrier. Zeroing the score
    tail (``>= count``) happens after a final barrier. Other programs touch disjoint
    memory, so they need no ordering. Traffic: K and V kept rows are read once and
    written once, no extra memory.
    """
    _check_cache(key_cache, "key_cache")
    _check_cache(value_cache, "value_cache")
    dev = key_cache.device
    nreq, hkv, kmax = keep_idx.shape
    if nreq == 0:
        return
    _, page, hkv_c, d = key_cache.shape
    if hkv_c != hkv:
        raise ValueError("keep_idx heads do not match the cache")
    bt = _as_i32(block_tables, dev)
    idx = _as_i32(keep_idx, dev)
    if keep_counts is not None:
        cnt = _as_i32(keep_counts, dev)
        c_strides = (cnt.stride(0), cnt.stride(1))
    else:
        cnt, c_strides = idx, (0, 0)
    if scores is not None:
        if scores.dtype != torch.float32 or scores.stride(-1) != 1:
            raise ValueError("scores must be float32, contiguous in the token dim")
        hq, t_sc = scores.shape[1], scores.shape[2]
        g = hq // hkv
        sc, s_strides = scores, (scores.stride(0), scores.stride(1))
    else:
        g, t_sc, sc, s_strides = 1, 0, idx, (0, 0)
    _compact_kernel[(nreq, hkv)](
        key_cache, value_cache, bt, idx, cnt, sc,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), bt.stride(0),
        idx.stride(0), idx.stride(1), *c_strides, *s_strides,
        kmax, t_sc,
        G=g, G_BLK=_next_pow2(g), HEAD_DIM=d, D_BLK=max(16, _next_pow2(d)), PAGE=page, BLOCK_J=block_j,
        HAS_COUNTS=keep_counts is not None, HAS_SCORES=scores is not None, ZERO_TAIL=bool(zero_score_tail),
        num_stages=1,
    )
