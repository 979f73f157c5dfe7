"""Every vLLM symbol this plugin wraps, replaces or subclasses: the whole seam.

Each entry names the symbol and says why. `apply_all()` installs
them once per process (vLLM calls the plugin in the API server, the engine
core, each worker and a model-inspection subprocess). Wrappers are inert
unless the engine was configured with `kv_compress`: with the plugin installed
and no `--kv-compress`, vLLM behaves exactly as without it.

Subclasses that vLLM instantiates for us (not patches):
  - vllm.v1.core.sched.scheduler.Scheduler -> scheduler.KVCompressScheduler,
    installed through `scheduler_cls` only when compression is configured;
    overrides `schedule` (plan compressions first), `update_from_output` (take
    the layer budgets a worker derived from attention), `_reserve_prefill_lookahead`
    (end a streamed prompt's chunk at its next eviction), `_get_local_prefix_cache_hit`
    (cap a prefix-cache hit where it would change what the request keeps) and
    `_free_request_blocks` (where finish, abort and preemption drop the state).
  - vllm.v1.kv_cache_interface.FullAttentionSpec and
    vllm.v1.core.single_type_kv_cache_manager.FullAttentionManager ->
    block_manager.CompressedAttentionSpec/CompressedAttentionManager,
    registered through vLLM's `KVCacheSpecRegistry` (its extension point for
    KV cache specs) and swapped into the KV cache groups by the
    `get_kv_cache_groups` wrapper below; the manager allocates by a request's
    physical, not logical, length and frees its evicted tail blocks.
  - vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend/Impl ->
    attention.KVCompressCPUBackend/Impl, registered for CPU_ATTN on CPU;
    vllm.v1.attention.backends.flash_attn.FlashAttentionBackend/Impl ->
    attention.KVCompressFlashBackend/Impl, registered for FLASH_ATTN on CUDA.
    After vLLM's `forward` they redo the output rows of requests whose KV
    heads keep different counts (per-head budgets: each head's evicted slots
    masked), write the rows of fused decode queries (attention and scores in
    one op; vLLM's kernel attended one key for them) and score the step's
    other observed queries.

Patched symbols: the table below, one line each.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

VLLM_VERSION = "0.32.0"  # the version this seam was written and tested against


@dataclass(frozen=True)
class Patch:
    module: str
    owner: str  # class name inside module ("" for a module-level function)
    attr: str
    make: str  # "seam_module.function": original -> replacement (imported when applied)
    kind: str  # method | staticmethod | classmethod | function
    why: str


# module | owner ("" for a module-level function) | attribute | seam_module.function (original ->
# replacement) | kind | why. One line each: the whole seam at a glance.
_TABLE = """
vllm.engine.arg_utils | EngineArgs | add_cli_args | engine_args.wrap_add_cli_args | staticmethod
    | add the KVCompress flag group to every vLLM parser
vllm.engine.arg_utils | EngineArgs | __init__ | engine_args.wrap_init | method
    | accept LLM(kv_compress=...) keywords (unknown fields raise TypeError otherwise)
vllm.engine.arg_utils | AsyncEngineArgs | __init__ | engine_args.wrap_init | method
    | same for the async engine's arguments (a dataclass with its own __init__)
vllm.engine.arg_utils | EngineArgs | create_engine_config | engine_args.wrap_create_engine_config | method
    | validate the config and refuse or make safe what compression cannot serve
vllm.v1.engine.input_processor | InputProcessor | process_inputs | engine_args.wrap_process_inputs | method
    | reject a bad per-request extra_args['kv_compress'] before it reaches the engine core
vllm.entrypoints.openai.completion.serving | OpenAIServingCompletion | create_completion
    | engine_args.wrap_openai_handler | method
    | a JSON boolean among the kv_compress vllm_xargs is a 400 (the protocol would read true as 1)
vllm.entrypoints.openai.chat_completion.serving | OpenAIServingChat | create_chat_completion
    | engine_args.wrap_openai_handler | method | same for chat completions
