"""Which device to run on, and what this machine has (for `cullama info` and the benchmark's record)."""

from __future__ import annotations

import importlib.metadata
import platform
import re
import sys
from typing import Callable

import numpy as np

from . import cache
from .errors import DeviceError, KernelError

DEVICES = ("auto", "cpu", "cuda")
# The CUDA extras (setup.cfg), one per CUDA major version: CuPy's wheel for it and the NVRTC wheel it loads.
EXTRAS = {12: ("cuda12", "cupy-cuda12x", "nvidia-cuda-nvrtc-cu12"), 13: ("cuda13", "cupy-cuda13x", "nvidia-cuda-nvrtc")}
DEFAULT_CUDA = 12  # the `cuda` extra: CUDA 12 wheels run on CUDA 12 and 13 drivers alike


def cupy_packages() -> list[str]:
    """The CuPy distributions installed ("cupy-cuda12x 14.2.0", ...): each ships the same `cupy` module, so
    with two of them one has overwritten the other's files."""
    found = set()
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
        if name == "cupy" or name.startswith(("cupy-cuda", "cupy-rocm")):
            found.add(f"{name} {dist.version}")
    return sorted(found)


def cuda_major() -> int:
    """The CUDA major version to install wheels for: the installed CuPy's (cupy-cuda13x: 13), else the
    driver's, else DEFAULT_CUDA."""
    for package in cupy_packages():
        if m := re.match(r"cupy-cuda(\d+)x ", package):
            return int(m.group(1))
    from .backends import driver

    return driver.cuda_version(default=DEFAULT_CUDA * 1000) // 1000


def install_hint() -> str:
    """What to install, naming the wheels for this machine's CUDA."""
    major = cuda_major()
    extra, cupy_wheel, nvrtc_wheel = EXTRAS.get(major, EXTRAS[DEFAULT_CUDA])
    return f"install the CUDA {major} extras: pip install 'cullama[{extra}]' ({cupy_wheel} and {nvrtc_wheel})"


def two_cupys_warning() -> str | None:
    """A warning line where more than one CuPy distribution is installed, else None."""
    packages = cupy_packages()
    if len(packages) < 2:
        return None
    keep = EXTRAS.get(cuda_major(), EXTRAS[DEFAULT_CUDA])[1]
    return (f"{len(packages)} CuPy packages are installed ({', '.join(packages)}): they share one `cupy` module, "
            f"so one overwrote the other; uninstall all but one (for this CUDA: {keep}) and reinstall it")


def import_cupy():
    """CuPy (its kernel cache under cullama's: cache.import_cupy), or a one-line DeviceError that says why not
    and, where it is missing, what to install."""
    try:
        return cache.import_cupy()
    except DeviceError:
        raise
    except ImportError as exc:
        raise DeviceError(f"CuPy is not installed ({exc}); {install_hint()}") from None
    except Exception as exc:  # a broken CUDA install can raise anything
        raise DeviceError(f"CuPy failed to import ({type(exc).__name__}: {exc})") from None


def cuda_status() -> tuple[bool, str]:
    """(usable, why): a GPU is usable when CuPy imports, the driver reports at least one device, and the first
    is one cullama's kernels run on (sm_80 or newer)."""
    from .registry import arch_number

    try:
        cupy = import_cupy()
    except DeviceError as exc:
        return False, str(exc)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return False, f"no usable NVIDIA GPU ({type(exc).__name__}: {exc})"
    if count == 0:
        return False, "no NVIDIA GPU found"
    arch = f"sm_{cupy.cuda.Device().compute_capability}"
    try:
        arch_number(arch)
    except KernelError as exc:
        return False, f"the GPU is unusable: {exc}"
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
    env["cupy_packages"] = ", ".join(cupy_packages()) or None
    try:
        cupy = import_cupy()
        env["cupy"] = cupy.__version__
    except DeviceError as exc:
        env["cupy"] = None
        env["gpu"], env["gpu_status"] = None, str(exc)
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
