"""Engine arguments: CLI flags, `LLM(kv_compress=...)` keywords, startup checks.

All three routes end in `additional_config["kv_compress"]`, a plain dict that
vLLM pickles into the engine core and every worker.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any

from ..budgets import ALLOCATIONS
from ..cache_layout import CACHE_DTYPES, FP8_FORMATS, cpu_fp8_unserved
from ..config import (
    CONFIG_KEY,
    FIELD_ALIASES,
    KVCompressConfig,
    KVCompressConfigError,
    all_params,
    field_name,
    looks_like_ours,
    param_field,
    request_overrides,
)
from ..limits import EngineLimits
from ..merge import MERGES
from ..registry import POLICIES
from ..schedule import layer_groups
from ..selection import SELECTIONS
from ..triggers import TRIGGERS
from . import metrics
from .patches import has_row, support

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger

SCHEDULER_CLS = "vllm_kvcompress.vllm_seam.scheduler.KVCompressScheduler"
# Why compression cannot be served in this process (patches.apply_refusal:
# a vLLM version outside the plugin's window); None: it can.
REFUSAL: str | None = None
GROUP = "KVCompress"

# CLI flag suffix / keyword suffix -> config field.
_COMMON_OPTIONS = {
    "allocation": ("allocation", str, f"how the budget is spread over layers and KV heads, one of "
                   f"{sorted(ALLOCATIONS)} (default: the policy's own; pyramid, adaptive and retrieval need layer "
                   f"groups)"),
    "selection": ("selection", str, f"how scores become the kept tokens, one of {sorted(SELECTIONS)}: top-k, "
                  f"span carry (keep what follows a kept token) or whole chunks (default: top)"),
    "merge": ("merge", str, f"what follows selection across depth, one of {sorted(MERGES)}: nothing, or MiniCache "
              f"(adjacent layers' KV merged at prefill end; needs one layer group per layer) (default: none)"),
    "trigger": ("trigger", str, f"when a request compresses, one of {sorted(TRIGGERS)} (default: the "
                f"policy's own; --kv-compress-prompt-chunk N alone selects streamed)"),
    "budget": ("budget", int, "tokens kept per (layer, KV head), protected tokens included"),
    "ratio": ("compression_ratio", float, "fraction of the prompt removed, in [0, 1) (kvpress convention)"),
    "interval": ("interval", int, "rolling policies evict again after this many new tokens (default: one KV block)"),
    "protect-prefix": ("protect_prefix", int, "leading prompt tokens never evicted (a system prompt or document "
                       "many requests share: its blocks stay shared through the prefix cache; at most a request's "
                       "prompt) (default: 0)"),
    "layer-groups": ("layer_groups", int, "KV cache groups the layers are split into, each with its own block "
                     "table (the number of layers, or a divisor: contiguous tiers); needed by per-layer budgets "
                     "(pyramid, adaptive and retrieval allocations) to free memory per layer, and one per layer by "
                     "merge minicache (default: 1)"),
    "reserve-growth": ("reserve_growth", int, "admission of a compressed request reserves this many tokens of each "
                       "running compressed request's growth (default: all, up to its max_tokens; 0: vLLM's admission "
                       "on the compressed prompt alone; set it when max_tokens is far above what requests generate)"),
}


_PY_TYPES: dict[str, type] = {"int": int, "float": float, "str": str}


def _param_options() -> dict[str, tuple[str, type, str]]:
    """One option per component parameter, help listing each component's default."""
    out = {}
    for name, defaults in all_params().items():
        f = param_field(name)
        shown = ", ".join(f"{p} {d}" for p, d in defaults.items())
        choices = f.metadata.get("choices")
        text = f.metadata.get("help", name) + (f" {{{', '.join(choices)}}}" if choices else "")
        type_ = _PY_TYPES[str(f.type)] if isinstance(f.type, str) else f.type
        out[name.replace("_", "-")] = (name, type_, f"{text} (default: {shown})")
    return out


