"""The machine a benchmark ran on, recorded beside its numbers."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def machine_info() -> dict:
    cpu, cores, phys = None, 0, set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        block = {}
        for line in info.splitlines() + [""]:
            if not line.strip():
                if block:
                    cores += 1
                    phys.add((block.get("physical id"), block.get("core id")))
                    cpu = cpu or block.get("model name")
                block = {}
                continue
            key, _, value = line.partition(":")
            block[key.strip()] = value.strip()
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return dict(cpu_model=cpu or platform.processor(), cpuinfo_processors=cores,
                physical_cores=len(phys) if phys and None not in next(iter(phys)) else None,
                os_cpu_count=os.cpu_count(),
                usable_cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
                mem_gib=mem, loadavg_at_start=load, platform=platform.platform(),
                python=platform.python_version())
