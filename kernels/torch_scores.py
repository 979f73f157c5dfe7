"""Plain-torch scoring: observation-window scores (a), decode scores and
decode attention with scores (b) (see ``torch_ops`` for the layout)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import torch_paged
from .torch_paged import LogitsTransform, _cdiv, _check_devices, check_sinks, gather_dense, softmax_with_sinks

# ---------------------------------------------------------------------------------------
# (a) observation-window scores (SnapKV / PyramidKV / ...)
# ---------------------------------------------------------------------------------------


def window_scores(
    q_win: torch.Tensor,
    key_cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    q_positions: torch.Tensor,
    scale: float,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of window queries to one request's cached keys, summed over the queries.

    ``q_win [W, Hq, D]``; ``q_positions [W]`` physical index of each query (query ``i``
    sees keys ``[0, q_positions[i]]``). Returns ``[Hq, seq_len]`` float32:
    ``out[h, j] = sum_i softmax_j(q_i[h] . K[h // G, :]^T * scale)`` over visible keys.
    No GQA reduction (see :func:`reduce_gqa`), no pooling (see :func:`pool_scores`).
    ``sinks [Hq]`` float32 (gpt-oss): each head's sink logit joins the softmax's
    denominator (:func:`torch_paged.softmax_with_sinks`).
    """
    _check_devices("window_scores", sinks=sinks, q_win=q_win, key_cache=key_cache, block_table_row=block_table_row,
                   q_positions=q_positions)
    check_sinks("window_scores", sinks, q_win.shape[1])
    seq_len = int(seq_len)
    w, hq, d = q_win.shape
    hkv = key_cache.shape[2]
    if hq % hkv:
        raise ValueError(f"num_q_heads {hq} not a multiple of num_kv_heads {hkv}")
    g = hq // hkv
    dev = key_cache.device
    out = torch.zeros(hq, seq_len, dtype=torch.float32, device=dev)
    if w == 0 or seq_len == 0:
        return out
    keys = gather_dense(key_cache, block_table_row, seq_len)  # [Hkv, T, D] (cache dtype)
    # [Hkv, G*W, D] contiguous: one plain batched matmul per kv head (no broadcasting)
    q = q_win.to(torch.float32).reshape(w, hkv, g, d).permute(1, 2, 0, 3)
    q = q.reshape(hkv, g * w, d).contiguous()
    pos = q_positions.long()
    hidden = torch.arange(seq_len, device=dev)[None, :] > pos[:, None]  # [W, T]
    chunk = max(1, torch_paged._CHUNK_ELEMS // max(1, g * w * seq_len + seq_len * d))
    for h0 in range(0, hkv, chunk):
        h1 = min(hkv, h0 + chunk)
        k = keys[h0:h1].to(torch.float32, memory_format=torch.contiguous_format)  # [h, T, D]
        logits = torch.matmul(q[h0:h1], k.transpose(-1, -2)).view(h1 - h0, g, w, seq_len)
        logits.mul_(scale)
        logits.masked_fill_(hidden, float("-inf"))
        p = softmax_with_sinks(logits, None if sinks is None else sinks[h0 * g : h1 * g].view(h1 - h0, g, 1, 1))
        out[h0 * g : h1 * g] = p.sum(dim=-2).reshape((h1 - h0) * g, seq_len)
    return out


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
) -> torch.Tensor:
    """Varlen batch of :func:`window_scores`.

    ``q [total_q, Hq, D]``, ``cu_q_lens [B+1]`` (request ``b`` owns query rows
    ``cu_q_lens[b]:cu_q_lens[b+1]``), ``block_tables [B, max_blocks]``, ``seq_lens [B]``,
    ``q_positions [total_q]``. Scores are **added** into ``out [B, Hq, max_T]`` float32
    (allocated as zeros when ``None``; ``max_T = max_seq_len or max(seq_lens)``) and
    ``out`` is returned. Columns ``>= seq_lens[b]`` are left untouched. Adding (instead of
    overwriting) makes window scores of a window split over prefill chunks accumulate
    exactly, since a query only ever sees keys that already exist when it runs.
    ``max_q_len`` is accepted for signature parity with the Triton kernel (unused here).
    """
    del max_q_len
    _check_devices("window_scores_batched", q=q, cu_q_lens=cu_q_lens, key_cache=key_cache,
                   block_tables=block_tables, seq_lens=seq_lens, q_positions=q_positions, out=out)
    hq = q.shape[1]
    lens = [int(x) for x in seq_lens.tolist()]
    cu = [int(x) for x in cu_q_lens.tolist()]
    nreq = len(lens)
    if out is None:
        t_out = int(max_seq_len) if max_seq_len is not None else max(lens, default=0)
        out = torch.zeros(nreq, hq, t_out, dtype=torch.float32, device=key_cache.device)
    for b in range(nreq):
        if cu[b + 1] == cu[b] or lens[b] == 0:
            continue
        s = window_scores(
            q[cu[b] : cu[b + 1]], key_cache, block_tables[b], lens[b], q_positions[cu[b] : cu[b + 1]], scale, sinks
        )
        out[b, :, : lens[b]] += s
    return out


