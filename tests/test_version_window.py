"""The plugin never breaks vLLM: beside a vLLM version it does not serve it
stays out of the way (vLLM runs as without it) and refuses compression at
startup in one line; a seam row whose target is missing fails by name.

Other versions are faked in subprocesses (tests/fake_vllm_version: vLLM
reports $KVC_FAKE_VLLM_VERSION in every process it starts); 0.32 is installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from helpers import random_prompts
from server_utils import VLLM, Server

SCRIPT = Path(__file__).parent / "scripts" / "generate.py"
FAKE = Path(__file__).parent / "fake_vllm_version"
PROMPTS = random_prompts((120, 33), seed=7)
OUTSIDE = "0.35.0"  # a vLLM the plugin has no rows for
UNTESTED = "0.33.0"  # rows written from its sources, served only when opted in
# Run on every vLLM leg (scripts/test_vllm034.sh): the installed vLLM is 0.32 or 0.34.
pytestmark = pytest.mark.versions
# A vLLM module the seam imports (attention.py) that vLLM's CPU engine never does.
BROKEN = "vllm.v1.attention.backends.flash_attn"


def fake_env(version: str, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, (str(FAKE), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, "KVC_FAKE_VLLM_VERSION": version, **extra}


def generate(model: str, env: dict[str, str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), model, json.dumps(PROMPTS), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=300,
                          env={**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def tokens_of(out: subprocess.CompletedProcess) -> list[list[int]]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])["tokens"]


def serve_refusal(model: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([VLLM, "serve", model, "--dtype", "float32", "--kv-compress", "snapkv",
                           "--kv-compress-budget", "64"], capture_output=True, text=True, timeout=240, env=env)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    """Every process this module checks, started at once (each imports vLLM)."""
    log = tmp_path_factory.mktemp("version-window") / "serve.log"
    with ThreadPoolExecutor(6) as pool:
        jobs = {
            "without_plugin": pool.submit(generate, tiny_model,
                                          {**os.environ, "VLLM_PLUGINS": "lora_filesystem_resolver"}),
            "outside": pool.submit(generate, tiny_model, fake_env(OUTSIDE)),
            "outside_llm_compress": pool.submit(generate, tiny_model, fake_env(OUTSIDE),
                                                additional_config={"kv_compress": {"policy": "snapkv",
                                                                                   "budget": 64}}),
            "outside_serve_compress": pool.submit(serve_refusal, tiny_model, fake_env(OUTSIDE)),
            "untested_serve_compress": pool.submit(serve_refusal, tiny_model, fake_env(UNTESTED)),
            # Opted in, but the rows of 0.33 do not match the installed vLLM
            # (0.32 has no kv_cache_planning module, 0.34 no V1 runner): refused by name.
            "mismatch_serve_compress": pool.submit(serve_refusal, tiny_model,
                                                   fake_env(UNTESTED, VLLM_KVCOMPRESS_ALLOW_UNTESTED_VLLM="1")),
            "outside_server": pool.submit(Server, tiny_model, log=log, env=fake_env(OUTSIDE)),
            # The installed 0.32, but a module the seam imports does not import.
            "broken_seam": pool.submit(generate, tiny_model, fake_env("", KVC_FAKE_VLLM_BROKEN=BROKEN)),
            "broken_seam_serve_compress": pool.submit(serve_refusal, tiny_model,
                                                      fake_env("", KVC_FAKE_VLLM_BROKEN=BROKEN)),
        }
        yield {name: job for name, job in jobs.items()}
        server = jobs["outside_server"]
        if server.exception() is None:
            server.result().stop()


@pytest.mark.extended  # nine processes importing vLLM: the extended run and the 0.34 leg
def test_outside_the_window_vllm_runs_as_without_the_plugin(runs):
    outside = runs["outside"].result()
    assert tokens_of(outside) == tokens_of(runs["without_plugin"].result())
    warnings = [ln for ln in outside.stdout.splitlines() + outside.stderr.splitlines()
                if "vllm-kvcompress is inactive" in ln]
    assert len(warnings) == 1 and OUTSIDE in warnings[0] and "0.32" in warnings[0], warnings


@pytest.mark.extended  # nine processes importing vLLM: the extended run and the 0.34 leg
def test_a_seam_that_does_not_import_leaves_vllm_untouched(runs):
    """Whatever fails while the seam installs (here a vLLM module it imports
    raises ImportError), vLLM runs exactly as without the plugin: the same
    tokens, no row installed, one warning naming the failure; asking for
    compression is then vLLM's own unknown-argument error (exit 2)."""
    out = runs["broken_seam"].result()
    assert tokens_of(out) == tokens_of(runs["without_plugin"].result())
    result = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert result["installed"] == 0
    warnings = [ln for ln in out.stdout.splitlines() + out.stderr.splitlines() if "vllm-kvcompress is inactive" in ln]
    assert len(warnings) == 1 and "nothing was installed" in warnings[0] and BROKEN in warnings[0], warnings
    serve = runs["broken_seam_serve_compress"].result()
    assert serve.returncode == 2, serve.stderr[-3000:]
    assert "unrecognized arguments: --kv-compress snapkv" in serve.stderr and "Traceback" not in serve.stderr


