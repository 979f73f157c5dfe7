"""Startup checks: what compression cannot serve is refused before the engine starts.

`EngineArgs.create_engine_config` validates the config and makes the engine
safe for compression (synchronous scheduling, the plugin's scheduler, the
attention backend, CUDA graph mode), then checks the model, the parallelism
and speculation vLLM resolved. A refusal is a `KVCompressConfigError` with one
line naming the feature; `vllm serve` prints it as an argument error.
"""

from __future__ import annotations

import logging
import sys

from ..cache_layout import CACHE_DTYPES, FP8_FORMATS, cpu_fp8_unserved
from ..config import CONFIG_KEY, KVCompressConfig, KVCompressConfigError
from ..limits import EngineLimits
from ..schedule import layer_groups
from . import metrics, versions
from .patches import has_row

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger

SCHEDULER_CLS = "vllm_kvcompress.vllm_seam.scheduler.KVCompressScheduler"


def _refuse(what: str) -> KVCompressConfigError:
    return KVCompressConfigError(f"kv_compress cannot be served with {what}; turn one of them off")


def prepare_engine_args(args) -> KVCompressConfig | None:
    """Validate the config and make the engine safe for compression, or refuse."""
    raw = (args.additional_config or {}).get(CONFIG_KEY)
    if raw is None:
        return None
    config = raw if isinstance(raw, KVCompressConfig) else KVCompressConfig.from_dict(raw)
    args.additional_config = {**args.additional_config, CONFIG_KEY: config.to_dict()}
    if args.speculative_config:
        spec = args.speculative_config
        get = spec.get if isinstance(spec, dict) else lambda key: getattr(spec, key, None)
        # Without a method vLLM picks one from the draft model (EAGLE, MTP or
        # a plain draft model): checked once resolved (check_speculation).
        if get("method") is not None or get("model") is None:
            check_speculative_method(get("method"))
    if args.kv_transfer_config:
        raise _refuse("a KV connector (it addresses blocks by logical position)")
    if args.pipeline_parallel_size > 1:
        raise _refuse("pipeline parallelism (a stage holds only some layers; tensor and data parallelism "
                      "are supported)")
    _check_cache_dtype(args.kv_cache_dtype)
    if args.scheduler_cls not in (None, SCHEDULER_CLS) and "vllm.v1.core.sched" not in str(args.scheduler_cls):
        raise _refuse(f"a custom scheduler_cls ({args.scheduler_cls})")
    if args.async_scheduling:
        logger.warning("kv_compress: async scheduling turned off: blocks are freed and compacted "
                       "between synchronous steps (docs/deployment.md, Async scheduling)")
    args.async_scheduling = False
    args.scheduler_cls = SCHEDULER_CLS
    # The model runner is vLLM's choice (V1 or Model Runner V2: both are hooked).
    prepare_platform(args, config)
    return config


def refuse_create_engine_config(original):
    """On a vLLM this plugin does not serve: an engine asked to compress
    refuses at startup with the window's refusal (`versions.refusal`); any
    other starts as vLLM's own."""

    def create_engine_config(self, *args, **kwargs):
        if (self.additional_config or {}).get(CONFIG_KEY) is not None:
            raise KVCompressConfigError(versions.refusal or versions.support().refusal)
        return original(self, *args, **kwargs)

    return create_engine_config


def _check_cache_dtype(name: str | None) -> None:
    """fp8 on CPU, where its rounding is checked (cache_layout.CacheDType); the
    model's dtype everywhere. The worker checks again against vLLM's writer."""
    from vllm.platforms import current_platform

    valid = CACHE_DTYPES["CPU_ATTN" if current_platform.is_cpu() else "FLASH_ATTN"]
    if name not in (None, *valid):
        raise _refuse(f"kv_cache_dtype={name} (valid with compression here: {', '.join(valid)}; "
                      f"fp8 is checked on the CPU engine only)")
    if name in FP8_FORMATS and current_platform.is_cpu() and (why := cpu_fp8_unserved()) is not None:
        raise _refuse(f"kv_cache_dtype={name} on this CPU ({why})")


