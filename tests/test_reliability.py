"""No request can take the server down.

Against one real `vllm serve` (the tiny model, `--kv-compress none`, so every
request picks its own compression, as any client of a shared server can):
every integer a request sets is bounded by the engine (400 naming the field
and its range), JSON booleans are not numbers, near-miss keys are refused,
random settings (valid, extreme and invalid) are served or refused by name
with the engine alive and its pool whole after each, and a compression that
raises inside one request's compaction (the worker's test hook) fails that
request alone while the others finish with their reference tokens.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import random_prompts
from server_utils import Server
from vllm_kvcompress.budgets import ALLOCATIONS
from vllm_kvcompress.config import KVCompressConfig, KVCompressConfigError, request_overrides
from vllm_kvcompress.limits import ABSOLUTE_MAX, EngineLimits
from vllm_kvcompress.merge import MERGES
from vllm_kvcompress.scorers import SCORERS
from vllm_kvcompress.selection import SELECTIONS
from vllm_kvcompress.triggers import TRIGGERS
from vllm_kvcompress.vllm_seam.request_checks import boolean_setting, wrap_openai_handler
from vllm_kvcompress.vllm_seam.worker import FAULT_ENV

TIMEOUT = 120
MAX_MODEL_LEN = 1024  # server_utils.Server's
FAULTY_PROMPT_LEN = 333  # the worker's test hook fails this prompt length's compaction
HUGE = (2**63 - 1, 2**64 - 1, 10**11, True)

# Each integer field a request can set, with a request that reaches it.
SIZE_FIELDS = {
    "budget": {"kv_compress": "h2o"},
    "interval": {"kv_compress": "h2o", "kv_compress_budget": 64},
    "span": {"kv_compress": "snapkv-span", "kv_compress_budget": 64},
    "decode_window": {"kv_compress": "snapkv-span-window", "kv_compress_budget": 64},
    "sink_tokens": {"kv_compress": "streamingllm", "kv_compress_budget": 64},
    "chunk_length": {"kv_compress": "snapkv", "kv_compress_selection": "chunk", "kv_compress_budget": 64},
    "window": {"kv_compress": "snapkv", "kv_compress_budget": 64},
    "kernel_size": {"kv_compress": "snapkv", "kv_compress_budget": 64},
    "kept_window": {"kv_compress": "snapkv", "kv_compress_budget": 64},
    "prompt_chunk": {"kv_compress": "streamingllm", "kv_compress_budget": 64},
    "seed": {"kv_compress": "random", "kv_compress_budget": 64},
    "future_positions": {"kv_compress": "expected_attention", "kv_compress_budget": 64},
    "chunk_size": {"kv_compress": "kvzip", "kv_compress_budget": 64},
    "overlap": {"kv_compress": "kvzip", "kv_compress_budget": 64},
    "beta": {"kv_compress": "pyramidkv", "kv_compress_budget": 64},
    "floor": {"kv_compress": "adaptive", "kv_compress_budget": 64},
    "start_layer": {"kv_compress": "minicache"},
    "layer_groups": {"kv_compress": "h2o", "kv_compress_budget": 64},
    "protect_prefix": {"kv_compress": "h2o", "kv_compress_budget": 64},
}


def test_every_integer_field_is_bounded():
    """A new component's integer parameter without a range fails here."""
    for registry in (SCORERS, ALLOCATIONS, TRIGGERS, SELECTIONS, MERGES):
        for cls in registry.values():
            for f in dataclasses.fields(cls):
                if f.type in (int, "int"):
                    assert "bounds" in f.metadata, f"{cls.__name__}.{f.name} declares no range (limits.bounded)"
                    assert f.name in SIZE_FIELDS, f"{f.name}: add it to this module's SIZE_FIELDS"