vllm.v1.worker.gpu_worker | Worker | determine_available_memory | worker.hooks.wrap_determine_available_memory | method
    | CUDA: the KV cache leaves room for the scores the profiling run never allocated
vllm.v1.worker.gpu_model_runner | GPUModelRunner | initialize_kv_cache | worker.hooks.wrap_initialize_kv_cache | method
    | set up compression (and self-test the cache layout) once the KV cache exists
vllm.v1.worker.gpu_model_runner | GPUModelRunner | _update_states | worker.hooks.wrap_update_states | method
    | compact evicted KV and truncate block tables before new block ids are appended
vllm.v1.worker.gpu_model_runner | GPUModelRunner | _prepare_inputs | worker.hooks.wrap_prepare_inputs | method
    | physical slot mapping and seq_lens; positions (RoPE) stay logical
vllm.v1.worker.gpu_model_runner | GPUModelRunner | sample_tokens | worker.hooks.wrap_sample_tokens | method
    | carry layer budgets decided from a prompt's attention back to the scheduler
vllm.v1.core.kv_cache_utils | | get_kv_cache_groups | groups.wrap_get_kv_cache_groups | function
    | KV cache groups carry CompressedAttentionSpec; --kv-compress-layer-groups splits the layers
vllm.v1.worker.utils | AttentionGroup | build_metadata | worker.hooks.wrap_build_metadata | method
    | each KV cache group's seq_lens follow that group's physical length; fused decode rows attend one key
vllm.v1.engine.core | EngineCore | kv_compress_stats | scheduler.make_engine_stats | method
    | a utility method so LLM/serve clients can read the scheduler's compression stats
"""


def _parse(table: str) -> list[Patch]:
    rows = table.strip().replace("\n    |", " |").splitlines()
    return [Patch(*(cell.strip() for cell in row.split("|"))) for row in rows]


PATCHES = _parse(_TABLE)

_applied: set[tuple[str, ...]] = set()


def check_vllm_version() -> str:
    import vllm

    version = getattr(vllm, "__version__", "unknown")
    if not version.startswith(VLLM_VERSION):
        raise RuntimeError(
            f"vllm_kvcompress {VLLM_VERSION}-seam: installed vLLM is {version}; this plugin "
            f"hooks vLLM internals and was written for vLLM {VLLM_VERSION} only"
        )
    return version


def apply(patches: list[Patch]) -> None:
    """Install these patches in this process; each at most once."""
    for p in patches:
        key = (p.module, p.owner, p.attr)
        if key in _applied:
            continue
        seam_module, function = p.make.rsplit(".", 1)
        make = getattr(importlib.import_module(f"{__package__}.{seam_module}"), function)
        module = importlib.import_module(p.module)
        owner = getattr(module, p.owner) if p.owner else module
        raw = owner.__dict__.get(p.attr)
        new: Any
        if p.kind == "staticmethod":
            new = staticmethod(make(raw.__func__))  # type: ignore[union-attr]
        elif p.kind == "classmethod":
            new = classmethod(make(raw.__func__))  # type: ignore[union-attr]
        else:
            new = make(raw)
            if raw is not None:
                functools.update_wrapper(new, raw)
        setattr(owner, p.attr, new)
        _applied.add(key)


def apply_all() -> None:
    """Install the whole seam (the plugin entry point calls this in every process)."""
    if ("attention",) in _applied:
        return
    check_vllm_version()
    apply(PATCHES)
    from vllm.platforms import current_platform

    from . import attention

    attention.register_backends(current_platform)
    _applied.add(("attention",))


def apply_keyword_support() -> None:
    """Only what `LLM(kv_compress=...)` needs; safe while vLLM is still importing."""
    apply([p for p in PATCHES if p.attr == "__init__"])


def describe() -> str:
    """One line per patch, for logs and the README."""
    return "\n".join(f"{'.'.join(filter(None, (p.module, p.owner, p.attr)))}: {p.why}" for p in PATCHES)
