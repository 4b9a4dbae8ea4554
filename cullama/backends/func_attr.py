"""Kernel attributes set through the CUDA driver: a kernel may launch with more than 48 KB of dynamic shared
memory only after cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) has raised its limit
(once per loaded function, before its first launch, outside or inside stream capture alike). gemm_wgmma.cu
needs ~200 KB (cullama/ops/gemm_wgmma.py: Geometry.smem_bytes).

CuPy launches through cuLaunchKernel and exposes the same setter as RawKernel.max_dynamic_shared_size_bytes;
this calls the driver's cuFuncSetAttribute through ctypes (libcuda is present wherever a GPU is), as
backends/pdl.py does for cuLaunchKernelEx, so that it can be tested on the CPU with a stand-in driver.
"""

from __future__ import annotations

import ctypes

from ..errors import DeviceError

MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h, CUfunction_attribute)
PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent, -1 = default)
OPTIN_LIMIT = 232448  # the most an H100 / H200 block may opt in to (227 KB; cudaDevAttrMaxSharedMemoryPerBlockOptin)


def function_handle(fn) -> int:
    """The CUfunction of a loaded kernel: `.ptr` of a CuPy Function, or of a RawKernel's `.kernel`."""
    ptr = getattr(fn, "ptr", None)
    if ptr is None:
        ptr = fn.kernel.ptr
    return int(ptr)


class FuncAttributes:
    """set(fn, attribute, value) through cuFuncSetAttribute; `library` stands in for libcuda in tests."""

    def __init__(self, library=None):
        if library is None:
            try:
                library = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise DeviceError(f"kernel attributes need the CUDA driver (libcuda.so.1): {exc}") from None
        self._set = library.cuFuncSetAttribute
        self._set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self._set.restype = ctypes.c_int
        self._error_string = getattr(library, "cuGetErrorString", None)

    def set(self, fn, attribute: int, value: int) -> None:
        status = self._set(ctypes.c_void_p(function_handle(fn)), int(attribute), int(value))
        if status != 0:
            raise DeviceError(f"cuFuncSetAttribute({attribute}, {value}) failed: {self._describe(status)}")

    def allow_dynamic_shared(self, fn, nbytes: int) -> None:
        """Let `fn` launch with up to `nbytes` of dynamic shared memory (static shared memory comes on top)."""
        if not 0 <= nbytes <= OPTIN_LIMIT:
            raise DeviceError(f"{nbytes} bytes of dynamic shared memory: a block may have at most {OPTIN_LIMIT}")
        self.set(fn, MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

    def _describe(self, status: int) -> str:
        text = ctypes.c_char_p()
        if self._error_string is not None and self._error_string(status, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode()} (CUresult {status})"
        return f"CUresult {status}"


def allow_dynamic_shared(fn, nbytes: int, library=None) -> None:
    """One call: cuFuncSetAttribute(fn, MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes), a DeviceError on failure."""
    FuncAttributes(library).allow_dynamic_shared(fn, nbytes)