def prepare_platform(args, config: KVCompressConfig) -> None:
    """CPU: CPU_ATTN as vLLM picks it. CUDA: FLASH_ATTN with piecewise CUDA graphs. Else: refuse."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return
    if not current_platform.is_cuda():
        raise _refuse(f"the {current_platform.device_name} platform (CPU and CUDA only)")
    chosen = args.attention_backend or getattr(args.attention_config, "backend", None)
    name = getattr(chosen, "name", chosen)
    if name is None:
        args.attention_backend = "FLASH_ATTN"
    elif str(name).upper() != "FLASH_ATTN":
        raise _refuse(f"attention backend {name} (on CUDA only FLASH_ATTN's cache layout is known)")
    prepare_cuda_graphs(args.compilation_config, args.enforce_eager)
    if getattr(args, "enable_extensible_kv_cache", None):
        raise _refuse("enable_extensible_kv_cache (it re-sizes the KV cache after warm-up, over the room the "
                      "scores need)")
    if hasattr(args, "enable_extensible_kv_cache"):  # vLLM 0.34: on by default on CUDA
        args.enable_extensible_kv_cache = False


def prepare_cuda_graphs(compilation, enforce_eager: bool) -> None:
    """Piecewise CUDA graphs unless the user chose a mode: the plugin's
    per-step work lives in the attention op, which piecewise mode runs eagerly
    between the captured pieces (vLLM's default splitting ops). vLLM's own
    default on FLASH_ATTN, FULL_AND_PIECEWISE, would replay attention from a
    graph in decode steps, without it (`check_cuda_graphs` refuses that)."""
    from vllm.config import CUDAGraphMode

    if not enforce_eager and compilation.cudagraph_mode is None:
        compilation.cudagraph_mode = CUDAGraphMode.PIECEWISE
        logger.info("kv_compress: CUDA graphs PIECEWISE (attention and the plugin's hooks run eagerly between "
                    "captured pieces)")


def check_cuda_graphs(compilation) -> None:
    """The compilation as vLLM resolved it (a fusion pass may change the mode)
    captures no attention op: no full graph, and with piecewise graphs every
    attention op is a splitting op."""
    mode = compilation.cudagraph_mode
    if mode is None:
        return
    if mode.has_full_cudagraphs():
        raise _refuse(f"cudagraph_mode={mode.name} (a full CUDA graph replays attention without the plugin's "
                      f"scoring and metadata edits; use PIECEWISE, the default with kv_compress, or NONE)")
    # Breakable CUDA graphs (vLLM 0.34) run attention as an eager segment.
    eager_attention = compilation.splitting_ops_contain_attention() or getattr(
        compilation, "use_breakable_cudagraph", False)
    if mode.has_piecewise_cudagraphs() and not eager_attention:
        raise _refuse(f"splitting_ops={compilation.splitting_ops} (piecewise CUDA graphs would capture an "
                      f"attention op; leave splitting_ops unset or include vLLM's attention ops)")


COMPRESSIBLE_LAYER_TYPE = "full_attention"
# Layer kinds that may sit beside the compressed full-attention layers:
# vLLM manages their cache, and they never see a compressed one.
# Gated DeltaNet layers (Qwen3-Next, Qwen3.5) keep a fixed-size recurrent
# state in vLLM's Mamba-style cache: nothing there grows with the context.
KEPT_LAYER_TYPES = ("sliding_attention", "linear_attention")


def window_never_slides(model) -> bool:
    """A model whose every layer is sliding-window (no `layer_types`), by a
    window no shorter than the engine's context: it never slides."""
    window = model.get_sliding_window()
    return (not getattr(model.hf_text_config, "layer_types", None) and window is not None
            and window >= model.max_model_len)


def full_attention_layers(model) -> int | None:
    """How many of the model's attention layers compress (None: all), or refuse.

    Hybrid models (Gemma 2/3) name each layer's kind in `layer_types`;
    sliding-window layers stay with vLLM's manager. A model whose every layer
    is sliding (Mistral-style `sliding_window`) has nothing to compress.
    """
    num_layers = None  # no layer types: every layer is full attention
    hf = model.hf_text_config
    layer_types = getattr(hf, "layer_types", None)
    if layer_types:
        unknown = sorted({t for t in layer_types if t not in (COMPRESSIBLE_LAYER_TYPE, *KEPT_LAYER_TYPES)})
        if unknown:
            raise _refuse(f"layer types {unknown} (full-attention layers compress; only sliding-window ones "
                          f"may sit beside them)")
        num_layers = layer_types.count(COMPRESSIBLE_LAYER_TYPE)
    elif model.get_sliding_window() is not None:
        num_layers = 0
    if num_layers == 0:
        raise _refuse("a model without full-attention layers (every layer is sliding-window)")
    return num_layers


# Hybrids whose state-space layers are Gated DeltaNet ("linear_attention"),
# left to vLLM as sliding-window layers are; their full-attention layers compress.
GATED_DELTANET_MODELS = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text")


def gated_deltanet_hybrid(hf) -> bool:
    """Whether the model's state-space layers are Gated DeltaNet ones (the layer
    types themselves are checked by `full_attention_layers`)."""
    return getattr(hf, "model_type", "") in GATED_DELTANET_MODELS and "linear_attention" in (
        getattr(hf, "layer_types", None) or ())


def unscored_attention(hf) -> tuple[str, str] | None:
    """The model's attention feature that the scoring ops would not reproduce,
    and what in its config says so (None: none). Scores and the masked per-head pass
    are softmax(scale * q.k) (gpt-oss's learned sinks join the denominator:
    the ops take them); a logit soft cap (Gemma 2) or ALiBi slopes (BLOOM,
    MPT, Falcon with `alibi`) change that attention. Refused here, before the
    engine starts; the worker checks the layers again
    (worker/startup.check_scoring_exact)."""
    model_type = getattr(hf, "model_type", "")
    cap = getattr(hf, "attn_logit_softcapping", None)
    if cap:
        return "an attention logit soft cap", f"{model_type} attn_logit_softcapping={cap}"
    attn_config = getattr(hf, "attn_config", None)
    mpt_alibi = attn_config.get("alibi") if isinstance(attn_config, dict) else getattr(attn_config, "alibi", False)
    if (model_type == "bloom" or getattr(hf, "alibi", False) is True or mpt_alibi is True
            or getattr(hf, "position_embedding_type", None) == "alibi"):
        return "ALiBi slopes", model_type
    return None


def engine_limits(vllm_config) -> EngineLimits:
    """What bounds a configuration's integers on this engine (`limits.py`)."""
    model = vllm_config.model_config
    num_layers = full_attention_layers(model)
    if num_layers is None:
        num_layers = model.get_num_layers(vllm_config.parallel_config)
    return EngineLimits(max_model_len=model.max_model_len, num_layers=num_layers)


def check_model(vllm_config) -> None:
    """Refuse model kinds whose full-attention layers cannot compress, and
    values out of their range on this engine."""
    model = vllm_config.model_config
    if model.use_mla:
        raise _refuse("an MLA model (latent KV cache layout)")
    if model.is_attention_free or (model.is_hybrid and not gated_deltanet_hybrid(model.hf_text_config)):
        raise _refuse("a hybrid state-space or attention-free model (Mamba-style layers)")
    unscored = unscored_attention(model.hf_text_config)
    if unscored is not None:
        feature, detail = unscored
        raise _refuse(f"{feature} ({detail}: the scores would not be the model's attention)")
    limits = engine_limits(vllm_config)
    num_layers = limits.num_layers
    tp = vllm_config.parallel_config.tensor_parallel_size
    if model.get_total_num_kv_heads() % tp:
        raise _refuse(f"tensor_parallel_size {tp} over {model.get_total_num_kv_heads()} KV heads (ranks would "
                      f"hold copies of a head: use a size that divides the KV heads)")
    check_parallelism(vllm_config.parallel_config)
    check_speculation(vllm_config)
    shared = getattr(model.hf_text_config, "num_kv_shared_layers", 0) or 0
    if shared:
        # Their attention reads an earlier layer's cache: compacting that
        # layer for its own scores would move what they read.
        raise _refuse(f"KV cache shared across layers ({model.hf_text_config.model_type} "
                      f"num_kv_shared_layers={shared}: the last layers read earlier layers' caches)")
    if getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False):
        raise _refuse("kv_sharing_fast_prefill (it skips prefill tokens' queries the scorers observe)")
    config = KVCompressConfig.from_dict(vllm_config.additional_config[CONFIG_KEY], limits)
    try:
        layer_groups(num_layers, config.num_layer_groups)
    except ValueError as e:
        raise KVCompressConfigError(str(e)) from None
    parts = config.components()
    if parts is not None:
        problem = parts.merge.problem(num_layers, config.num_layer_groups, has_uncompressed_layers(vllm_config))
        if problem is not None:
            raise KVCompressConfigError(f"{CONFIG_KEY}.merge: {problem}")
        problem = parts.allocation.problem(num_layers)
        if problem is not None:
            raise KVCompressConfigError(f"{CONFIG_KEY}.allocation: {problem}")
    if config.reuse:
        problem = reuse_problem(vllm_config)
        if problem is not None:
            raise KVCompressConfigError(f"{CONFIG_KEY}.reuse: {problem}")


