"""Triton kernels for KV compression (paged vLLM FlashAttention layout).

Same signatures and math as ``torch_ops.py`` (the oracle); see its docstrings for the
layout. Import this module lazily (``kernels.get_ops('cuda')``): it imports Triton.
Under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors (used by the tests).

Requirements: the last dim of ``q``/caches/score buffers is contiguous; ``q`` is cast to
the cache dtype (fp16 / bf16 / fp32; fp8 caches are not supported); index tensors are
converted to int32. ``split_kv_cache`` and ``gather_dense`` are the torch versions
(views and one index_select; they run on whatever device the tensors are on).

Kernels
-------
(a) ``window_scores_batched``: two launches, grid ``(B, Hkv * q_tiles, key_splits)``.
    A program owns the G query heads x ``W_BLK`` window queries of one kv head (one
    ``tl.dot`` per key tile for the whole GQA group, so K is fetched once per group, not
    per query head) and one split of the keys. Launch 1 computes per-row online
    (max, sum-exp) partials per split; launch 2 combines the partials of all splits into
    the exact softmax normaliser, recomputes ``q.K^T`` for its split, normalises, sums
    over the window queries (reshape ``[G, W_BLK, N]`` and reduce) and adds the result
    into ``out``. K is read twice (once per launch); storing per-query logits instead
    would cost ``W*Hq*T`` floats, far more than K. Splitting keys keeps the GPU busy
    for a single long prompt.
(b) ``accumulate_decode_scores``: see its docstring for the design choice.
    ``decode_attention_with_scores``: paged decode attention (split-K online softmax)
    that also adds the probabilities into the score buffer, from one read of K and V;
    two launches, see its docstring.
(c) ``compact_kv_batched``: grid ``(R, Hkv)``, one program walks one (request, kv head)
    in order; see its docstring for the overlap-safety argument.

Status: checked against the references under ``TRITON_INTERPRET=1`` only (written
without GPU access). On a first GPU run, do ``pytest tests/kernels`` (it uses the real
backend when CUDA is present) and then ``python benchmarks/kernels.py``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .torch_ops import (
    OP_NAMES,  # the shared operation list
    LogitsTransform,
    _check_decode_attention,
    _parse_transform,
)

# Torch versions reused on the Triton path (a view and one gather, not fused);
# re-exported: they are part of the operation list.
from .torch_ops import gather_dense as gather_dense  # noqa: E402
from .torch_ops import split_kv_cache as split_kv_cache  # noqa: E402

__all__ = list(OP_NAMES)

_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima (avoids inf - inf = nan)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches: exact fp32 products (tf32 would lose ~3 decimal digits);
    # fp16/bf16: the option is ignored (products are exact, accumulation is fp32).
    return "ieee" if dtype == torch.float32 else "tf32"


def _pick_split(t: int, block_n: int, split_len: Optional[int], min_split: int, max_splits: int = 64) -> int:
    if split_len is None:
        split_len = max(min_split, -(-t // max_splits))
    split_len = max(block_n, -(-int(split_len) // block_n) * block_n)  # multiple of block_n
    return split_len


def _as_i32(x: torch.Tensor, device) -> torch.Tensor:
    return x.to(device=device, dtype=torch.int32).contiguous()


def _check_cache(cache: torch.Tensor, name: str) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name} must be [num_blocks, block_size, H, D], got {tuple(cache.shape)}")
    if cache.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim")


def _interpreting() -> bool:
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older Triton
        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_flags(dtype: torch.dtype) -> dict:
    # The CPU interpreter (Triton 3.9) computes bf16 tl.dot wrongly (garbage values),
    # so there, bf16 operands are up-cast to fp32 (exact: bf16 products fit in fp32).
    return dict(DOT_PREC=_dot_precision(dtype), DOT_F32=_interpreting() and dtype == torch.bfloat16)


@triton.jit
def _qk(q, k, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """``q [M, D] @ k[N, D]^T`` in fp32."""
    if DOT_F32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    return s


@triton.jit
def _load_kv_tile(
    cache_ptr, bt_row_ptr, offs_n, n_ok, head, offs_d, d_ok,
    stride_b, stride_s, stride_h, PAGE: tl.constexpr,
):
    """Tile ``[len(offs_n), D_BLK]`` of physical positions ``offs_n`` of one kv head."""
    blk = tl.load(bt_row_ptr + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
    ptrs = (
        cache_ptr
        + blk[:, None] * stride_b
        + (offs_n % PAGE)[:, None] * stride_s
        + head * stride_h
        + offs_d[None, :]
    )
    return tl.load(ptrs, mask=n_ok[:, None] & d_ok[None, :], other=0.0)


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
    q_ptr, k_ptr, bt_ptr, cu_q_ptr, qpos_ptr, seq_lens_ptr, pm_ptr, pl_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_btb, stride_pt, stride_ph,
    stride_ob, stride_oh,
    NUM_WT, SPLIT_LEN, NUM_SPLITS,
    G: tl.constexpr, G_BLK: tl.constexpr, W_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    SPLITS_BLK: tl.constexpr, USE_ATOMIC: tl.constexpr,
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
    *,
    split_len: Optional[int] = None,
    block_n: int = 64,
    max_rows: int = 64,
) -> torch.Tensor:
    """Triton version of :func:`torch_ops.window_scores_batched` (scores added into
    ``out [B, Hq, max_T]``). Pass ``out`` (or ``max_seq_len``) and ``max_q_len`` to avoid
    host syncs. ``split_len``: keys per program (default: ``T/64``, at least 512)."""
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
        q, key_cache, bt, cu, qpos, sl, pm, pl, out, scale_log2, *strides, out.stride(0), out.stride(1),
        num_wt, split, num_splits, SPLITS_BLK=max(2, _next_pow2(num_splits)), USE_ATOMIC=num_wt > 1,
        **common,
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
    seq_lens_ptr, scratch_ptr, pm_ptr, pl_ptr, out_ptr,
    stride_xr, stride_xh, stride_pr, stride_ph, stride_or, stride_oh,
    SPLIT_LEN, NUM_SPLITS,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_BLK: tl.constexpr,
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
    covers the width of ``scores_out``).
    """
    del max_seq_len
    _check_cache(key_cache, "key_cache")
    noise, tau = _parse_transform(logits_transform)
    if lse is not None and noise is not None:
        raise ValueError("lse is only valid without a logits transform")
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
        _decode_normalize_kernel[grid](
            sl, scratch_t, pm, pl, scores_out,
            *x_strides, *p_strides, scores_out.stride(0), scores_out.stride(1),
            split, num_splits,
            G=g, G_BLK=_next_pow2(g), BLOCK_N=block_n, SPLITS_BLK=max(2, _next_pow2(num_splits)),
        )
    return scores_out


