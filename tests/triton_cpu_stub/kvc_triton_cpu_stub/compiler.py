"""The stub's compiler: never compiles (kernels run in Triton's interpreter)."""

from __future__ import annotations

import hashlib

from triton.backends.compiler import BaseBackend, GPUTarget

_MESSAGE = ("the `cpu` Triton backend here is a test stub (tests/triton_cpu_stub) and cannot compile; "
            "run with TRITON_INTERPRET=1")


class CPUStubBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return hashlib.sha256(b"kvc_triton_cpu_stub").hexdigest()

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(_MESSAGE)

    def add_stages(self, stages: dict, options: object, language) -> None:
        raise RuntimeError(_MESSAGE)

    def load_dialects(self, context) -> None:
        pass

    def get_module_map(self) -> dict:
        return {}