def has_uncompressed_layers(vllm_config) -> bool:
    """Whether some layers of the model do not compress (a sliding-window or linear-attention hybrid)."""
    return engine_limits(vllm_config).num_layers != vllm_config.model_config.get_num_layers(
        vllm_config.parallel_config)


def query_moments_bytes(vllm_config, config: KVCompressConfig) -> int:
    """Bytes of one request's query moments under `config` on one
    tensor-parallel rank (its query heads, every compressed layer); 0 for
    scorers that observe no queries."""
    parts = config.components()
    if parts is None:
        return 0
    model = vllm_config.model_config
    return parts.scorer.query_moments_bytes(engine_limits(vllm_config).num_layers,
                                            model.get_num_attention_heads(vllm_config.parallel_config),
                                            model.get_head_size())


def query_moments_problem(vllm_config, engine: KVCompressConfig, request: KVCompressConfig) -> str | None:
    """Why a request's scorer cannot keep its query moments on this engine (None: it can).

    On CUDA the worker holds the engine setting's moments aside for every
    request (`wrap_determine_available_memory`): a request asking for more
    (expected attention where the engine runs another scorer, or its
    covariance where the engine keeps the mean) would take memory the KV
    cache was given. The CPU cache is sized apart from host memory, and a
    KV cache sized in bytes by the user has everything else on top.
    """
    if vllm_config.device_config.device_type != "cuda" or vllm_config.cache_config.kv_cache_memory_bytes:
        return None
    wanted, held = query_moments_bytes(vllm_config, request), query_moments_bytes(vllm_config, engine)
    if wanted <= held:
        return None
    parts = request.components()
    field, value = (("statistics", getattr(parts.scorer, "statistics", None)) if engine.policy == request.policy
                    and parts is not None else ("policy", request.policy))
    return (f"{CONFIG_KEY}.{field}: {value!r} keeps its "
            f"observed queries' moments on the GPU ({wanted / 2**20:.1f} MiB per request here, "
            f"{held / 2**20:.1f} MiB held for each at startup by the engine's setting); start the engine "
            f"with it to serve it per request")


