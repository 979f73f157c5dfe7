"""vLLM general-plugin entry point (`vllm.general_plugins: kvcompress`)."""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger("vllm.kvcompress")  # under vLLM's configured logger


def register() -> None:
    """Install the seam. vLLM calls this in every process, without a try: on a
    vLLM version this plugin does not serve it must not raise, so it installs
    only a startup refusal for compression and vLLM runs as without it."""
    from . import patches

    served = patches.support()
    if not served.serves:
        logger.warning("vllm-kvcompress is inactive on vLLM %s (vLLM runs as without it): %s", served.version,
                       served.window)
        patches.apply_refusal(served)
        return
    if served.untested:
        logger.warning("vllm-kvcompress on vLLM %s, a version it has not been tested on (%s is set)",
                       served.version, patches.ALLOW_UNTESTED_ENV)
    try:
        patches.apply_all()
    except RuntimeError as e:  # a seam row this vLLM does not match: nothing was installed
        logger.error("vllm-kvcompress is inactive: %s", e)
        patches.apply_refusal(dataclasses.replace(served, reason=str(e)))
