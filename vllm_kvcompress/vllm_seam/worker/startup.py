"""Start-up: what the worker checks and sizes before anything is served.

The cache layout self-test against vLLM's own cache writer, the attention
features whose scores would not be the model's attention, this worker's
tensor-parallel heads, and the KV cache size that leaves room for the scores.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap

import torch

from ...cache_layout import CACHE_DTYPES, CacheDType
from ...config import CONFIG_KEY, KVCompressConfig
from ...scorers.expected_attention import QueryGeometry
from ...sharding import ONE_DEVICE, HeadShard
from ...token_state import score_bytes_per_kv_byte, selection_scratch_bytes
from ..engine_checks import query_moments_bytes

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger


def _cpu_ops():
    """vLLM's CPU ops: `vllm._cpu_ops` from 0.34 on, `vllm._custom_ops` before."""
    try:
        from vllm import _cpu_ops as ops
    except ImportError:
        from vllm import _custom_ops as ops
    return ops


def _write_cpu_attn(layer, scratch: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    ops = _cpu_ops()
    _, heads, block, two_d = scratch.shape
    key_cache, value_cache = scratch.view(2, heads, 2 * block, two_d // 2).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, torch.arange(len(key)), layer.isa,
                                   k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
                                   kv_cache_dtype=layer.impl.kv_cache_dtype)


def _write_flash_attn(layer, scratch: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    from vllm import _custom_ops as ops

    key_cache, value_cache = scratch.transpose(1, 2).split(scratch.shape[-1] // 2, dim=-1)
    slots = torch.arange(len(key), device=scratch.device)
    ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, "auto", layer._k_scale, layer._v_scale)


# attention backend -> vLLM's own cache writer, for the layout self-test
CACHE_WRITERS = {"CPU_ATTN": _write_cpu_attn, "FLASH_ATTN": _write_flash_attn}


def cache_dtype_of(layers, backend: str) -> CacheDType:
    """The compressed layers' KV cache dtype, or a refusal naming it.

    An fp8 cache is served at scale 1 (vLLM's default without checkpoint KV
    scales): the kernel ops read it dequantised by converting the stored
    values, which a scale other than 1 would silently break.
    """
    name = layers[0].impl.kv_cache_dtype
    if name not in CACHE_DTYPES[backend]:
        raise RuntimeError(f"kv_compress: KV cache dtype {name!r} is not supported on {backend} "
                           f"(valid: {', '.join(CACHE_DTYPES[backend])})")
    if name != "auto":
        for layer in layers:
            scales = (layer._k_scale_float, layer._v_scale_float)
            if scales != (1.0, 1.0):
                raise RuntimeError(f"kv_compress: an fp8 KV cache with the checkpoint's KV scales (layer "
                                   f"{layer.layer_name}: k {scales[0]}, v {scales[1]}) is not supported; "
                                   f"only scale 1.0")
    return CacheDType(name)


def check_layout(layer, views, ops, write, backend: str, cache_dtype: CacheDType, model_dtype: torch.dtype) -> None:
    """Refuse to run unless our reader sees what vLLM's own writer wrote.

    A cache's inner layout depends on the backend, the instruction-set path
    and the cache dtype, and an fp8 cache on vLLM's rounding (CacheDType
    writes as vLLM's writer does: MiniCache's merged vectors, the reference
    decoder's cache); reading or writing it wrong would corrupt output silently.
    """
    cache = layer.kv_cache
    _, heads, block, two_d = cache.shape
    dim, n = two_d // 2, block + 3
    scratch = torch.zeros_like(cache[:2])  # two blocks, the cache's own strides
    # Magnitudes from the subnormal range of fp8 to past its largest value.
    magnitude = torch.logspace(-7, 4, n * heads * dim).view(n, heads, dim)
    key = (torch.randn(n, heads, dim) * magnitude).to(model_dtype).to(cache.device)
    value = torch.randn(n, heads, dim).to(model_dtype).to(cache.device)
    write(layer, scratch, key, value)
    key_view, value_view = views(scratch)
    blocks = torch.arange(2, device=cache.device)
    keys, values = ops.gather_dense(key_view, blocks, n), ops.gather_dense(value_view, blocks, n)
    stored = (cache_dtype.write(x.transpose(0, 1), key_view.dtype) for x in (key, value))
    if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if cache_dtype.fp8 else torch.equal(a, b)
               for a, b in zip((keys, values), stored)):
        raise RuntimeError(
            f"kv_compress: unknown {backend} KV cache layout (shape {tuple(cache.shape)}, "
            f"strides {cache.stride()}, dtype {cache.dtype}, kv_cache_dtype {cache_dtype.name}): vLLM's writer "
            f"stored other values than the plugin reads and writes; refusing to compact"
        )


def check_scoring_exact(layer) -> None:
    """Refuse attention the scoring ops would not reproduce.

    Scores (and the per-head masked pass) are softmax(scale * q.k), with each
    head's sink logit in the denominator where the layer has sinks (gpt-oss;
    the ops take them): a logit soft cap (Gemma 2) or ALiBi slopes change the
    attention, so the scores would be of a different attention than the model's.
    """
    impl = layer.impl
    for attr, what in (("logits_soft_cap", "an attention logit soft cap"), ("alibi_slopes", "ALiBi slopes")):
        value = getattr(impl, attr, None)  # a number, or a tensor (ALiBi slopes: one per head)
        if value is not None and (isinstance(value, torch.Tensor) or value not in (0, 0.0)):
            raise RuntimeError(f"kv_compress cannot be served with {what} (layer {layer.layer_name}); "
                               f"its scores would not be the model's attention")


# RotaryEmbedding's forward methods: a subclass that overrides none of them
# turns a query at position p by row p of its cos_sin_cache (NeoX or GPT-J
# layout), which is what expected attention reads back.
_ROPE_FORWARDS = ("forward_static", "forward_native", "forward_cuda", "forward_cpu", "forward_hip", "forward_xpu")


def query_geometry(model, layers, scales: list[float]) -> tuple[QueryGeometry | None, str]:
    """How the compressed layers turn and scale their queries (expected
    attention un-turns the queries vLLM's attention sees, and turns their
    moments to the positions to come), or None and why not.

    Each layer's rotary embedding is its attention module's `rotary_emb`
    beside its `attn` (every model the plugin serves builds them so). Served:
    one table for every compressed layer, NeoX's layout, rows indexed by
    position alone (vLLM's RotaryEmbedding or a subclass keeping its forward:
    linear, Llama 3, YaRN and NTK scalings); refused: GPT-J's interleaved
    layout, multimodal and long/short (Phi-3 LongRoPE) tables, per-layer tables."""
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    rotary_of: dict[str, torch.nn.Module] = {}
    owner_of: dict[str, torch.nn.Module] = {}
    for module in torch.nn.Module.modules(model):  # torch's, called on the model (not an attribute of vLLM's)
        rotary, name = getattr(module, "rotary_emb", None), getattr(getattr(module, "attn", None), "layer_name", None)
        if isinstance(rotary, torch.nn.Module) and name is not None:
            rotary_of[name], owner_of[name] = rotary, module
    rotaries = [rotary_of.get(layer.layer_name) for layer in layers]
    missing = [layer.layer_name for layer, r in zip(layers, rotaries) if r is None]
    if missing:
        return None, f"no rotary embedding found beside layer {missing[0]}"
    rotary = rotaries[0]
    kind = type(rotary)
    if not isinstance(rotary, RotaryEmbedding) or any(
            getattr(kind, name, None) is not getattr(RotaryEmbedding, name, None) for name in _ROPE_FORWARDS):
        return None, f"rotary embedding {kind.__name__} (not a table indexed by position alone)"
    if not rotary.is_neox_style:
        return None, "GPT-J-style (interleaved) rotary embedding"
    if len(getattr(rotary, "scaling_factors", ())) > 1:
        return None, f"{kind.__name__} with several scaling factors"
    tables = [getattr(rotary_of[layer.layer_name], "cos_sin_cache", None) for layer in layers]
    if any(not isinstance(t, torch.Tensor) or not torch.equal(t, rotary.cos_sin_cache) for t in tables):
        return None, "compressed layers with different rotary embeddings"
    if len(set(scales)) != 1:
        return None, f"compressed layers with different attention scales {sorted(set(scales))}"
    for layer in layers:
        problem = rope_not_applied(owner_of[layer.layer_name])
        if problem is not None:
            return None, f"layer {layer.layer_name}: {problem}"
    half = rotary.rotary_dim // 2

    def cos_sin(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        table = rotary.cos_sin_cache  # read per call: vLLM may move or recast it at a forward
        rows = table.index_select(0, positions.to(table.device)).to(torch.float32)
        return rows[:, :half], rows[:, half:]

    return QueryGeometry(cos_sin=cos_sin, max_position=rotary.cos_sin_cache.shape[0], scale=scales[0]), ""


def rope_not_applied(attention: torch.nn.Module) -> str | None:
    """Why the queries this attention module hands its `attn` may not be
    turned by its `rotary_emb` (None: they are).

    Some models hold a rotary embedding in every attention module and use it
    in some layers only: EXAONE 4 and Cohere 2 (Command R7B, Command A) turn
    their sliding-window layers' queries and leave their full-attention ones,
    the very layers that compress, without RoPE. Which layers do is decided
    in the module's forward, so its code is read (`_RopePaths`): every path
    through it must use `self.rotary_emb` (a call, or its table handed to a
    fused kernel), conditions on the module's own attributes evaluated with
    this layer's values; anything it cannot decide counts as not turned."""
    cls = type(attention)
    body = _statements(cls.forward)
    if body is None:
        return f"{cls.__name__}.forward's code cannot be read (whether its queries are turned by RoPE is not known)"
    if not _RopePaths(attention).always(body):
        return f"{cls.__name__}.forward does not turn this layer's queries by RoPE on every path"
    return None


@functools.cache
def _statements(function) -> list[ast.stmt] | None:
    """A function's body as parsed from its source (None: not readable),
    once per function: every compressed layer's module shares its class's."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0]
    return definition.body if isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


class _RopePaths:
    """Whether statements of an attention module's forward use `self.rotary_emb`
    on every path, conditions on the module's attributes (`self.x`, `not`,
    `and`/`or`, `is (not) None`) evaluated, `self.<method>(...)` followed."""

    def __init__(self, module: torch.nn.Module, depth: int = 0) -> None:
        self.module, self.depth = module, depth

    def always(self, body: list[ast.stmt]) -> bool:
        for stmt in body:
            if isinstance(stmt, ast.If):
                test = self._value(stmt.test)
                taken = [stmt.body, stmt.orelse] if test is None else [stmt.body if test else stmt.orelse]
                if all(self.always(branch) for branch in taken):
                    return True
                if any(isinstance(n, ast.Return) for branch in taken for s in branch for n in ast.walk(s)):
                    return False  # a path may leave without it
                continue
            if isinstance(stmt, (ast.With, ast.Try)) and self.always(stmt.body):
                return True
            if isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try, ast.FunctionDef)):
                if any(isinstance(n, ast.Return) for n in ast.walk(stmt)):
                    return False
                continue
            if self._uses(stmt):
                return True
            if isinstance(stmt, ast.Return):
                return False
        return False

    def _uses(self, node) -> bool:
        """Whether evaluating this simple statement uses the rotary embedding
        (outside conditional expressions)."""
        if isinstance(node, (ast.IfExp, ast.BoolOp, ast.Lambda, ast.comprehension)):
            return False
        if isinstance(node, ast.Attribute) and node.attr == "rotary_emb" and _is_self(node.value):
            return True  # called, or its table read for a fused kernel
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value) \
                and self.depth < 2:
            method = getattr(type(self.module), node.func.attr, None)
            body = _statements(method) if inspect.isfunction(method) else None
            if body is not None and _RopePaths(self.module, self.depth + 1).always(body):
                return True
        return any(self._uses(child) for child in ast.iter_child_nodes(node))

    def _value(self, node):
        """The condition's value on this module (None: not decided here)."""
        if isinstance(node, ast.Attribute) and _is_self(node.value):
            value = getattr(self.module, node.attr, _UNKNOWN)
            return None if value is _UNKNOWN or not isinstance(value, (bool, int, float, str, type(None))) \
                else bool(value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = self._value(node.operand)
            return None if value is None else not value
        if isinstance(node, ast.BoolOp):
            values = [self._value(v) for v in node.values]
            if isinstance(node.op, ast.Or):
                return True if True in values else (None if None in values else False)
            return False if False in values else (None if None in values else True)
        if isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.Is, ast.IsNot)) \
                and isinstance(node.comparators[0], ast.Constant) and node.comparators[0].value is None \
                and isinstance(node.left, ast.Attribute) and _is_self(node.left.value):
            value = getattr(self.module, node.left.attr, _UNKNOWN)
            if value is _UNKNOWN:
                return None
            return (value is None) == isinstance(node.ops[0], ast.Is)
        return None


