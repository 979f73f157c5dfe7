"""`vllm serve MODEL --kv-compress ...`: flags, help, validation (the values reaching
every process: tests/test_server.py, whose servers start from a recipe and flags)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from server_utils import VLLM

HELP = ("serve", "--help=KVCompress")
# Run as the real command in the extended run (a process each, 15-20 s of a
# core importing vLLM): the help, the interval that once asked for a 1.6 TB
# buffer (tests/test_reliability.py has it as a request), an engine refusal
# (below) and two recipes. The default run checks each through the same
# parser, built the way the command builds it, in this process (below and
# tests/test_reliability.py); the servers of tests/test_server.py and
# tests/test_reliability.py are the real command, plugin loaded by its entry point.
BAD_FLAGS = [
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--kv-compress-interval", "100000000000"],
     "kv_compress.interval: 100000000000 is out of range"),
]
# Refused once the engine config is known (engine_checks.prepare_engine_args,
# check_model), read as argument errors by `vllm serve` (engine_checks.wrap_serve_cmd):
# the first also as the real command (in BAD_FLAGS), all three in process below.
# An EAGLE head (n-gram and draft models are served: test_speculative.py); "{model}": the tiny model.
SPECULATIVE = '{"method": "eagle", "model": "{model}", "num_speculative_tokens": 2}'
ENGINE_REFUSALS = [
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--speculative-config", SPECULATIVE],
     "vllm serve: error: kv_compress cannot be served with speculative decoding"),
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--pipeline-parallel-size", "2"],
     "vllm serve: error: kv_compress cannot be served with pipeline parallelism"),
    (["--kv-compress", "h2o", "--kv-compress-budget", "2000", "--max-model-len", "1024"],
     "vllm serve: error: kv_compress.budget: 2000 is out of range; valid values: 1 .. 1024 (max_model_len)"),
]
BAD_FLAGS.append(ENGINE_REFUSALS[0])


# Recipe mistakes (--kv-compress-config FILE): the file's name -> how it is
# made, and what the one error line says after the file's name.
BAD_RECIPES = {
    "fifo": (os.mkfifo, "is a FIFO, not a regular file"),  # opening it would wait for a writer
    "utf16.yaml": (lambda p: p.write_bytes(b"\xff\xfepolicy: snapkv\n"), "is not UTF-8 text (byte 0xff at offset 0)"),
    "empty.yaml": (lambda p: p.write_text(""), "is empty: a recipe names its policy"),
    "comments.yaml": (lambda p: p.write_text("# nothing yet\n"), "is empty: a recipe names its policy"),
    "no-policy.yaml": (lambda p: p.write_text("kv_compress:\n  budget: 64\n"), "names no policy"),
    "null-policy.yaml": (lambda p: p.write_text("policy:\nbudget: 64\n"), "names no policy"),
    "list.yaml": (lambda p: p.write_text("- snapkv\n"), "is not a YAML mapping of settings"),
    "folder": (Path.mkdir, "is a directory, not a regular file"),
    "/dev/null": (None, "is a character device, not a regular file"),
    "/dev/zero": (None, "is a character device, not a regular file"),  # would read forever
    "huge.yaml": (lambda p: p.write_text("# padding\n" * 110_000), "is larger than 1048576 bytes (1 MiB)"),
}
REAL_RECIPES = ("fifo", "utf16.yaml")  # also as the real command; every one through the parser below


@pytest.fixture(scope="module")
def recipes(tmp_path_factory) -> Path:
    """A folder with each of BAD_RECIPES made."""
    folder = tmp_path_factory.mktemp("recipes")
    for name, (make, _) in BAD_RECIPES.items():
        if make is not None:
            make(folder / name)
    return folder


def recipe_path(recipes: Path, name: str) -> str:
    return name if name.startswith("/") else str(recipes / name)


def with_model(tiny_model: str, args: list[str]) -> list[str]:
    return [a.replace("{model}", tiny_model) for a in args]


def bad_flag_command(tiny_model: str, args: list[str]) -> tuple[str, ...]:
    return ("serve", tiny_model, "--dtype", "float32", *with_model(tiny_model, args))


def bad_recipe_command(tiny_model: str, recipes: Path, name: str) -> tuple[str, ...]:
    return bad_flag_command(tiny_model, ["--kv-compress-config", recipe_path(recipes, name)])


def real_command(item, tiny_model: str, recipes: Path) -> tuple[str, ...]:
    """The real `vllm` command a test of this module checks."""
    params = item.callspec.params if hasattr(item, "callspec") else {}
    if "args" in params:
        return bad_flag_command(tiny_model, params["args"])
    if "name" in params:
        return bad_recipe_command(tiny_model, recipes, params["name"])
    return HELP


@pytest.fixture(scope="module")
def commands(request, tiny_model, recipes) -> dict[tuple[str, ...], subprocess.CompletedProcess]:
    """The real `vllm` commands the selected tests of this module check, run
    at once (each spends its seconds importing vLLM): command -> its result."""
    wanted = {real_command(item, tiny_model, recipes) for item in request.session.items
              if item.module is request.module and "commands" in item.fixturenames}
    procs = {c: subprocess.Popen([VLLM, *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for c in wanted}
    results = {}
    for command, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        results[command] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return results


def check_help(text: str) -> None:
    for flag in ("--kv-compress ", "--kv-compress-budget", "--kv-compress-ratio", "--kv-compress-config",
                 "--kv-compress-window", "--kv-compress-sink-tokens", "--kv-compress-kernel-size",
                 "--kv-compress-pooling", "--kv-compress-interval", "--kv-compress-recent-ratio"):
        assert flag in text, flag
    assert "snapkv 32" in text  # each policy's default is shown


@pytest.mark.extended
def test_help_lists_the_flag_group(commands):
    out = commands[HELP]
    assert out.returncode == 0, out.stderr
    check_help(out.stdout)


def test_the_parsers_help_lists_the_flag_group(capsys):
    """`vllm serve --help=KVCompress` as the command's parser prints it."""
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(["--help=KVCompress"])
    assert e.value.code == 0
    check_help(capsys.readouterr().out)