def options() -> dict[str, tuple[str, type, str]]:
    """flag suffix -> (config field, type, help) for every --kv-compress-* flag."""
    return {**_COMMON_OPTIONS, **_param_options()}


# ---------------------------------------------------------------- CLI


def add_kv_compress_args(parser: argparse.ArgumentParser) -> None:
    if any(g.title == GROUP for g in parser._action_groups):
        return  # vLLM builds several parsers; each gets the group once
    group = parser.add_argument_group(
        GROUP, "KV-cache compression (vllm-kvcompress). Evicted tokens' blocks return to vLLM's pool."
    )
    group.add_argument(
        "--kv-compress", dest="kv_compress", default=None, choices=sorted(POLICIES),
        metavar="POLICY",
        help=f"compression policy, one of {sorted(POLICIES)}; 'none' installs the plugin without compressing",
    )
    group.add_argument(
        "--kv-compress-config", dest="kv_compress_config", default=None, metavar="FILE.yaml",
        help="YAML recipe (see recipes/); flags given on the command line override it",
    )
    for suffix, (field, type_, text) in options().items():
        group.add_argument(f"--kv-compress-{suffix}", dest=f"kv_compress_{field}", type=type_,
                           default=None, help=text)
    _check_after_parsing(parser)


def _check_after_parsing(parser: argparse.ArgumentParser) -> None:
    """Validate and fold the kv_compress flags as soon as they are parsed.

    A bad flag is an argument error: one line and exit 2, as argparse reports
    vLLM's own (not a traceback from the engine's startup). A good one goes
    into the namespace's `additional_config` right away, a field that
    `EngineArgs.from_cli_args` copies: so every process that builds engine
    arguments from the namespace sees it, even before this plugin loads there
    (the API server processes of data parallelism).

    Wraps this parser instance's `parse_known_args`, which argparse also
    calls for a subcommand's parser (`vllm serve`).
    """
    parse = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        namespace, rest = parse(args, namespace)
        values = {k: v for k, v in vars(namespace).items() if k.startswith("kv_compress")}
        try:
            config = config_from_options(values)
        except KVCompressConfigError as e:
            parser.error(str(e))
        if config is not None and REFUSAL is not None:
            parser.error(REFUSAL)  # a vLLM version the plugin does not serve
        if config is not None and hasattr(namespace, "additional_config"):
            namespace.additional_config = {**(namespace.additional_config or {}), CONFIG_KEY: config}
        if (config is not None and getattr(namespace, "data_parallel_size", 1) > 1
                and getattr(namespace, "api_server_count", 0) is None):
            # vLLM would start one API server per engine core; several API
            # servers serve /metrics from prometheus' multiprocess files only,
            # which the plugin's collector cannot join. One API server still
            # serves every engine core.
            logger.info("kv_compress: one API server process for %d engine cores, so that /metrics "
                        "sums the plugin's counters over all of them", namespace.data_parallel_size)
            namespace.api_server_count = 1
        return namespace, rest

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


def config_from_options(values: dict[str, Any]) -> dict[str, Any] | None:
    """`kv_compress`, `kv_compress_config`, `kv_compress_<field>` -> config dict.

    `kv_compress` is a policy name (CLI) or, from Python, a dict or a
    KVCompressConfig. Field options override the recipe file. Returns None
    when no option was given: the plugin then stays inert.
    """
    policy = values.pop("kv_compress", None)
    recipe = values.pop("kv_compress_config", None)
    overrides = {}
    for key, value in values.items():
        if value is not None:
            name = key[len("kv_compress_"):]
            overrides[FIELD_ALIASES.get(name, name)] = value
    if policy is None and recipe is None and not overrides:
        return None
    if isinstance(policy, KVCompressConfig):
        base = policy
    elif isinstance(policy, Mapping):
        base = KVCompressConfig.from_dict(policy)
    elif recipe is not None:
        base = KVCompressConfig.from_yaml(recipe)
    else:
        base = KVCompressConfig()
    if isinstance(policy, str):
        overrides = {"policy": policy, **overrides}
    return (base.merged(overrides, startup=True) if overrides else base).to_dict()


