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
One module per family: ``triton_scores`` (a, b), ``triton_attention`` (b's decode
attention, d), ``triton_compact`` (c); shared helpers in ``triton_common``.

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
(d) ``merged_attention``: grid ``(n, Hkv)``, one program per (query, kv head) of a
    MiniCache-merged upper layer, reading the lower layer's slots rescaled.

Status: checked against the references under ``TRITON_INTERPRET=1`` only (written
without GPU access). On a first GPU run, do ``pytest tests/kernels`` (it uses the real
backend when CUDA is present) and then ``python benchmarks/kernels.py``.
"""

from __future__ import annotations

from .torch_ops import OP_NAMES

# Torch versions reused on the Triton path (a view and one gather, not fused);
# re-exported: they are part of the operation list.
from .torch_ops import gather_dense as gather_dense
from .torch_ops import split_kv_cache as split_kv_cache
from .triton_attention import decode_attention_with_scores as decode_attention_with_scores
from .triton_attention import merged_attention as merged_attention
from .triton_compact import compact_kv_batched as compact_kv_batched
from .triton_scores import accumulate_decode_scores as accumulate_decode_scores
from .triton_scores import window_scores_batched as window_scores_batched

__all__ = list(OP_NAMES)
