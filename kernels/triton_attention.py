"""Triton attention kernels: paged decode attention that also adds its
probabilities to the score buffer (b), and a MiniCache-merged layer's attention (d).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .torch_paged import check_sinks
from .torch_scores import _check_decode_attention
from .triton_common import (
    _LOG2E,
    _NEG,
    _as_i32,
    _check_cache,
    _dot_flags,
    _fold_sinks,
    _load_kv_tile,
    _next_pow2,
    _pick_split,
    _pv,
    _qk,
    _sinks_log2,
)


@triton.jit
def _decode_attn_partial_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, logits_ptr, pm_ptr, pl_ptr, pacc_ptr,
    scale_log2,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
    stride_xr, stride_xh, stride_pr, stride_ph, stride_ar, stride_ah, stride_as,
    SPLIT_LEN, MAX_T,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    HAS_SCORES: tl.constexpr,
):
    """One program: the G query heads of one kv head over one split of the keys. Each
    K and V tile is loaded once; an online softmax gives the split's (max, sum-exp,
    sum p V); with scores, the logits (fp32, log2 units) also go to the scratch."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    r64 = r.to(tl.int64)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + r), MAX_T)
    gg = tl.arange(0, G_BLK)
    g_ok = gg < G
    qh = kvh * G + gg
    offs_d = tl.arange(0, D_BLK)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + r64 * stride_qr + qh[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, seq_len)
    bt_row = bt_ptr + r64 * stride_btb
    m_i = tl.full([G_BLK], _NEG, tl.float32)
    l_i = tl.zeros([G_BLK], tl.float32)
    acc = tl.zeros([G_BLK, D_BLK], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = _load_kv_tile(k_ptr, bt_row, offs_n, n_ok, kvh, offs_d, d_ok, stride_kb, stride_ks, stride_kh, PAGE)
        v = _load_kv_tile(v_ptr, bt_row, offs_n, n_ok, kvh, offs_d, d_ok, stride_vb, stride_vs, stride_vh, PAGE)
        x2 = tl.where(n_ok[None, :], _qk(q, k, DOT_PREC, DOT_F32) * scale_log2, float("-inf"))
        if HAS_SCORES:
            tl.store(logits_ptr + r64 * stride_xr + qh[:, None] * stride_xh + offs_n[None, :], x2,
                     mask=g_ok[:, None] & n_ok[None, :])
        m_new = tl.maximum(m_i, tl.max(x2, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(x2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _pv(p, v, DOT_PREC, DOT_F32)
        m_i = m_new
    pofs = r64 * stride_pr + qh * stride_ph + sp
    tl.store(pm_ptr + pofs, m_i, mask=g_ok)
    tl.store(pl_ptr + pofs, l_i, mask=g_ok)
    aptr = pacc_ptr + r64 * stride_ar + qh[:, None] * stride_ah + sp * stride_as + offs_d[None, :]
    tl.store(aptr, acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_attn_reduce_kernel(
    seq_lens_ptr, logits_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, scores_ptr, sinks_ptr,
    stride_xr, stride_xh, stride_pr, stride_ph, stride_ar, stride_ah, stride_as,
    stride_or, stride_oh, stride_sr, stride_sh,
    SPLIT_LEN, NUM_SPLITS, MAX_T,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr,
    SPLITS_BLK: tl.constexpr, HAS_SCORES: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Combine the splits' partials (and the sink logit, with sinks) into the LSE of each query head. Split 0's program
    writes the output; with scores, every program adds ``exp(x - lse)`` over its own
    split, reading the stored logits (not K)."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    r64 = r.to(tl.int64)
    gg = tl.arange(0, G_BLK)
    g_ok = gg < G
    qh = kvh * G + gg
    offs_s = tl.arange(0, SPLITS_BLK)
    pmask = g_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
    prow = r64 * stride_pr + qh * stride_ph
    pm = tl.load(pm_ptr + prow[:, None] + offs_s[None, :], mask=pmask, other=_NEG)
    pl = tl.load(pl_ptr + prow[:, None] + offs_s[None, :], mask=pmask, other=0.0)
    m = tl.max(pm, 1)
    l = tl.sum(pl * tl.exp2(pm - m[:, None]), 1)
    m, l = _fold_sinks(m, l, sinks_ptr, qh, g_ok, HAS_SINKS)
    l_safe = tl.where(l > 0, l, 1.0)  # l == 0 only for a request with no keys: output 0
    if sp == 0:
        offs_d = tl.arange(0, D_BLK)
        od_mask = g_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
        acc = tl.zeros([G_BLK, D_BLK], tl.float32)
        for s in range(0, NUM_SPLITS):
            w = tl.exp2(tl.load(pm_ptr + prow + s, mask=g_ok, other=_NEG) - m)
            a = tl.load(pacc_ptr + r64 * stride_ar + qh[:, None] * stride_ah + s * stride_as + offs_d[None, :],
                        mask=od_mask, other=0.0)
            acc += a * w[:, None]
        out = acc / l_safe[:, None]
        optr = out_ptr + r64 * stride_or + qh[:, None] * stride_oh + offs_d[None, :]
        tl.store(optr, out.to(out_ptr.dtype.element_ty), mask=od_mask)
    if HAS_SCORES:
        lse2 = m + tl.log2(l_safe)
        seq_len = tl.minimum(tl.load(seq_lens_ptr + r), MAX_T)
        lo = sp * SPLIT_LEN
        hi = tl.minimum(lo + SPLIT_LEN, seq_len)
        for start in range(lo, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            msk = g_ok[:, None] & (offs_n < hi)[None, :]
            x2 = tl.load(logits_ptr + r64 * stride_xr + qh[:, None] * stride_xh + offs_n[None, :],
                         mask=msk, other=float("-inf"))
            sptr = scores_ptr + r64 * stride_sr + qh[:, None] * stride_sh + offs_n[None, :]
            tl.store(sptr, tl.load(sptr, mask=msk, other=0.0) + tl.exp2(x2 - lse2[:, None]), mask=msk)


def decode_attention_with_scores(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    scores_out: Optional[torch.Tensor],
    max_seq_len: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    *,
    scratch: Optional[torch.Tensor] = None,
    split_len: Optional[int] = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton version of :func:`torch_ops.decode_attention_with_scores` (``out``
    returned, probabilities added into ``scores_out`` in place unless it is ``None``).

    Design (K and V are read exactly once, attention and scores alike). Launch 1, grid
    ``(R, Hkv, key_splits)`` (split-K, as :func:`accumulate_decode_scores`): a program
    loads each K and V tile of its split once for the G query heads of its kv head (one
    ``tl.dot`` each), keeps an online softmax (max, sum-exp, ``sum p V``) and, with
    scores, writes the logits (fp32, log2 units) to ``scratch [R, Hq, >= max_T]``; its
    partials go to ``[R, Hq, splits(, D)]`` buffers. Launch 2, same grid: each program
    combines all splits' (max, sum-exp) into the LSE; split 0 also writes ``out``
    (rescaled ``sum p V`` over the splits) and, with scores, every program re-reads its
    split's logits (``G * 4`` bytes per token and kv head, against ``2 * D * 2`` for K
    and V in bf16) to add ``exp(x - lse)``. Without scores it is plain split-K paged
    decode attention, the baseline the fused op is timed against.

    ``scratch``: optional preallocated logits buffer (reused across layers/steps).
    ``max_seq_len``: pass it (>= every ``seq_len``) to avoid a host sync; keys past it
    are not read. ``split_len``: keys per program (default ``T/64``, at least 512).
    ``sinks [Hq]``: folded into launch 2's LSE (the output's and the scores' alike).
    """
    t = _check_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scores_out, max_seq_len,
                                sinks)
    _check_cache(key_cache, "key_cache")
    _check_cache(value_cache, "value_cache")
    if scores_out is not None and scores_out.stride(-1) != 1:
        raise ValueError("scores_out must be contiguous in the token dim")
    dev = key_cache.device
    nreq, hq, d = q.shape
    if nreq == 0 or t == 0:
        return torch.zeros(nreq, hq, d, dtype=q.dtype, device=dev)
    out = torch.empty(nreq, hq, d, dtype=q.dtype, device=dev)
    _, page, hkv, _ = key_cache.shape
    g = hq // hkv
    qc = q.to(key_cache.dtype)
    if qc.stride(-1) != 1:
        qc = qc.contiguous()
    bt = _as_i32(block_tables, dev)
    sl = _as_i32(seq_lens, dev)
    split = _pick_split(t, block_n, split_len, min_split=512)
    num_splits = -(-t // split)
    pm = torch.empty(nreq, hq, num_splits, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    pacc = torch.empty(nreq, hq, num_splits, d, dtype=torch.float32, device=dev)
    if scores_out is not None:
        if scratch is None:
            scratch = torch.empty(nreq, hq, t, dtype=torch.float32, device=dev)
        if scratch.dtype != torch.float32 or scratch.stride(-1) != 1 or scratch.shape[-1] < t:
            raise ValueError("scratch must be float32 [R, Hq, >= max_T], contiguous in the last dim")
        logits, sc = scratch, scores_out
        x_strides, s_strides = (scratch.stride(0), scratch.stride(1)), (scores_out.stride(0), scores_out.stride(1))
    else:
        logits, sc = pm, pm  # placeholder pointers, never dereferenced
        x_strides, s_strides = (0, 0), (0, 0)
    p_strides = (pm.stride(0), pm.stride(1))
    a_strides = (pacc.stride(0), pacc.stride(1), pacc.stride(2))
    grid = (nreq, hkv, num_splits)
    _decode_attn_partial_kernel[grid](
        qc, key_cache, value_cache, bt, sl, logits, pm, pl, pacc,
        float(scale) * _LOG2E,
        qc.stride(0), qc.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), bt.stride(0),
        *x_strides, *p_strides, *a_strides,
        split, t,
        G=g, G_BLK=max(16, _next_pow2(g)), BLOCK_N=block_n, HEAD_DIM=d, D_BLK=max(16, _next_pow2(d)), PAGE=page,
        **_dot_flags(key_cache.dtype), HAS_SCORES=scores_out is not None,
    )
    sinks2, has_sinks = _sinks_log2("decode_attention_with_scores", sinks, hq, pm)
    _decode_attn_reduce_kernel[grid](
        sl, logits, pm, pl, pacc, out, sc, sinks2,
        *x_strides, *p_strides, *a_strides, out.stride(0), out.stride(1), *s_strides,
        split, num_splits, t,
        G=g, G_BLK=_next_pow2(g), BLOCK_N=block_n, HEAD_DIM=d, D_BLK=_next_pow2(d),
        SPLITS_BLK=max(2, _next_pow2(num_splits)), HAS_SCORES=scores_out is not None, HAS_SINKS=has_sinks,
    )
    return out


# ---------------------------------------------------------------------------------------
# (d) attention of a MiniCache-merged layer
# ---------------------------------------------------------------------------------------


@triton.jit
def _merged_kv_tile(
    lower_ptr, lower_bt_ptr, upper_ptr, upper_bt_ptr, slot_ptr, scale_ptr,
    offs_n, n_ok, head, offs_d, d_ok, tokens, retained,
    l_sb, l_ss, l_sh, u_sb, u_ss, u_sh, stride_slot,
    PAGE: tl.constexpr,
):
    """Keys (or values) ``offs_n`` of one kv head as the upper layer of a merged pair
    sees them: the lower cache's slot times the token's scale (merged), its own
    retained slot (retained), or its own slot past the retained ones (appended)."""
    in_pair = offs_n < tokens
    slot = tl.load(slot_ptr + head * stride_slot + offs_n, mask=n_ok & in_pair, other=-1)
    scale = tl.load(scale_ptr + head * stride_slot + offs_n, mask=n_ok & in_pair, other=0.0)
    merged = n_ok & in_pair & (slot < 0)
    own = n_ok & ~merged
    own_pos = tl.where(in_pair, slot, retained + offs_n - tokens)
    own_pos = tl.where(own, own_pos, 0)
    low = _load_kv_tile(lower_ptr, lower_bt_ptr, offs_n, merged, head, offs_d, d_ok, l_sb, l_ss, l_sh, PAGE)
    mine = _load_kv_tile(upper_ptr, upper_bt_ptr, own_pos, own, head, offs_d, d_ok, u_sb, u_ss, u_sh, PAGE)
    return low.to(tl.float32) * scale[:, None] + mine.to(tl.float32)


@triton.jit
def _merged_attention_kernel(
    q_ptr, qpos_ptr, out_ptr, sinks_ptr,
    lk_ptr, lv_ptr, lbt_ptr, uk_ptr, uv_ptr, ubt_ptr,
    kslot_ptr, kscale_ptr, vslot_ptr, vscale_ptr,
    tokens, retained, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    lk_sb, lk_ss, lk_sh, lv_sb, lv_ss, lv_sh, uk_sb, uk_ss, uk_sh, uv_sb, uv_ss, uv_sh, stride_slot,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """One program: the G query heads of one kv head for one query, an online
    softmax over the keys it sees (K and V read once, as the model's attention)."""
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    offs_g = tl.arange(0, G_BLK)
    offs_d = tl.arange(0, D_BLK)
    g_ok = offs_g < G
    d_ok = offs_d < HEAD_DIM
    q = tl.load(q_ptr + i * stride_qt + (kvh * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    last = tl.load(qpos_ptr + i)
    m = tl.full([G_BLK], _NEG, dtype=tl.float32)
    total = tl.zeros([G_BLK], dtype=tl.float32)
    acc = tl.zeros([G_BLK, D_BLK], dtype=tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n <= last
        k = _merged_kv_tile(lk_ptr, lbt_ptr, uk_ptr, ubt_ptr, kslot_ptr, kscale_ptr, offs_n, n_ok, kvh, offs_d,
                            d_ok, tokens, retained, lk_sb, lk_ss, lk_sh, uk_sb, uk_ss, uk_sh, stride_slot, PAGE)
        v = _merged_kv_tile(lv_ptr, lbt_ptr, uv_ptr, ubt_ptr, vslot_ptr, vscale_ptr, offs_n, n_ok, kvh, offs_d,
                            d_ok, tokens, retained, lv_sb, lv_ss, lv_sh, uv_sb, uv_ss, uv_sh, stride_slot, PAGE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(n_ok[None, :], s, _NEG)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        p = tl.where(n_ok[None, :], p, 0.0)
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m = m_new
    if HAS_SINKS:  # each head's sink logit (natural units here) joins the denominator, no value
        sink = tl.load(sinks_ptr + kvh * G + offs_g, mask=g_ok, other=_NEG)
        m_new = tl.maximum(m, sink)
        alpha = tl.exp(m - m_new)
        total = total * alpha + tl.exp(sink - m_new)
        acc = acc * alpha[:, None]
    out = acc / total[:, None]
    tl.store(out_ptr + i * stride_ot + (kvh * G + offs_g)[:, None] * stride_oh + offs_d[None, :], out,
             mask=g_ok[:, None] & d_ok[None, :])


def merged_attention(
    query: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    lower_keys: torch.Tensor,
    lower_values: torch.Tensor,
    lower_blocks: torch.Tensor,
    upper_keys: torch.Tensor,
    upper_values: torch.Tensor,
    upper_blocks: torch.Tensor,
    upper_len: int,
    retained: int,
    key_slot: torch.Tensor,
    key_scale: torch.Tensor,
    value_slot: torch.Tensor,
    value_scale: torch.Tensor,
    sinks: Optional[torch.Tensor] = None,
    *,
    block_n: int = 32,
) -> torch.Tensor:
    """Triton version of :func:`torch_ops.merged_attention`: grid ``(n, Hkv)``, one
    program per query and kv head (its G query heads in one ``tl.dot``), an online
    softmax over the keys that query sees. A merged key costs one load of the lower
    layer's slot plus its scale; a retained one a load of the upper layer's slot. fp32
    math on the cache's values (fp32 products, ``ieee``), so it matches the torch
    reference up to summation order."""
    del upper_len  # the query positions bound the keys read
    for cache, name in ((lower_keys, "lower_keys"), (lower_values, "lower_values"), (upper_keys, "upper_keys"),
                        (upper_values, "upper_values")):
        _check_cache(cache, name)
    dev = query.device
    n, hq, d = query.shape
    _, page, hkv, _ = lower_keys.shape
    out = torch.empty(n, hq, d, dtype=torch.float32, device=dev)
    if n == 0:
        return out
    q = query.contiguous()
    slots = [_as_i32(x, dev) for x in (key_slot, value_slot)]
    scales = [x.to(device=dev, dtype=torch.float32).contiguous() for x in (key_scale, value_scale)]
    if slots[0].shape[1] == 0:  # nothing merged: zero-width slot maps still need a valid row stride
        slots = [torch.full((hkv, 1), -1, dtype=torch.int32, device=dev)] * 2
        scales = [torch.zeros(hkv, 1, dtype=torch.float32, device=dev)] * 2
    g = hq // hkv
    check_sinks("merged_attention", sinks, hq)
    _merged_attention_kernel[(n, hkv)](
        q, _as_i32(q_positions, dev), out, out if sinks is None else sinks.contiguous(),
        lower_keys, lower_values, _as_i32(lower_blocks, dev), upper_keys, upper_values, _as_i32(upper_blocks, dev),
        slots[0], scales[0], slots[1], scales[1],
        key_slot.shape[1], int(retained), float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        lower_keys.stride(0), lower_keys.stride(1), lower_keys.stride(2),
        lower_values.stride(0), lower_values.stride(1), lower_values.stride(2),
        upper_keys.stride(0), upper_keys.stride(1), upper_keys.stride(2),
        upper_values.stride(0), upper_values.stride(1), upper_values.stride(2), slots[0].stride(0),
        G=g, G_BLK=max(16, _next_pow2(g)), BLOCK_N=block_n, HEAD_DIM=d, D_BLK=max(16, _next_pow2(d)), PAGE=page,
        HAS_SINKS=sinks is not None,
    )
    return out