@pytest.mark.extended  # nine processes importing vLLM: the extended run and the 0.34 leg
def test_outside_the_window_a_server_serves_as_without_the_plugin(runs):
    server = runs["outside_server"].result()
    expected = tokens_of(runs["without_plugin"].result())
    for prompt, tokens in zip(PROMPTS, expected):
        r = requests.post(server.url + "/v1/completions", json={
            "model": server.model, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == tokens
    # Asking for compression per request is vLLM's own business there: the plugin installed nothing.
    r = requests.post(server.url + "/v1/completions", json={
        "model": server.model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
        "vllm_xargs": {"kv_compress": "snapkv"}}, timeout=120)
    assert r.status_code == 200, r.text
    log = server.output()
    assert "vllm-kvcompress is inactive on vLLM 0.35.0" in log
    assert "kv_compress worker ready" not in log and "kv_compress enabled" not in log


@pytest.mark.extended  # nine processes importing vLLM: the extended run and the 0.34 leg
@pytest.mark.parametrize("run, version, needle", [
    ("outside_serve_compress", OUTSIDE, "vllm-kvcompress supports vLLM 0.32, 0.34 (tested)"),
    ("untested_serve_compress", UNTESTED, "VLLM_KVCOMPRESS_ALLOW_UNTESTED_VLLM=1"),
    ("mismatch_serve_compress", UNTESTED, "not found in vLLM"),
])
def test_compression_is_refused_in_one_line(runs, run, version, needle):
    out = runs[run].result()
    assert out.returncode == 2, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, out.stderr[-3000:]
    assert f"kv_compress cannot be served on vLLM {version}" in errors[0] and needle in errors[0], errors
    assert "Traceback" not in out.stderr


@pytest.mark.extended  # nine processes importing vLLM: the extended run and the 0.34 leg
def test_llm_asking_for_compression_outside_the_window_fails_at_startup(runs):
    out = runs["outside_llm_compress"].result()
    assert out.returncode != 0
    assert f"KVCompressConfigError: kv_compress cannot be served on vLLM {OUTSIDE}" in out.stderr, out.stderr[-3000:]


# ---------------------------------------------------------------- the seam table, in this process


@pytest.fixture
def target_module(monkeypatch):
    """A stand-in for a vLLM module, importable by name."""
    module = types.ModuleType("kvc_fake_vllm_target")

    class Runner:
        def present(self):
            return "original"

    module.Runner = Runner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def row(attr: str, kind: str = "method"):
    from vllm_kvcompress.vllm_seam.patches import Patch

    return Patch("kvc_fake_vllm_target", "Runner", attr, "worker.hooks.wrap_prepare_dummy_attn", kind, "0.32-0.34",
                 "test row")


def test_a_row_whose_target_is_missing_raises_by_name_and_installs_nothing(target_module):
    from vllm_kvcompress.vllm_seam import patches

    with pytest.raises(RuntimeError, match=r"has no kvc_fake_vllm_target\.Runner\.moved_away"):
        patches.apply([row("present"), row("moved_away")])
    assert target_module.Runner().present() == "original"  # resolved first: nothing installed
    with pytest.raises(RuntimeError, match=r"kvc_fake_vllm_target\.Runner\.present; the seam row"):
        patches.apply([row("present", kind="added")])  # an attribute the row would add exists already
    with pytest.raises(RuntimeError, match="kvc_fake_vllm_nowhere.Runner.present not found"):
        patches.apply([dataclasses.replace(row("present"), module="kvc_fake_vllm_nowhere")])


def test_rows_install_all_or_nothing(target_module):
    """A row whose seam module does not import (its vLLM imports fail on
    another vLLM) raises before any row of the call is installed."""
    from vllm_kvcompress.vllm_seam import patches

    broken = dataclasses.replace(row("present"), attr="present", make="kvc_no_such_seam_module.wrap")
    with pytest.raises(ImportError, match="kvc_no_such_seam_module"):
        patches.apply([row("present"), broken])
    assert target_module.Runner().present() == "original"
    assert ("kvc_fake_vllm_target", "Runner", "present") not in patches._installed


def test_every_row_of_the_installed_version_applies():
    from vllm_kvcompress.vllm_seam import patches, versions

    served = versions.support()
    assert served.serves and not served.untested and served.minor in versions.TESTED
    rows = patches.rows_for("0.32")
    assert {p.module for p in rows} >= {"vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner",
                                        "vllm.v1.core.kv_cache_utils"}
    assert not any(p.module == "vllm.v1.core.kv_cache_planning" for p in rows)
    assert not any(p.module == "vllm.v1.worker.gpu_model_runner" for p in patches.rows_for("0.34"))
    assert served.minor is not None
    for p in patches.rows_for(served.minor):
        if (p.module, p.owner, p.attr) in patches._installed:  # another test's engine installed it
            owner = importlib.import_module(p.module)
            owner = getattr(owner, p.owner) if p.owner else owner
            assert p.attr in owner.__dict__, p.symbol
        else:
            patches._resolve(p)  # resolves on the installed vLLM


@pytest.mark.parametrize("version, serves, untested", [
    ("0.32.0", True, False), ("0.32.0+cpu", True, False), ("0.33.1", False, True), ("0.34.0", True, False),
    ("0.35.0", False, True), ("0.31.2", False, True), ("dev", False, True),
])
def test_the_window(version, serves, untested, monkeypatch):
    from vllm_kvcompress.vllm_seam import versions

    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    served = versions.support(version)
    assert (served.serves, served.untested) == (serves, untested)
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert versions.support(version).serves == (serves or versions.minor_of(version) in versions.UNTESTED)
