#!/usr/bin/env python
"""Check the plugin's vLLM seam against a vLLM source tree, by static analysis.

    python scripts/seam_check.py                 # the installed vLLM
    python scripts/seam_check.py 0.33.0 0.34.0   # wheels: /work/vllm-wheels, else the cache (pip download)
    python scripts/seam_check.py path/to/vllm-X.whl path/to/site-packages

Every row of `vllm_seam.patches.PATCHES` and of `vllm_seam.relied_on.RELIED_ON`
whose versions include the checked vLLM's minor version is resolved in that
version's Python files with `ast` (nothing of vLLM is imported: the CUDA wheels
of 0.33/0.34 cannot be imported here): module file -> class (following
`from X import Y` re-exports, star imports and base classes where the plugin's
use allows it) -> attribute. Signatures (parameter names, kinds, defaults) are
compared with the baseline's (the installed vLLM 0.32, the version the wrappers
were written against). Statuses: ok, changed (old -> new), missing,
added-but-present. A missing symbol gets a hint where a symbol of that name now
lives. Exit status 0 when every checked version has nothing missing, changed or
present-but-added, 1 otherwise. docs/vllm-versions.md has the output per version.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from vllm_kvcompress.vllm_seam import patches, relied_on, versions  # noqa: E402

DEFAULT_WHEELS = os.environ.get("VLLM_KVCOMPRESS_WHEELS", "/work/vllm-wheels")
CACHE_WHEELS = Path.home() / ".cache" / "vllm_kvcompress" / "wheels"
BASELINE_MINOR = versions.TESTED[0]
# The baseline's signatures, recorded (`--write-baseline`); `--baseline recorded` compares with them.
BASELINE_FILE = ROOT / "scripts" / "seam_baseline.json"

# ---------------------------------------------------------------- sources


class Source:
    """A vLLM source tree: `vllm/...` paths -> Python text."""

    label: str

    def read(self, path: str) -> str | None:
        raise NotImplementedError

    def paths(self) -> list[str]:
        raise NotImplementedError


class DirSource(Source):
    def __init__(self, root: Path, label: str | None = None) -> None:
        self.root = Path(root)  # the folder holding vllm/
        self.label = label or str(self.root / "vllm")

    def read(self, path: str) -> str | None:
        try:
            return (self.root / path).read_text(encoding="utf-8", errors="replace")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def paths(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in (self.root / "vllm").rglob("*.py"))


class ZipSource(Source):
    def __init__(self, wheel: Path) -> None:
        self.zip = zipfile.ZipFile(wheel)
        self.names = {n for n in self.zip.namelist() if n.endswith(".py")}
        self.label = str(wheel)

    def read(self, path: str) -> str | None:
        if path not in self.names:
            return None
        return self.zip.read(path).decode("utf-8", errors="replace")

    def paths(self) -> list[str]:
        return sorted(n for n in self.names if n.startswith("vllm/"))


def version_of(source: Source) -> str:
    text = source.read("vllm/_version.py") or ""
    m = re.search(r"""(?:__version__|version)\s*(?::[^=]*)?=\s*['"]([^'"]+)['"]""", text)
    return m[1] if m else "unknown"


def installed_source() -> Source | None:
    """The installed vLLM's files, found without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(list(spec.submodule_search_locations)[0])
    return DirSource(package.parent, label=f"{package} (installed)")


def wheel_source(version: str, wheels: str) -> Source:
    """vllm-VERSION's wheel: from `wheels`, else the cache, else `pip download` into the cache."""
    for folder in (Path(wheels), CACHE_WHEELS):
        found = sorted(glob.glob(str(folder / f"vllm-{version}-*.whl")))
        if found:
            return ZipSource(Path(found[0]))
    CACHE_WHEELS.mkdir(parents=True, exist_ok=True)
    print(f"seam_check: downloading vllm=={version} into {CACHE_WHEELS}", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "-d", str(CACHE_WHEELS), f"vllm=={version}"], check=True, stdout=sys.stderr)
    found = sorted(glob.glob(str(CACHE_WHEELS / f"vllm-{version}-*.whl")))
    if not found:
        raise SystemExit(f"seam_check: no wheel for vllm=={version} after pip download")
    return ZipSource(Path(found[0]))