_UNKNOWN = object()


def _is_self(node) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def tensor_parallel_shard() -> HeadShard:
    """This worker's heads among vLLM's tensor-parallel ranks (a slice of every layer's)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        get_tp_group,
    )

    size = get_tensor_model_parallel_world_size()
    if size == 1:
        return ONE_DEVICE
    group = get_tp_group()
    return HeadShard(rank=get_tensor_model_parallel_rank(), size=size,
                     gather=lambda local: group.all_gather(local, dim=0))



def wrap_determine_available_memory(original):
    """CUDA: leave room for the scores beside the KV cache vLLM sizes.

    vLLM gives the KV cache what its profiling run leaves free; the plugin's
    per-request scores (float32 per query head and cached token, on the
    device while a policy needs them) grow with the cached tokens and were
    never part of that run. Worst case every cached token carries scores, so
    the cache gets (B - S) / (1 + f) of the B bytes, f = score bytes per KV
    byte (about 3% for 4 query heads per KV head, head_dim 128, bf16), S the
    selection's transient scratch at max_model_len (`selection_scratch_bytes`). The CPU
    worker sizes its cache from VLLM_CPU_KVCACHE_SPACE instead (its own
    method; this one is not called there)."""

    def determine_available_memory(self) -> int:
        available = original(self)
        if CONFIG_KEY not in (self.vllm_config.additional_config or {}) or self.cache_config.kv_cache_memory_bytes:
            return available  # off, or the user sized the KV cache in bytes: scores come on top
        if self.cache_config.cache_dtype != "auto":  # cache_dtype_of refuses fp8 on CUDA at startup
            return available
        model, parallel = self.model_config, self.parallel_config
        q_heads, kv_heads = model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel)
        ratio = score_bytes_per_kv_byte(q_heads, kv_heads, model.get_head_size(), model.dtype.itemsize)
        # The selection's transient scratch is held aside too (its bound: selection_scratch_bytes).
        scratch = selection_scratch_bytes(model.max_model_len, q_heads, kv_heads, model.get_head_size())
        # And the query moments of the engine's scorer (expected attention),
        # for every request that may run (a request asking for more is refused).
        moments = self.vllm_config.scheduler_config.max_num_seqs * query_moments_bytes(
            self.vllm_config, KVCompressConfig.from_dict(self.vllm_config.additional_config[CONFIG_KEY]))
        kept = int(max(available - scratch - moments, 0) / (1 + ratio))
        logger.info("kv_compress: %.2f GiB of %.2f GiB left for the KV cache; %.2f GiB for scores "
                    "(%.1f%% of the KV bytes), %.2f GiB of selection scratch and %.2f GiB of query moments",
                    kept / 2**30, available / 2**30, (available - scratch - moments - kept) / 2**30, 100 * ratio,
                    scratch / 2**30, moments / 2**30)
        return kept

    return determine_available_memory


