"""KVCompressConfig: the one validated configuration.

The same type is built from CLI flags, `LLM(kv_compress=...)` keywords, a YAML
recipe, `additional_config={"kv_compress": {...}}` and per-request
`extra_args`, always through `from_dict`, so every entry point rejects the same
mistakes with the same message.

The dictionary form is flat: the common keys below plus the parameters of the
policy's scorer, allocation and trigger (their dataclass fields), e.g.
`{"policy": "snapkv", "budget": 256, "window": 32}` or
`{"policy": "h2o", "allocation": "per_head", "trigger": "once", "budget": 256, "alpha": 0.5}`.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .budgets import ALLOCATIONS
from .limits import MAX_SHOWN, Bound, EngineLimits, field_bound, shown
from .merge import MERGES
from .registry import POLICIES, Components, component_classes
from .scorers import SCORERS
from .selection import SELECTIONS
from .triggers import TRIGGERS

CONFIG_KEY = "kv_compress"  # key inside vLLM's additional_config / extra_args
COMMON_FIELDS = ("policy", "allocation", "trigger", "selection", "merge", "budget", "compression_ratio", "interval",
                 "protect_prefix", "layer_groups", "reserve_growth", "reuse")
COMPONENT_FIELDS = ("allocation", "trigger", "selection", "merge")  # replace the policy's own component
ENGINE_FIELDS = ("layer_groups", "reserve_growth")  # fixed at startup: a request cannot change them
# Common fields other than `policy`, with their types (None when not given).
_OPTIONAL_FIELDS: dict[str, type] = {"allocation": str, "trigger": str, "selection": str, "merge": str, "budget": int,
                                     "compression_ratio": float, "interval": int, "protect_prefix": int,
                                     "layer_groups": int, "reserve_growth": int, "reuse": bool}
# The common integer fields' ranges (component fields declare theirs in their metadata).
_BOUNDS = {"budget": Bound(1, "tokens"), "interval": Bound(1, "tokens"), "protect_prefix": Bound(0, "tokens"),
           "layer_groups": Bound(1, "layers"), "reserve_growth": Bound(0, "tokens")}
_CHOICES: dict[str, Mapping[str, type]] = {"allocation": ALLOCATIONS, "trigger": TRIGGERS, "selection": SELECTIONS,
                                           "merge": MERGES}
_COMPONENT_REGISTRIES = (SCORERS, ALLOCATIONS, TRIGGERS, SELECTIONS, MERGES)


# Short names accepted for fields (the CLI flag is --kv-compress-ratio).
FIELD_ALIASES = {"ratio": "compression_ratio"}


class KVCompressConfigError(ValueError):
    """A configuration value that cannot be served; the message names the field."""


def _fail(name: str, problem: str) -> KVCompressConfigError:
    return KVCompressConfigError(f"{CONFIG_KEY}.{name}: {problem}")


def composition_params(policy: str, allocation: str | None = None, trigger: str | None = None,
                       selection: str | None = None, merge: str | None = None) -> dict[str, dataclasses.Field]:
    """The parameters (dataclass fields) of a policy's scorer, allocation, trigger, selection and merge."""
    classes = component_classes(policy, allocation, trigger, selection, merge)
    return {f.name: f for cls in classes for f in dataclasses.fields(cls)}


def all_params() -> dict[str, dict[str, Any]]:
    """Every parameter name -> {component name: default}, for CLI flags."""
    out: dict[str, dict[str, Any]] = {}
    for registry in _COMPONENT_REGISTRIES:
        for name in sorted(registry):
            for f in dataclasses.fields(registry[name]):
                out.setdefault(f.name, {})[name] = f.default
    return out


def _flagged_params(flag: str) -> tuple[str, ...]:
    """Component parameters whose field metadata sets `flag` ("engine": fixed at startup; "path": a file)."""
    return tuple(sorted({f.name for registry in _COMPONENT_REGISTRIES for cls in registry.values()
                         for f in dataclasses.fields(cls) if f.metadata.get(flag)}))


# Fixed at startup (a file the server reads), and files a recipe names relative to itself.
ENGINE_PARAMS = _flagged_params("engine")
PATH_PARAMS = _flagged_params("path")


