"""Kernel tests: run Triton on CPU through its interpreter when no GPU is present.

TRITON_INTERPRET must be set before Triton is first imported, hence at conftest import.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


