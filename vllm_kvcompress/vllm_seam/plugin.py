"""vLLM general-plugin entry point (`vllm.general_plugins: kvcompress`)."""

from __future__ import annotations


def register() -> None:
    """Install the seam. vLLM calls this in every process; it runs once per process."""
    from . import patches

    patches.apply_all()
