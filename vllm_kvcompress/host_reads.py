"""Every read of cache-device data on the host goes through `read`, which names why.

On CUDA a host read waits for everything queued on the GPU before it (a
sync): each one stalls the whole batch. So the plugin reads device data only
here: each read is counted by its reason (`COUNTS`), a test counts them in a
real engine (per step a small constant, none per layer in the attention
hooks), and another keeps `.item()`, `.tolist()`, `.cpu()` and friends out of
the rest of the package (tests/test_device_selection.py). Host data (vLLM's CPU
arrays, the plan's numbers) never needs it. The other way, host numbers go to
the device through `upload` (pinned, asynchronous: no wait either).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

COUNTS: Counter[str] = Counter()  # reason -> reads, in this process


def read(tensor: torch.Tensor, why: str) -> torch.Tensor:
    """`tensor` on the host: one transfer, counted under `why`."""
    COUNTS[why] += 1
    return tensor.to("cpu")


def read_list(tensor: torch.Tensor, why: str) -> list:
    """`tensor` as (nested) Python numbers: one transfer, counted under `why`."""
    return read(tensor, why).tolist()


def host_list(array: np.ndarray) -> list:
    """A host array (vLLM's CPU-side step inputs) as Python numbers: no
    device involved, nothing counted; here so that the package's only
    `.tolist()` calls are in this module."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"host_list takes a host numpy array, got {type(array).__name__}")
    return array.tolist()


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`. To CUDA through pinned memory, asynchronously:
    a copy from pageable memory would wait for the device (a host sync)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
