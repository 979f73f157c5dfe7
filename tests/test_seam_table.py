"""The seam tables cannot drift from the code: every vLLM symbol the plugin
imports, and every attribute it reads on a vLLM object, is a row of
`patches.PATCHES` or `relied_on.RELIED_ON` (which scripts/seam_check.py then
resolves in every vLLM version of the window).

Imports are read from the plugin's source (`ast`). Attribute reads are
recorded while a real engine serves compressed requests: every vLLM class of
the modules the tables name gets a `__getattribute__` that notes each read
made from the plugin's code (the caller's module), and each read must match a
row naming that attribute on the object's class or one of its vLLM bases.
What the engine run does not reach is not recorded: the run covers the
scheduler, the worker, the block manager, the attention backend, per-request
settings, layer groups, prefix caching, preemption and the stats.
"""

from __future__ import annotations

import ast
import enum
import importlib
import re
import sys
from pathlib import Path

import pytest

from helpers import engine_kwargs, random_prompts
from vllm_kvcompress.vllm_seam import patches, relied_on

PLUGIN = Path(__file__).resolve().parents[1] / "vllm_kvcompress"
# Reached by the plugin beside the tables' own modules: LLM -> its engine -> the core (stats()).
ENTRY_MODULES = ("vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core_client",
                 "vllm.v1.engine.core", "vllm.v1.request", "vllm.v1.core.kv_cache_manager",
                 "vllm.v1.core.sched.output", "vllm.v1.attention.backend", "vllm.forward_context")


def _targets() -> set[str]:
    """Every `module:Qual.name` the tables name (all versions: a read is
    covered if some row names it; the seam check resolves rows per version)."""
    out = {alt for r in relied_on.RELIED_ON for alt in r.alternatives}
    out |= {f"{p.module}:{p.owner}.{p.attr}" if p.owner else f"{p.module}:{p.attr}" for p in patches.PATCHES}
    out |= {f"{p.module}:{p.owner}.{attr}" for p in patches.PATCHES
            for _, attr in relied_on.WRAPPER_NEEDS.get(p.make, ())}
    return out


def _plugin_imports() -> list[tuple[str, str, str]]:
    """(vLLM module, imported name, where) for every `from vllm... import name` / `import vllm...`."""
    found = []
    for path in sorted(PLUGIN.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PLUGIN.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                found += [(node.module or "", alias.name, where) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, "", where) for alias in node.names if alias.name.split(".")[0] == "vllm"]
    return found


def test_every_vllm_import_of_the_plugin_is_a_row():
    targets = _targets()
    modules = {t.partition(":")[0] for t in targets}
    missing = []
    for module, name, where in _plugin_imports():
        if not name:  # `import vllm.x`: a module some row lives in
            symbol, covered = module, module in modules
        else:  # `from vllm.x import y`: a row names y (or one of its attributes), or y is a module of rows
            symbol = f"{module}:{name}"
            covered = (symbol in targets or any(t.startswith(symbol + ".") for t in targets)
                       or f"{module}.{name}" in modules)
        if not covered:
            missing.append(f"{symbol} (imported at {where})")
    assert not missing, "vLLM symbols the plugin imports without a seam row:\n" + "\n".join(missing)


# ---------------------------------------------------------------- attribute reads, recorded


def _vllm_classes() -> set[type]:
    """The vLLM classes of the tables' modules (and the entry path's), with their vLLM bases."""
    names = {t.partition(":")[0] for t in _targets()} | set(ENTRY_MODULES)
    classes: set[type] = set()
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a row of another vLLM version, or CUDA-only
            continue
        for obj in vars(module).values():
            if isinstance(obj, type):
                classes |= {c for c in obj.__mro__ if c.__module__.split(".")[0] == "vllm"}
    # Enums are read through their class (members), never an instance's lookup.
    return {c for c in classes if not issubclass(c, enum.Enum)}


def _plugin_instance_attrs() -> set[str]:
    """Attributes the plugin's own subclasses set on themselves (`self.x = ...`)."""
    names = set()
    for path in PLUGIN.rglob("*.py"):
        names |= set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=(?!=)", path.read_text()))
    return names


