"""KV-compression kernels: Triton on CUDA, plain torch everywhere else.

Installed as ``vllm_kvcompress.kernels``. Pick the implementation once at startup::

    from vllm_kvcompress.kernels import get_ops
    ops = get_ops(device.type)   # 'cuda' -> Triton when available, else torch
    ops.window_scores_batched(...); ops.accumulate_decode_scores(...); ops.compact_kv_batched(...)

Both namespaces expose the same functions with the same signatures and math
(see ``torch_ops.py``), the operation list ``OP_NAMES`` that the worker calls on every
device: ``split_kv_cache, gather_dense, window_scores_batched, accumulate_decode_scores,
decode_attention_with_scores, compact_kv_batched, merged_attention``; both also have
``check_keep_idx``. ``split_kv_cache`` and ``gather_dense`` are the torch versions in
both (views and one gather, not fused). The ops take every tensor argument on one
device and move none: a mix raises ``ValueError`` naming the op and the argument.
This module never imports Triton itself; ``triton_kernels`` is imported on demand.
"""

from __future__ import annotations

import types

from . import torch_ops

__all__ = ["get_ops", "triton_ops", "triton_available", "torch_ops", "OP_NAMES"]

OP_NAMES = torch_ops.OP_NAMES


def triton_available() -> bool:
    """True when Triton imports and a CUDA GPU is present."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the environment
        return False
    return True


def _namespace(mod, backend: str) -> types.SimpleNamespace:
    ns = types.SimpleNamespace(**{name: getattr(mod, name) for name in OP_NAMES})
    ns.backend = backend
    ns.check_keep_idx = torch_ops.check_keep_idx
    return ns


def triton_ops() -> types.SimpleNamespace:
    """The Triton namespace whatever the device: on CUDA tensors, or on CPU
    tensors under ``TRITON_INTERPRET=1`` (set before Triton is imported)."""
    from . import triton_kernels

    return _namespace(triton_kernels, "triton")


def get_ops(device_type: str = "cpu", prefer_triton: bool = True) -> types.SimpleNamespace:
    """Namespace of kernel functions for ``device_type``.

    ``'cuda'`` with Triton importable and a GPU present (and ``prefer_triton``) ->
    Triton kernels (``ns.backend == 'triton'``); otherwise the torch references
    (``ns.backend == 'torch'``), which work on any device torch supports.
    """
    if device_type == "cuda" and prefer_triton and triton_available():
        return triton_ops()
    return _namespace(torch_ops, "torch")