@pytest.mark.parametrize("value", HUGE + (-(2**63),))
@pytest.mark.parametrize("field", sorted(SIZE_FIELDS))
def test_out_of_range_values_name_the_field_and_the_engine_range(field, value):
    request = {**SIZE_FIELDS[field], f"kv_compress_{field}": value}
    limits = EngineLimits(max_model_len=MAX_MODEL_LEN, num_layers=4)
    with pytest.raises(KVCompressConfigError) as e:
        KVCompressConfig.from_dict({"policy": "none"}).merged(request_overrides(request), limits=limits)
    message = str(e.value)
    assert message.startswith(f"kv_compress.{field}: "), message
    if value is not True:
        assert "out of range; valid values: " in message and len(message) < 200, message


def test_near_miss_keys_are_refused():
    for key in ("kv_compress.budget", "kv-compress-budget", "KV_COMPRESS_BUDGET", "kvcompress_budget", "kv_compress_"):
        with pytest.raises(KVCompressConfigError, match="unknown per-request key"):
            request_overrides({"kv_compress": "h2o", key: 64})
    with pytest.raises(KVCompressConfigError, match="given twice"):
        request_overrides({"kv_compress": {"policy": "h2o", "budget": 64}, "kv_compress_budget": 32})
    assert request_overrides({"other_plugin": 1}) is None


def _flags(field: str, value: str) -> list[str]:
    """The startup flags of SIZE_FIELDS[field]'s request, with `field` at `value`."""
    flags = []
    for key, v in {**SIZE_FIELDS[field], f"kv_compress_{field}": value}.items():
        flags += ["--" + key.replace("_", "-"), str(v)]
    return flags


@pytest.mark.parametrize("value", [str(v).lower() for v in HUGE])
@pytest.mark.parametrize("field", sorted(SIZE_FIELDS))
def test_startup_flags_out_of_range_exit_2_with_one_line(field, value, capsys):
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    with pytest.raises(SystemExit) as e:
        make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *_flags(field, value)])
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1, errors
    name = f"--kv-compress-{field.replace('_', '-')}" if value == "true" else f"kv_compress.{field}: "
    assert name in errors[0], errors