def reuse_problem(vllm_config) -> str | None:
    """Why this engine cannot keep compressed states for later requests (None: it can)."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return "needs prefix caching (the engine runs with it off: drop --no-enable-prefix-caching)"
    hf = vllm_config.model_config.hf_text_config
    if gated_deltanet_hybrid(hf):
        # A sliding-window group's state is its last window's blocks, saved
        # beside the compressed ones; a DeltaNet layer's is one recurrent
        # state, which vLLM's Mamba cache keeps (and hits) at block
        # boundaries only, never at a compressed state's own length.
        return (f"a Gated DeltaNet hybrid ({hf.model_type}) is not served: its recurrent state is cached "
                f"at block boundaries only (sliding-window hybrids are)")
    return None


# Proposers whose drafts compose with compression: n-gram lookup reads only
# the request's token ids; a draft model keeps its layers' KV in the target's
# first KV cache group, compacted with the target's kept positions
# (worker/speculation.py). EAGLE/MTP heads read the target's hidden states at
# positions the plugin does not follow, and are refused.
SPECULATIVE_METHODS = ("ngram", "draft_model")
# The seam row that follows a draft model on Model Runner V2 (patches.py).
MRV2_DRAFT_PROPOSE = "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator.StandaloneARSpeculator.propose"


def check_speculative_method(method: str | None) -> None:
    """Refuse proposers other than n-gram lookup and a draft model: from the engine arguments
    (before vLLM loads a draft model's config) and again once resolved."""
    if method not in SPECULATIVE_METHODS:
        named = repr(method) if method else "(none given: vLLM picks it from the draft model)"
        raise _refuse(f"speculative decoding method {named} (valid with compression: "
                      f"{', '.join(SPECULATIVE_METHODS)}; EAGLE and MTP heads read the target's hidden states)")


def check_speculation(vllm_config) -> None:
    """Speculative decoding: n-gram and draft-model proposals, on either model runner
    (worker/speculation.py); the rest refused."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    check_speculative_method(spec.method)
    if getattr(spec, "parallel_drafting", False):
        raise _refuse("parallel drafting (speculative_config.parallel_drafting: its padding slots are not "
                      "mapped to physical ones)")
    # vLLM 0.34 has no such property: Model Runner V2 is its only runner.
    if spec.method == "draft_model" and getattr(vllm_config, "use_v2_model_runner", True):
        minor = versions.support().minor
        if not has_row(MRV2_DRAFT_PROPOSE, minor):
            raise _refuse(f"a draft model on Model Runner V2 of vLLM {minor} (its speculator's slots are "
                          f"followed on vLLM 0.32-0.33; n-gram speculation is served)")


def check_parallelism(parallel) -> None:
    """Refuse the ways of splitting a step that the plugin's per-request
    slots and lengths do not follow (Model Runner V2 brings them)."""
    for attr, what in (("decode_context_parallel_size", "decode context parallelism"),
                       ("prefill_context_parallel_size", "prefill context parallelism")):
        if (getattr(parallel, attr, 1) or 1) > 1:
            raise _refuse(f"{what} ({attr}={getattr(parallel, attr)}: a request's cache is split over ranks "
                          f"by logical position)")
    if getattr(parallel, "enable_dbo", False) or getattr(parallel, "use_ubatching", False):
        raise _refuse("micro-batching (enable_dbo: metadata is built per micro-batch, the plugin's per step)")


def wrap_create_engine_config(original):
    def create_engine_config(self, *args, **kwargs):
        config = prepare_engine_args(self)
        vllm_config = original(self, *args, **kwargs)
        if config is not None and window_never_slides(vllm_config.model_config) and not self.disable_sliding_window:
            # Every layer "sliding" by a window at least as long as the context
            # (Phi-4-mini, Phi-3.5-mini: 262,144 over 131,072) is full attention:
            # vLLM's own disable_sliding_window says so, and its layers compress.
            logger.info("kv_compress: sliding_window %d >= max_model_len %d: full attention (disable_sliding_window)",
                        vllm_config.model_config.get_sliding_window(), vllm_config.model_config.max_model_len)
            self.disable_sliding_window = True
            vllm_config = original(self, *args, **kwargs)
        if config is not None:
            if vllm_config.device_config.device_type == "cuda":
                check_cuda_graphs(vllm_config.compilation_config)
            check_model(vllm_config)
            metrics.enable_metrics()
            logger.info("kv_compress enabled: %s", config.to_dict())
        return vllm_config

    return create_engine_config


def wrap_serve_cmd(original):
    """`vllm serve`: a refusal once the engine config is known (the checks
    above, raised from `create_engine_config` in this process) reads as an
    argument error: one line, exit 2; the traceback only at debug level."""

    def cmd(args) -> None:
        try:
            original(args)
        except KVCompressConfigError as e:
            logger.debug("kv_compress: startup refused", exc_info=True)
            message = " ".join(str(e).split())
            print(f"vllm serve: error: {message}", file=sys.stderr, flush=True)
            sys.exit(2)

    return cmd