def reduce_gqa(scores: torch.Tensor, group_size: int, mode: str = "mean") -> torch.Tensor:
    """``[..., Hq, T]`` -> ``[..., Hq // G, T]``: reduce the G query heads of each kv head."""
    *lead, hq, t = scores.shape
    if hq % group_size:
        raise ValueError(f"num_q_heads {hq} not a multiple of group size {group_size}")
    x = scores.reshape(*lead, hq // group_size, group_size, t)
    if mode == "mean":
        return x.mean(dim=-2)
    if mode == "max":
        return x.amax(dim=-2)
    raise ValueError(f"unknown GQA reduction {mode!r} (mean | max)")


def pool_scores(scores: torch.Tensor, kernel_size: int, mode: str = "avg") -> torch.Tensor:
    """1-D pooling along the token axis, stride 1, padding ``kernel_size // 2``.

    ``avg`` uses ``count_include_pad=True`` (zeros padded, divided by ``kernel_size``),
    like SnapKV / kvpress; ``max`` pads with ``-inf``. Output has the input's shape
    (for an even kernel the extra last column is dropped). For a padded ragged batch whose
    padding columns are zero, pooling the padded row gives, on the valid columns, exactly
    what pooling the unpadded row gives (avg: zero padding either way; max: scores >= 0).
    """
    if kernel_size <= 1:
        return scores.clone()
    shape = scores.shape
    t = shape[-1]
    x = scores.reshape(1, -1, t).float()
    pad = kernel_size // 2
    if mode == "avg":
        y = F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=True)
    elif mode == "max":
        y = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        raise ValueError(f"unknown pooling {mode!r} (avg | max)")
    return y[..., :t].reshape(shape).to(scores.dtype)


# ---------------------------------------------------------------------------------------
# (b) decode-time score accumulation (H2O, Keyformer, TOVA)
# ---------------------------------------------------------------------------------------