def test_a_startup_value_above_the_engine_range_is_refused_naming_it(tiny_model):
    """In range for the parser (below 2**31), out of range for this engine: refused when it is created."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_kvcompress  # noqa: F401  (keyword support)

    args = EngineArgs(model=tiny_model, max_model_len=MAX_MODEL_LEN, kv_compress="h2o", kv_compress_budget=64,
                      kv_compress_interval=5000)
    with pytest.raises(KVCompressConfigError, match=r"kv_compress.interval: 5000 is out of range; valid values: "
                                                    r"1 .. 1024 \(max_model_len\)"):
        args.create_engine_config()


def test_json_booleans_are_found_in_the_raw_body():
    assert "kv_compress.span: " in boolean_setting(b'{"vllm_xargs": {"kv_compress_span": true}}')
    assert "kv_compress.compression_ratio" in boolean_setting(b'{"vllm_xargs": {"kv_compress_ratio": [false]}}')
    assert boolean_setting(b'{"vllm_xargs": {"kv_compress_span": 1, "other": true}}') is None
    assert boolean_setting(b"not json") is None


def test_echoed_values_are_cut():
    """One helper (limits.shown) formats every value a message echoes: short
    values as they are, long ones cut to MAX_SHOWN characters with their length."""
    from vllm_kvcompress.config import field_name
    from vllm_kvcompress.limits import MAX_SHOWN, shown

    assert (shown(64), shown("snapkv"), shown(True), shown(0.5)) == ("64", "'snapkv'", "True", "0.5")
    assert shown(10**40) == "100000000000... (41 digits)"
    assert shown("x" * 10**6) == repr("x" * MAX_SHOWN) + "... (1000000 characters)"
    nested: list = []
    for _ in range(40):
        nested = [nested, nested, "y" * 10**5]  # formatted whole, 2**40 lists
    for value in (nested, ["z" * 10**6] * 1000, {"k" * 10**6: "v" * 10**6}, -(10**5000 // 10**4000)):
        assert len(shown(value)) < 4 * MAX_SHOWN
    assert field_name("budget") == "budget" and len(field_name("b" * 10**6)) < 2 * MAX_SHOWN
    with pytest.raises(KVCompressConfigError) as e:
        KVCompressConfig.from_dict({"policy": "p" * 10**6})
    assert len(str(e.value)) < 2048 and "(1000000 characters)" in str(e.value)


def _xargs_routes() -> dict[str, tuple[type, str]]:
    """The routes of vLLM's OpenAI-compatible server (built as `vllm serve` builds
    it, every task and scale-out on) whose request model carries `vllm_xargs` (a
    field, or an extra field copied into a model that has one: batched chat) ->
    the serving class and method the route calls. SageMaker's /invocations
    dispatches to these routes' functions."""
    import importlib
    import pkgutil
    import typing

    from fastapi.routing import APIRoute
    from pydantic import BaseModel
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.tasks import SupportedTask
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def has_field(model: Any) -> bool:
        return isinstance(model, type) and issubclass(model, BaseModel) and "vllm_xargs" in model.model_fields

    def carries(model: Any) -> bool:
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return False
        returns = []
        for _, method in inspect.getmembers(model, inspect.isfunction):
            try:
                returns.append(typing.get_type_hints(method).get("return"))
            except Exception:  # noqa: BLE001 - an annotation this test cannot resolve
                continue
        return has_field(model) or any(has_field(r) for r in returns)

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", "--enable-scale-out"])
    app = build_app(args, tuple(t for t in typing.get_args(SupportedTask) if t != "render"))
    routes = {}
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        hints = typing.get_type_hints(route.endpoint, include_extras=True)
        models = [typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t for t in hints.values()]
        if not any(carries(m) for m in models):
            continue
        (method,) = set(re.findall(r"handler\.(\w+)\(", inspect.getsource(route.endpoint)))
        package = route.endpoint.__module__.rsplit(".", 1)[0]
        owners = set()
        for sub in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
            if "serving" in sub.name:
                owners |= {cls for _, cls in inspect.getmembers(importlib.import_module(sub.name), inspect.isclass)
                           if method in cls.__dict__}
        (owner,) = owners
        routes[route.path] = (owner, method)
    return routes


# Routes that take vllm_xargs but whose handler the plugin cannot check, and why.
UNCHECKED = {
    "/v1/responses/render": "vLLM calls its handler without the raw request (render returns sampling params and "
                            "runs no engine; scale-out only)",
}


def test_every_route_that_takes_vllm_xargs_checks_them():
    """Each of vLLM's routes whose request carries vllm_xargs calls a handler
    that the seam wraps with the boolean and near-miss check, for the installed
    vLLM; a new route (or a handler moved) fails here until the seam has its row."""
    from vllm_kvcompress.vllm_seam.patches import PATCHES
    from vllm_kvcompress.vllm_seam.versions import installed_vllm_version, minor_of

    minor = minor_of(installed_vllm_version())
    wrapped = {(p.module, p.owner, p.attr) for p in PATCHES
               if p.make == "request_checks.wrap_openai_handler" and p.applies_to(minor)}
    routes = _xargs_routes()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"} <= set(routes), routes
    missing = []
    for path, (owner, method) in sorted(routes.items()):
        params = inspect.signature(getattr(owner, method)).parameters
        covered = (owner.__module__, owner.__name__, method) in wrapped and {"request", "raw_request"} <= set(params)
        if covered == (path in UNCHECKED):
            missing.append(f"{path}: {owner.__module__}.{owner.__name__}.{method}")
    assert not missing, f"routes taking vllm_xargs without the seam's check (or listed as unchecked): {missing}"