def param_field(name: str) -> dataclasses.Field:
    """The dataclass field behind a parameter name (the first component that has it)."""
    for registry in _COMPONENT_REGISTRIES:
        for cls in registry.values():
            fields = {f.name: f for f in dataclasses.fields(cls)}
            if name in fields:
                return fields[name]
    raise KeyError(name)


def parse_bool(value: Any) -> bool | None:
    """A true or false given as a boolean, 1 or 0, or a word (flags, a
    server's vllm_xargs, which carry no booleans); None: neither."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(value.lower())
    return None


# Common fields that are true or false.
BOOLEAN_FIELDS = frozenset(name for name, t in _OPTIONAL_FIELDS.items() if t is bool)


def _check_type(name: str, value: Any, expected: Any, bound: Bound | None = None,
                limits: EngineLimits | None = None) -> Any:
    """Accept `value` for a field annotated `expected` (int, float, str, or
    bool: `parse_bool`), an integer within `bound` (on the engine of `limits`,
    when known)."""
    if expected in (bool, "bool"):
        parsed = parse_bool(value)
        if parsed is None:
            raise _fail(name, f"expected true or false, got {type(value).__name__} {shown(value)}")
        return parsed
    if expected in (float, "float") and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    py_type = {"int": int, "float": float, "str": str, "bool": bool}.get(expected, expected)
    if isinstance(value, bool) and py_type is not bool:
        ok = False
    else:
        ok = isinstance(value, py_type)
    if not ok:
        raise _fail(name, f"expected {py_type.__name__}, got {type(value).__name__} {shown(value)}")
    if py_type is float and not math.isfinite(value):
        raise _fail(name, f"must be a finite number, got {shown(value)}")
    if py_type is int and bound is not None:
        problem = bound.problem(value, limits)
        if problem is not None:
            raise _fail(name, problem)
    return value


@dataclass(frozen=True)
class KVCompressConfig:
    """How a request's KV cache is compressed."""

    policy: str = "none"
    # Overrides of the policy's budget allocation, trigger, selection
    # modifier and merge stage (None: the policy's own).
    allocation: str | None = None
    trigger: str | None = None
    selection: str | None = None
    merge: str | None = None
    # Tokens kept per (layer, KV head) on average, protected ones included.
    budget: int | None = None
    # kvpress convention: the fraction removed (0.75 keeps 25% of the prompt).
    compression_ratio: float | None = None
    # Rolling triggers evict again once the cache has grown by this many tokens
    # past the budget; None means one KV block (each eviction frees a block).
    interval: int | None = None
    # Leading prompt tokens never evicted (a shared system prompt or
    # document): their blocks stay whole and shared through the prefix
    # cache, and the budget counts the tokens after them. An engine's value
    # protects at most a request's whole prompt; a request's own may not
    # exceed its prompt (checked where the prompt is known).
    protect_prefix: int | None = None
    # Engine setting: KV cache groups the layers are split into (contiguous
    # tiers of equal size), each with its own block table, so layers with
    # different budgets free their own blocks. None: one group.
    layer_groups: int | None = None
    # Engine setting: growth-aware admission (scheduler `_admits`) reserves
    # this many tokens of each compressed request's future growth (None: up
    # to its max_tokens; 0: off, vLLM's admission on the compressed prompt).
    reserve_growth: int | None = None
    # A finished request's compressed state stays in the prefix cache, and a
    # later request whose prompt begins with its prompt and outputs (the next
    # turn of a conversation, another question on a document) with the same
    # settings starts from it instead of computing them again
    # (vllm_seam/saved_states.py). Needs prefix caching. None: off.
    reuse: bool | None = None
    # The components' own parameters, validated against their dataclass fields.
    params: Mapping[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------ building

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, limits: EngineLimits | None = None) -> KVCompressConfig:
        """Validate a flat mapping; raise KVCompressConfigError on any mistake.

        `limits`: the engine's, when known (startup checks, requests): every
        integer is then checked against its range on that engine
        (`limits.py`); without, against the absolute bound."""
        data = dict(data or {})
        policy = data.pop("policy", "none")
        if policy is None:
            policy = "none"
        if not isinstance(policy, str) or policy not in POLICIES:
            raise _fail("policy", f"unknown policy {shown(policy)}; valid policies: {sorted(POLICIES)}")
        common: dict[str, Any] = {}
        for name, expected in _OPTIONAL_FIELDS.items():
            value = data.pop(name, None)
            common[name] = None if value is None else _check_type(name, value, expected, _BOUNDS.get(name), limits)
            if name in _CHOICES and common[name] is not None and common[name] not in _CHOICES[name]:
                raise _fail(name, f"unknown {name} {shown(common[name])}; valid values: {sorted(_CHOICES[name])}")
        if common["trigger"] is None and data.get("prompt_chunk") is not None:
            # Shorthand: a prompt chunk streams the prompt; 0 means "do not stream".
            if data["prompt_chunk"] == 0:
                del data["prompt_chunk"]
            else:
                common["trigger"] = "streamed"
        if policy == "none":
            for name in COMPONENT_FIELDS:
                if common[name] is not None:
                    raise _fail(name, "needs a policy other than 'none'")
        params = composition_params(policy, *(common[name] for name in COMPONENT_FIELDS))
        unknown = sorted((k for k in data if k not in params), key=str)
        if unknown:
            raise _fail(
                field_name(unknown[0]),
                f"unknown field for policy {policy!r}"
                f"{_describe({name: common[name] for name in COMPONENT_FIELDS})}; valid fields: "
                f"{list(COMMON_FIELDS) + sorted(params)}",
            )
        typed = {k: _check_type(k, v, params[k].type, field_bound(params[k].metadata), limits)
                 for k, v in data.items() if v is not None}
        config = cls(policy=policy, params=typed, **common)
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, path: str | Path) -> KVCompressConfig:
        """A recipe: a YAML mapping (optionally under `kv_compress:`) that names its policy."""
        import yaml

        text = _read_recipe(path)
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            problem = " ".join(str(e).split())
            raise _fail("config", f"the recipe {str(path)!r} is not valid YAML: {problem}") from None
        # Recipes may nest everything under `kv_compress:`.
        if isinstance(data, Mapping) and set(data) == {CONFIG_KEY}:
            data = data[CONFIG_KEY]
        if data is None:
            raise _recipe_error(path, "is empty: a recipe names its policy (policy: none serves without "
                                      "compression)")
        if not isinstance(data, Mapping):
            raise _recipe_error(path, "is not a YAML mapping of settings (e.g. policy: snapkv)")
        if data.get("policy") is None:
            raise _recipe_error(path, "names no policy: a recipe names its policy (policy: none serves without "
                                      "compression)")
        # A file a recipe names is relative to the recipe.
        data = {k: str(Path(path).parent / v) if k in PATH_PARAMS and isinstance(v, str)
                and v and not Path(v).is_absolute() else v for k, v in data.items()}
        return cls.from_dict(data)

    def merged(self, overrides: Mapping[str, Any], startup: bool = False,
               limits: EngineLimits | None = None) -> KVCompressConfig:
        """This config with `overrides` applied (e.g. a request's extra_args).

        Switching policy drops the old policy's parameters and component
        overrides (switching to `none` drops everything); switching allocation
        or trigger drops inherited parameters the new composition does not
        have; giving `budget` drops an inherited `compression_ratio` and vice
        versa. Engine fields, and engine parameters (a retrieval `profile`)
        where the new composition has them, carry over, and only `startup`
        overrides (CLI flags over a recipe) may change them.
        """
        overrides = dict(overrides)
        engine = {name: getattr(self, name) for name in ENGINE_FIELDS if getattr(self, name) is not None}
        for name in ENGINE_FIELDS:
            if overrides.get(name) is not None:  # a value out of its range says so first
                _check_type(name, overrides[name], _OPTIONAL_FIELDS[name], _BOUNDS.get(name), limits)
            # Not given means 1 group: a request may restate the engine's value.
            current = (getattr(self, name) or 1) if name == "layer_groups" else getattr(self, name)
            if name in overrides and overrides[name] != current:
                if not startup:
                    raise _fail(name, "an engine setting, fixed at startup; a request cannot change it")
                engine[name] = overrides[name]
        for name in ENGINE_PARAMS:
            if not startup and name in overrides and overrides[name] != self.params.get(name):
                raise _fail(name, "an engine setting, fixed at startup; a request cannot change it")
        base = self.to_dict()
        policy = overrides.get("policy", self.policy)
        if policy is None or policy == "none":
            base = {}  # off: nothing to inherit
        elif policy != self.policy:
            base = {k: base[k] for k in ("budget", "compression_ratio", "interval", "protect_prefix") if k in base}
        elif any(k in overrides for k in COMPONENT_FIELDS):
            names = []
            for name in COMPONENT_FIELDS:
                value = overrides.get(name, getattr(self, name))
                names.append(value if _is_name_in(value, _CHOICES[name]) else None)
            kept = composition_params(policy, *names)
            base = {k: v for k, v in base.items() if k in COMMON_FIELDS or k in kept}
        if "budget" in overrides:
            base.pop("compression_ratio", None)
        if "compression_ratio" in overrides:
            base.pop("budget", None)
        out = {**base, **overrides, **engine}
        # The engine's own component parameters (a profile file) carry over to
        # whichever composition a request picks, where it has them.
        fixed = {name: self.params[name] for name in ENGINE_PARAMS if name in self.params}
        if fixed and _is_name_in(out.get("policy"), POLICIES):
            names = [out.get(c) if _is_name_in(out.get(c), _CHOICES[c]) else None for c in COMPONENT_FIELDS]
            fields = composition_params(out["policy"], *names)
            out.update({name: value for name, value in fixed.items() if name in fields and name not in out})
        return KVCompressConfig.from_dict(out, limits)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy}
        for name in _OPTIONAL_FIELDS:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out.update(self.params)
        return out

    # ------------------------------------------------------------ checking

    def validate(self) -> None:
        parts = self.components()  # runs the components' own field checks
        if self.interval is not None and self.interval < 1:
            raise _fail("interval", f"must be >= 1 token, got {self.interval}")
        if self.layer_groups is not None and self.layer_groups < 1:
            raise _fail("layer_groups", f"must be >= 1, got {self.layer_groups}")
        if self.compression_ratio is not None and not 0.0 <= self.compression_ratio < 1.0:
            raise _fail("compression_ratio", f"must be in [0, 1), got {self.compression_ratio}")
        if self.budget is not None and self.budget < 1:
            raise _fail("budget", f"must be >= 1 token, got {self.budget}")
        if self.reserve_growth is not None and self.reserve_growth < 0:
            raise _fail("reserve_growth", f"must be >= 0 tokens, got {self.reserve_growth}")
        if self.protect_prefix is not None and self.protect_prefix < 0:
            raise _fail("protect_prefix", f"must be >= 0 tokens, got {self.protect_prefix}")
        if parts is None:
            if self.budget is not None or self.compression_ratio is not None or self.protect_prefix:
                raise _fail("policy", "a budget, compression_ratio or protect_prefix needs a policy other than "
                                      "'none'")
            return
        # Each part states what it cannot serve beside the others.
        for part in (parts.scorer, parts.trigger, parts.allocation, parts.merge, parts.selection):
            problem = part.incompatible_with(parts, self)
            if problem is not None:
                raise _fail(problem.field, problem.reason)
        if self.reuse and parts.merge.name != "none":
            raise _fail("reuse", f"a state whose layers were merged (merge {parts.merge.name!r}) cannot be "
                                 f"continued; valid with it: merge 'none'")

    # ------------------------------------------------------------ using

    @property
    def enabled(self) -> bool:
        return self.policy != "none"

    @property
    def num_layer_groups(self) -> int:
        return self.layer_groups or 1

    def components(self) -> Components | None:
        """The scorer, allocation and trigger with their parameters (None: compression off)."""
        classes = component_classes(self.policy, self.allocation, self.trigger, self.selection, self.merge)
        if not classes:
            return None
        params = {**POLICIES[self.policy].defaults, **self.params}
        try:
            parts = []
            for cls in classes:
                names = {f.name for f in dataclasses.fields(cls)}
                part = cls(**{k: v for k, v in params.items() if k in names})
                part.validate()
                parts.append(part)
        except ValueError as e:  # the component names its own field: "window must be ..."
            name, _, problem = str(e).partition(" ")
            raise _fail(name, problem) from None
        return Components(*parts)

    def resolve_budget(self, prompt_len: int, min_budget: int) -> int:
        """Tokens kept for a request with `prompt_len` prompt tokens."""
        if self.budget is not None:
            return self.budget
        if self.compression_ratio is None:  # a scorer that evicts nothing
            return max(prompt_len, min_budget)
        removed = math.floor(prompt_len * self.compression_ratio)
        return max(prompt_len - removed, min_budget)


