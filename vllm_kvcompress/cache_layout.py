"""Where one layer's K and V sit in vLLM's paged cache, per attention backend.

Every backend's cache is read through the same views, `[num_blocks,
block_size, num_kv_heads, head_dim]` for K and for V, so that the kernel ops
(`vllm_kvcompress.kernels`: Triton on CUDA, torch elsewhere) gather, score
and compact any of them. The worker checks the views at startup against
vLLM's own cache writer and refuses to run on a cache they do not match: a
wrong reader would silently corrupt output.

vLLM's CPU attention (CPU_ATTN, "vec" instruction-set path) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`; inside each
(block, head) slab the first half is K *transposed* (`[head_size, block_size]`)
and the second half is V (`[block_size, head_size]`).

vLLM 0.32's GPU FlashAttention (FLASH_ATTN) stores one layer as
`[num_blocks, num_kv_heads, block_size, 2 * head_size]` (logical shape; the
physical dim order is NHD or HND), K in the first half of the last dim, and
splits it as `kernels.reference.split_kv_cache` does.

The values themselves are the model's dtype (kv_cache_dtype "auto") or fp8:
`CacheDType` reads and writes them as vLLM's CPU cache writer does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .kernels.torch_ops import split_kv_cache

KVViews = tuple[torch.Tensor, torch.Tensor]


def cpu_attn_views(kv_cache: torch.Tensor) -> KVViews:
    """CPU_ATTN's K and V as [N, B, H, D] views sharing the cache's memory."""
    n, h, b, two_d = kv_cache.shape
    d = two_d // 2
    slab = kv_cache.view(n, h, 2, b * d)
    keys = slab[:, :, 0].view(n, h, d, b).permute(0, 3, 1, 2)
    values = slab[:, :, 1].view(n, h, b, d).permute(0, 2, 1, 3)
    return keys, values


# attention backend name -> its K/V views
LAYOUTS: dict[str, Callable[[torch.Tensor], KVViews]] = {
    "CPU_ATTN": cpu_attn_views,
    "FLASH_ATTN": split_kv_cache,
}


# ---------------------------------------------------------------- cache dtype

# kv_cache_dtype -> the float8 format vLLM's CPU attention stores ("fp8" is e4m3).
FP8_FORMATS: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def truncate_to_fp8(x: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """`x` as vLLM 0.32's CPU cache writer stores it in `fp8` at scale 1.

    Not torch's cast (round to nearest): the writer rounds toward zero to
    the format's mantissa (subnormals alike), saturates at the largest finite
    value (infinities too, NaN to +max) and stores a zero as +0. The worker checks
    this against vLLM's own writer at startup (worker/startup.check_layout)
    and the reference decoder quantises with it, so both see the same keys.
    """
    info = torch.finfo(fp8)
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8]
    x = x.to(torch.float32)
    # Normal range: clear the float32 mantissa bits the format lacks.
    y = (x.view(torch.int32) & ~((1 << (23 - mantissa)) - 1)).view(torch.float32)
    # Subnormal range: whole multiples of the smallest subnormal, toward zero.
    spacing = info.smallest_normal * 2.0 ** -mantissa
    y = torch.where(y.abs() < info.smallest_normal, torch.trunc(x / spacing) * spacing, y)
    y = torch.where(torch.isnan(x), info.max, y.clamp(-info.max, info.max))
    y = torch.where(x == 0, 0.0, y)  # a zero is stored +0 (a tiny negative stays -0)
    return y.to(fp8)  # exact: every value is representable


@dataclass(frozen=True)
class CacheDType:
    """How K and V values sit in the cache: the model's own dtype ("auto")
    or fp8 at scale 1 (`FP8_FORMATS`). Views of an fp8 cache are float8
    typed, so every read that converts to float32 dequantises, and a copy
    between slots moves the stored bytes as they are."""

    name: str = "auto"

    def __post_init__(self) -> None:
        if self.name != "auto" and self.name not in FP8_FORMATS:
            raise ValueError(f"kv_cache_dtype {self.name!r}: valid values are auto, {', '.join(FP8_FORMATS)}")

    @property
    def fp8(self) -> torch.dtype | None:
        return FP8_FORMATS.get(self.name)

    def storage(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache tensor typed as its values (vLLM allocates fp8 caches as uint8)."""
        return kv_cache if self.fp8 is None else kv_cache.view(self.fp8)

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """Values read from the cache, in a dtype torch computes with."""
        return x if self.fp8 is None else x.to(torch.float32)

    def write(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Values to store into a cache of `dtype`, rounded as vLLM's writer rounds them."""
        return x.to(dtype) if self.fp8 is None else truncate_to_fp8(x, self.fp8)

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        """`x` as attention reads it back from the cache, in `x`'s dtype (the reference decoder's cache)."""
        return x if self.fp8 is None else truncate_to_fp8(x, self.fp8).to(x.dtype)


AUTO = CacheDType()


def cpu_fp8_unserved() -> str | None:
    """Why vLLM's CPU attention cannot hold an fp8 cache on this CPU (None: it can).

    vLLM builds its CPU fp8 cache kernels for AVX-512 and AMX only: on an
    AVX2-only x86 CPU its attention raises at the first step (vLLM 0.32's
    `cpu_attn._get_attn_isa`, or the C++ dispatch for 16-token blocks). The
    same test as vLLM's, so that compression is refused at startup by name
    instead. Names the instruction set torch found (AVX2, DEFAULT, ...)."""
    if torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported():
        return None
    found = torch.backends.cpu.get_cpu_capability()
    return f"vLLM's CPU attention stores fp8 only with AVX-512 or AMX; this CPU has {found}"


# kv_cache_dtype values served with compression, per attention backend: fp8
# where vLLM's rounding is checked (truncate_to_fp8 against the CPU writer).
CACHE_DTYPES: dict[str, tuple[str, ...]] = {"CPU_ATTN": ("auto", *FP8_FORMATS), "FLASH_ATTN": ("auto",)}