class _Serving:
    """A handler's owner: the wrapper answers through its `create_error_response`."""

    @staticmethod
    def create_error_response(message, param=None):
        return ("error", message, param)

    async def handle(self, audio_data, request, raw_request=None):
        return "served"


def _form_request(xargs: str):
    from starlette.requests import Request

    boundary = "b0undary"
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="vllm_xargs"\r\n\r\n{xargs}\r\n'
            f"--{boundary}--\r\n").encode()
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(True)
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/audio/transcriptions", "query_string": b"",
             "headers": [(b"content-type", f"multipart/form-data; boundary={boundary}".encode())]}
    return Request(scope, receive)


@pytest.mark.parametrize("xargs, parsed, expected", [
    ('{"kv_compress": "h2o", "kv_compress_budget": true}', {"kv_compress": "h2o", "kv_compress_budget": 1},
     "kv_compress.budget: expected a number or a name, got the JSON boolean true"),
    ('{"kv_compress": "h2o", "kv-compress-budget": 64}', {"kv_compress": "h2o", "kv-compress-budget": 64},
     "kv_compress.'kv-compress-budget': unknown per-request key"),
    ('{"kv_compress": "h2o", "kv_compress_budget": 64}', {"kv_compress": "h2o", "kv_compress_budget": 64}, None),
    ('{"other": true}', {"other": 1}, None),
])
def test_the_audio_endpoints_read_vllm_xargs_from_the_form(xargs, parsed, expected):
    """Transcriptions and translations take vllm_xargs as a JSON form field
    (no audio model here to serve them): the same check reads it."""
    import asyncio

    handle = wrap_openai_handler(_Serving.handle)
    request = SimpleNamespace(vllm_xargs=parsed)  # as vLLM's protocol parsed it
    result = asyncio.run(handle(_Serving(), b"audio", request, _form_request(xargs)))
    if expected is None:
        assert result == "served"
    else:
        assert result[0] == "error" and result[1].startswith(expected) and result[2] == "kv_compress", result


# ---------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # Scale-out on: its render endpoints take vllm_xargs too.
    srv = Server(tiny_model, "--kv-compress", "none", "--max-num-seqs", "8", "--enable-prompt-tokens-details",
                 "--enable-scale-out", log=tmp_path_factory.mktemp("serve") / "serve.log",
                 env={FAULT_ENV: str(FAULTY_PROMPT_LEN)})
    yield srv
    srv.stop()


def complete(server, prompt, xargs=None, max_tokens=8, **kw):
    body = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return requests.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)


def metrics(server) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(server.url + "/metrics", timeout=TIMEOUT).text
    return {s.name + "".join(f"{{{v}}}" for v in s.labels.values()): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name.startswith("vllm:kv_compress")}


def pool(server) -> tuple[float, float]:
    """(free, total) blocks from /metrics (written when the engine goes idle)."""
    values = metrics(server)
    return values["vllm:kv_compress_free_blocks"], values["vllm:kv_compress_total_blocks"]


def assert_alive_and_whole(server):
    ok = complete(server, [7, 8, 9])
    assert ok.status_code == 200, ok.text
    free, total = pool(server)
    assert free == total > 0


def test_the_engine_killing_interval_is_a_400(server):
    """The issue's request: interval 10**11 once asked for a 1.6 TB buffer and killed the engine."""
    bad = complete(server, [5, 6, 7] * 40, {"kv_compress": "h2o", "kv_compress_budget": 64,
                                            "kv_compress_interval": 100000000000})
    assert bad.status_code == 400, bad.text
    message = bad.json()["error"]["message"]
    assert "kv_compress.interval: 100000000000 is out of range; valid values: 1 .. 1024 (max_model_len)" in message
    assert_alive_and_whole(server)


