"""A stub Triton backend named ``cpu`` (test-only; see ../README.md).

Its only job is to exist: vLLM's CPU build enables Triton (and so Model Runner
V2) only when Triton lists a ``cpu`` backend. Kernels then run in Triton's
interpreter (TRITON_INTERPRET=1); nothing is ever compiled for this backend.
"""

import importlib.abc
import sys

_INTERPRETER = "triton.runtime.interpreter"


def _boolean_masks(interpreter) -> None:
    """Triton 3.6's interpreter combines an int1 tensor and an int1 scalar
    with `&` into int64, then refuses it as a load or store mask ("mask has
    unsupported dtype"); compiled Triton keeps int1. vLLM's MRV2 n-gram
    kernel builds its masks so: cast them back (nonzero is true, as for int1)."""
    import numpy as np

    builder = interpreter.InterpreterBuilder

    def as_bool(mask):
        if mask.data.dtype == np.bool_:
            return mask
        return interpreter.TensorHandle(mask.data != 0, interpreter.tl.int1)

    load, store = builder.create_masked_load, builder.create_masked_store
    builder.create_masked_load = lambda self, ptrs, mask, *a: load(self, ptrs, as_bool(mask), *a)
    builder.create_masked_store = lambda self, ptrs, value, mask, *a: store(self, ptrs, value, as_bool(mask), *a)


class _PatchInterpreterOnImport(importlib.abc.MetaPathFinder):
    """Triton imports this backend while it is itself being imported, before
    its interpreter module exists: patch that module once it is loaded."""

    def find_spec(self, name, path, target=None):
        if name != _INTERPRETER:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader

        class Patching(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                _boolean_masks(module)

        spec.loader = Patching()
        return spec


if _INTERPRETER in sys.modules:
    _boolean_masks(sys.modules[_INTERPRETER])
elif not any(isinstance(f, _PatchInterpreterOnImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _PatchInterpreterOnImport())
