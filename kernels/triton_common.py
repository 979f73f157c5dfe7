"""What the Triton kernels share: launch-size helpers, dot precision, tile loads."""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .torch_paged import check_sinks

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
def _fold_sinks(m, l, sinks_ptr, offs, mask, HAS_SINKS: tl.constexpr):
    """A softmax's running (max, sum-exp) in log2 units, each row's sink logit
    (log2 units, at ``sinks_ptr + offs``) joined to the denominator: gpt-oss's
    learned sinks (torch_paged.softmax_with_sinks). Unchanged without sinks."""
    if HAS_SINKS:
        s2 = tl.load(sinks_ptr + offs, mask=mask, other=_NEG)
        m_new = tl.maximum(m, s2)
        l = l * tl.exp2(m - m_new) + tl.exp2(s2 - m_new)
        m = m_new
    return m, l


def _sinks_log2(op: str, sinks: Optional[torch.Tensor], hq: int, fallback: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The sinks in log2 units (float32, contiguous) and whether there are any
    (``fallback``: a placeholder pointer, never read, when there are none)."""
    check_sinks(op, sinks, hq)
    if sinks is None:
        return fallback, False
    return (sinks * _LOG2E).contiguous(), True
