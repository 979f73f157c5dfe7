"""The vLLM versions this plugin serves: its window, and why it refuses.

Plain Python (no vLLM import beyond reading its version): the plugin entry
point decides from this, before any seam row is touched, whether to install
the seam, only a startup refusal, or nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

# vLLM versions (major.minor) the seam has rows for; the tested ones are
# served by default, the others only with ALLOW_UNTESTED_ENV=1.
TESTED = ("0.32", "0.34")
UNTESTED = ("0.33",)
KNOWN = (*TESTED, *UNTESTED)
ALLOW_UNTESTED_ENV = "VLLM_KVCOMPRESS_ALLOW_UNTESTED_VLLM"

# Why compression cannot be served in this process (set with the startup
# refusal on a vLLM outside the window); None: it can.
refusal: str | None = None


def minor_key(minor: str) -> tuple[int, ...]:
    return tuple(int(x) for x in minor.split("."))


def covers(span: str, minor: str) -> bool:
    """Whether a row's versions ("0.32-0.34", or one "0.32") include `minor`."""
    first, _, last = span.partition("-")
    return minor_key(first) <= minor_key(minor) <= minor_key(last or first)


def minor_of(version: str) -> str | None:
    """"0.32.0+cpu" -> "0.32" (None: not a release version)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return f"{m[1]}.{m[2]}" if m else None


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


@dataclass(frozen=True)
class Support:
    """Whether this plugin serves the installed vLLM, and why not."""

    version: str  # installed vLLM
    minor: str | None  # its rows (None: none)
    serves: bool
    untested: bool  # served behind ALLOW_UNTESTED_ENV
    reason: str = ""  # why a version in the window is not served after all (a seam row that does not match)

    @property
    def window(self) -> str:
        return (f"vllm-kvcompress supports vLLM {', '.join(TESTED)} (tested) and {', '.join(UNTESTED)} "
                f"(untested, with {ALLOW_UNTESTED_ENV}=1)")

    @property
    def refusal(self) -> str:
        """The one line a request for compression gets on a vLLM this plugin does not serve."""
        return f"kv_compress cannot be served on vLLM {self.version}: {self.reason or self.window}"


def support(version: str | None = None) -> Support:
    version = installed_vllm_version() if version is None else version
    minor = minor_of(version)
    if minor in TESTED:
        return Support(version, minor, serves=True, untested=False)
    allowed = os.environ.get(ALLOW_UNTESTED_ENV, "") not in ("", "0")
    if minor in UNTESTED:
        return Support(version, minor, serves=allowed, untested=True)
    return Support(version, None, serves=False, untested=True)