class Recorder:
    """Notes every attribute read made from the plugin's code on an instance of the given classes."""

    def __init__(self, classes: set[type]) -> None:
        self.reads: dict[tuple[type, str], str] = {}
        self.patched: list[type] = []
        for cls in classes:
            if any("__getattribute__" in c.__dict__ for c in cls.__mro__[:-1]):
                continue  # a class with its own lookup: left as it is
            try:
                cls.__getattribute__ = self._hook()  # type: ignore[method-assign]
            except (TypeError, AttributeError):
                continue  # an extension type
            self.patched.append(cls)

    def _hook(self):
        reads = self.reads

        def __getattribute__(obj, name):
            value = object.__getattribute__(obj, name)  # a failed probe (hasattr) is no read
            if not name.startswith(("__", "kv_compress", "_kv_compress")):  # the plugin's own names
                frame = sys._getframe(1)
                module = frame.f_globals.get("__name__", "")
                # Code a dataclass generates for the plugin's subclasses has no file ("<string>").
                if module.startswith("vllm_kvcompress") and not frame.f_code.co_filename.startswith("<"):
                    reads.setdefault((type(obj), name), f"{module}:{frame.f_lineno}")
            return value

        return __getattribute__

    def remove(self) -> None:
        for cls in self.patched:
            del cls.__getattribute__
        self.patched.clear()


def _row_classes() -> dict[str, set[type]]:
    """attribute name -> the classes whose rows name it (rows whose module imports here)."""
    out: dict[str, set[type]] = {}
    for target in _targets():
        module, _, qual = target.partition(":")
        owner, _, attr = qual.rpartition(".")
        if not owner:
            continue
        try:
            obj = importlib.import_module(module)
            for part in owner.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            continue
        if isinstance(obj, type):
            out.setdefault(attr, set()).add(obj)
    return out


def uncovered(reads: dict[tuple[type, str], str]) -> list[str]:
    """The recorded reads no row names (on the object's class or a vLLM base of it)."""
    rows = _row_classes()
    own = _plugin_instance_attrs()
    missing = []
    for (cls, name), where in sorted(reads.items(), key=lambda kv: (kv[0][0].__qualname__, kv[0][1])):
        defined = next((c for c in cls.__mro__ if name in c.__dict__), None)
        if defined is not None and defined.__module__.startswith("vllm_kvcompress"):
            continue  # the plugin's own subclass's attribute
        if defined is None and cls.__module__.startswith("vllm_kvcompress") and name in own:
            continue  # set by the plugin's subclass on itself
        if any(issubclass(cls, c) for c in rows.get(name, ())):
            continue
        vllm_class = next(c for c in cls.__mro__ if c.__module__.split(".")[0] == "vllm")
        missing.append(f"{vllm_class.__module__}:{vllm_class.__qualname__}.{name} (read at {where})")
    return missing


def test_uncovered_reads_are_found():
    """The check itself: a read with no row is reported, one with a row is not."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request

    reads = {(Scheduler, "requests"): "x:1", (Request, "kvc_no_such_attribute"): "x:2"}
    assert uncovered(reads) == ["vllm.v1.request:Request.kvc_no_such_attribute (read at x:2)"]


@pytest.mark.mrv2
def test_every_vllm_attribute_the_plugin_reads_is_a_row(tiny_model):
    from helpers import Engine

    recorder = Recorder(_vllm_classes())
    try:
        engine = Engine(in_process=True, **engine_kwargs(
            tiny_model, kv_compress="snapkv", kv_compress_budget=64, kv_compress_layer_groups=2,
            enable_prefix_caching=True, max_model_len=512, num_gpu_blocks_override=48, max_num_seqs=4))
        try:
            prompts = random_prompts((180, 120, 200, 150, 90, 170), seed=11)
            settings = [None, {"policy": "h2o", "budget": 48, "interval": 16}, {"policy": "tova", "budget": 64},
                        {"policy": "streamingllm", "budget": 64}, {"policy": "pyramidkv", "budget": 64},
                        {"policy": "snapkv-span", "compression_ratio": 0.75}]
            engine.generate(prompts + prompts[:2], 24, settings + settings[:2])  # a repeat: prefix hits
            engine.stats()
        finally:
            engine.close()
    finally:
        recorder.remove()
    assert len(recorder.reads) > 50, "the recorder saw almost nothing: is the seam installed?"
    missing = uncovered(recorder.reads)
    assert not missing, "vLLM attributes the plugin reads without a seam row:\n" + "\n".join(missing)
