"""Scorers, by name: what each observes and how it scores a layer's cached tokens.

A scorer is one module of this package: every `Scorer` subclass with a `name`
defined in a module here is registered under that name (a policy then names it
in registry.py).
"""

import importlib
import pkgutil

from .base import LogitsNoise, Observation, Observe, Scorer, hash_uniform


def _discover() -> dict[str, type[Scorer]]:
    found: dict[str, type[Scorer]] = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        for obj in vars(importlib.import_module(f"{__name__}.{module}")).values():
            if isinstance(obj, type) and issubclass(obj, Scorer) and "name" in vars(obj) \
                    and obj.__module__ == f"{__name__}.{module}":
                if obj.name in found:
                    raise RuntimeError(f"two scorers named {obj.name!r}: {found[obj.name]} and {obj}")
                found[obj.name] = obj
    return found


SCORERS: dict[str, type[Scorer]] = _discover()

__all__ = ["SCORERS", "LogitsNoise", "Observation", "Observe", "Scorer", "hash_uniform"]