def source_for(spec: str, wheels: str) -> Source:
    if spec == "installed":
        source = installed_source()
        if source is None:
            raise SystemExit("seam_check: vLLM is not installed here; name a version (0.32.0) or a wheel")
        return source
    path = Path(spec)
    if path.suffix == ".whl" and path.is_file():
        return ZipSource(path)
    if path.is_dir():
        return DirSource(path.parent if path.name == "vllm" else path)
    if re.fullmatch(r"\d+\.\d+(\.\d+)?\S*", spec):
        return wheel_source(spec, wheels)
    raise SystemExit(f"seam_check: {spec!r} is neither 'installed', a version, a .whl nor a folder")


# ---------------------------------------------------------------- the tree's symbols


@dataclass
class Found:
    module: str
    qualname: str
    node: ast.AST | None  # ClassDef, FunctionDef, an assignment, ... (None: a module)
    how: str  # "def", "class", "field", "self.x in __init__", "re-export of m.X", ...
    cls: ast.ClassDef | None = None  # the class that holds it
    module_node: ast.Module | None = None  # the module a class lives in (to resolve its bases)

    @property
    def where(self) -> str:
        return f"{self.module}.{self.qualname}" if self.qualname else self.module


_IGNORED_BASES = {"object", "ABC", "Generic", "Protocol", "Enum", "IntEnum", "NamedTuple", "TypedDict"}