@pytest.mark.parametrize("field", sorted(SIZE_FIELDS))
def test_every_size_field_at_huge_values_and_true_is_a_400(server, field):
    for value in HUGE:
        bad = complete(server, [5, 6, 7], {**SIZE_FIELDS[field], f"kv_compress_{field}": value})
        assert bad.status_code == 400, (value, bad.text)
        message = bad.json()["error"]["message"]
        assert f"kv_compress.{field}: " in message, (value, message)
        expected = "JSON boolean true" if value is True else "is out of range; valid values: "
        assert expected in message, (value, message)
    assert complete(server, [5, 6, 7]).status_code == 200


def test_dotted_and_misspelt_keys_are_a_400(server):
    for key in ("kv_compress.budget", "kv-compress-budget"):
        bad = complete(server, [5, 6, 7], {"kv_compress": "h2o", key: 64})
        assert bad.status_code == 400, bad.text
        assert "unknown per-request key" in bad.json()["error"]["message"]


MESSAGES = [{"role": "user", "content": "tell me a story"}]
# Every route that takes vllm_xargs and runs on this server, with a body for it
# (the audio routes need an audio model: test_the_audio_endpoints_read_vllm_xargs_from_the_form).
ENDPOINTS = {
    "/v1/completions": {"prompt": [5, 6, 7], "max_tokens": 4},
    "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/chat/completions/batch": {"messages": [MESSAGES, MESSAGES], "max_tokens": 4},
    "/v1/responses": {"input": "tell me a story", "max_output_tokens": 4},
    "/v1/messages": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/completions/render": {"prompt": [5, 6, 7], "max_tokens": 4},
    "/v1/chat/completions/render": {"messages": MESSAGES, "max_tokens": 4},
    "/v1/messages/render": {"messages": MESSAGES, "max_tokens": 4},
}
STREAMS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
GOOD = {"kv_compress": "snapkv-span", "kv_compress_ratio": 0.75, "kv_compress_protect_prefix": 1}


def post(server, path, xargs, **kw):
    body = {"model": server.model, **ENDPOINTS[path], "vllm_xargs": xargs, **kw}
    return requests.post(server.url + path, json=body, timeout=TIMEOUT)


def error_message(response) -> str:
    """The message of a 400 body: OpenAI's shape, or Anthropic's on /v1/messages."""
    assert response.status_code == 400, response.text
    body = response.json()
    if body.get("type") == "error":  # {"type": "error", "error": {"type": ..., "message": ...}}
        assert body["error"]["type"] == "BadRequestError", body
    else:
        assert body["error"]["code"] == 400 and body["error"]["param"] == "kv_compress", body
    return body["error"]["message"]


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_endpoint_refuses_booleans_and_near_misses_alike(server, path):
    """The issue's /v1/responses bodies, on every endpoint that takes vllm_xargs:
    a JSON boolean is a 400 naming the field (never 1), streamed or not, and so is a near-miss key."""
    assert post(server, path, GOOD).status_code == 200
    for field, value in (("protect_prefix", True), ("budget", True), ("ratio", [False])):
        xargs = {**GOOD, f"kv_compress_{field}": value}
        expected = f"kv_compress.{'compression_ratio' if field == 'ratio' else field}: expected a number or a name, " \
                   f"got the JSON boolean {'false in a list' if field == 'ratio' else 'true'}"
        assert expected in error_message(post(server, path, xargs)), (path, field)
        if path in STREAMS:
            assert expected in error_message(post(server, path, xargs, stream=True)), (path, field)
    for key in ("kv-compress-budget", "kv_compress.budget"):
        message = error_message(post(server, path, {"kv_compress": "h2o", key: 64}))
        assert f"kv_compress.{key!r}: unknown per-request key" in message, (path, message)
    assert_alive_and_whole(server)


