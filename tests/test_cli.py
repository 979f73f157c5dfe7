"""`vllm serve MODEL --kv-compress ...`: flags, help, validation, values reaching every process."""

from __future__ import annotations

import re
import subprocess

import pytest
import requests

from helpers import random_prompts
from server_utils import VLLM, Server

HELP = ("serve", "--help=KVCompress")
BAD_FLAGS = [
    (["--kv-compress", "snapkv", "--kv-compress-ratio", "1.5"], "kv_compress.compression_ratio: must be in [0, 1)"),
    (["--kv-compress-ratio", "1.5"], "kv_compress.compression_ratio: must be in [0, 1)"),  # the value, not the policy
    (["--kv-compress-config", "/nonexistent.yaml"],
     "kv_compress.config: cannot read the recipe '/nonexistent.yaml' (--kv-compress-config)"),
]


def bad_flag_command(tiny_model: str, args: list[str]) -> tuple[str, ...]:
    return ("serve", tiny_model, "--dtype", "float32", *args)


@pytest.fixture(scope="module")
def commands(tiny_model) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The real `vllm` commands this module checks, run at once (each spends
    its seconds importing vLLM): command -> its result."""
    wanted = [HELP, *(bad_flag_command(tiny_model, args) for args, _ in BAD_FLAGS)]
    procs = {c: subprocess.Popen([VLLM, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in wanted}
    results = {}
    for command, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        results[command] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


def test_help_lists_the_flag_group(commands):
    out = commands[HELP]
    assert out.returncode == 0, out.stderr
    for flag in ("--kv-compress ", "--kv-compress-budget", "--kv-compress-ratio", "--kv-compress-config",
                 "--kv-compress-window", "--kv-compress-sink-tokens", "--kv-compress-kernel-size",
                 "--kv-compress-pooling", "--kv-compress-interval", "--kv-compress-recent-ratio"):
        assert flag in out.stdout, flag
    assert "snapkv 32" in out.stdout  # each policy's default is shown


@pytest.mark.parametrize("args, needle", BAD_FLAGS)
def test_bad_flag_fails_the_real_command_with_one_line(commands, tiny_model, args, needle):
    """As vLLM's own argument errors: usage, one error line naming the field, exit 2, no traceback."""
    out = commands[bad_flag_command(tiny_model, args)]
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def serve_parser():
    """The parser `vllm serve` builds (plugins loaded first, as in the CLI)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("args, needle", [
    (["--kv-compress", "snapkv", "--kv-compress-budget", "8"], "kv_compress.budget: 8 is below the 32"),
    (["--kv-compress", "snapkv"], "needs exactly one of budget"),
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--kv-compress-kernel-size", "3"],
     "kv_compress.kernel_size: unknown field for policy 'h2o'"),
    (["--kv-compress-budget", "64"], "needs a policy other than 'none'"),
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--kv-compress-allocation", "per_head"],
     "kv_compress.trigger: allocation 'per_head' compresses once"),
])
def test_bad_flag_combinations_name_the_field(tiny_model, args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(["--model", tiny_model, *args])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_unknown_policy_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", "--kv-compress", "magic"])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_no_flag_leaves_additional_config_alone(tiny_model):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs.from_cli_args(serve_parser().parse_args(["--model", tiny_model]))
    assert "kv_compress" not in (args.additional_config or {})


def test_flags_reach_engine_core_and_worker(tiny_model, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("kv_compress:\n  policy: snapkv\n  budget: 96\n  window: 8\n")
    server = Server(tiny_model, "--kv-compress-config", str(recipe), "--kv-compress-budget", "64",
                    "--kv-compress-kernel-size", "3", log=tmp_path / "serve.log")
    try:
        (prompt,) = random_prompts((300,), seed=1)
        r = requests.post(server.url + "/v1/completions", json={
            "model": tiny_model, "prompt": prompt, "max_tokens": 8, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert server.stop() == 0
    log = server.output()
    expected = "{'policy': 'snapkv', 'budget': 64, 'window': 8, 'kernel_size': 3}"
    lines = [line for line in log.splitlines() if "kv_compress" in line and "ready" in line]
    assert any(re.search(r"EngineCore.*scheduler ready", ln) and expected in ln for ln in lines), lines
    assert any(re.search(r"Worker.*worker ready", ln) and expected in ln for ln in lines), lines
