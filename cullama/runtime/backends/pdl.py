"""Programmatic dependent launch (PDL): a kernel launch that may start while the kernel before it in the
stream is still running, so that a GEMV's blocks stream their weights during the previous kernel's tail.

CuPy launches through cuLaunchKernel, which takes no launch attributes; this calls the driver's
cuLaunchKernelEx through ctypes (backends/driver.py). Launched
inside stream capture, the kernel becomes a graph node with a programmatic edge to the node before it.
Only kernels that read nothing but weights before `pdl_wait()` (kernels_cu/common.cuh) may be launched
this way: plan.OVERLAP_SAFE names them and tests/runtime/test_contracts.py checks their sources.

The structures mirror cuda.h (CUDA 12.0+): CUlaunchAttribute is an int id padded to 8 bytes and a
64-byte value union; CUlaunchConfig is 7 unsigned ints, the stream, the attribute array and its length.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ...common.errors import DeviceError
from . import driver

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def supported(arch: str) -> bool:
    """Whether a GPU of this arch (e.g. "sm_90", "sm_90a") has programmatic dependent launch: sm_90 and newer."""
    return int(arch.removeprefix("sm_").rstrip("a")) >= 90


class LaunchAttributeValue(ctypes.Union):  # CUlaunchAttributeValue
    _fields_ = [("pad", ctypes.c_char * 64), ("programmatic_stream_serialization_allowed", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


SCALARS = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.float32): ctypes.c_float, np.dtype(np.uint64): ctypes.c_uint64}


def kernel_params(args) -> tuple[ctypes.Array, list]:
    """cuLaunchKernelEx's `void** kernelParams` for device arrays and NumPy scalars, in parameter order,
    and the ctypes values it points at (keep them alive until the launch returns)."""
    values = []
    for arg in args:
        if isinstance(arg, np.generic):
            ctype = SCALARS.get(arg.dtype)
            if ctype is None:
                raise DeviceError(f"kernel argument of dtype {arg.dtype} has no launch type")
            values.append(ctype(arg.item()))
        else:  # a device array (or a view of one): its address
            values.append(ctypes.c_void_p(arg.data.ptr))
    params = (ctypes.c_void_p * max(len(values), 1))(*(ctypes.addressof(v) for v in values))
    return params, values


class PdlLauncher:
    """launch(fn, grid, block, args, stream_ptr, smem=0): fn is a loaded kernel (the RawKernel that
    RawModule.get_function returns; its CUfunction is `.kernel.ptr`), launched on the stream with
    programmatic stream serialization allowed."""

    def __init__(self, library=None):
        self._library = library = library or driver.load("overlapped launches")
        self._launch = library.cuLaunchKernelEx
        self._launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._launch.restype = ctypes.c_int
        self._attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attribute.value.programmatic_stream_serialization_allowed = 1

    def __call__(self, fn, grid, block, args, stream_ptr: int, smem: int = 0) -> None:
        self.prepare(fn, grid, block, args, stream_ptr, smem)()

    def prepare(self, fn, grid, block, args, stream_ptr: int, smem: int = 0):
        """The launch with its configuration and parameter array built once: each call of the returned
        function is one driver call (an eager prefill chunk is ~300 launches; the host must keep ahead)."""
        config = LaunchConfig(*grid, *block, smem, stream_ptr, ctypes.pointer(self._attribute), 1)
        params, alive = kernel_params(args)
        handle, launch_ex, library = driver.function_handle(fn), self._launch, self._library

        def launch() -> None:
            status = launch_ex(ctypes.byref(config), handle, params, None)
            if status != 0:
                raise DeviceError(f"cuLaunchKernelEx (overlapped launch) failed: {driver.describe(library, status)}")

        launch.alive = alive  # the values the parameter array points at
        return launch