def _parse_transform(transform: LogitsTransform):
    if transform is None:
        return None, None
    if len(transform) != 3 or transform[0] != "gumbel":
        raise ValueError("logits_transform must be None or ('gumbel', noise, tau)")
    return transform[1], transform[2]


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
) -> torch.Tensor:
    """Add each decode query's attention probabilities into the per-slot score buffer.

    ``q [R, Hq, D]`` (one decode query per request), ``block_tables [R, max_blocks]``,
    ``seq_lens [R]`` (keys ``[0, seq_len)`` are visible, the new token included),
    ``scores_out [R, Hq, max_T]`` float32, updated in place and returned:
    ``scores_out[r, h, j] += softmax_j(y)`` for ``j < seq_lens[r]`` with
    ``x = q[r, h] . K[r, h // G, j] * scale`` and

    * ``logits_transform=None``: ``y = x`` (H2O; TOVA if the buffer is zeroed first);
    * ``('gumbel', noise, tau)``: ``y = (x + noise[r, h, j]) / tau`` (Keyformer), with
      ``noise [R, Hq, >= max_T]`` Gumbel(0, 1) samples made by the caller (seeded) and
      ``tau`` a float or a ``[R]`` tensor.

    ``lse [R, Hq]`` (optional, plain transform only): natural-log sum-exp of ``x`` over
    the visible keys, e.g. flash-attn's ``softmax_lse``; then ``p = exp(x - lse)`` with no
    normalisation of its own (the Triton kernel then reads K once and needs no scratch).

    ``sinks [Hq]`` float32 (gpt-oss): head ``h``'s sink logit ``s_h`` joins each softmax's
    denominator, transformed as the logits are (``s_h / tau`` with the Gumbel transform:
    the sink is no token, so it gets no noise). Not with ``lse`` (which would hold it).
    """
    noise, tau = _parse_transform(logits_transform)
    _check_devices("accumulate_decode_scores", sinks=sinks, q=q, key_cache=key_cache, block_tables=block_tables,
                   seq_lens=seq_lens, scores_out=scores_out, noise=noise, tau=tau, lse=lse)
    if lse is not None and (noise is not None or sinks is not None):
        raise ValueError("lse is only valid without a logits transform or sinks")
    nreq, hq, d = q.shape
    check_sinks("accumulate_decode_scores", sinks, hq)
    if nreq == 0:
        return scores_out
    _, bs, hkv, _ = key_cache.shape
    g = hq // hkv
    dev = key_cache.device
    lens = seq_lens.long()
    t = int(max_seq_len) if max_seq_len is not None else int(lens.max())
    if t == 0:
        return scores_out
    if t > scores_out.shape[-1]:
        raise ValueError(f"seq_len {t} exceeds score buffer width {scores_out.shape[-1]}")
    nb = _cdiv(t, bs)
    nblocks_total = key_cache.shape[0]
    per_req = nb * bs * hkv * d + hq * nb * bs * 2
    chunk = max(1, torch_paged._CHUNK_ELEMS // per_req)
    ar = torch.arange(t, device=dev)
    tau_t = None
    if tau is not None:
        tau_t = torch.as_tensor(tau, dtype=torch.float32, device=dev).reshape(-1)
        if tau_t.numel() == 1:
            tau_t = tau_t.expand(nreq)
    for r0 in range(0, nreq, chunk):
        r1 = min(nreq, r0 + chunk)
        n = r1 - r0
        bt = block_tables[r0:r1, :nb].long().clamp(0, nblocks_total - 1)
        keys = key_cache.index_select(0, bt.reshape(-1)).reshape(n, nb * bs, hkv, d)[:, :t]
        # contiguous [n, Hkv, T, D] fp32 (matmul on strided views is very slow on CPU)
        keys = keys.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format)
        qq = q[r0:r1].to(torch.float32).reshape(n, hkv, g, d)
        x = torch.matmul(qq, keys.transpose(-1, -2)).reshape(n, hq, t) * scale  # [n, Hq, T]
        valid = (ar[None, :] < lens[r0:r1, None])[:, None, :]  # [n, 1, T]
        sink = None if sinks is None else sinks.view(1, hq, 1)
        if noise is not None:
            assert tau_t is not None
            x = (x + noise[r0:r1, :, :t].to(torch.float32)) / tau_t[r0:r1, None, None]
            if sink is not None:
                sink = sink / tau_t[r0:r1, None, None]
        if lse is not None:
            p = torch.exp(x - lse[r0:r1].to(torch.float32)[..., None])
        else:
            p = softmax_with_sinks(x.masked_fill(~valid, float("-inf")), sink)
        scores_out[r0:r1, :, :t] += torch.where(valid, p, torch.zeros((), device=dev))
    return scores_out


