"""vLLM general-plugin entry point (`vllm.general_plugins: kvcompress`)."""

from __future__ import annotations

import dataclasses
import logging

from . import patches, versions

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger


def register() -> None:
    """Install the seam. vLLM calls this in every process, without a try: it
    must never raise, and whatever fails must leave vLLM as it was.

    - A vLLM outside the window, or one whose symbols a seam row does not
      find: only the flags and a startup refusal of compression (one line
      naming why); vLLM runs as without the plugin.
    - Any other failure (a seam module that does not import on this vLLM,
      anything unexpected): every row taken out again, one warning, vLLM
      untouched (`--kv-compress` is then vLLM's unknown argument).
    """
    try:
        _install()
    except Exception as e:  # noqa: BLE001 - vLLM calls plugins without a try
        try:
            patches.remove_all()
        finally:
            reason = " ".join(f"{type(e).__name__}: {e}".split())
            logger.warning("vllm-kvcompress is inactive (vLLM runs as without it; nothing was installed): %s",
                           reason)


def _install() -> None:
    served = versions.support()
    if not served.serves:
        logger.warning("vllm-kvcompress is inactive on vLLM %s (vLLM runs as without it): %s", served.version,
                       served.window)
        patches.apply_refusal(served)
        return
    if served.untested:
        logger.warning("vllm-kvcompress on vLLM %s, a version it has not been tested on (%s is set)",
                       served.version, versions.ALLOW_UNTESTED_ENV)
    try:
        patches.apply_all()
    except patches.SeamMismatch as e:  # a seam row this vLLM does not match: nothing is installed
        logger.error("vllm-kvcompress is inactive: %s", e)
        patches.apply_refusal(dataclasses.replace(served, reason=str(e)))
