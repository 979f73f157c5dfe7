"""Test-only: a fake vLLM in this process and every process it starts (on
PYTHONPATH, Python imports this at start-up).

tests/test_version_window.py runs vLLM with the plugin installed as if vLLM
were another version, or one whose modules the seam imports do not import:
- $KVC_FAKE_VLLM_VERSION: `vllm.version.__version__` (which `vllm.__version__`
  copies) is replaced as soon as vLLM defines it, before any plugin loads;
- $KVC_FAKE_VLLM_BROKEN: comma-separated vLLM modules whose import raises
  ImportError (as a module of another vLLM build might).
"""

import importlib.abc
import importlib.machinery
import os
import sys

FAKE = os.environ.get("KVC_FAKE_VLLM_VERSION")
BROKEN = [name for name in os.environ.get("KVC_FAKE_VLLM_BROKEN", "").split(",") if name]


class _FakeVersion(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.version":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_fake(module):
            exec_module(module)
            module.__version__ = FAKE

        spec.loader.exec_module = exec_then_fake
        return spec


if FAKE:
    sys.meta_path.insert(0, _FakeVersion())


class _Broken(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name in BROKEN:
            raise ImportError(f"{name}: broken in this fake vLLM (KVC_FAKE_VLLM_BROKEN)", name=name)
        return None


if BROKEN:
    sys.meta_path.insert(0, _Broken())