# A recipe is a few hundred bytes; a larger file is not one (a checkpoint, a
# log), and is neither read whole into memory nor parsed (PyYAML is pure
# Python: seconds per MB). The retrieval profiles a recipe names have the same bound.
MAX_RECIPE_BYTES = 1 << 20

_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _recipe_error(path: str | Path, problem: str) -> KVCompressConfigError:
    return _fail("config", f"the recipe {str(path)!r} (--kv-compress-config) {problem}")


def _read_recipe(path: str | Path) -> str:
    """A recipe's text: a regular file of at most MAX_RECIPE_BYTES of UTF-8.

    What the path is, is checked before it is opened (opening a FIFO waits
    for a writer; a device reads forever), and again on the opened file,
    which is opened without waiting, in case the path changed in between.
    """
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _FILE_KINDS if test(mode)), "a special file")
            raise _recipe_error(path, f"is {kind}, not a regular file")
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise _recipe_error(path, "is not a regular file")
            data = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as e:
        raise _fail("config", f"cannot read the recipe {str(path)!r} (--kv-compress-config): "
                              f"{e.strerror or e}") from None
    if len(data) > MAX_RECIPE_BYTES:
        raise _recipe_error(path, f"is larger than {MAX_RECIPE_BYTES} bytes (1 MiB): not a recipe")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _recipe_error(path, f"is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _is_name_in(value: Any, registry: Mapping[str, Any]) -> bool:
    return isinstance(value, str) and value in registry


def field_name(key: Any) -> str:
    """A key as the error names it: plain if it could be a field, quoted (and cut) otherwise."""
    plain = isinstance(key, str) and key.isascii() and key.isidentifier() and len(key) <= MAX_SHOWN
    return key if plain else shown(key)


def _describe(components: Mapping[str, str | None]) -> str:
    given = [f"{k} {v!r}" for k, v in components.items() if v is not None]
    return f" with {', '.join(given)}" if given else ""


def request_overrides(extra_args: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A request's kv_compress overrides from `SamplingParams.extra_args`.

    Accepts `{"kv_compress": {...}}` (Python), `{"kv_compress": "snapkv"}` (a
    policy name) and flat `kv_compress_<field>` keys, which is what the
    OpenAI server's `vllm_xargs` can carry (no nested objects):
    `{"kv_compress": "h2o", "kv_compress_budget": 256}`.
    """
    if not extra_args:
        return None
    out: dict[str, Any] = {}
    nested = extra_args.get(CONFIG_KEY)
    if isinstance(nested, str):
        out["policy"] = nested
    elif isinstance(nested, Mapping):
        out.update(nested)
    elif nested is not None:
        raise _fail("policy", f"expected a policy name or an object, got {type(nested).__name__} {shown(nested)}")
    prefix = CONFIG_KEY + "_"
    for key, value in extra_args.items():
        if not isinstance(key, str) or key == CONFIG_KEY or not looks_like_ours(key):
            continue  # another plugin's argument
        name = key[len(prefix):] if key.startswith(prefix) else ""
        if not name.isidentifier():
            # A near miss ("kv_compress.budget", "kv-compress-budget") would
            # otherwise be ignored, and the request would run with settings
            # its client did not ask for.
            raise _fail(field_name(key), f"unknown per-request key; valid keys: {CONFIG_KEY!r} (a policy name, "
                                          f"or an object of fields) and flat '{prefix}<field>' keys, e.g. "
                                          f"'{prefix}budget'")
        name = FIELD_ALIASES.get(name, name)
        if name in out:
            raise _fail(field_name(name), f"given twice (as {shown(key)} and inside {CONFIG_KEY!r})")
        out[name] = value
    return out or None


# Keys that look like this plugin's, whatever their case and separators.
_LOOKS_OURS = re.compile(r"kv\W*_*\W*compress", re.IGNORECASE)


def looks_like_ours(key: str) -> bool:
    """Whether a request's extra-argument key is meant for this plugin."""
    return bool(_LOOKS_OURS.match(key))
