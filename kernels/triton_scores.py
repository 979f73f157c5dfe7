"""Triton scoring kernels: observation-window scores (a) and decode scores (b).

Same math as ``torch_ops``; see ``triton_kernels`` for the design notes.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .torch_scores import LogitsTransform, _parse_transform
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
    _qk,
    _sinks_log2,
)

# ---------------------------------------------------------------------------------------
# (a) observation-window scores
# ---------------------------------------------------------------------------------------


@triton.jit
def _window_rows(
    q_ptr, cu_q_ptr, qpos_ptr, b, kvh, wt, stride_qt, stride_qh,
    G: tl.constexpr, G_BLK: tl.constexpr, W_BLK: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr,
):
    """Rows = (query head g of the group, window query w): row = g * W_BLK + w."""
    q_start = tl.load(cu_q_ptr + b)
    n_q = tl.load(cu_q_ptr + b + 1) - q_start
    rows = tl.arange(0, G_BLK * W_BLK)
    g = rows // W_BLK
    w = wt * W_BLK + rows % W_BLK
    row_ok = (g < G) & (w < n_q)
    qh = kvh * G + g
    tok = (q_start + w).to(tl.int64)
    offs_d = tl.arange(0, D_BLK)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + tok[:, None] * stride_qt + qh[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    qpos = tl.load(qpos_ptr + tok, mask=row_ok, other=-1)
    return q, qpos, row_ok, qh, tok, offs_d, d_ok


@triton.jit
def _window_partial_kernel(
    q_ptr, k_ptr, bt_ptr, cu_q_ptr, qpos_ptr, seq_lens_ptr, pm_ptr, pl_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_btb, stride_pt, stride_ph,
    NUM_WT, SPLIT_LEN,
    G: tl.constexpr, G_BLK: tl.constexpr, W_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_WT
    wt = tl.program_id(1) % NUM_WT
    sp = tl.program_id(2)
    q, qpos, row_ok, qh, tok, offs_d, d_ok = _window_rows(
        q_ptr, cu_q_ptr, qpos_ptr, b, kvh, wt, stride_qt, stride_qh, G, G_BLK, W_BLK, HEAD_DIM, D_BLK
    )
    seq_len = tl.load(seq_lens_ptr + b)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, seq_len), tl.max(qpos, 0) + 1)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    m_i = tl.full([G_BLK * W_BLK], _NEG, tl.float32)
    l_i = tl.zeros([G_BLK * W_BLK], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = _load_kv_tile(k_ptr, bt_row, offs_n, n_ok, kvh, offs_d, d_ok, stride_kb, stride_ks, stride_kh, PAGE)
        s = _qk(q, k, DOT_PREC, DOT_F32) * scale_log2
        vis = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
        m_i = m_new
    pofs = tok * stride_pt + qh * stride_ph + sp
    tl.store(pm_ptr + pofs, m_i, mask=row_ok)
    tl.store(pl_ptr + pofs, l_i, mask=row_ok)


@triton.jit
def _window_scores_kernel(
    q_ptr, k_ptr, bt_ptr, cu_q_ptr, qpos_ptr, seq_lens_ptr, pm_ptr, pl_ptr, out_ptr, sinks_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_btb, stride_pt, stride_ph,
    stride_ob, stride_oh,
    NUM_WT, SPLIT_LEN, NUM_SPLITS,
    G: tl.constexpr, G_BLK: tl.constexpr, W_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    SPLITS_BLK: tl.constexpr, USE_ATOMIC: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_WT
    wt = tl.program_id(1) % NUM_WT
    sp = tl.program_id(2)
    q, qpos, row_ok, qh, tok, offs_d, d_ok = _window_rows(
        q_ptr, cu_q_ptr, qpos_ptr, b, kvh, wt, stride_qt, stride_qh, G, G_BLK, W_BLK, HEAD_DIM, D_BLK
    )
    # exact normaliser of every row from the per-split partials
    offs_s = tl.arange(0, SPLITS_BLK)
    pmask = row_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
    pofs = (tok * stride_pt + qh * stride_ph)[:, None] + offs_s[None, :]
    pm = tl.load(pm_ptr + pofs, mask=pmask, other=_NEG)
    pl = tl.load(pl_ptr + pofs, mask=pmask, other=0.0)
    m_i = tl.max(pm, 1)
    l_i = tl.sum(pl * tl.exp2(pm - m_i[:, None]), 1)
    m_i, l_i = _fold_sinks(m_i, l_i, sinks_ptr, qh, row_ok, HAS_SINKS)
    inv_l = tl.where(row_ok & (l_i > 0), 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)

    seq_len = tl.load(seq_lens_ptr + b)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(tl.minimum(lo + SPLIT_LEN, seq_len), tl.max(qpos, 0) + 1)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    gg = tl.arange(0, G_BLK)
    out_row = out_ptr + b.to(tl.int64) * stride_ob + (kvh * G + gg)[:, None] * stride_oh
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = _load_kv_tile(k_ptr, bt_row, offs_n, n_ok, kvh, offs_d, d_ok, stride_kb, stride_ks, stride_kh, PAGE)
        s = _qk(q, k, DOT_PREC, DOT_F32) * scale_log2
        vis = (offs_n[None, :] <= qpos[:, None]) & n_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        p = tl.exp2(s - m_i[:, None]) * inv_l[:, None]
        ps = tl.sum(tl.reshape(p, [G_BLK, W_BLK, BLOCK_N]), 1)  # sum over window queries
        optr = out_row + offs_n[None, :]
        omask = (gg < G)[:, None] & n_ok[None, :]
        if USE_ATOMIC:
            tl.atomic_add(optr, ps, mask=omask)
        else:
            tl.store(optr, tl.load(optr, mask=omask, other=0.0) + ps, mask=omask)


def window_scores_batched(
    q: torch.Tensor,
    cu_q_lens: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    out: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
    max_q_len: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    *,
    split_len: Optional[int] = None,
    block_n: int = 64,
    max_rows: int = 64,
) -> torch.Tensor:
    """Triton version of :func:`torch_ops.window_scores_batched` (scores added into
    ``out [B, Hq, max_T]``). Pass ``out`` (or ``max_seq_len``) and ``max_q_len`` to avoid
    host syncs. ``split_len``: keys per program (default: ``T/64``, at least 512).
    ``sinks [Hq]``: folded into each row's normaliser (``_fold_sinks``)."""
    _check_cache(key_cache, "key_cache")
    dev = key_cache.device
    total_q, hq, d = q.shape
    nkv_blocks, page, hkv, d_k = key_cache.shape
    if d_k != d or hq % hkv:
        raise ValueError("shape mismatch between q and key_cache")
    g = hq // hkv
    nreq = cu_q_lens.numel() - 1
    if out is None:
        t_out = int(max_seq_len) if max_seq_len is not None else int(seq_lens.max()) if nreq else 0
        out = torch.zeros(nreq, hq, t_out, dtype=torch.float32, device=dev)
    if out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("out must be float32 and contiguous in the token dim")
    t_out = out.shape[-1]
    if nreq == 0 or total_q == 0 or t_out == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_q_lens[1:] - cu_q_lens[:-1]).max())
    q = q.to(key_cache.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    cu = _as_i32(cu_q_lens, dev)
    bt = _as_i32(block_tables, dev)
    sl = _as_i32(seq_lens, dev)
    qpos = _as_i32(q_positions, dev)

    g_blk = _next_pow2(g)
    w_blk = min(_next_pow2(max_q_len), max(1, max_rows // g_blk))
    w_blk = max(w_blk, max(1, 16 // g_blk))  # tl.dot needs >= 16 rows
    num_wt = -(-max_q_len // w_blk)
    split = _pick_split(t_out, block_n, split_len, min_split=512)
    num_splits = -(-t_out // split)
    d_blk = max(16, _next_pow2(d))
    pm = torch.empty(total_q, hq, num_splits, dtype=torch.float32, device=dev)
    pl = torch.empty_like(pm)
    sinks2, has_sinks = _sinks_log2("window_scores_batched", sinks, hq, pm)
    grid = (nreq, hkv * num_wt, num_splits)
    common = dict(G=g, G_BLK=g_blk, W_BLK=w_blk, BLOCK_N=block_n, HEAD_DIM=d, D_BLK=d_blk,
                  PAGE=page, **_dot_flags(key_cache.dtype))
    strides = (q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
               bt.stride(0), pm.stride(0), pm.stride(1))
    scale_log2 = float(scale) * _LOG2E
    _window_partial_kernel[grid](
        q, key_cache, bt, cu, qpos, sl, pm, pl, scale_log2, *strides, num_wt, split, **common
    )
    _window_scores_kernel[grid](
        q, key_cache, bt, cu, qpos, sl, pm, pl, out, sinks2, scale_log2, *strides, out.stride(0), out.stride(1),
        num_wt, split, num_splits, SPLITS_BLK=max(2, _next_pow2(num_splits)), USE_ATOMIC=num_wt > 1,
        HAS_SINKS=has_sinks, **common,
    )
    return out


# ---------------------------------------------------------------------------------------
# (b) decode-time accumulation
# ---------------------------------------------------------------------------------------


@triton.jit
def _decode_logits_kernel(
    q_ptr, k_ptr, bt_ptr, seq_lens_ptr, noise_ptr, inv_tau_ptr, lse_ptr,
    scratch_ptr, pm_ptr, pl_ptr, out_ptr,
    scale,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_btb,
    stride_nr, stride_nh, stride_lr, stride_lh, stride_xr, stride_xh,
    stride_pr, stride_ph, stride_or, stride_oh,
    SPLIT_LEN,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    GUMBEL: tl.constexpr, HAS_LSE: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    r64 = r.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
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
    if GUMBEL:
        inv_tau = tl.load(inv_tau_ptr + r)
    if HAS_LSE:
        lse2 = tl.load(lse_ptr + r64 * stride_lr + qh * stride_lh, mask=g_ok, other=0.0) * 1.4426950408889634
    m_i = tl.full([G_BLK], _NEG, tl.float32)
    l_i = tl.zeros([G_BLK], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        msk = g_ok[:, None] & n_ok[None, :]
        k = _load_kv_tile(k_ptr, bt_row, offs_n, n_ok, kvh, offs_d, d_ok, stride_kb, stride_ks, stride_kh, PAGE)
        x = _qk(q, k, DOT_PREC, DOT_F32) * scale
        if GUMBEL:
            z = tl.load(noise_ptr + r64 * stride_nr + qh[:, None] * stride_nh + offs_n[None, :],
                        mask=msk, other=0.0)
            x = (x + z) * inv_tau
        x2 = tl.where(n_ok[None, :], x * 1.4426950408889634, float("-inf"))  # log2 units
        if HAS_LSE:
            optr = out_ptr + r64 * stride_or + qh[:, None] * stride_oh + offs_n[None, :]
            p = tl.exp2(x2 - lse2[:, None])
            tl.store(optr, tl.load(optr, mask=msk, other=0.0) + p, mask=msk)
        else:
            tl.store(scratch_ptr + r64 * stride_xr + qh[:, None] * stride_xh + offs_n[None, :], x2, mask=msk)
            m_new = tl.maximum(m_i, tl.max(x2, 1))
            l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(x2 - m_new[:, None]), 1)
            m_i = m_new
    if not HAS_LSE:
        pofs = r64 * stride_pr + qh * stride_ph + sp
        tl.store(pm_ptr + pofs, m_i, mask=g_ok)
        tl.store(pl_ptr + pofs, l_i, mask=g_ok)


@triton.jit
def _decode_normalize_kernel(
    seq_lens_ptr, scratch_ptr, pm_ptr, pl_ptr, out_ptr, sinks_ptr,
    stride_xr, stride_xh, stride_pr, stride_ph, stride_or, stride_oh, stride_sr,
    SPLIT_LEN, NUM_SPLITS,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_BLK: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    r64 = r.to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r)
    lo = sp * SPLIT_LEN
    hi = tl.minimum(lo + SPLIT_LEN, seq_len)
    gg = tl.arange(0, G_BLK)
    g_ok = gg < G
    qh = kvh * G + gg
    offs_s = tl.arange(0, SPLITS_BLK)
    pmask = g_ok[:, None] & (offs_s < NUM_SPLITS)[None, :]
    pofs = r64 * stride_pr + qh[:, None] * stride_ph + offs_s[None, :]
    pm = tl.load(pm_ptr + pofs, mask=pmask, other=_NEG)
    pl = tl.load(pl_ptr + pofs, mask=pmask, other=0.0)
    m = tl.max(pm, 1)
    l = tl.sum(pl * tl.exp2(pm - m[:, None]), 1)
    m, l = _fold_sinks(m, l, sinks_ptr, r64 * stride_sr + qh, g_ok, HAS_SINKS)
    lse2 = m + tl.log2(tl.where(l > 0, l, 1.0))  # l == 0 only for rows with no keys (masked)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        msk = g_ok[:, None] & (offs_n < hi)[None, :]
        x2 = tl.load(scratch_ptr + r64 * stride_xr + qh[:, None] * stride_xh + offs_n[None, :],
                     mask=msk, other=float("-inf"))
        p = tl.exp2(x2 - lse2[:, None])
        optr = out_ptr + r64 * stride_or + qh[:, None] * stride_oh + offs_n[None, :]
        tl.store(optr, tl.load(optr, mask=msk, other=0.0) + p, mask=msk)


def accumulate_decode_scores(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scores_out: torch.Tensor,
    scale: float,
    logits_transform: LogitsTransform = None,
    lse: Optional[torch.Tensor] = None,
    max_seq_len: Optional[int] = None,
    sinks: Optional[torch.Tensor] = None,
    *,
    scratch: Optional[torch.Tensor] = None,
    split_len: Optional[int] = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Triton version of :func:`torch_ops.accumulate_decode_scores` (in place, returned).

    Design (K is read exactly once):

    vLLM's paged attention does not return probabilities, so the scores need a second
    ``q.K^T``. A per-head softmax needs the normaliser before any probability can be
    written, so a single sweep over K is impossible without it. Options:

    1. two passes over K (max/sum-exp, then probabilities): reads K twice, the dominant
       traffic (``D`` * 2 bytes per token and kv head, e.g. 256 B at D=128 bf16);
    2. **logits scratch (chosen, default)**: launch 1, grid ``(R, Hkv, key_splits)``:
       a program computes the logits of the G query heads of one kv head (one
       ``tl.dot`` per key tile, K loaded once for the whole GQA group) over one split
       of the keys, applies the optional Gumbel transform, writes them (fp32, log2
       units) to ``scratch [R, Hq, max_T]`` and writes its per-split (max, sum-exp).
       Launch 2, same grid: combines the partials of all splits into the LSE and
       re-reads *its own logits* (``G * 4`` bytes per token and kv head, 16 B at G=4,
       16x less than K) to add ``exp(x - lse)`` into ``scores_out``. Splitting the keys
       across programs keeps the GPU busy at small batch; two launches replace an
       in-kernel barrier between the sweeps.
    3. **LSE from the attention pass** (``lse=`` argument, plain transform only):
       flash-attn can return ``softmax_lse``; then one launch, one sweep, no scratch:
       ``p = exp(x - lse)``. Not valid for Keyformer (the transform changes the
       normaliser) and not all vLLM backends expose it, hence option 2 as the default.

    ``scratch``: optional preallocated ``[R, Hq, >= max_T]`` float32 buffer (reused
    across layers/steps to skip an allocation). ``max_seq_len`` is unused (the grid
    covers the width of ``scores_out``). ``sinks [Hq]``: each head's sink logit
    (over ``tau`` with the Gumbel transform) folded into launch 2's normaliser.
    """
    del max_seq_len
    _check_cache(key_cache, "key_cache")
    noise, tau = _parse_transform(logits_transform)
    if lse is not None and (noise is not None or sinks is not None):
        raise ValueError("lse is only valid without a logits transform or sinks")
    dev = key_cache.device
    nreq, hq, d = q.shape
    _, page, hkv, d_k = key_cache.shape
    if d_k != d or hq % hkv:
        raise ValueError("shape mismatch between q and key_cache")
    if scores_out.dtype != torch.float32 or scores_out.stride(-1) != 1:
        raise ValueError("scores_out must be float32 and contiguous in the token dim")
    g = hq // hkv
    t_out = scores_out.shape[-1]
    if nreq == 0 or t_out == 0:
        return scores_out
    q = q.to(key_cache.dtype)
    if q.stride(-1) != 1:
        q = q.contiguous()
    bt = _as_i32(block_tables, dev)
    sl = _as_i32(seq_lens, dev)
    split = _pick_split(t_out, block_n, split_len, min_split=512)
    num_splits = -(-t_out // split)
    g_blk = max(16, _next_pow2(g))  # tl.dot needs >= 16 rows; padded rows are masked
    d_blk = max(16, _next_pow2(d))
    dummy = scores_out  # placeholder pointer for unused operands

    if noise is not None:
        noise = noise.to(device=dev, dtype=torch.float32)
        if noise.stride(-1) != 1:
            noise = noise.contiguous()
        inv_tau = (1.0 / torch.as_tensor(tau, dtype=torch.float32, device=dev).reshape(-1)).expand(nreq).contiguous()
        n_strides = (noise.stride(0), noise.stride(1))
    else:
        inv_tau, n_strides = dummy, (0, 0)
    if lse is not None:
        lse = lse.to(device=dev, dtype=torch.float32)
        l_strides = (lse.stride(0), lse.stride(1))
        scratch_t, pm, pl = dummy, dummy, dummy
        x_strides, p_strides = (0, 0), (0, 0)
    else:
        l_strides = (0, 0)
        if scratch is None:
            scratch = torch.empty(nreq, hq, t_out, dtype=torch.float32, device=dev)
        if scratch.stride(-1) != 1 or scratch.shape[-1] < t_out:
            raise ValueError("scratch must be [R, Hq, >= max_T], contiguous in the last dim")
        scratch_t = scratch
        pm = torch.empty(nreq, hq, num_splits, dtype=torch.float32, device=dev)
        pl = torch.empty_like(pm)
        x_strides, p_strides = (scratch.stride(0), scratch.stride(1)), (pm.stride(0), pm.stride(1))
    grid = (nreq, hkv, num_splits)
    _decode_logits_kernel[grid](
        q, key_cache, bt, sl, noise if noise is not None else dummy, inv_tau,
        lse if lse is not None else dummy, scratch_t, pm, pl, scores_out,
        float(scale),
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), bt.stride(0),
        *n_strides, *l_strides, *x_strides, *p_strides, scores_out.stride(0), scores_out.stride(1),
        split,
        G=g, G_BLK=g_blk, BLOCK_N=block_n, HEAD_DIM=d, D_BLK=d_blk, PAGE=page,
        **_dot_flags(key_cache.dtype), GUMBEL=noise is not None, HAS_LSE=lse is not None,
    )
    if lse is None:
        # [R, Hq] sink logits in log2 units, over each request's tau (the logits' transform).
        sinks2, has_sinks = _sinks_log2("accumulate_decode_scores", sinks, hq, pm)
        if has_sinks:
            sinks2 = (sinks2[None, :] * (inv_tau[:, None] if noise is not None else 1.0)).expand(nreq, hq).contiguous()
        _decode_normalize_kernel[grid](
            sl, scratch_t, pm, pl, scores_out, sinks2,
            *x_strides, *p_strides, scores_out.stride(0), scores_out.stride(1), sinks2.stride(0) if has_sinks else 0,
            split, num_splits,
            G=g, G_BLK=_next_pow2(g), BLOCK_N=block_n, SPLITS_BLK=max(2, _next_pow2(num_splits)),
            HAS_SINKS=has_sinks,
        )
    return scores_out
