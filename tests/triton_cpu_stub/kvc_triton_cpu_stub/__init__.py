"""A stub Triton backend named ``cpu`` (test-only; see ../README.md).

Its only job is to exist: vLLM's CPU build enables Triton (and so Model Runner
V2) only when Triton lists a ``cpu`` backend. Kernels then run in Triton's
interpreter (TRITON_INTERPRET=1); nothing is ever compiled for this backend.
"""
