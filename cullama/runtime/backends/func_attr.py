"""Kernel attributes set through the CUDA driver: a kernel may launch with more than 48 KB of dynamic shared
memory only after cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) has raised its limit
(once per loaded function, before its first launch, outside or inside stream capture alike). gemm_wgmma.cu
needs ~200 KB (cullama/runtime/ops/gemm_wgmma.py: Geometry.smem_bytes).

CuPy launches through cuLaunchKernel and exposes the same setter as RawKernel.max_dynamic_shared_size_bytes;
this calls the driver's cuFuncSetAttribute through ctypes (backends/driver.py), as backends/pdl.py does for
cuLaunchKernelEx, so that it can be tested on the CPU with a stand-in driver.
"""

from __future__ import annotations

import ctypes

from ...common.errors import DeviceError
from . import driver

MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (cuda.h, CUfunction_attribute)
PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (percent, -1 = default)
OPTIN_LIMIT = 232448  # the most an H100 / H200 block may opt in to (227 KB; cudaDevAttrMaxSharedMemoryPerBlockOptin)


class FuncAttributes:
    """set(fn, attribute, value) through cuFuncSetAttribute; `library` stands in for libcuda in tests."""

    def __init__(self, library=None):
        self._library = library = library or driver.load("kernel attributes")
        self._set = library.cuFuncSetAttribute
        self._set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self._set.restype = ctypes.c_int

    def set(self, fn, attribute: int, value: int) -> None:
        status = self._set(ctypes.c_void_p(driver.function_handle(fn)), int(attribute), int(value))
        if status != 0:
            raise DeviceError(f"cuFuncSetAttribute({attribute}, {value}) failed: "
                              f"{driver.describe(self._library, status)}")

    def allow_dynamic_shared(self, fn, nbytes: int) -> None:
        """Let `fn` launch with up to `nbytes` of dynamic shared memory (static shared memory comes on top)."""
        if not 0 <= nbytes <= OPTIN_LIMIT:
            raise DeviceError(f"{nbytes} bytes of dynamic shared memory: a block may have at most {OPTIN_LIMIT}")
        self.set(fn, MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)


def allow_dynamic_shared(fn, nbytes: int, library=None) -> None:
    """One call: cuFuncSetAttribute(fn, MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes), a DeviceError on failure."""
    FuncAttributes(library).allow_dynamic_shared(fn, nbytes)