def wrap_add_cli_args(original):
    def add_cli_args(parser, *args, **kwargs):
        parser = original(parser, *args, **kwargs)
        add_kv_compress_args(parser)
        return parser

    return add_cli_args


def wrap_init(original):
    def __init__(self, *args, **kwargs):
        ours = {k: kwargs.pop(k) for k in list(kwargs) if k.startswith("kv_compress")}
        original(self, *args, **kwargs)
        config = config_from_options(ours)
        if config is not None:
            self.additional_config = {**(self.additional_config or {}), CONFIG_KEY: config}

    return __init__


# ---------------------------------------------------------------- startup checks


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


def refuse_create_engine_config(original, refusal: str):
    """On a vLLM this plugin does not serve: an engine asked to compress
    refuses at startup with `refusal`; any other starts as vLLM's own."""

    def create_engine_config(self, *args, **kwargs):
        if (self.additional_config or {}).get(CONFIG_KEY) is not None:
            raise KVCompressConfigError(refusal)
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
KEPT_LAYER_TYPES = ("sliding_attention",)


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
    if model.is_hybrid or model.is_attention_free:
        raise _refuse("a hybrid state-space or attention-free model (Mamba-style layers)")
    limits = engine_limits(vllm_config)
    num_layers = limits.num_layers
    tp = vllm_config.parallel_config.tensor_parallel_size
    if model.get_total_num_kv_heads() % tp:
        raise _refuse(f"tensor_parallel_size {tp} over {model.get_total_num_kv_heads()} KV heads (ranks would "
                      f"hold copies of a head: use a size that divides the KV heads)")
    check_parallelism(vllm_config.parallel_config)
    check_speculation(vllm_config)
    if getattr(vllm_config.cache_config, "kv_sharing_fast_prefill", False):
        raise _refuse("kv_sharing_fast_prefill (it skips prefill tokens' queries the scorers observe)")
    config = KVCompressConfig.from_dict(vllm_config.additional_config[CONFIG_KEY], limits)
    try:
        layer_groups(num_layers, config.num_layer_groups)
    except ValueError as e:
        raise KVCompressConfigError(str(e)) from None
    parts = config.components()
    if parts is not None:
        hybrid = num_layers != model.get_num_layers(vllm_config.parallel_config)
        problem = parts.merge.problem(num_layers, config.num_layer_groups, hybrid)
        if problem is not None:
            raise KVCompressConfigError(f"{CONFIG_KEY}.merge: {problem}")
        problem = parts.allocation.problem(num_layers)
        if problem is not None:
            raise KVCompressConfigError(f"{CONFIG_KEY}.allocation: {problem}")


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
        minor = support().minor
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


# ---------------------------------------------------------------- per request


def wrap_process_inputs(original):
    """Check a request's `extra_args["kv_compress"]` where vLLM checks its inputs.

    A bad value then fails that request (HTTP 400 from the server, an exception
    from LLM.generate) instead of the engine core, which would take every other
    request down with it. After vLLM's own processing, which knows the
    prompt's length (a request's `protect_prefix` may not exceed it).
    """
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    def process_inputs(self, request_id, prompt, params, *args, **kwargs):
        request = original(self, request_id, prompt, params, *args, **kwargs)
        if not isinstance(params, SamplingParams):
            return request
        try:
            overrides = request_overrides(params.extra_args)
            if overrides is None:
                return request
            limits = self.__dict__.get("_kv_compress_limits")
            if limits is None:
                limits = self._kv_compress_limits = engine_limits(self.vllm_config)
            engine = (self.vllm_config.additional_config or {}).get(CONFIG_KEY)
            if engine is None:
                raise KVCompressConfigError(
                    "kv_compress: this engine was started without kv_compress; start it with "
                    "--kv-compress POLICY (or --kv-compress none) to allow per-request compression")
            config = KVCompressConfig.from_dict(engine).merged(overrides, limits=limits)
            prompt_len = (len(request.prompt_token_ids) if request.prompt_token_ids is not None
                          else len(request.prompt_embeds))
            if overrides.get("protect_prefix") is not None and (config.protect_prefix or 0) > prompt_len:
                raise KVCompressConfigError(
                    f"{CONFIG_KEY}.protect_prefix: {config.protect_prefix} is longer than the prompt "
                    f"({prompt_len} tokens); valid values: 0 .. {prompt_len}")
        except KVCompressConfigError as e:
            raise VLLMValidationError(str(e), parameter=CONFIG_KEY) from None
        return request

    return process_inputs


