"""Which device to run on, and what this machine has (for `cullama info` and the benchmark's record)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
from typing import Callable

import numpy as np

from . import cache
from ..common.errors import DeviceError, KernelError, OptionError, option

MIN_ARCH = 80  # cp.async, ldmatrix and mma.sync (mma.cuh): Ampere (A100) and newer
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


def driver_major() -> int | None:
    """The CUDA major version the driver supports (cuDriverGetVersion 12080: 12), or None without a driver."""
    from .backends import driver

    version = driver.cuda_version(default=0)
    return version // 1000 if version > 0 else None


def installed_cupy_major() -> int | None:
    """The CUDA major of the one installed CuPy wheel (cupy-cuda13x: 13), or None where there is none, or more
    than one (two_cupys_warning's case)."""
    majors = [int(m.group(1)) for p in cupy_packages() if (m := re.match(r"cupy-cuda(\d+)x ", p))]
    return majors[0] if len(majors) == 1 else None


def wheels_for(driver: int) -> int:
    """The EXTRAS major whose wheels run on a CUDA `driver` driver: the newest not newer than it (a driver runs
    the wheels of older CUDA majors too: a CUDA 14 driver runs cuda13's), cuda12 below CUDA 12."""
    return max((m for m in EXTRAS if m <= driver), default=min(EXTRAS))


def cuda_major() -> int:
    """The EXTRAS major to install wheels for. With a driver: the installed CuPy's where it runs on that driver
    (cupy-cuda12x on a CUDA 13 driver: 12, so the hint completes it rather than adding a second CuPy), else the
    newest the driver runs (cupy-cuda13x on a CUDA 12 driver: 12). Without one: the installed CuPy's, else
    DEFAULT_CUDA."""
    installed, driver = installed_cupy_major(), driver_major()
    if driver is None:
        return installed if installed in EXTRAS else DEFAULT_CUDA
    if installed in EXTRAS and installed <= driver:
        return installed
    return wheels_for(driver)


def install_hint() -> str:
    """What to install, naming the wheels that run on this machine's driver (and, where the installed CuPy is
    another one, to uninstall that first: two CuPy packages share one module)."""
    major, driver, installed = cuda_major(), driver_major(), installed_cupy_major()
    extra, cupy_wheel, nvrtc_wheel = EXTRAS[major]
    what = f"the CUDA {major} extras"
    if driver is not None and driver < major:
        what = f"a CUDA {major} or newer driver (this one is CUDA {driver}) and {what}"
    elif driver is not None and driver > major and major == max(EXTRAS):
        what += f" (the newest; they run on this CUDA {driver} driver)"
    first = ""
    if installed is not None and installed != major:
        why = f" (it needs a CUDA {installed} driver)" if driver is not None and installed > driver else ""
        first = f"uninstall cupy-cuda{installed}x{why}, then "
    return f"{first}install {what}: pip install 'cullama[{extra}]' ({cupy_wheel} and {nvrtc_wheel})"


def two_cupys_warning() -> str | None:
    """A warning line where more than one CuPy distribution is installed, else None. It says which to keep: the
    wheel for the driver's CUDA major (cupy-cuda13x on a CUDA 13 driver; the newest it runs on a newer one), or
    without a driver DEFAULT_CUDA's, which runs on CUDA 12 and 13 drivers alike."""
    packages = cupy_packages()
    if len(packages) < 2:
        return None
    driver = driver_major()
    if driver is None:
        keep = f"no driver found; {EXTRAS[DEFAULT_CUDA][1]} runs on CUDA 12 and 13 drivers alike"
    else:
        keep = f"for this CUDA {driver} driver: {EXTRAS[wheels_for(driver)][1]}"
    return (f"{len(packages)} CuPy packages are installed ({', '.join(packages)}): they share one `cupy` module, "
            f"so one overwrote the other; uninstall all but one ({keep}) and reinstall it")


def nvrtc_library(maps: str = "/proc/self/maps") -> str | None:
    """Which libnvrtc this process loaded, in words: its path, after the pip wheel that installed it where one did
    ("nvidia-cuda-nvrtc-cu12 12.9.86: /…/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"), else after "not from a wheel"
    (a CUDA toolkit's). None where none is loaded or the memory map cannot be read (not Linux)."""
    try:
        with open(maps) as lines:
            paths = sorted({line.split()[-1] for line in lines if "/libnvrtc.so" in line})
    except OSError:
        return None
    if not paths:
        return None
    path = paths[0]
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", (dist.metadata["Name"] or "").lower())
        if "nvrtc" not in name:
            continue
        for file in dist.files or ():
            if "libnvrtc.so" in file.name and os.path.realpath(dist.locate_file(file)) == os.path.realpath(path):
                return f"{name} {dist.version}: {path}"
    return f"not from a wheel: {path}"


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


def cupy_or_why():
    """(cupy, None), or (None, why it cannot be had). A cache directory that cannot be made (cache.CacheError)
    is raised where the CUDA driver is installed: on a GPU machine the cache is the mistake to fix, never a
    reason to run on the CPU or to report no GPU."""
    try:
        return import_cupy(), None
    except cache.CacheError as exc:
        if driver_major() is not None:
            raise
        return None, str(exc)
    except DeviceError as exc:
        return None, str(exc)


def arch_number(arch: str) -> int:
    """90 for "sm_90" or "sm_90a"; a KernelError for anything not of that form, or older than MIN_ARCH."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise KernelError(f"--arch {arch!r} is not of the form sm_90")
    number = int(arch[3:].rstrip("a"))
    if number < MIN_ARCH:
        raise KernelError(f"{arch}: cullama's kernels need sm_{MIN_ARCH} (A100) or newer (cp.async, mma.sync)")
    return number


def cuda_status() -> tuple[bool, str]:
    """(usable, why): a GPU is usable when CuPy imports, the driver reports at least one device, and the first
    is one cullama's kernels run on (sm_80 or newer). A cache that cannot be made on a machine with a CUDA
    driver raises its CacheError (cupy_or_why)."""
    cupy, why = cupy_or_why()
    if cupy is None:
        return False, why
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
    user: "running on the CPU: <why there is no GPU>". 'cuda' without a GPU is an error, and so is a cache
    directory that cannot be made on a machine with a CUDA driver (cuda_status)."""
    if not isinstance(device, str) or device not in DEVICES:
        raise OptionError("device", f"{device!r} is not one of {', '.join(DEVICES)}")
    if device == "cpu":
        return "cpu"
    ok, why = cuda_status()
    if ok:
        return "cuda"
    if device == "cuda":
        raise DeviceError(f"{option('device')} cuda needs a usable GPU: {why}")
    if on_fallback is not None:
        on_fallback(f"running on the CPU: {why}")
    return "cpu"


def environment() -> dict:
    """Facts about this machine worth recording next to any measurement."""
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "numpy": np.__version__}
    env["cupy_packages"] = ", ".join(cupy_packages()) or None
    cupy, why = cupy_or_why()
    if cupy is None:
        env["cupy"] = None
        env["gpu"], env["gpu_status"] = None, why
        return env
    env["cupy"] = cupy.__version__
    try:
        from cupy.cuda import nvrtc
        env["nvrtc"] = "%d.%d" % nvrtc.getVersion()
        env["nvrtc_library"] = nvrtc_library()
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
