"""Plain-torch paged-cache operations: the layout views, dense gathers,
compaction and a MiniCache-merged layer's attention (see ``torch_ops`` for the layout)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

# Upper bound on the number of float32 elements a reference materialises at once
# (logits / gathered keys); larger problems are processed in chunks.
_CHUNK_ELEMS = 1 << 26  # 64 Mi elements = 256 MiB of float32

LogitsTransform = Optional[Tuple[str, torch.Tensor, Union[float, torch.Tensor]]]


def split_kv_cache(kv_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32 ``[num_blocks, H, block_size, 2 * D]`` -> ``(key_cache, value_cache)``.

    Views ``[num_blocks, block_size, H, D]`` sharing the cache's memory, split as
    ``FlashAttentionImpl.forward`` splits them.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"expected kv_cache [num_blocks, H, block_size, 2 * D], got {tuple(kv_cache.shape)}")
    key_cache, value_cache = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    return key_cache, value_cache


def softmax_with_sinks(logits: torch.Tensor, sinks: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the last dim, each row's denominator holding its head's
    sink logit too (gpt-oss's learned attention sinks): ``p_j = exp(x_j) /
    (sum_k exp(x_k) + exp(s))``. The sink has no value: its share of the
    probability is attention paid to nothing, so the probabilities sum to
    less than one, as in the model. ``sinks`` broadcasts to ``logits[..., :1]``
    (``None``: a plain softmax). A row whose keys are all masked (-inf) gives
    zeros, not NaN."""
    if sinks is None:
        return torch.softmax(logits, dim=-1)
    sink = sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)
    return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


def check_sinks(op: str, sinks: Optional[torch.Tensor], num_q_heads: int) -> None:
    """``sinks``: None, or one float32 logit per query head (shared with the Triton ops)."""
    if sinks is not None and (sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_q_heads,)):
        raise ValueError(f"{op}: sinks must be float32 [Hq={num_q_heads}], got {sinks.dtype} {tuple(sinks.shape)}")


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _check_devices(op: str, **tensors: object) -> None:
    """Raise ``ValueError`` unless every tensor among ``tensors`` (name -> argument) is on
    one device; ``None`` and plain numbers are skipped.

    The ops never move their arguments: a CPU index tensor next to CUDA caches would
    otherwise cost a hidden host-to-device copy (and a sync) per call, or fail deep
    inside torch with an error that names neither the op nor the argument.
    """
    first: Optional[Tuple[str, torch.device]] = None
    for name, x in tensors.items():
        if not isinstance(x, torch.Tensor):
            continue
        if first is None:
            first = (name, x.device)
        elif x.device != first[1]:
            raise ValueError(f"{op}: {name} is on {x.device} but {first[0]} is on {first[1]}; "
                             "pass every tensor on one device")


