"""The CUDA driver (libcuda) through ctypes, for the few calls CuPy does not wrap: cuLaunchKernelEx
(backends/pdl.py), cuFuncSetAttribute (backends/func_attr.py) and cuEventRecordWithFlags
(benchmarks/decode_step.py). libcuda is present wherever a GPU is, so this adds no dependency; tests hand
these modules a stand-in library instead."""

from __future__ import annotations

import ctypes

from ..errors import DeviceError


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
    if error_string is not None and error_string(status, ctypes.byref(text)) == 0 and text.value:
        return f"{text.value.decode()} (CUresult {status})"
    return f"CUresult {status}"


def function_handle(fn) -> int:
    """The CUfunction of a loaded kernel: `.ptr` of a CuPy Function, or of a RawKernel's `.kernel`
    (RawModule.get_function returns a RawKernel)."""
    ptr = getattr(fn, "ptr", None)
    if ptr is None:
        ptr = fn.kernel.ptr
    return int(ptr)
