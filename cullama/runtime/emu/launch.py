"""Launches an emulated kernel as CuPy would launch the real one: a KernelSpec, grid and block (ints or tuples of
1 to 3), the arguments exactly as the plan passes them (NumPy arrays for pointers, written in place; NumPy
scalars of the kernel's exact C types) and the bytes of dynamic shared memory.

Global memory is guarded: every array argument runs from a copy with 4 KiB of 0xFF bytes on each side (a read
past an end reads NaN; a write past it fails the launch), aliased arguments sharing one copy; the arrays get the
results back only when the launch succeeds. Two rules of the CUDA memory model are checked against the bytes the
launch wrote (those that differ from the arrays' when it ends: a write of the value a byte held is not seen):
what an ld.global.nc or __ldg read must be read-only for the whole launch; and a __restrict__ pointer argument
must not share written bytes with another argument (the arrays' extents stand for the ranges accessed). A failed
launch raises EmuError, one line naming the kernel, the block, the thread and the kernels_cu line.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from ...common.errors import KernelError
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
                ("error_size", ctypes.c_int), ("spans", ctypes.c_int), ("span_start", ctypes.c_void_p),
                ("span_bytes", ctypes.c_void_p), ("span_read_only", ctypes.c_void_p)]


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
        self.spans: list[list] = []  # [start, end, buffer, copy address, read-only flags per byte]
        for start, end in spans:
            if self.spans and start < self.spans[-1][1]:
                self.spans[-1][1] = max(self.spans[-1][1], end)
            else:
                self.spans.append([start, end, None, 0, None])
        for span in self.spans:
            start, end = span[0], span[1]
            buffer = np.full(end - start + 2 * GUARD + _ALIGN, 0xFF, np.uint8)
            base = buffer.ctypes.data + GUARD
            base += (start - base) % _ALIGN
            ctypes.memmove(base, start, end - start)
            span[2], span[3], span[4] = buffer, base, np.zeros(end - start, np.uint8)
        n = max(1, len(self.spans))  # the runtime's view (emu_launch): copies, sizes, read-only flags
        self.c_start = (ctypes.c_void_p * n)(*(span[3] for span in self.spans))
        self.c_bytes = (ctypes.c_ulonglong * n)(*(span[1] - span[0] for span in self.spans))
        self.c_read_only = (ctypes.c_void_p * n)(*(span[4].ctypes.data for span in self.spans))

    def pointer(self, array: np.ndarray) -> int:
        address = array.ctypes.data
        for start, end, _, copy, _ in self.spans:
            if start <= address <= end:
                return copy + (address - start)
        raise AssertionError("an array outside every guarded span")

    def check_and_copy_back(self, name: str, pointers: list[tuple[int, np.ndarray, bool]]) -> None:
        """pointers: (argument index, array, declared __restrict__) of each pointer argument. Raises EmuError where
        the launch wrote a guard byte, a byte an ld.global.nc / __ldg read, or a byte that a __restrict__ argument
        shares with another argument; else copies the results back into the arrays."""
        for start, end, buffer, copy, _ in self.spans:
            offset = copy - buffer.ctypes.data
            before, after = buffer[offset - GUARD:offset], buffer[offset + end - start:offset + end - start + GUARD]
            for side, guard in (("before the start", before), ("past the end", after)):
                if (guard != 0xFF).any():
                    which = [i for i, a, _ in pointers if start <= a.ctypes.data <= end]
                    raise EmuError(f"{name}: wrote {side} of argument {which[0] if which else '?'} "
                                   f"({int((guard != 0xFF).sum())} of the {GUARD} guard bytes changed)")
        for start, end, _, _, read_only in self.spans:
            both = np.flatnonzero(read_only.view(bool) & self._written(start, end))
            if both.size:
                at = start + int(both[0])
                i, a = next((i, a) for i, a, _ in pointers if a.ctypes.data <= at < a.ctypes.data + a.nbytes)
                raise EmuError(f"{name}: argument {i} is read by ld.global.nc / __ldg, which needs it read-only for "
                               f"the whole launch, and written by it ({both.size} bytes, the first at byte "
                               f"{at - a.ctypes.data})")
        for k, (i, a, restrict_a) in enumerate(pointers):
            for j, b, restrict_b in pointers[k + 1:]:
                lo = max(a.ctypes.data, b.ctypes.data)
                hi = min(a.ctypes.data + a.nbytes, b.ctypes.data + b.nbytes)
                if (restrict_a or restrict_b) and lo < hi and self._written(lo, hi).any():
                    raise EmuError(f"{name}: arguments {i} and {j} share bytes that the launch wrote, but argument "
                                   f"{i if restrict_a else j} is __restrict__ (what it reaches is reached through "
                                   f"it alone)")
        for start, end, _, copy, _ in self.spans:
            ctypes.memmove(start, copy, end - start)

    def _written(self, start: int, end: int) -> np.ndarray:
        """[end - start] bool: the bytes of original memory [start, end) (inside one span) that the launch changed."""
        def view(address: int) -> np.ndarray:
            return np.frombuffer((ctypes.c_char * (end - start)).from_address(address), np.uint8)

        span_start, _, _, copy, _ = next(span for span in self.spans if span[0] <= start and end <= span[1])
        return view(copy + start - span_start) != view(start)


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
                     int(seed) & (2**64 - 1), ctypes.addressof(error), len(error), len(guarded.spans),
                     ctypes.addressof(guarded.c_start), ctypes.addressof(guarded.c_bytes),
                     ctypes.addressof(guarded.c_read_only))
    with _launching:
        status = kernel.entry(ctypes.byref(record), params)
    if status != 0:
        raise EmuError(error.value.decode(errors="replace"))
    guarded.check_and_copy_back(name, [(i, a, kernel.restrict[i]) for i, a in enumerate(args)
                                       if kernel.params[i][0] == "p"])