def _check_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scores_out: Optional[torch.Tensor],
    max_seq_len: Optional[int],
    sinks: Optional[torch.Tensor] = None,
) -> int:
    """Validate the arguments of :func:`decode_attention_with_scores` (shared with the
    Triton version, so both raise the same errors) and return the key count ``T`` the op
    covers: ``max_seq_len``, else ``max(seq_lens)`` (a host sync)."""
    op = "decode_attention_with_scores"
    _check_devices(op, q=q, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   seq_lens=seq_lens, scores_out=scores_out, sinks=sinks)
    if q.dim() != 3:
        raise ValueError(f"{op}: q must be [R, Hq, D], got {tuple(q.shape)}")
    nreq, hq, d = q.shape
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"{op}: key_cache and value_cache must both be [num_blocks, block_size, Hkv, D], "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    _, bs, hkv, d_k = key_cache.shape
    if d_k != d or hq % hkv:
        raise ValueError(f"{op}: q {tuple(q.shape)} does not fit key_cache {tuple(key_cache.shape)} "
                         "(same head_dim, num_q_heads a multiple of num_kv_heads)")
    if block_tables.dim() != 2 or block_tables.shape[0] != nreq:
        raise ValueError(f"{op}: block_tables must be [R={nreq}, max_blocks], got {tuple(block_tables.shape)}")
    if tuple(seq_lens.shape) != (nreq,):
        raise ValueError(f"{op}: seq_lens must be [R={nreq}], got {tuple(seq_lens.shape)}")
    if scores_out is not None:
        if scores_out.dtype != torch.float32:
            raise ValueError(f"{op}: scores_out must be float32, got {scores_out.dtype}")
        if scores_out.dim() != 3 or tuple(scores_out.shape[:2]) != (nreq, hq):
            raise ValueError(f"{op}: scores_out must be [R={nreq}, Hq={hq}, max_T], got {tuple(scores_out.shape)}")
    check_sinks(op, sinks, hq)
    if nreq == 0:
        return 0
    t = int(max_seq_len) if max_seq_len is not None else int(seq_lens.max())
    if scores_out is not None and t > scores_out.shape[-1]:
        raise ValueError(f"{op}: seq_lens reach {t} tokens, more than scores_out holds ({scores_out.shape[-1]})")
    if _cdiv(t, bs) > block_tables.shape[1]:
        raise ValueError(f"{op}: {t} tokens need {_cdiv(t, bs)} blocks, block_tables has {block_tables.shape[1]}")
    return t


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
) -> torch.Tensor:
    """Paged decode attention that also adds its probabilities into the score buffer.

    ``q [R, Hq, D]`` (one decode query per request), caches as for :func:`gather_dense`,
    ``block_tables [R, max_blocks]``, ``seq_lens [R]`` (keys ``[0, seq_len)`` visible).
    Returns ``out [R, Hq, D]`` in ``q``'s dtype, ``out[r, h] = sum_j p[r, h, j] V[r, h // G, j]``
    with ``p = softmax_j(q[r, h] . K[r, h // G, j] * scale)`` (zero for ``seq_len == 0``).
    ``scores_out [R, Hq, >= max_T]`` float32 (or ``None``: attention only) gets ``p``
    added in place at ``j < seq_lens[r]``: exactly what :func:`accumulate_decode_scores`
    adds with no logits transform. One pass over K and V gives both, so a decode-time
    scorer (H2O, TOVA) needs no second ``q.K^T`` after the attention.
    ``max_seq_len`` (>= every ``seq_len``; default ``max(seq_lens)``, a host sync) bounds
    the keys read. ``sinks [Hq]`` float32 (gpt-oss): each head's sink logit joins the
    softmax's denominator, for the output and the scores alike (an empty row's output is 0).
    """
    t = _check_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scores_out, max_seq_len,
                                sinks)
    nreq, hq, d = q.shape
    out = torch.zeros(nreq, hq, d, dtype=q.dtype, device=q.device)
    if nreq == 0 or t == 0:
        return out
    _, bs, hkv, _ = key_cache.shape
    g = hq // hkv
    dev = key_cache.device
    lens = seq_lens.long()
    nb = _cdiv(t, bs)
    nblocks_total = key_cache.shape[0]
    per_req = 2 * nb * bs * hkv * d + hq * nb * bs * 2  # K and V, logits and probabilities
    chunk = max(1, torch_paged._CHUNK_ELEMS // per_req)
    ar = torch.arange(t, device=dev)
    for r0 in range(0, nreq, chunk):
        r1 = min(nreq, r0 + chunk)
        n = r1 - r0
        # block ids past a request's own blocks may be stale or padding: clamp, then mask
        bt = block_tables[r0:r1, :nb].long().clamp(0, nblocks_total - 1).reshape(-1)
        kv = []
        for cache in (key_cache, value_cache):
            x = cache.index_select(0, bt).reshape(n, nb * bs, hkv, d)[:, :t]
            # contiguous [n, Hkv, T, D] fp32 (matmul on strided views is very slow on CPU)
            kv.append(x.permute(0, 2, 1, 3).to(torch.float32, memory_format=torch.contiguous_format))
        keys, values = kv
        qq = q[r0:r1].to(torch.float32).reshape(n, hkv, g, d)
        # the same products, in the same order, as accumulate_decode_scores
        x = torch.matmul(qq, keys.transpose(-1, -2)).reshape(n, hq, t) * scale  # [n, Hq, T]
        valid = (ar[None, :] < lens[r0:r1, None])[:, None, :]  # [n, 1, T]
        p = softmax_with_sinks(x.masked_fill(~valid, float("-inf")), None if sinks is None else sinks.view(1, hq, 1))
        p = torch.where(valid, p, torch.zeros((), device=dev))  # an empty row's NaNs -> 0
        out[r0:r1] = torch.matmul(p.view(n, hkv, g, t), values).reshape(n, hq, d).to(q.dtype)
        if scores_out is not None:
            scores_out[r0:r1, :, :t] += p
    return out
