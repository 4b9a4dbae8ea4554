"""Launches an emulated kernel as CuPy would launch the real one: a KernelSpec, grid and block (ints or tuples of
1 to 3), the arguments exactly as the plan passes them (NumPy arrays for pointers, written in place; NumPy
scalars of the kernel's exact C types) and the bytes of dynamic shared memory.

Global memory is guarded: every array argument runs from a copy with 4 KiB of 0xFF bytes on each side (a read
past an end reads NaN; a write past it fails the launch), aliased arguments sharing one copy; the arrays get the
results back only when the launch succeeds. A failed launch raises EmuError, one line naming the kernel, the
block, the thread and the kernels_cu line.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from ..errors import KernelError
from ..registry import KernelSpec
from . import build

SCHEDULES = ("forward", "reverse", "shuffled")  # warp (and block, and lane) order; runtime.cpp
GUARD = 4096  # poisoned bytes on each side of every array argument
_ALIGN = 256  # a copy keeps its array's address modulo this: alignment the kernels rely on is kept
_SCALARS = {("i", 4): ctypes.c_int32, ("u", 4): ctypes.c_uint32, ("i", 8): ctypes.c_int64,
            ("u", 8): ctypes.c_uint64, ("f", 4): ctypes.c_float, ("f", 8): ctypes.c_double,
            ("i", 1): ctypes.c_int8, ("u", 1): ctypes.c_uint8, ("i", 2): ctypes.c_int16, ("u", 2): ctypes.c_uint16}


class EmuError(KernelError):
    """An emulated launch failed: a hazard, a deadlock, a stray access, or arguments the kernel cannot take."""


class _Dim3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _Launch(ctypes.Structure):  # struct emu_launch (emu_abi.h)
    _fields_ = [("kernel", ctypes.c_char_p), ("grid", _Dim3), ("block", _Dim3), ("dynamic_shared", ctypes.c_uint),
                ("schedule", ctypes.c_int), ("seed", ctypes.c_ulonglong), ("error", ctypes.c_void_p),
                ("error_size", ctypes.c_int)]


def _dims(value, what: str, name: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) and d >= 1 for d in dims):
        raise EmuError(f"{name}: {what} {value!r} is not 1 to 3 positive integers")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


class _Guarded:
    """Copies of the arrays' memory, each span (merged where arguments overlap) between two GUARD-byte runs of
    0xFF; pointer(array) is the array's address in its copy."""

    def __init__(self, arrays: list[np.ndarray]):
        spans = sorted({(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays})
        self.spans: list[list] = []  # [start, end, buffer, copy address]
        for start, end in spans:
            if self.spans and start < self.spans[-1][1]:
                self.spans[-1][1] = max(self.spans[-1][1], end)
            else:
                self.spans.append([start, end, None, 0])
        for span in self.spans:
            start, end = span[0], span[1]
            buffer = np.full(end - start + 2 * GUARD + _ALIGN, 0xFF, np.uint8)
            base = buffer.ctypes.data + GUARD
            base += (start - base) % _ALIGN
            ctypes.memmove(base, start, end - start)
            span[2], span[3] = buffer, base

    def pointer(self, array: np.ndarray) -> int:
        address = array.ctypes.data
        for start, end, _, copy in self.spans:
            if start <= address <= end:
                return copy + (address - start)
        raise AssertionError("an array outside every guarded span")

    def check_and_copy_back(self, name: str, arrays: list[np.ndarray]) -> None:
        for start, end, buffer, copy in self.spans:
            offset = copy - buffer.ctypes.data
            before, after = buffer[offset - GUARD:offset], buffer[offset + end - start:offset + end - start + GUARD]
            for side, guard in (("before the start", before), ("past the end", after)):
                if (guard != 0xFF).any():
                    which = [i for i, a in enumerate(arrays) if start <= a.ctypes.data <= end]
                    raise EmuError(f"{name}: wrote {side} of argument {which[0] if which else '?'} "
                                   f"({int((guard != 0xFF).sum())} of the {GUARD} guard bytes changed)")
        for start, end, _, copy in self.spans:
            ctypes.memmove(start, copy, end - start)


_launching = threading.Lock()  # the runtime runs one launch at a time


def launch(spec: KernelSpec, grid, block, args, shared_mem: int = 0, schedule: str = "forward", seed: int = 0,
           source_dir: Path | None = None) -> None:
    """Run kernel `spec` on the CPU with CuPy's launch arguments (see the module docstring); raises EmuError."""
    name = spec.name
    if schedule not in SCHEDULES:
        raise EmuError(f"{name}: schedule {schedule!r} is not one of {', '.join(SCHEDULES)}")
    lib = build.library(spec.source, spec.defines, spec.arch_specific, source_dir)
    kernel = lib.kernels.get(name)
    if kernel is None:
        raise EmuError(f"{spec.source} has no kernel {name!r} (it has {', '.join(sorted(lib.kernels))})")
    grid, block = _dims(grid, "grid", name), _dims(block, "block", name)
    threads = block[0] * block[1] * block[2]
    if threads > kernel.max_threads:
        raise EmuError(f"{name}: a block of {threads} threads, above its __launch_bounds__ ({kernel.max_threads})")
    if len(args) != len(kernel.params):
        raise EmuError(f"{name}: {len(args)} arguments, the kernel takes {len(kernel.params)}")
    arrays = []
    for i, ((kind, size), arg) in enumerate(zip(kernel.params, args)):
        if kind == "p":
            if not isinstance(arg, np.ndarray) or not arg.flags.c_contiguous:
                raise EmuError(f"{name}: argument {i} is a pointer: a C-contiguous NumPy array, not "
                               f"{type(arg).__name__}{'' if not isinstance(arg, np.ndarray) else ' (a strided view)'}")
            arrays.append(arg)
        elif not isinstance(arg, np.generic) or (arg.dtype.kind, arg.dtype.itemsize) != (kind, size):
            raise EmuError(f"{name}: argument {i} is a {size}-byte {dict(i='signed', u='unsigned', f='float')[kind]} "
                           f"scalar: a NumPy scalar of that type, not {arg!r}")
    guarded = _Guarded(arrays)
    values = [ctypes.c_void_p(guarded.pointer(a)) if kind == "p" else _SCALARS[kind, size](a.item())
              for (kind, size), a in zip(kernel.params, args)]
    params = (ctypes.c_void_p * max(1, len(values)))(*(ctypes.addressof(v) for v in values))
    error = ctypes.create_string_buffer(1024)
    record = _Launch(name.encode(), _Dim3(*grid), _Dim3(*block), int(shared_mem), SCHEDULES.index(schedule),
                     int(seed) & (2**64 - 1), ctypes.addressof(error), len(error))
    with _launching:
        status = kernel.entry(ctypes.byref(record), params)
    if status != 0:
        raise EmuError(error.value.decode(errors="replace"))
    guarded.check_and_copy_back(name, arrays)