def test_generate_takes_extra_args_as_json_and_refuses_a_boolean(server):
    """/inference/v1/generate (scale-out) takes what render returns, with
    `extra_args` as JSON: a boolean stays one, and the engine's check refuses it."""
    rendered = post(server, "/v1/completions/render", {"kv_compress": "h2o", "kv_compress_budget": 64})
    assert rendered.status_code == 200, rendered.text
    (body,) = rendered.json()
    assert body["sampling_params"]["extra_args"]["kv_compress_budget"] == 64
    ok = requests.post(server.url + "/inference/v1/generate", json=body, timeout=TIMEOUT)
    assert ok.status_code == 200, ok.text
    body["sampling_params"]["extra_args"]["kv_compress_budget"] = True
    bad = requests.post(server.url + "/inference/v1/generate", json=body, timeout=TIMEOUT)
    assert "kv_compress.budget: expected int, got bool True" in error_message(bad)


MB = 10**6
# A 1 MB value in every place a message echoes one: the policy, a field's
# value, a component's choice, a key (unknown, near-miss, given twice, a
# boolean's), a nested value.
HUGE_XARGS = {
    "policy": {"kv_compress": "p" * MB},
    "value": {"kv_compress": "h2o", "kv_compress_budget": "9" * MB},
    "choice": {"kv_compress": "snapkv", "kv_compress_budget": 64, "kv_compress_pooling": "q" * MB},
    "component": {"kv_compress": "h2o", "kv_compress_budget": 64, "kv_compress_trigger": "t" * MB},
    "unknown key": {"kv_compress": "h2o", "kv_compress_budget": 64, "kv_compress_" + "f" * MB: 1},
    "near-miss key": {"kv_compress": "h2o", "kv-compress-" + "n" * MB: 1},
    "boolean key": {"kv_compress": "h2o", "kv_compress_" + "b" * MB: True},
    "list": {"kv_compress": "h2o", "kv_compress_budget": ["l" * MB] * 2},
}


@pytest.mark.parametrize("what", sorted(HUGE_XARGS))
def test_a_1mb_bad_value_gets_a_short_error_body(server, what):
    for path in ("/v1/completions", "/v1/responses", "/v1/messages"):
        response = post(server, path, HUGE_XARGS[what])
        assert response.status_code == 400 and len(response.content) < 2048, (path, len(response.content))
        assert error_message(response).startswith("kv_compress."), (path, response.text)


def _settings():
    """Per-request settings, valid and invalid, extreme valid values included."""
    sizes = st.sampled_from([0, 1, 2, 3, 7, 16, 33, 64, 511, 1023, MAX_MODEL_LEN, MAX_MODEL_LEN + 1, ABSOLUTE_MAX,
                             2**63 - 1, -1, -(2**31), True, "12", 0.5])
    fractions = st.sampled_from([0.0, 1e-300, 0.25, 0.5, 0.875, 0.999999, 1.0, -0.5, 2.0, 1e300, True])
    fields = st.fixed_dictionaries({}, optional={
        "kv_compress_budget": sizes, "kv_compress_ratio": fractions, "kv_compress_interval": sizes,
        "kv_compress_window": sizes, "kv_compress_kernel_size": sizes, "kv_compress_span": sizes,
        "kv_compress_sink_tokens": sizes, "kv_compress_chunk_length": sizes, "kv_compress_seed": sizes,
        "kv_compress_prompt_chunk": sizes, "kv_compress_kept_window": sizes, "kv_compress_retain_ratio": fractions,
        "kv_compress_recent_ratio": fractions, "kv_compress_alpha": fractions,
        "kv_compress_trigger": st.sampled_from(["once", "rolling", "decode", "streamed", "bogus"]),
        "kv_compress_selection": st.sampled_from(["top", "span", "chunk"]),
        "kv_compress_allocation": st.sampled_from(["uniform", "per_head", "pyramid"]),
    })
    policy = st.sampled_from(["none", "snapkv", "snapkv-span", "h2o", "tova", "keyformer", "streamingllm", "window",
                              "random", "rkv", "adakv", "minicache", "wat"])
    return st.builds(lambda p, f: {"kv_compress": p, **f}, policy, fields)