@pytest.mark.extended
@pytest.mark.parametrize("args, needle", BAD_FLAGS)
def test_bad_flag_fails_the_real_command_with_one_line(commands, tiny_model, args, needle):
    """As vLLM's own argument errors: usage, one error line naming the field, exit 2, no traceback."""
    out = commands[bad_flag_command(tiny_model, args)]
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


@pytest.mark.extended
@pytest.mark.parametrize("name", REAL_RECIPES)
def test_bad_recipe_fails_the_real_command_with_one_line(commands, tiny_model, recipes, name):
    """The issue's not-UTF-8 recipe (a 56-line traceback) and a FIFO (startup hung)."""
    out = commands[bad_recipe_command(tiny_model, recipes, name)]
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    needle = f"kv_compress.config: the recipe {recipe_path(recipes, name)!r} (--kv-compress-config) " \
             f"{BAD_RECIPES[name][1]}"
    assert len(errors) == 1 and needle in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def serve_parser():
    """The parser `vllm serve` builds (plugins loaded first, as in the CLI)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


@pytest.mark.parametrize("args, needle", [
    (["--kv-compress", "snapkv", "--kv-compress-ratio", "1.5"], "kv_compress.compression_ratio: must be in [0, 1)"),
    (["--kv-compress-ratio", "1.5"], "kv_compress.compression_ratio: must be in [0, 1)"),  # the value, not the policy
    (["--kv-compress-config", "/nonexistent.yaml"],
     "kv_compress.config: cannot read the recipe '/nonexistent.yaml' (--kv-compress-config)"),
    (["--kv-compress", "snapkv", "--kv-compress-budget", "8"], "kv_compress.budget: 8 is below the 32"),
    (["--kv-compress", "snapkv"], "needs exactly one of budget"),
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--kv-compress-kernel-size", "3"],
     "kv_compress.kernel_size: unknown field for policy 'h2o'"),
    (["--kv-compress-budget", "64"], "needs a policy other than 'none'"),
    (["--kv-compress", "h2o", "--kv-compress-budget", "64", "--kv-compress-allocation", "per_head"],
     "kv_compress.trigger: allocation 'per_head' compresses once"),
])
def test_bad_flag_combinations_name_the_field(tiny_model, args, needle, capsys):
    """As the real command: usage, one error line naming the field, exit 2, no traceback."""
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(["--model", tiny_model, *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(BAD_RECIPES))
def test_bad_recipes_name_the_file_and_the_mistake(tiny_model, recipes, name, capsys):
    """Each recipe mistake: exit 2, one error line naming the file and what is wrong, no traceback."""
    path = recipe_path(recipes, name)
    with pytest.raises(SystemExit) as e:
        serve_parser().parse_args(["--model", tiny_model, "--kv-compress-config", path])
    assert e.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    needle = f"kv_compress.config: the recipe {path!r} (--kv-compress-config) {BAD_RECIPES[name][1]}"
    assert len(errors) == 1 and needle in errors[0], err
    assert "Traceback" not in err


def serve_to_engine_config(args: list[str], capsys) -> tuple[str, str]:
    """What `vllm serve ARGS` runs to the engine config, under the hook it runs
    in, expected to exit 2: (its one error line, all it wrote to stderr)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from vllm_kvcompress.vllm_seam.engine_checks import wrap_serve_cmd

    parsed = serve_parser().parse_args(args)
    serve = wrap_serve_cmd(lambda a: AsyncEngineArgs.from_cli_args(a).create_engine_config())
    with pytest.raises(SystemExit) as e:
        serve(parsed)
    assert e.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0], err


