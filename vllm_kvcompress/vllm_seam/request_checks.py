"""Per-request settings checked where vLLM checks a request's inputs.

A bad `extra_args["kv_compress"]` (or `vllm_xargs`) fails that request, an
HTTP 400 or an exception from `LLM.generate` naming the field, never the
engine core that serves every other request.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any

from ..config import (
    BOOLEAN_FIELDS,
    CONFIG_KEY,
    FIELD_ALIASES,
    KVCompressConfig,
    KVCompressConfigError,
    field_name,
    looks_like_ours,
    request_overrides,
)
from .engine_checks import engine_limits, query_moments_problem, reuse_problem


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
            engine_config = KVCompressConfig.from_dict(engine)
            config = engine_config.merged(overrides, limits=limits)
            problem = query_moments_problem(self.vllm_config, engine_config, config)
            if problem is not None:
                raise KVCompressConfigError(problem)
            prompt_len = (len(request.prompt_token_ids) if request.prompt_token_ids is not None
                          else len(request.prompt_embeds))
            if config.reuse:
                problem = reuse_problem(self.vllm_config)
                if problem is not None:
                    raise KVCompressConfigError(f"{CONFIG_KEY}.reuse: {problem}")
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
        name = key.removeprefix(CONFIG_KEY + "_") if key != CONFIG_KEY else "policy"
        if looks_like_ours(key) and booleans and field_name(FIELD_ALIASES.get(name, name)) not in BOOLEAN_FIELDS:
            got = json.dumps(booleans[0]) + (" in a list" if isinstance(value, list) else "")
            return (f"{CONFIG_KEY}.{field_name(FIELD_ALIASES.get(name, name))}: expected a number or a name, got "
                    f"the JSON boolean {got}")
    return None
