"""The stub's driver: always active, targets ``cpu``, runs nothing itself."""

from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class CPUStubDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return True

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("test stub: no launcher code is generated for the cpu backend")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_benchmarker(self):
        from triton.testing import do_bench

        return do_bench
