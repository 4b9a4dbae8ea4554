"""Which device to run on, and what this machine has (for `cullama info` and the benchmark's record)."""

from __future__ import annotations

import platform
import sys
from typing import Callable

import numpy as np

from .errors import DeviceError

DEVICES = ("auto", "cpu", "cuda")


def cuda_status() -> tuple[bool, str]:
    """(usable, why): a GPU is usable when CuPy imports and the driver reports at least one device."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install raising anything else
        return False, f"CuPy is not importable ({type(exc).__name__}: {exc}); install with `pip install cullama[cuda]`"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no usable NVIDIA GPU ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "no NVIDIA GPU found"
    return True, f"{count} GPU(s)"


def resolve(device: str, on_fallback: Callable[[str], None] | None = None) -> str:
    """'auto' -> 'cuda' when a GPU is usable, else 'cpu', and then `on_fallback` hears it in a line for the
    user: "running on the CPU: <why there is no GPU>". 'cuda' without a GPU is an error."""
    if device not in DEVICES:
        raise DeviceError(f"--device {device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    ok, why = cuda_status()
    if ok:
        return "cuda"
    if device == "cuda":
        raise DeviceError(f"--device cuda: {why}")
    if on_fallback is not None:
        on_fallback(f"running on the CPU: {why}")
    return "cpu"


def environment() -> dict:
    """Facts about this machine worth recording next to any measurement."""
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "numpy": np.__version__}
    try:
        import cupy
        env["cupy"] = cupy.__version__
    except Exception:
        env["cupy"] = None
        env["gpu"], env["gpu_status"] = None, cuda_status()[1]
        return env
    try:
        from cupy.cuda import nvrtc
        env["nvrtc"] = "%d.%d" % nvrtc.getVersion()
    except Exception as exc:
        env["nvrtc"] = f"unavailable ({type(exc).__name__})"
    ok, why = cuda_status()
    if not ok:
        env["gpu"] = None
        env["gpu_status"] = why
        return env
    runtime = cupy.cuda.runtime
    props = runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    env.update({
        "gpu": name.decode() if isinstance(name, bytes) else name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "sm_count": props["multiProcessorCount"],
        "gpu_memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "l2_mib": round(props["l2CacheSize"] / 2**20, 1),
        "driver": runtime.driverGetVersion(),
        "cuda_runtime": runtime.runtimeGetVersion(),
    })
    try:  # clocks as the driver reports them now (kHz); absent on some CuPy builds
        env["sm_clock_mhz"] = props["clockRate"] // 1000
        env["memory_clock_mhz"] = props["memoryClockRate"] // 1000
    except KeyError:
        pass
    return env