def wrap_openai_handler(original):
    """Refuse JSON booleans and near-miss keys among a request's kv_compress values.

    The OpenAI protocol parses `vllm_xargs` values as str | int | float, which
    reads `true` as 1: `"kv_compress_span": true` would be served as span 1.
    Only the raw body still tells a boolean from a number, so the handler
    reads it (FastAPI keeps it: the JSON body, or the form's `vllm_xargs`
    field for the audio endpoints) when `vllm_xargs` holds one of our keys.
    Near-miss keys are refused here too, so that every endpoint refuses them
    before anything runs (a render endpoint reaches no engine). Wraps every
    handler that takes a `request` and the `raw_request` (seam table).
    """
    signature = inspect.signature(original)

    async def handler(self, *args, **kwargs):
        bound = signature.bind_partial(self, *args, **kwargs).arguments
        problem = await vllm_xargs_problem(bound.get("request"), bound.get("raw_request"))
        if problem is not None:
            return self.create_error_response(problem, param=CONFIG_KEY)
        return await original(self, *args, **kwargs)

    return handler


async def vllm_xargs_problem(request, raw_request) -> str | None:
    """Why a request's kv_compress `vllm_xargs` cannot be served as parsed (None: they can)."""
    xargs = getattr(request, "vllm_xargs", None)  # a field, or an extra one (batch chat)
    if raw_request is None or not isinstance(xargs, Mapping):
        return None
    if not any(isinstance(k, str) and looks_like_ours(k) for k in xargs):
        return None
    if "form" in raw_request.headers.get("content-type", ""):
        raw = (await raw_request.form()).get("vllm_xargs")
        try:
            problem = boolean_in(json.loads(raw)) if isinstance(raw, str) else None
        except ValueError:
            return None  # the protocol's own validation answers
    else:
        problem = boolean_setting(await raw_request.body())
    if problem is not None:
        return problem
    try:
        request_overrides(xargs)
    except KVCompressConfigError as e:
        return str(e)
    return None


def boolean_setting(body: bytes) -> str | None:
    """The error for the first kv_compress value of `vllm_xargs` that is a JSON boolean (None: none is)."""
    try:
        xargs = json.loads(body).get("vllm_xargs")
    except (ValueError, AttributeError):
        return None  # not a JSON object: the protocol's own validation answers
    return boolean_in(xargs)


def boolean_in(xargs: Any) -> str | None:
    """`boolean_setting` of a parsed `vllm_xargs` object."""
    if not isinstance(xargs, dict):
        return None
    for key, value in xargs.items():
        values = value if isinstance(value, list) else [value]
        booleans = [v for v in values if isinstance(v, bool)]
        if looks_like_ours(key) and booleans:
            name = key.removeprefix(CONFIG_KEY + "_") if key != CONFIG_KEY else "policy"
            got = json.dumps(booleans[0]) + (" in a list" if isinstance(value, list) else "")
            return (f"{CONFIG_KEY}.{field_name(FIELD_ALIASES.get(name, name))}: expected a number or a name, got "
                    f"the JSON boolean {got}")
    return None
