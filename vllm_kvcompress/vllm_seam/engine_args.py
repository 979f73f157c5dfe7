"""Engine arguments: the `--kv-compress*` flags and `LLM(kv_compress=...)` keywords.

Flags, keywords and recipes all end in `additional_config["kv_compress"]`, a
plain dict that vLLM pickles into the engine core and every worker; what
the engine then refuses is in engine_checks.py, per-request settings in
request_checks.py.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..budgets import ALLOCATIONS
from ..config import (
    CONFIG_KEY,
    FIELD_ALIASES,
    KVCompressConfig,
    KVCompressConfigError,
    all_params,
    param_field,
    parse_bool,
)
from ..merge import MERGES
from ..registry import POLICIES
from ..selection import SELECTIONS
from ..triggers import TRIGGERS
from . import versions

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger

GROUP = "KVCompress"

def boolean(text: str) -> bool:
    """A flag's true or false."""
    value = parse_bool(text)
    if value is None:
        raise ValueError(f"expected true or false, got {text!r}")
    return value


# CLI flag suffix / keyword suffix -> config field.
_COMMON_OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
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
    "reuse": ("reuse", boolean, "a finished request's compressed state stays in the prefix cache for a later request "
              "whose prompt begins with its prompt and outputs under the same settings (a conversation's next "
              "turn), which then computes only its new tokens; needs prefix caching (default: false)"),
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


def options() -> dict[str, tuple[str, Callable[[str], Any], str]]:
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
        if config is not None and versions.refusal is not None:
            parser.error(versions.refusal)  # a vLLM version the plugin does not serve
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
