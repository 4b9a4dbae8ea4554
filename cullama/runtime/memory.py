"""How much memory a device has free, and a check that a model's buffers fit in it before any is allocated:
a context too long for the machine is refused in one line naming what it needs and what is free, instead of
an allocation failure (or an out-of-memory kill) after minutes of loading."""

from __future__ import annotations

import os
from typing import Mapping

from ..common.errors import ResourceError


def free_bytes(device: str) -> tuple[int | None, str]:
    """(bytes free now, where they are); None where this machine does not say."""
    if device == "cuda":
        import cupy

        free, _ = cupy.cuda.runtime.memGetInfo()
        pool = cupy.get_default_memory_pool()
        cached = pool.total_bytes() - pool.used_bytes()  # blocks CuPy freed but keeps for reuse
        return free + cached, "the GPU has"
    return available_ram(), "the CPU has"


def available_ram() -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.1f} MiB"


def check_fits(device: str, needs: Mapping[str, int], advice: str) -> None:
    """ResourceError unless the parts in `needs` (name -> bytes) fit in what `device` has free."""
    total = sum(needs.values())
    free, where = free_bytes(device)
    if free is None or total <= free:
        return
    parts = ", ".join(f"{name} {gib(n)}" for name, n in needs.items() if n)
    raise ResourceError(f"needs {gib(total)} ({parts}) but {where} {gib(free)} free: {advice}")