NAMED = re.compile(r"kv_compress\.[\w']+: \S")


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(xargs=_settings(), length=st.integers(20, 300).filter(lambda n: n != FAULTY_PROMPT_LEN),
       max_tokens=st.integers(1, 40))
def test_random_settings_are_served_or_refused_by_name(server, xargs, length, max_tokens):
    (prompt,) = random_prompts((length,), seed=length)
    response = complete(server, prompt, xargs, max_tokens=max_tokens)
    if response.status_code == 200:
        assert response.json()["usage"]["completion_tokens"] == max_tokens
    else:
        assert response.status_code == 400, (xargs, response.text)
        assert NAMED.search(response.json()["error"]["message"]), (xargs, response.text)
    assert_alive_and_whole(server)


def test_a_failing_compaction_fails_that_request_only(server, tiny_model):
    """The worker's hook raises inside the compaction of the 333-token prompt,
    while two other compressed requests decode beside it: those two answer
    their reference tokens, the faulty one ends with an error, and the engine
    goes on serving with its pool whole."""
    from transformers import AutoTokenizer

    from kvc_tools.reference_decoder import ReferenceDecoder

    prompts = random_prompts((180, 240, FAULTY_PROMPT_LEN), seed=71)
    xargs = {"kv_compress": "h2o", "kv_compress_budget": 64}
    with ThreadPoolExecutor(3) as ex:
        healthy = [ex.submit(complete, server, p, xargs, max_tokens=48) for p in prompts[:2]]
        faulty = ex.submit(complete, server, prompts[2], xargs, max_tokens=48)
        results = [f.result() for f in healthy]
        failed = faulty.result()
    assert failed.status_code == 500, failed.text
    assert FAULT_ENV in server.output() and "finishes with an error, the others go on" in server.output()
    decoder = ReferenceDecoder(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    config = KVCompressConfig.from_dict({"policy": "h2o", "budget": 64})
    for prompt, response in zip(prompts, results):
        assert response.status_code == 200, response.text
        body = response.json()
        tokens = decoder.generate(prompt, 48, config)["tokens"]
        assert body["choices"][0]["text"] == tokenizer.decode(tokens, skip_special_tokens=True)
    assert_alive_and_whole(server)
    assert "EngineDeadError" not in server.output()


def test_counters_never_go_back_when_the_metrics_folder_becomes_a_file(server):
    (folder,) = set(re.findall(r"kv_compress: metrics snapshots in (\S+)", server.output()))
    folder = Path(folder)
    compressed = {"kv_compress": "h2o", "kv_compress_budget": 64}
    for prompt in random_prompts((200, 230), seed=73):
        assert complete(server, prompt, compressed, max_tokens=24).status_code == 200
    before = metrics(server)
    counters = [k for k in before if k.endswith("_total") or "_seconds_total" in k]
    assert before["vllm:kv_compress_tokens_evicted_total"] > 0 and counters
    shutil.rmtree(folder)
    folder.write_text("not a folder")  # the engine's writes fail now; /metrics cannot read any snapshot
    try:
        during = metrics(server)
        for prompt in random_prompts((210,), seed=74):  # the engine keeps serving
            assert complete(server, prompt, compressed, max_tokens=24).status_code == 200
        later = metrics(server)
        for key in counters:
            assert before[key] <= during[key] <= later[key], key
        assert math.isnan(during["vllm:kv_compress_free_blocks"]) and math.isnan(later["vllm:kv_compress_total_blocks"])
    finally:
        folder.unlink()
    for prompt in random_prompts((220,), seed=75):  # the writer recreates the folder
        assert complete(server, prompt, compressed, max_tokens=24).status_code == 200
    after = metrics(server)
    for key in counters:
        assert later[key] <= after[key], key
    assert after["vllm:kv_compress_tokens_evicted_total"] > before["vllm:kv_compress_tokens_evicted_total"]
    assert after["vllm:kv_compress_free_blocks"] == after["vllm:kv_compress_total_blocks"] > 0