def gather_dense(cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Gather one request's first ``seq_len`` tokens from a paged cache.

    ``cache [num_blocks, block_size, H, D]``, ``block_table_row [>= ceil(seq_len/bs)]``
    -> ``[H, seq_len, D]`` (a copy, same dtype as the cache; a non-contiguous view of it).
    """
    _check_devices("gather_dense", cache=cache, block_table_row=block_table_row)
    seq_len = int(seq_len)
    _, bs, h, d = cache.shape
    nb = _cdiv(seq_len, bs)
    blocks = block_table_row[:nb].long()
    x = cache.index_select(0, blocks).reshape(nb * bs, h, d)[:seq_len]
    return x.permute(1, 0, 2)

# ---------------------------------------------------------------------------------------
# (c) in-place compaction of kept tokens to the front of each request
# ---------------------------------------------------------------------------------------


def check_keep_idx(keep_idx: torch.Tensor, keep_counts: Optional[torch.Tensor] = None,
                   seq_lens: Optional[torch.Tensor] = None) -> None:
    """Validate ``keep_idx [..., Hkv, K]`` per head: >= 0, ``< seq_len`` when given,
    and either strictly ascending (hence ``idx[j] >= j``) or hole-filling (distinct,
    every entry ``j`` or ``>= count``: the plugin's order, see
    ``vllm_kvcompress.selection.hole_filling_order``). Raises ``ValueError``.
    (Syncs; for debugging/tests.)"""
    ki = keep_idx.long()
    k = ki.shape[-1]
    pos = torch.arange(k, device=ki.device)
    counts = torch.full(ki.shape[:-1], k, device=ki.device)
    if keep_counts is not None:
        counts = keep_counts.to(ki.device).long()
    valid = pos < counts[..., None]
    if bool(((ki < 0) & valid).any()):
        raise ValueError("keep_idx has negative entries")
    ascending = ((ki[..., 1:] > ki[..., :-1]) | ~valid[..., 1:]).all(dim=-1)
    in_place_or_from_beyond = ((ki == pos) | (ki >= counts[..., None]) | ~valid).all(dim=-1)
    ranked = ki.masked_fill(~valid, -1).sort(dim=-1).values
    distinct = ((ranked[..., 1:] > ranked[..., :-1]) | (ranked[..., 1:] < 0)).all(dim=-1)
    if not bool((ascending | (in_place_or_from_beyond & distinct)).all()):
        raise ValueError("keep_idx must be strictly ascending or hole-filling per head")
    if seq_lens is not None:
        sl = seq_lens.to(ki.device).long().reshape(*ki.shape[:-2], 1, 1)
        if bool(((ki >= sl) & valid).any()):
            raise ValueError("keep_idx out of range of seq_len")


def compact_kv_batched(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    keep_idx: torch.Tensor,
    keep_counts: Optional[torch.Tensor] = None,
    scores: Optional[torch.Tensor] = None,
    zero_score_tail: bool = True,
) -> None:
    """Move kept tokens of each (request, kv head) to physical positions ``[0, keep)``.

    ``block_tables [R, max_blocks]``, ``keep_idx [R, Hkv, K]`` ascending physical indices
    per head (heads may keep different tokens), ``keep_counts [R, Hkv]`` (optional, per
    head number of valid entries, AdaKV; default ``K``). In place, K and V:
    ``cache[pos j of head h] <- cache[pos keep_idx[r, h, j] of head h]`` for ``j < count``.
    Slots ``>= count`` keep stale data. ``scores [R, Hq, T]`` (optional, float32) gets the
    same permutation per query head (following its kv head), and with ``zero_score_tail``
    its columns ``>= count`` are zeroed (tokens later appended there start from 0).

    ``keep_idx`` per head is strictly ascending or hole-filling (see
    :func:`check_keep_idx`). Only entries with ``keep_idx[j] != j`` are copied. Here the
    copy gathers everything first and then scatters, so overlap of source and
    destination is harmless. Requests must not share physical blocks (no prefix caching).
    """
    _check_devices("compact_kv_batched", key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   keep_idx=keep_idx, keep_counts=keep_counts, scores=scores)
    nreq, hkv, kmax = keep_idx.shape
    if nreq == 0:
        return
    dev = key_cache.device
    bs = key_cache.shape[1]
    ki = keep_idx.long()
    if keep_counts is None:
        valid = torch.ones(nreq, hkv, kmax, dtype=torch.bool, device=dev)
        counts = torch.full((nreq, hkv), kmax, dtype=torch.long, device=dev)
    else:
        counts = keep_counts.long()
        valid = torch.arange(kmax, device=dev) < counts[..., None]
    moved = valid & (ki != torch.arange(kmax, device=dev))
    r_idx, h_idx, j_idx = moved.nonzero(as_tuple=True)
    src = ki[r_idx, h_idx, j_idx]
    bt = block_tables.long()
    src_blk, src_off = bt[r_idx, src // bs], src % bs
    dst_blk, dst_off = bt[r_idx, j_idx // bs], j_idx % bs
    for cache in (key_cache, value_cache):
        vals = cache[src_blk, src_off, h_idx]  # advanced indexing: a copy
        cache[dst_blk, dst_off, h_idx] = vals
    if scores is not None:
        _, hq, t = scores.shape
        g = hq // hkv
        s = scores.view(nreq, hkv, g, t)
        vals = s[r_idx, h_idx, :, src]  # [n, G] copy
        if zero_score_tail:
            tail = torch.arange(t, device=dev) >= counts[..., None]  # [R, Hkv, T]
            s.masked_fill_(tail[:, :, None, :], 0.0)
        s[r_idx, h_idx, :, j_idx] = vals


# ---------------------------------------------------------------------------------------
# (d) attention of a MiniCache-merged layer (the upper layer of a merged pair)
# ---------------------------------------------------------------------------------------


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
) -> torch.Tensor:
    """Causal attention of one request's queries in the upper layer of a merged pair.

    ``query [n, Hq, D]``; ``q_positions [n]`` each query's slot among the keys below;
    caches as for :func:`gather_dense`. The keys (values alike) the layer attends, ``T =
    key_slot.shape[1]`` merged-pair tokens and then the tokens appended since: key ``j <
    T`` of head ``h`` is the upper cache's slot ``key_slot[h, j]`` when that is ``>= 0``
    (retained, exact), else ``key_scale[h, j]`` times the lower cache's slot ``j`` (the
    lower layer stores ``||k_lower|| d_m``, so this is ``||k_upper|| d_m``); key ``j >= T``
    is the upper cache's slot ``retained + j - T``. ``upper_len``: the slots the upper
    cache holds. Query ``i`` sees keys ``j <= q_positions[i]``. ``sinks [Hq]``: each head's
    sink logit in the softmax (:func:`softmax_with_sinks`). Returns ``[n, Hq, D]`` float32.
    """
    _check_devices("merged_attention", sinks=sinks, query=query, q_positions=q_positions, lower_keys=lower_keys,
                   lower_values=lower_values, lower_blocks=lower_blocks, upper_keys=upper_keys,
                   upper_values=upper_values, upper_blocks=upper_blocks, key_slot=key_slot, key_scale=key_scale,
                   value_slot=value_slot, value_scale=value_scale)
    from ..merge import restore  # the formula the merge and the reference decoder use

    check_sinks("merged_attention", sinks, query.shape[1])

    tokens = key_slot.shape[1]
    dev = query.device
    own_k = gather_dense(upper_keys, upper_blocks, upper_len).to(torch.float32)
    own_v = gather_dense(upper_values, upper_blocks, upper_len).to(torch.float32)
    keys = torch.cat([restore(gather_dense(lower_keys, lower_blocks, tokens), own_k[:, :retained],
                              key_slot, key_scale), own_k[:, retained:]], dim=1)
    values = torch.cat([restore(gather_dense(lower_values, lower_blocks, tokens), own_v[:, :retained],
                                value_slot, value_scale), own_v[:, retained:]], dim=1)
    hkv, total, d = keys.shape
    n, hq, _ = query.shape
    out = torch.empty(n, hq, d, dtype=torch.float32, device=dev)
    key_pos = torch.arange(total, device=dev)
    step = max(1, _CHUNK_ELEMS // (hq * total))
    for i in range(0, n, step):
        q = query[i: i + step].to(torch.float32)
        m = q.shape[0]
        # [Hkv, G*m, D] against [Hkv, T, D]: K is never repeated per query head.
        qg = q.permute(1, 0, 2).reshape(hkv, -1, d)
        logits = torch.bmm(qg, keys.transpose(1, 2)).view(hq, m, total) * scale
        hidden = key_pos.view(1, 1, -1) > q_positions[i: i + step].view(1, -1, 1)
        probs = softmax_with_sinks(logits.masked_fill(hidden, float("-inf")),
                                   None if sinks is None else sinks.view(hq, 1, 1))
        out[i: i + step] = torch.bmm(probs.view(hkv, -1, total), values).view(hq, m, d).transpose(0, 1)
    return out
