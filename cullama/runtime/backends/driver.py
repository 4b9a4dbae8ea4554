"""The CUDA driver (libcuda) through ctypes, for the few calls CuPy does not wrap: cuLaunchKernelEx
(backends/pdl.py), cuFuncSetAttribute (backends/func_attr.py), cuEventRecordWithFlags
(benchmarks/decode_step.py), and here cuGetErrorString and cuDriverGetVersion. libcuda is present wherever a
GPU is, so this adds no dependency; tests hand these modules a stand-in library instead. Every function's
argtypes and restype are set before its first call (tests/runtime/backends/test_driver.py checks them against
cuda.h)."""

from __future__ import annotations

import ctypes

from ...common.errors import DeviceError


def load(purpose: str):
    """The driver library, or a one-line DeviceError saying what needed it."""
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DeviceError(f"{purpose} need the CUDA driver (libcuda.so.1): {exc}") from None


def describe(library, status: int) -> str:
    """A CUresult as the driver words it (cuGetErrorString), with its number."""
    error_string = getattr(library, "cuGetErrorString", None)
    text = ctypes.c_char_p()
    if error_string is not None:
        error_string.argtypes, error_string.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int
        if error_string(status, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode()} (CUresult {status})"
    return f"CUresult {status}"


def cuda_version(default: int, library=None) -> int:
    """The CUDA version the driver supports (cuDriverGetVersion: 12080 for 12.8), or `default` where there is
    no driver (a machine without a GPU) or it fails."""
    try:
        library = library or load("the driver's CUDA version")
    except DeviceError:
        return default
    get_version = getattr(library, "cuDriverGetVersion", None)
    if get_version is None:
        return default
    get_version.argtypes, get_version.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    version = ctypes.c_int()
    return version.value if get_version(ctypes.byref(version)) == 0 and version.value > 0 else default


def function_handle(fn) -> int:
    """The CUfunction of a loaded kernel: `.ptr` of a CuPy Function, or of a RawKernel's `.kernel`
    (RawModule.get_function returns a RawKernel)."""
    ptr = getattr(fn, "ptr", None)
    if ptr is None:
        ptr = fn.kernel.ptr
    return int(ptr)
