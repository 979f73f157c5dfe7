"""Tests for kvc_tools.longctx (RULER-style offline tasks) and the
generated lm-eval suite in eval/tasks. Fast: no engine, no model weights.

Tests that measure real token counts use the SmolLM2 tokenizer of the cached
model folder and are skipped when it is absent.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
TASK_DIR = REPO / "eval" / "tasks"


from kvc_tools import longctx as lc  # noqa: E402

try:
    lc.essay_sentences()
    lc.word_lists()
except lc.LongCtxError as e:  # pragma: no cover - environment without the data packages
    pytest.skip(f"data packages missing: {e}", allow_module_level=True)


def approx_count(text: str) -> int:
    """Tokenizer-free counter: words and punctuation marks."""
    return len(re.findall(r"\w+|[^\w\s]", text))


@pytest.fixture(scope="module")
def smollm2_count():
    path = lc.default_tokenizer_path()
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"SmolLM2 tokenizer not cached at {path}")
    count, _ = lc.make_token_counter(path)
    return count


# --------------------------------------------------------------------------
# generation
# --------------------------------------------------------------------------


@pytest.mark.parametrize("task", lc.TASKS)
def test_deterministic(task):
    a = lc.generate_sample(task, 1024, 3, seed=7, count_tokens=approx_count)
    b = lc.generate_sample(task, 1024, 3, seed=7, count_tokens=approx_count)
    assert a == b
    other_seed = lc.generate_sample(task, 1024, 3, seed=8, count_tokens=approx_count)
    other_index = lc.generate_sample(task, 1024, 4, seed=7, count_tokens=approx_count)
    assert other_seed["input"] != a["input"]
    assert other_index["input"] != a["input"]
    # A sample does not depend on how many are generated around it.
    batch = lc.generate_samples(task, 1024, 5, seed=7, count_tokens=approx_count)
    assert batch[3] == a
    assert [s["index"] for s in batch] == list(range(5))


def test_seed_stable_across_processes():
    """`random.Random(str)` must not depend on PYTHONHASHSEED."""
    import subprocess

    code = (
        "import importlib.util,sys;"
        f"s=importlib.util.spec_from_file_location('m',{str(REPO / 'kvc_tools' / 'longctx.py')!r});"
        "m=importlib.util.module_from_spec(s);sys.modules['m']=m;s.loader.exec_module(m);"
        "print(m.generate_sample('niah_multikey',1024,1,seed=3,count_tokens=lambda t: len(t.split()))['outputs'])"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": h, "PATH": "/usr/bin:/bin"}).stdout
        for h in ("1", "2")
    }
    assert len(outs) == 1


@pytest.mark.parametrize("task", lc.TASKS)
@pytest.mark.parametrize("length", [1024, 2048])
def test_fits_approx_counter(task, length):
    s = lc.generate_sample(task, length, 0, count_tokens=approx_count)
    budget = length - lc.GEN_TOKS[task]
    assert s["length"] == approx_count(s["input"]) <= budget
    assert s["length"] >= 0.85 * budget
    assert s["max_length"] == length and s["max_gen_toks"] == lc.GEN_TOKS[task]


@pytest.mark.parametrize("task", lc.TASKS)
@pytest.mark.parametrize("length", lc.DEFAULT_LENGTHS)
def test_fits_smollm2(task, length, smollm2_count):
    budget = length - lc.GEN_TOKS[task]
    for i in range(2):
        s = lc.generate_sample(task, length, i, count_tokens=smollm2_count)
        n = smollm2_count(s["input"])
        assert n == s["length"]
        assert n + s["max_gen_toks"] <= length
        assert n >= 0.9 * budget, f"{task}@{length}: {n} tokens, budget {budget}"


def test_too_small_target_raises():
    with pytest.raises(lc.LongCtxError):
        lc.generate_sample("cwe", 128, 0, count_tokens=approx_count)


def test_unknown_task():
    with pytest.raises(ValueError):
        lc.generate_sample("qa_squad", 1024, 0, count_tokens=approx_count)


@pytest.mark.parametrize("task", ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"])
def test_niah_needles_in_context(task):
    num_k, num_v, num_q = lc.NIAH_SHAPES[task]
    for i in range(4):
        s = lc.generate_sample(task, 2048, i, count_tokens=approx_count)
        text = s["input"]
        needles = re.findall(r"One of the special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)
        assert len(needles) == num_k * num_v
        by_key: dict[str, list[str]] = {}
        for k, v in needles:
            by_key.setdefault(k, []).append(v)
        assert len(by_key) == num_k
        assert len(s["outputs"]) == num_q * num_v
        queries = [q for q in re.split(r", and |, ", s["query"])]
        assert len(queries) == num_q
        assert sorted(s["outputs"]) == sorted(v for q in queries for v in by_key[q])
        for o in s["outputs"]:
            assert text.count(o) == 1  # the value occurs once: in its needle
        # the question asks for the queried key(s) and the prompt ends with the answer prefix
        assert text.rstrip().endswith(("mentioned in the provided text is", "mentioned in the provided text are"))
        assert s["query"] in text.rsplit("\n", 1)[-1]
        assert len(s["depth"]) == num_k * num_v and s["depth"] == sorted(s["depth"])
        assert all(0 <= d <= 100 for d in s["depth"])


def test_niah_single_depths_vary():
    depths = {lc.generate_sample("niah_single", 1024, i, count_tokens=approx_count)["depth"][0]
              for i in range(12)}
    assert len(depths) >= 6


def test_vt_chain_in_context():
    for i in range(3):
        s = lc.generate_sample("vt", 2048, i, count_tokens=approx_count)
        text = s["input"]
        names, value = s["outputs"], s["query"]
        assert len(names) == lc.VT_HOPS + 1 and len(set(names)) == len(names)
        assert f"VAR {names[0]} = {value}" in text
        pos = [text.index(f"VAR {names[0]} = {value}")]
        for a, b in zip(names, names[1:]):
            stmt = f"VAR {b} = VAR {a}"
            assert text.count(stmt) == 1
            pos.append(text.index(stmt))
        assert pos == sorted(pos)  # the chain appears in order
        # the one-shot example comes first and answers a different chain
        assert text.count(lc.VT_INSTRUCTION) == 2
        assert text.rstrip().endswith("they are:")
        assert f"assigned the value {value}, they are:" in text


def test_cwe_frequencies():
    for length, fc, fu in ((1024, 6, 1), (4096, 30, 3)):
        s = lc.generate_sample("cwe", length, 0, count_tokens=approx_count)
        main = s["input"].split("\n\n", 1)[1]  # after the one-shot example
        words = re.findall(r"\d+\. ([a-z]+)", main.split(lc.CWE_QUESTION)[0])
        counts: dict[str, int] = {}
        for w in words:
            counts[w] = counts.get(w, 0) + 1
        assert len(s["outputs"]) == lc.CWE_COMMON
        assert all(counts[w] == fc for w in s["outputs"])
        others = [c for w, c in counts.items() if w not in s["outputs"]]
        assert others and all(c == fu for c in others)
        assert s["input"].rstrip().endswith(lc.CWE_PREFIX)


def test_word_lists_clean():
    wl = lc.word_lists()
    for kind in ("nouns", "adjectives", "verbs"):
        assert len(wl[kind]) > 500
        assert all(re.fullmatch(r"[a-z]+", w) for w in wl[kind])
    assert "intercourse" not in lc._cwe_words()  # profanity list applied


# --------------------------------------------------------------------------
# scoring
# --------------------------------------------------------------------------


def test_string_match_all():
    refs = ["1234567", "7654321"]
    assert lc.string_match_all(" 1234567 and 7654321.", refs) == 1.0
    assert lc.string_match_all(" 1234567.", refs) == 0.5
    assert lc.string_match_all("", refs) == 0.0
    assert lc.string_match_all("I don't know", refs) == 0.0
    assert lc.string_match_all("ABCDE fghij", ["abcde", "FGHIJ"]) == 1.0  # case-insensitive
    assert lc.string_match_all("x\x00y", ["x\ny"]) == 1.0  # control chars -> newline (RULER)
    assert lc.string_match_all("answer 42", "42") == 1.0  # a bare string is one reference
    with pytest.raises(ValueError):
        lc.string_match_all("x", [])


def test_string_match_part():
    assert lc.string_match_part("b", ["a", "B"]) == 1.0
    assert lc.string_match_part("c", ["a", "b"]) == 0.0


def test_process_results():
    doc = {"outputs": ["SCJJX", "MFXCN", "NRTKM", "CRLHS"]}
    assert lc.process_results(doc, [" SCJJX MFXCN"]) == {"string_match_all": 0.5}
    assert lc.process_results(doc, ["scjjx mfxcn nrtkm crlhs"]) == {"string_match_all": 1.0}
    assert lc.process_results(doc, ["SCJJX MFXCN NRTKM CRLHS", ""]) == {"string_match_all": 0.5}
    assert lc.process_results(doc, []) == {"string_match_all": 0.0}


# --------------------------------------------------------------------------
# lm-eval YAMLs and data
# --------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    pass


_Loader.add_constructor("!function", lambda loader, node: ("!function", loader.construct_scalar(node)))


def _yaml(path: Path) -> dict:
    return yaml.load(path.read_text(encoding="utf-8"), Loader=_Loader)


def _check_suite(task_dir: Path, root: Path, tasks, lengths, samples) -> None:
    configs = {p.stem: _yaml(p) for p in sorted(task_dir.glob("*.yaml"))}
    expected_tasks = {lc.task_name(t, n) for t in tasks for n in lengths}
    expected_groups = {"kvc_ruler"} | {f"kvc_ruler_{lc.length_label(n)}" for n in lengths}
    assert set(configs) == expected_tasks | expected_groups
    for name in expected_tasks:
        c = configs[name]
        assert c["task"] == name
        assert c["dataset_path"] == "json"
        assert c["output_type"] == "generate_until"
        assert c["doc_to_text"] == "{{input}}"
        assert c["process_results"] == ("!function", "kvc_ruler_utils.process_results")
        assert c["metric_list"][0]["metric"] == "string_match_all"
        gk = c["generation_kwargs"]
        assert gk["do_sample"] is False and gk["temperature"] == 0.0
        task = name[len("kvc_"):].rsplit("_", 1)[0]
        assert gk["max_gen_toks"] == lc.GEN_TOKS[task]
        assert gk["until"] and all(isinstance(u, str) and u for u in gk["until"])
        rel = c["dataset_kwargs"]["data_files"]["test"]
        assert not Path(rel).is_absolute()
        data = root / rel
        assert data.is_file(), f"{name}: {rel} does not exist relative to {root}"
        rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
        assert len(rows) == samples
        length = c["metadata"]["max_length"]
        for r in rows:
            assert r["task"] == task and r["max_length"] == length
            assert r["length"] + r["max_gen_toks"] <= length
            assert r["outputs"] and all(o in r["input"] for o in r["outputs"])
    for g in expected_groups:
        c = configs[g]
        assert c["group"] == g
        assert all(t in configs for t in c["task"])
        assert c["aggregate_metric_list"][0]["metric"] == "string_match_all"
    assert configs["kvc_ruler"]["task"] == [f"kvc_ruler_{lc.length_label(n)}" for n in sorted(lengths)]
    # the !function module loads and scores
    spec = importlib.util.spec_from_file_location("_kvc_utils_under_test", task_dir / "kvc_ruler_utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.process_results({"outputs": ["a", "b"]}, ["A"]) == {"string_match_all": 0.5}
    # the manifest matches the data
    manifest = json.loads((task_dir / "data" / "MANIFEST.json").read_text())
    for rel, sha in manifest["files"].items():
        assert hashlib.sha256((task_dir / rel).read_bytes()).hexdigest() == sha


def test_build_suite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    summary = lc.build_suite("out/tasks", lengths=[2048, 1024], samples=2, seed=5,
                             tokenizer=approx_count, tasks=["niah_single", "cwe"])
    assert summary["data_bytes"] > 0
    _check_suite(tmp_path / "out" / "tasks", tmp_path, ["niah_single", "cwe"], [1024, 2048], 2)
    # same arguments, same bytes
    before = {p.name: p.read_bytes() for p in (tmp_path / "out" / "tasks" / "data").iterdir()}
    lc.build_suite("out/tasks", lengths=[2048, 1024], samples=2, seed=5,
                   tokenizer=approx_count, tasks=["niah_single", "cwe"])
    after = {p.name: p.read_bytes() for p in (tmp_path / "out" / "tasks" / "data").iterdir()}
    assert before == after


def test_build_suite_data_root(tmp_path):
    lc.build_suite(tmp_path / "t", lengths=[1024], samples=1, tokenizer=approx_count,
                   tasks=["niah_single"], data_root=tmp_path)
    c = _yaml(tmp_path / "t" / "kvc_niah_single_1k.yaml")
    assert c["dataset_kwargs"]["data_files"]["test"] == "t/data/kvc_niah_single_1k.jsonl"


@pytest.mark.skipif(not (TASK_DIR / "kvc_ruler.yaml").is_file(), reason="eval/tasks not generated")
def test_committed_suite():
    manifest = json.loads((TASK_DIR / "data" / "MANIFEST.json").read_text())
    _check_suite(TASK_DIR, REPO, manifest["tasks"], manifest["lengths"], manifest["samples"])
    size = sum(p.stat().st_size for p in (TASK_DIR / "data").iterdir())
    assert size < 5_000_000


@pytest.mark.skipif(not (TASK_DIR / "kvc_ruler.yaml").is_file(), reason="eval/tasks not generated")
def test_committed_data_regenerates(smollm2_count):
    """The committed data is what the generator produces today."""
    manifest = json.loads((TASK_DIR / "data" / "MANIFEST.json").read_text())
    for task, length in (("niah_multikey", 1024), ("vt", 2048), ("cwe", 1024)):
        name = lc.task_name(task, length)
        rows = lc.generate_samples(task, length, 3, seed=manifest["seed"], count_tokens=smollm2_count)
        lines = (TASK_DIR / "data" / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()[:3]
        assert [json.loads(line) for line in lines] == rows
