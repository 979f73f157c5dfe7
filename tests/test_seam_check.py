"""The seam check (scripts/seam_check.py): every vLLM symbol the plugin patches or relies on
exists in the installed vLLM with the signature the seam was written against, and the check
can fail."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from vllm_kvcompress.vllm_seam import patches, relied_on, versions

ROOT = Path(__file__).resolve().parents[1]
# Run on every vLLM leg (scripts/test_vllm034.sh), not only the default one.
pytestmark = pytest.mark.versions


def _load():
    spec = importlib.util.spec_from_file_location("seam_check", ROOT / "scripts" / "seam_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("seam_check", module)
    spec.loader.exec_module(module)
    return module


seam_check = _load()


@pytest.fixture(scope="module")
def installed():
    source = seam_check.installed_source()
    if source is None:
        pytest.skip("vLLM is not installed")
    return seam_check.Tree(source)


def test_tables_import_no_vllm():
    code = ("import sys; import vllm_kvcompress.vllm_seam.patches, vllm_kvcompress.vllm_seam.relied_on; "
            "sys.exit('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_every_row_covers_a_known_version():
    for row in patches.PATCHES:
        assert any(row.applies_to(m) for m in versions.KNOWN), row
    for relied in relied_on.RELIED_ON:
        assert any(relied.applies_to(m) for m in versions.KNOWN), relied


def test_installed_vllm_has_every_symbol_unchanged(installed):
    """The installed vLLM (0.32 on the default leg, 0.34 on its own) against the
    signatures recorded from the baseline 0.32 (scripts/seam_baseline.json):
    every row found, every signature the recorded one or a reviewed change."""
    recorded = seam_check.Recorded.load()
    assert versions.minor_of(recorded.version) == seam_check.BASELINE_MINOR
    report = seam_check.check(installed, recorded)
    assert report.minor in versions.TESTED
    bad = [f"{r.symbol}: {r.status} {r.note}" for r in report.rows if r.status != "ok" and not r.reviewed]
    assert not bad and not report.problems, "\n".join(bad + report.problems)
    # Every applicable row was checked, and each signature compared with the recorded one
    # (rows of symbols 0.32 does not have, such as 0.33's moved functions, have none recorded).
    assert len(report.rows) >= len(patches.rows_for(report.minor))
    compared = [r for r in report.rows if r.signature is not None and r.baseline is not None]
    assert len(compared) >= 60
    for r in compared:
        assert r.signature == r.baseline or r.reviewed, r


def test_the_recorded_baseline_is_the_baseline_trees():
    """scripts/seam_baseline.json holds what --write-baseline records from vLLM
    0.32 (here its installed files, else nothing to compare): a row added to
    the tables without recording its signature fails here."""
    source = seam_check.installed_source()
    tree = seam_check.Tree(source) if source is not None else None
    if tree is None or versions.minor_of(tree.version) != seam_check.BASELINE_MINOR:
        pytest.skip(f"vLLM {seam_check.BASELINE_MINOR} is not installed in this leg")
    assert seam_check.record(tree).signatures == seam_check.Recorded.load().signatures


def test_a_recorded_signature_that_differs_is_reported(installed):
    recorded = seam_check.Recorded.load()
    target = "vllm.v1.core.sched.scheduler:Scheduler.schedule"
    assert target in recorded.signatures
    altered = seam_check.Recorded(recorded.version, {**recorded.signatures, target: "(self, budget)"})
    report = seam_check.check(installed, altered)
    row = next(r for r in report.rows if r.symbol == "vllm.v1.core.sched.scheduler.Scheduler.schedule")
    assert row.status == "changed" and row.note.startswith("(self, budget) -> ")
    assert report.failed


def _tree(root: Path, files: dict[str, str]):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(textwrap.dedent(text))
    return seam_check.Tree(seam_check.DirSource(root))


def test_a_missing_patched_method_is_reported(tmp_path):
    tree = _tree(tmp_path, {
        "vllm/__init__.py": "",
        "vllm/_version.py": "__version__ = version = '0.32.0'\n",
        "vllm/engine/__init__.py": "",
        # EngineArgs lost create_engine_config; AsyncEngineArgs re-exports through a base module.
        "vllm/engine/arg_utils.py": """
            from dataclasses import dataclass
            from vllm.engine.base import Base

            @dataclass
            class EngineArgs(Base):
                model: str = "m"

                @staticmethod
                def add_cli_args(parser):
                    return parser

            @dataclass
            class AsyncEngineArgs(EngineArgs):
                pass
        """,
        "vllm/engine/base.py": """
            class Base:
                def create_engine_config(self, usage_context=None):
                    pass
        """,
        "vllm/v1/engine/core.py": """
            class EngineCore:
                def kv_compress_stats(self):
                    pass
        """,
    })
    rows = [p for p in patches.PATCHES if p.module in ("vllm.engine.arg_utils", "vllm.v1.engine.core")]
    relied = [relied_on.Relied("method", "vllm.engine.arg_utils:EngineArgs.create_engine_config", "0.32", "x"),
              relied_on.Relied("class", "vllm.engine.gone:Missing", "0.32", "x")]
    report = seam_check.check(tree, None, "0.32", rows, relied)
    status = {(r.list, r.symbol): r.status for r in report.rows}
    # apply() reads the class's own __dict__: a method only a base class has is missing.
    assert status["patch", "vllm.engine.arg_utils.EngineArgs.create_engine_config"] == "missing"
    assert status["patch", "vllm.engine.arg_utils.EngineArgs.add_cli_args"] == "ok"
    assert status["patch", "vllm.engine.arg_utils.EngineArgs.__init__"] == "ok"  # dataclass-generated
    assert status["patch", "vllm.v1.engine.core.EngineCore.kv_compress_stats"] == "added-but-present"
    assert status["relied", "vllm.engine.arg_utils.EngineArgs.create_engine_config"] == "ok"  # inherited
    assert status["relied", "vllm.engine.gone.Missing"] == "missing"
    assert report.failed
    assert "missing" in seam_check.markdown(report)


def test_a_changed_signature_is_reported(tmp_path):
    files = {"vllm/__init__.py": "", "vllm/m.py": "def f(a, b=1):\n    pass\n"}
    old = _tree(tmp_path / "old", files)
    new = _tree(tmp_path / "new", {**files, "vllm/m.py": "def f(a, *, b=2, **kw):\n    pass\n"})
    relied = [relied_on.Relied("function", "vllm.m:f", "0.32-0.34", "x")]
    report = seam_check.check(new, old, "0.33", [], relied)
    assert [r.status for r in report.rows] == ["changed"]
    assert report.rows[0].note == "(a, b=1) -> (a, *, b=2, **kw)"
    assert report.failed
