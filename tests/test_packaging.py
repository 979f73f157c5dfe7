"""The wheel holds every package: a non-editable install imports what a checkout does."""

from __future__ import annotations

import os
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    # followlinks: vllm_kvcompress/kernels is a link to the top-level kernels/.
    found = {".".join(Path(folder).relative_to(ROOT).parts)
             for top in ("vllm_kvcompress", "kvc_tools") for folder, _, files in os.walk(ROOT / top, followlinks=True)
             if "__init__.py" in files}
    assert found == listed