@pytest.mark.parametrize("args, needle", ENGINE_REFUSALS)
def test_engine_refusals_are_one_line_and_exit_2(tiny_model, args, needle, capsys):
    """One error line, exit 2, no traceback (the real command: BAD_FLAGS)."""
    error, err = serve_to_engine_config(["--model", tiny_model, "--dtype", "float32",
                                         *with_model(tiny_model, args)], capsys)
    assert error.startswith(needle), err
    assert "Traceback" not in err


def test_unknown_policy_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--model", "m", "--kv-compress", "magic"])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_no_flag_leaves_additional_config_alone(tiny_model):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs.from_cli_args(serve_parser().parse_args(["--model", tiny_model]))
    assert "kv_compress" not in (args.additional_config or {})


# Model features whose attention the scorers would not reproduce: refused once
# the engine config is known, before any weight loads (config-only folders).
# (gpt-oss's learned sinks are served: the ops take them, tests/test_model_families.py.)
FEATURE_CONFIGS = {
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=64, intermediate_size=256), "Gemma2ForCausalLM",
               "an attention logit soft cap (gemma2 attn_logit_softcapping=50.0"),
    "falcon": ("FalconConfig", dict(alibi=True), "FalconForCausalLM", "ALiBi slopes (falcon"),
    "deepseek_v2": ("DeepseekV2Config", dict(num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None,
                                             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
                    "DeepseekV2ForCausalLM", "an MLA model (latent KV cache layout)"),
    "jamba": ("JambaConfig", dict(num_key_value_heads=2, intermediate_size=256, attn_layer_period=2,
                                  attn_layer_offset=1, expert_layer_period=4, num_experts=1, use_mamba_kernels=False),
              "JambaForCausalLM", "a hybrid state-space or attention-free model (Mamba-style layers)"),
    "gemma4_text": ("Gemma4TextConfig", dict(num_key_value_heads=2, head_dim=64, intermediate_size=256,
                                             num_kv_shared_layers=1, layer_types=["sliding_attention",
                                                                                  "full_attention"],
                                             hidden_size_per_layer_input=16, vocab_size_per_layer_input=2048),
                    "Gemma4ForCausalLM", "KV cache shared across layers (gemma4_text num_kv_shared_layers=1"),
}


@pytest.fixture(scope="module")
def feature_models(tiny_model, tmp_path_factory) -> dict[str, str]:
    """A config-only folder per FEATURE_CONFIGS model (the tiny model's tokenizer beside it)."""
    import shutil

    import transformers

    out = {}
    for name, (config_cls, extra, arch, _) in FEATURE_CONFIGS.items():
        folder = tmp_path_factory.mktemp(name)
        config = getattr(transformers, config_cls)(vocab_size=2048, hidden_size=256, num_hidden_layers=2,
                                                   num_attention_heads=4, architectures=[arch], **extra)
        config.save_pretrained(folder)
        for f in Path(tiny_model).glob("*token*"):
            shutil.copy(f, folder)
        out[name] = str(folder)
    return out


@pytest.mark.parametrize("name", sorted(FEATURE_CONFIGS))
def test_model_features_the_scores_miss_are_refused_in_one_line(feature_models, name, capsys):
    """Gemma 2's soft cap, ALiBi, MLA (DeepSeek V2), a Mamba hybrid (Jamba),
    layers that share another's KV cache (Gemma 4's E-models):
    `vllm serve` exits 2 with one line naming the feature, before the engine
    starts (no traceback)."""
    error, err = serve_to_engine_config(["--model", feature_models[name], "--dtype", "float32",
                                         "--kv-compress", "snapkv", "--kv-compress-budget", "64"], capsys)
    assert error.startswith(f"vllm serve: error: kv_compress cannot be served with {FEATURE_CONFIGS[name][3]}"), err
    # (vLLM's loggers may write to an earlier test's closed capture: "Logging error" tracebacks, not ours.)
    if name in ("gemma2", "falcon"):
        assert "the scores would not be the model's attention" in error
    assert "KVCompressConfigError" not in err


def test_the_worker_refuses_tensor_valued_features_by_name():
    """The worker's second check (on the layers vLLM built): a tensor of ALiBi
    slopes is refused by name, not a tensor's truth value; sinks pass (served)."""
    import types

    import torch

    from vllm_kvcompress.vllm_seam.worker.startup import check_scoring_exact

    for attr, what in (("alibi_slopes", "ALiBi slopes"),):
        layer = types.SimpleNamespace(layer_name="model.layers.0.self_attn.attn",
                                      impl=types.SimpleNamespace(**{attr: torch.zeros(4)}))
        with pytest.raises(RuntimeError, match=f"cannot be served with {what} \\(layer model.layers.0"):
            check_scoring_exact(layer)
    check_scoring_exact(types.SimpleNamespace(layer_name="x", impl=types.SimpleNamespace(
        sinks=torch.zeros(4), alibi_slopes=None, logits_soft_cap=0)))