class Tree:
    """A vLLM source tree's modules, parsed on demand."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.version = version_of(source)
        self._modules: dict[str, tuple[ast.Module, bool] | None] = {}
        self._texts: dict[str, str] | None = None

    # ---- modules

    def module(self, name: str) -> tuple[ast.Module, bool] | None:
        """(parsed module, is a package) or None when the tree has no such module."""
        if name not in self._modules:
            parsed = None
            base = name.replace(".", "/")
            for path, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
                text = self.source.read(path)
                if text is not None:
                    parsed = (ast.parse(text), package)
                    break
            self._modules[name] = parsed
        return self._modules[name]

    def _absolute(self, module: str, is_package: bool, target: str | None, level: int) -> str:
        if level == 0:
            return target or ""
        parts = module.split(".")
        base = parts if is_package else parts[:-1]
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join(base + ([target] if target else []))

    # ---- module-level names

    def lookup(self, module: str, name: str, _seen: set | None = None) -> Found | None:
        """`name` as module `module` defines or imports it (None: it does not)."""
        seen = _seen if _seen is not None else set()
        if (module, name) in seen:
            return None
        seen.add((module, name))
        parsed = self.module(module)
        if parsed is None:
            return None
        tree, package = parsed
        stars: list[str] = []
        for node in _top_level(tree.body):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                kind = "class" if isinstance(node, ast.ClassDef) else "def"
                return Found(module, name, node, kind, module_node=tree)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and name in _assigned_names(node):
                return Found(module, name, node, "module variable", module_node=tree)
            if isinstance(node, ast.ImportFrom):
                src = self._absolute(module, package, node.module, node.level)
                for alias in node.names:
                    if alias.name == "*":
                        stars.append(src)
                    elif (alias.asname or alias.name) == name:
                        inner = self.lookup(src, alias.name, seen)
                        if inner is None and self.module(f"{src}.{alias.name}") is not None:
                            inner = Found(f"{src}.{alias.name}", "", None, "module")
                        if inner is not None:
                            if inner.module != module:
                                inner.how += f" (imported into {module})"
                            return inner
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname == name and self.module(alias.name) is not None:
                        return Found(alias.name, "", None, "module")
        for src in stars:
            inner = self.lookup(src, name, seen)
            if inner is not None:
                inner.how += f" (star-imported into {module})"
                return inner
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__" and any(
                    isinstance(c, ast.Constant) and c.value == name for c in ast.walk(node)):
                return Found(module, name, node, "module __getattr__", module_node=tree)
        if self.module(f"{module}.{name}") is not None:
            return Found(f"{module}.{name}", "", None, "module")
        return None

    # ---- class members

    def class_member(self, owner: Found, attr: str, inherit: bool = True,
                     _seen: set | None = None) -> Found | None:
        """`attr` of class `owner`: in its body, set on self in a method, or (inherit) from a base class."""
        cls = owner.node
        if not isinstance(cls, ast.ClassDef):
            return None
        seen = _seen if _seen is not None else set()
        if (owner.module, owner.qualname) in seen:
            return None
        seen.add((owner.module, owner.qualname))
        qual = f"{owner.qualname}.{attr}"
        body = list(_flatten(cls.body))
        defs = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == attr]
        if defs:
            # The last definition wins (typing.overload stubs come first).
            real = [d for d in defs if "overload" not in _decorators(d)] or defs
            return Found(owner.module, qual, real[-1], "def", cls=cls, module_node=owner.module_node)
        for node in body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and attr in _assigned_names(node):
                return Found(owner.module, qual, node, "class attribute", cls=cls, module_node=owner.module_node)
            if isinstance(node, ast.ClassDef) and node.name == attr:
                return Found(owner.module, qual, node, "nested class", cls=cls, module_node=owner.module_node)
        methods = [n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        methods.sort(key=lambda m: m.name != "__init__")
        for method in methods:
            for sub in ast.walk(method):
                if isinstance(sub, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and attr in _self_targets(sub):
                    return Found(owner.module, qual, sub, f"self.{attr} in {method.name}", cls=cls,
                                 module_node=owner.module_node)
        if owner.module_node is not None:
            # torch modules: buffers registered by name (`layer.register_buffer("_k_scale", ...)`) in its module.
            for sub in ast.walk(owner.module_node):
                if (isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute)
                        and sub.func.attr in ("register_buffer", "register_parameter") and sub.args
                        and isinstance(sub.args[0], ast.Constant) and sub.args[0].value == attr):
                    return Found(owner.module, qual, sub, f"{sub.func.attr} in {owner.module}", cls=cls,
                                 module_node=owner.module_node)
            # ... and attributes its module's helpers set on the layer (`layer._k_scale_float = 1.0`).
            for sub in ast.walk(owner.module_node):
                if isinstance(sub, ast.Assign) and any(
                        isinstance(t, ast.Attribute) and t.attr == attr and isinstance(t.value, ast.Name)
                        and t.value.id == "layer" for t in sub.targets):
                    return Found(owner.module, qual, sub, f"layer.{attr} set in {owner.module}", cls=cls,
                                 module_node=owner.module_node)
        if attr == "__init__" and _is_dataclass(cls):
            return Found(owner.module, qual, cls, "dataclass __init__", cls=cls, module_node=owner.module_node)
        if not inherit:
            return None
        for base in self.bases(owner):
            inner = self.class_member(base, attr, True, seen)
            if inner is not None:
                if "inherited" not in inner.how:
                    inner.how += f" (inherited from {base.qualname})"
                return inner
        return None

    def bases(self, owner: Found) -> list[Found]:
        cls = owner.node
        assert isinstance(cls, ast.ClassDef)
        out = []
        for expr in cls.bases:
            if isinstance(expr, ast.Subscript):
                expr = expr.value
            dotted = _dotted(expr)
            if dotted is None or dotted.split(".")[-1] in _IGNORED_BASES:
                continue
            head, *rest = dotted.split(".")
            found = self.lookup(owner.module, head)
            for part in rest:
                if found is None:
                    break
                found = self.lookup(found.module, part) if found.node is None else self.class_member(found, part)
            if found is not None and isinstance(found.node, ast.ClassDef):
                out.append(found)
        return out

    # ---- targets

    def resolve(self, target: str, inherit: bool = True) -> tuple[Found | None, str]:
        """`module:Qual.name` -> (what it is, why not when None)."""
        module, _, qual = target.partition(":")
        if self.module(module) is None:
            return None, f"module {module} is gone"
        if not qual:
            return Found(module, "", None, "module"), ""
        head, *rest = qual.split(".")
        found = self.lookup(module, head)
        if found is None:
            return None, f"{module} has no {head}"
        for i, part in enumerate(rest):
            if found.node is None:  # a module
                found = self.lookup(found.module, part)
            elif isinstance(found.node, ast.ClassDef):
                last = i == len(rest) - 1
                found = self.class_member(found, part, inherit=inherit or not last)
            else:
                return None, f"{found.where} is not a class"
            if found is None:
                return None, f"{'.'.join([head, *rest[:i]])} has no {part}"
        return found, ""

    # ---- where a missing name went

    def texts(self) -> dict[str, str]:
        if self._texts is None:
            self._texts = {p: self.source.read(p) or "" for p in self.source.paths()}
        return self._texts

    def find_elsewhere(self, name: str, owner: str | None, limit: int = 4) -> list[str]:
        """Where this tree defines `name` (a class or function; with `owner`, a member of a class of that
        name first, else any class's member)."""
        hits: list[str] = []
        if owner is None:
            pattern = re.compile(rf"^(?:class|def|async def) {re.escape(name)}\b", re.M)
        else:
            pattern = re.compile(rf"^class {re.escape(owner)}\b", re.M)
        for path, text in self.texts().items():
            if not pattern.search(text):
                continue
            module = _module_of(path)
            if owner is None:
                hits.append(f"{module}.{name}")
            else:
                cls = self.lookup(module, owner)
                if cls is not None and cls.module == module and self.class_member(cls, name) is not None:
                    hits.append(f"{module}.{owner}.{name}")
            if len(hits) >= limit:
                break
        if not hits and owner is not None:
            member = re.compile(rf"^\s+(?:async )?def {re.escape(name)}\(|self\.{re.escape(name)}\s*[:=][^=]", re.M)
            for path, text in self.texts().items():
                if member.search(text):
                    hits.append(f"{_module_of(path)} (another class has a member of that name)")
                    if len(hits) >= limit:
                        break
        return hits


def _module_of(path: str) -> str:
    return path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def _flatten(body: list[ast.stmt], skip_type_checking: bool = False) -> Iterable[ast.stmt]:
    """Statements, including those inside if/else and try blocks at this level."""
    for node in body:
        if isinstance(node, ast.If):
            if skip_type_checking and "TYPE_CHECKING" in ast.unparse(node.test):
                yield from _flatten(node.orelse, skip_type_checking)
                continue
            yield from _flatten(node.body, skip_type_checking)
            yield from _flatten(node.orelse, skip_type_checking)
        elif isinstance(node, ast.Try):
            yield from _flatten(node.body, skip_type_checking)
            for handler in node.handlers:
                yield from _flatten(handler.body, skip_type_checking)
            yield from _flatten(node.orelse, skip_type_checking)
            yield from _flatten(node.finalbody, skip_type_checking)
        else:
            yield node


def _top_level(body: list[ast.stmt]) -> Iterable[ast.stmt]:
    """A module's runtime statements: inside top-level if/try blocks too, not under `if TYPE_CHECKING`."""
    return _flatten(body, skip_type_checking=True)


def _assigned_names(node: ast.Assign | ast.AnnAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                names.add(sub.id)
    return names


def _self_targets(node: ast.Assign | ast.AnnAssign | ast.AugAssign) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    names = set()
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                names.add(sub.attr)
    return names


def _dotted(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        inner = _dotted(expr.value)
        return None if inner is None else f"{inner}.{expr.attr}"
    return None


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> list[str]:
    out = []
    for d in node.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        name = _dotted(d)
        if name:
            out.append(name.split(".")[-1])
    return out


def _is_dataclass(cls: ast.ClassDef) -> bool:
    for d in cls.decorator_list:
        call = d if isinstance(d, ast.Call) else None
        name = (_dotted(call.func if call else d) or "").split(".")[-1]
        if name in ("dataclass", "config"):  # vLLM's @config is a pydantic dataclass
            return not (call and any(k.arg == "init" and isinstance(k.value, ast.Constant) and k.value.value is False
                                     for k in call.keywords))
    return False


def signature(found: Found | None) -> str | None:
    """Parameter names, kinds and defaults (no annotations); a decorator kind in front. None: not a function."""
    if found is None:
        return None
    node = found.node
    if found.how.startswith("dataclass __init__"):
        return "<dataclass __init__>"
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or found.how == "module __getattr__":
        return None
    a = node.args
    params: list[str] = []
    positional = a.posonlyargs + a.args
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        params.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
        if a.posonlyargs and i == len(a.posonlyargs) - 1:
            params.append("/")
    if a.vararg:
        params.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        params.append("*")
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(arg.arg if kw_default is None else f"{arg.arg}={ast.unparse(kw_default)}")
    if a.kwarg:
        params.append(f"**{a.kwarg.arg}")
    kind = next((d for d in _decorators(node) if d in ("staticmethod", "classmethod", "property")), "")
    prefix = "async " if isinstance(node, ast.AsyncFunctionDef) else ""
    return f"{kind + ' ' if kind else ''}{prefix}({', '.join(params)})"


# ---------------------------------------------------------------- the check


@dataclass
class Row:
    symbol: str
    list: str  # "patch" | "relied"
    kind: str
    versions: str
    status: str  # ok | changed | missing | added-but-present
    where: str = ""
    signature: str | None = None
    baseline: str | None = None
    note: str = ""
    reviewed: str = ""  # a changed signature relied_on.REVIEWED says the seam handles: why


@dataclass
class Report:
    label: str
    version: str
    minor: str
    rows: list[Row] = field(default_factory=list)
    outside: list[Row] = field(default_factory=list)  # rows whose window excludes this version
    problems: list[str] = field(default_factory=list)  # windows that cover no known version, ...

    def count(self, status: str) -> int:
        return sum(r.status == status for r in self.rows)

    @property
    def failed(self) -> bool:
        return bool(self.problems) or any(r.status != "ok" and not r.reviewed for r in self.rows)

    def summary(self) -> str:
        reviewed = sum(bool(r.reviewed) for r in self.rows)
        changed = f"{self.count('changed')} changed" + (f" ({reviewed} reviewed)" if reviewed else "")
        counts = [f"{self.count('ok')} ok", changed, f"{self.count('missing')} missing"]
        if self.count("added-but-present"):
            counts.append(f"{self.count('added-but-present')} added-but-present")
        if self.problems:
            counts.append(f"{len(self.problems)} window problem(s)")
        return f"{len(self.rows)} rows: {', '.join(counts)}"


def _patch_target(p: patches.Patch) -> str:
    return f"{p.module}:{p.owner + '.' if p.owner else ''}{p.attr}"


def check_patch(tree: Tree, p: patches.Patch) -> tuple[str, Found | None, str]:
    """(status, what was found, note) for one PATCHES row, as `patches.apply` would see it."""
    target = _patch_target(p)
    if p.kind == "added":
        owner, why = tree.resolve(target.rsplit(".", 1)[0])
        if owner is None:
            return "missing", None, f"owner: {why}"
        own = tree.class_member(owner, p.attr, inherit=False)
        if own is not None:
            return "added-but-present", own, f"vLLM defines {own.where} ({own.how})"
        inherited = tree.class_member(owner, p.attr)
        note = f"absent as it must be{'; a base class has it: ' + inherited.where if inherited else ''}"
        return "ok", owner, note
    # apply() reads the owner's own __dict__: a method only a base class has is missing.
    found, why = tree.resolve(target, inherit=False)
    if found is None:
        return "missing", None, why
    sig = signature(found)
    if p.kind == "function":
        if not isinstance(found.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "missing", found, f"{found.where} is a {found.how}, not a function"
        note = "" if found.module == p.module else f"a re-export of {found.where}: patched where it is imported"
        return "ok", found, note
    if p.kind == "staticmethod" and not (sig or "").startswith("staticmethod"):
        return "changed", found, f"not a staticmethod any more: {sig}"
    if p.kind == "method" and sig is not None and sig.split(" (")[0] in ("staticmethod", "classmethod", "property"):
        return "changed", found, f"now a {sig.split(' ')[0]}: {sig}"
    return "ok", found, ""


def check_relied(tree: Tree, r: relied_on.Relied) -> tuple[str, Found | None, str]:
    notes = []
    for i, target in enumerate(r.alternatives):
        found, why = tree.resolve(target)
        if found is None:
            notes.append(why)
            continue
        want_class = r.kind == "class" and not isinstance(found.node, ast.ClassDef)
        want_module = r.kind == "module" and found.node is not None
        want_function = r.kind in ("function", "method") and signature(found) is None
        if want_class or want_module or want_function:
            return "changed", found, f"{found.where} is now a {found.how}, not a {r.kind}"
        note = f"found at alternative {i + 1}: {found.where}" if i else ""
        return "ok", found, note
    return "missing", None, "; ".join(notes)


def _hint(tree: Tree, target: str) -> str:
    module, _, qual = target.partition(":")
    parts = qual.split(".") if qual else []
    if not parts:
        return ""
    name, owner = parts[-1], (parts[-2] if len(parts) > 1 else None)
    if owner is not None and tree.resolve(f"{module}:{'.'.join(parts[:-1])}")[0] is None:
        hits = tree.find_elsewhere(owner, None)  # the class itself moved
        hits = [f"{h}.{name}" for h in hits]
    else:
        hits = tree.find_elsewhere(name, owner)
    return f"; found elsewhere: {', '.join(hits)}" if hits else "; not found elsewhere in this tree"


@dataclass
class Recorded:
    """Signatures recorded from the baseline vLLM (`BASELINE_FILE`, written by
    --write-baseline): what an installed vLLM is compared with when the
    baseline's own files are not at hand (the 0.34 leg), and what a
    reinstalled 0.32 must still match."""

    version: str
    signatures: dict[str, str | None]

    @classmethod
    def load(cls, path: Path | None = None) -> Recorded:
        data = json.loads((path or BASELINE_FILE).read_text())
        return cls(data["vllm"], data["signatures"])


def record(baseline: Tree) -> Recorded:
    """Every row's baseline signature (functions and methods, every known version's rows)."""
    signatures: dict[str, str | None] = {}
    rows = [p for p in patches.PATCHES if p.kind != "added"]
    relied = list(relied_on.RELIED_ON) + [r for m in versions.KNOWN for r in wrapper_needs(patches.PATCHES, m)]
    for p in rows:
        signatures[_patch_target(p)] = _baseline_sig(baseline, _patch_target(p), patch=True)
    for r in relied:
        if r.kind in ("function", "method"):
            signatures[r.target] = _baseline_sig(baseline, r.target, patch=False)
    return Recorded(baseline.version, dict(sorted(signatures.items())))


def _baseline_sig(baseline: Tree | Recorded | None, target: str, patch: bool) -> str | None:
    if baseline is None:
        return None
    if isinstance(baseline, Recorded):
        return baseline.signatures.get(target)
    if patch:
        found, _ = baseline.resolve(target, inherit=False)
    else:
        found = None
        for alt in target.split(" or "):
            found, _ = baseline.resolve(alt.strip())
            if found is not None:
                break
    return signature(found)


def _where(found: Found | None) -> str:
    if found is None:
        return ""
    how = found.how
    return found.where if how in ("def", "class", "module", "class attribute") else f"{found.where} [{how}]"


def _note(r: Row) -> str:
    """The table's last cell: where it was found (when not where the row names it) and the signature."""
    if r.status != "ok":
        return r.note + (f"; reviewed: {r.reviewed}" if r.reviewed else "")
    where = r.where
    if where.split(" [")[0] == r.symbol:
        where = where[len(r.symbol):].strip(" []")
    if r.signature == "<dataclass __init__>" and where == "dataclass __init__":
        where = ""
    return "; ".join(filter(None, [where, r.signature or "", r.note]))


def check(tree: Tree, baseline: Tree | Recorded | None, minor: str | None = None,
          patch_rows: Iterable[patches.Patch] | None = None,
          relied_rows: Iterable[relied_on.Relied] | None = None) -> Report:
    """Every row whose versions include this tree's minor version, resolved and compared with `baseline`."""
    minor = minor or versions.minor_of(tree.version) or "unknown"
    report = Report(tree.source.label, tree.version, minor)
    known = sorted(versions.KNOWN, key=versions.minor_key)
    rows_minor = minor
    if minor not in known:
        # A version the seam has no rows for: the rows of the nearest known version.
        newer = minor == "unknown" or versions.minor_key(minor) > versions.minor_key(known[-1])
        rows_minor = known[-1] if newer else known[0]
        report.problems.append(f"vLLM {minor} has no seam rows (known: {', '.join(known)}); "
                               f"checked the rows of {rows_minor}")
    all_patches = list(patches.PATCHES if patch_rows is None else patch_rows)
    all_relied = list(relied_on.RELIED_ON if relied_rows is None else relied_rows)
    all_relied += wrapper_needs(all_patches, rows_minor)
    for p in all_patches:
        if not any(p.applies_to(m) for m in known):
            report.problems.append(f"patch row {p.symbol} [{p.versions}] applies to no known version")
        target = _patch_target(p)
        status, found, note = check_patch(tree, p)
        sig = signature(found) if p.kind != "added" else None
        base = _baseline_sig(baseline, target, patch=True) if p.kind != "added" else None
        row = Row(p.symbol, "patch", p.kind, p.versions, status, _where(found), sig, base, note)
        if not p.applies_to(rows_minor):
            row.note = _outside_note(tree, target, found)
            report.outside.append(row)
            continue
        _compare(row, rows_minor)
        if row.status == "missing":
            row.note += _hint(tree, target)
        report.rows.append(row)
    for r in all_relied:
        if not any(r.applies_to(m) for m in known) and r.versions:
            report.problems.append(f"relied-on row {r.symbol} [{r.versions}] applies to no known version")
        status, found, note = check_relied(tree, r)
        sig = signature(found) if r.kind in ("function", "method") else None
        base = _baseline_sig(baseline, r.target, patch=False) if r.kind in ("function", "method") else None
        row = Row(r.symbol, "relied", r.kind, r.versions, status, _where(found), sig, base, note)
        if not r.applies_to(rows_minor):
            row.note = _outside_note(tree, r.alternatives[0], found)
            report.outside.append(row)
            continue
        _compare(row, rows_minor)
        if row.status == "missing":
            row.note += _hint(tree, r.alternatives[0])
        report.rows.append(row)
    return report


def wrapper_needs(rows: Iterable[patches.Patch], minor: str) -> list[relied_on.Relied]:
    """relied_on.WRAPPER_NEEDS as rows: what each applicable patch's wrapper reads on the patched class."""
    out: dict[str, relied_on.Relied] = {}
    for p in rows:
        if not p.owner or not p.applies_to(minor):
            continue
        for kind, attr in relied_on.WRAPPER_NEEDS.get(p.make, ()):
            target = f"{p.module}:{p.owner}.{attr}"
            out.setdefault(target, relied_on.Relied(kind, target, p.versions, f"read by {p.make}"))
    return list(out.values())


def _compare(row: Row, minor: str) -> None:
    if row.status != "ok" or row.signature is None or row.baseline is None:
        return
    if row.signature != row.baseline:
        row.status = "changed"
        row.note = f"{row.baseline} -> {row.signature}" + (f"; {row.note}" if row.note else "")
        for r in relied_on.REVIEWED:
            if r.symbol == row.symbol and r.signature == row.signature and r.applies_to(minor):
                row.reviewed = r.why


def _module_part(r: Row) -> str:
    for p in patches.PATCHES:
        if p.symbol == r.symbol:
            return p.module
    for rel in relied_on.RELIED_ON:
        if rel.symbol == r.symbol:
            return rel.alternatives[0].partition(":")[0]
    return r.symbol.rsplit(".", 1)[0]


def _outside_note(tree: Tree, target: str, found: Found | None) -> str:
    module = target.partition(":")[0]
    if tree.module(module) is None:
        return "absent (module gone)"
    return "present here (the window could include this version)" if found is not None else "absent"


# ---------------------------------------------------------------- output


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|").replace("\n", " ")


def markdown(report: Report) -> str:
    lines = [f"vLLM {report.version} ({report.label}); rows for {report.minor}", "",
             "| symbol | kind | status | where found / signature note |", "|---|---|---|---|"]
    for r in report.rows:
        status = "changed (reviewed)" if r.reviewed else r.status
        lines.append(f"| `{_cell(r.symbol)}` | {r.list} {r.kind} | {status} | {_cell(_note(r))} |")
    if report.outside:
        lines += ["", f"Rows whose versions exclude {report.minor} (not checked):", ""]
        gone: dict[str, int] = {}
        for r in report.outside:
            if r.note == "absent (module gone)":
                module = r.symbol if r.kind == "module" else _module_part(r)
                gone[module] = gone.get(module, 0) + 1
            else:
                lines.append(f"- `{r.symbol}` [{r.versions}]: {r.note}")
        lines += [f"- module `{m}` gone: {n} row(s)" for m, n in gone.items()]
    if report.problems:
        lines += ["", "Window problems:", ""] + [f"- {p}" for p in report.problems]
    lines += ["", f"**{report.version}: {report.summary()}**"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", default=["installed"],
                        help="'installed' (default), a vLLM version (0.34.0), a .whl or a source folder")
    parser.add_argument("--wheels", default=DEFAULT_WHEELS, help=f"folder of vllm-*.whl (default {DEFAULT_WHEELS})")
    parser.add_argument("--baseline", default="installed",
                        help="the tree signatures are compared with: 'recorded' (the baseline's, from "
                             f"{BASELINE_FILE.name}), 'installed' (default; the 0.32.0 wheel "
                             "when vLLM is not installed), a version, a .whl or a folder")
    parser.add_argument("--json", action="store_true", help="JSON instead of Markdown")
    parser.add_argument("--write-baseline", action="store_true",
                        help=f"record the baseline's signatures in {BASELINE_FILE.relative_to(ROOT)} and exit")
    args = parser.parse_args(argv)

    if "vllm" in sys.modules:  # patches/relied_on must not import vLLM
        print("seam_check: importing the seam tables imported vLLM", file=sys.stderr)
        return 1
    baseline: Tree | Recorded
    if args.baseline == "recorded":
        baseline = Recorded.load()
    else:
        base_source = installed_source() if args.baseline == "installed" else source_for(args.baseline, args.wheels)
        if base_source is None:
            base_source = wheel_source(f"{BASELINE_MINOR}.0", args.wheels)
        baseline = Tree(base_source)
    if args.write_baseline:
        assert isinstance(baseline, Tree), "--write-baseline records a source tree"
        recorded = record(baseline)
        BASELINE_FILE.write_text(json.dumps({"vllm": recorded.version, "signatures": recorded.signatures},
                                            indent=1) + "\n")
        print(f"seam_check: {len(recorded.signatures)} signatures of vLLM {recorded.version} -> {BASELINE_FILE}")
        return 0
    failed = False
    out = []
    for spec in args.versions:
        if isinstance(baseline, Tree) and spec == args.baseline:
            tree = baseline
        else:
            tree = Tree(source_for(spec, args.wheels))
        report = check(tree, baseline)
        failed |= report.failed
        out.append(report)
    if args.json:
        print(json.dumps([{**asdict(r), "summary": r.summary(), "failed": r.failed} for r in out], indent=1))
    else:
        print("\n\n".join(markdown(r) for r in out))
        label = baseline.source.label if isinstance(baseline, Tree) else BASELINE_FILE.relative_to(ROOT)
        print(f"\n(baseline: vLLM {baseline.version}, {label}; {time.strftime('%Y-%m-%d')})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