@triton.jit
def _pv(p, v, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    """``p [M, N] @ v [N, D]`` in fp32; ``p`` (fp32 probabilities) is rounded to the
    cache dtype for the tensor cores, as flash-attn does."""
    if DOT_F32:
        o = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        o = tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return o


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
    seq_lens_ptr, logits_ptr, pm_ptr, pl_ptr, pacc_ptr, out_ptr, scores_ptr,
    stride_xr, stride_xh, stride_pr, stride_ph, stride_ar, stride_ah, stride_as,
    stride_or, stride_oh, stride_sr, stride_sh,
    SPLIT_LEN, NUM_SPLITS, MAX_T,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr,
    SPLITS_BLK: tl.constexpr, HAS_SCORES: tl.constexpr,
):
    """Combine the splits' partials into the LSE of each query head. Split 0's program
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
    """
    t = _check_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scores_out, max_seq_len)
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
    _decode_attn_reduce_kernel[grid](
        sl, logits, pm, pl, pacc, out, sc,
        *x_strides, *p_strides, *a_strides, out.stride(0), out.stride(1), *s_strides,
        split, num_splits, t,
        G=g, G_BLK=_next_pow2(g), BLOCK_N=block_n, HEAD_DIM=d, D_BLK=_next_pow2(d),
        SPLITS_BLK=max(2, _next_pow2(num_splits)), HAS_SCORES=scores_out is not None,
    )
    return out


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
    q_ptr, qpos_ptr, out_ptr,
    lk_ptr, lv_ptr, lbt_ptr, uk_ptr, uv_ptr, ubt_ptr,
    kslot_ptr, kscale_ptr, vslot_ptr, vscale_ptr,
    tokens, retained, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    lk_sb, lk_ss, lk_sh, lv_sb, lv_ss, lv_sh, uk_sb, uk_ss, uk_sh, uv_sb, uv_ss, uv_sh, stride_slot,
    G: tl.constexpr, G_BLK: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_BLK: tl.constexpr, PAGE: tl.constexpr,
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
    _merged_attention_kernel[(n, hkv)](
        q, _as_i32(q_positions, dev), out,
        lower_keys, lower_values, _as_i32(lower_blocks, dev), upper_keys, upper_values, _as_i32(upper_blocks, dev),
        slots[0], scales[0], slots[1], scales[1],
        key_slot.shape[1], int(retained), float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        lower_keys.stride(0), lower_keys.stride(1), lower_keys.stride(2),
        lower_values.stride(0), lower_values.stride(1), lower_values.stride(2),
        upper_keys.stride(0), upper_keys.stride(1), upper_keys.stride(2),
        upper_values.stride(0), upper_values.stride(1), upper_values.stride(2), slots[0].stride(0),
        G=g, G_BLK=max(16, _next_pow2(g)), BLOCK_N=block_n, HEAD_DIM=d, D_BLK=max(16, _next_pow2(d)), PAGE=page,
    )
    return out
