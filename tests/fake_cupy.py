"""A test-only CuPy for cullama's GPU host code: host memory as device memory, NumPy twins as kernels, and the
CUDA rules that catch host bugs: stream work (kernels, set, memcpyAsync, graphs) runs when its stream syncs (or
get reads); set checks dtype and shape; kernels take device arrays and NumPy scalars; a capturing stream records
its launches, unrun, into its Graph, and other work meanwhile raises CaptureError."""

import ctypes
import inspect
import types
from functools import partial

import numpy as np

from cullama import ops

__version__ = "0.0-fake"
state = types.SimpleNamespace()


def reset() -> None:
    """A fresh device. launches: every kernel call (a namespace); runs: every launch run, eagerly or replayed."""
    state.capturing, state.current, state.streams = None, [], []  # current: the `with stream:` stack
    state.launches, state.runs, state.graphs = [], [], []
    state.null = Stream(null=True)


class CaptureError(RuntimeError):
    """What CUDA reports for an operation that is not permitted while a stream captures."""


def _not_capturing(what: str) -> None:
    if state.capturing is not None:
        raise CaptureError(f"{what} while stream {state.capturing.ptr:#x} is capturing")


class ndarray(np.ndarray):
    """A device array: a NumPy array whose views stay device arrays and share its memory."""

    @property
    def data(self):  # a cupy.cuda.MemoryPointer, as far as .ptr goes
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray) or arr.dtype != self.dtype:
            raise TypeError(f"only a numpy.ndarray of {self.dtype} can be set to this cupy.ndarray, not {arr!r}")
        if arr.shape != self.shape or not self.flags.c_contiguous:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape} (or non-contiguous)")
        _not_capturing("ndarray.set")
        source = arr.copy()  # a pageable source is staged by the time the call returns
        (stream or get_current_stream()).pending.append(lambda: np.copyto(self, source))

    def get(self, stream=None):  # blocking, CuPy's default
        _not_capturing("ndarray.get")
        (stream or get_current_stream()).synchronize()
        return np.array(self.view(np.ndarray), copy=True)


def _allocator(make):  # device arrays, as CuPy's zeros, empty, full, asarray (a copy) make them
    return lambda *args, **kwargs: _not_capturing("allocation") or make(*args, **kwargs).view(ndarray)


zeros, empty, full, asarray = map(_allocator, (np.zeros, np.empty, np.full, np.array))  # asarray copies


class Stream:
    def __init__(self, null=False, non_blocking=False):
        self.ptr, self.non_blocking, self.pending = 0 if null else id(self), non_blocking, []
        state.streams.append(self)

    def __enter__(self):
        state.current.append(self)
        return self

    def __exit__(self, *exc):
        assert state.current.pop() is self

    def synchronize(self):
        _not_capturing("synchronize")
        while self.pending:
            self.pending.pop(0)()

    def begin_capture(self, mode=None):
        assert self.ptr != 0 and state.capturing is None, "capture needs a created stream, one at a time"
        state.capturing, self.graph = self, Graph()

    def end_capture(self):
        assert state.capturing is self, "end_capture without begin_capture on this stream"
        state.capturing = None
        state.graphs.append(self.graph)
        return self.graph


class Graph:
    def __init__(self):
        self.launches, self.replays = [], 0

    def launch(self, stream=None):
        _not_capturing("Graph.launch")
        self.replays += 1
        (stream or get_current_stream()).pending.extend(partial(l.kernel.run, l) for l in self.launches)


def get_current_stream() -> Stream:
    return state.current[-1] if state.current else state.null


class Kernel:
    """A loaded kernel (a CuPy RawKernel): fn(grid, block, args) launches its twin on the current stream."""

    def __init__(self, spec):
        self.spec, self.twin = spec, ops.twin(spec.source, spec.name)
        grid = inspect.signature(self.twin).parameters.get("grid")
        self.wants_grid = grid is not None and grid.kind is inspect.Parameter.KEYWORD_ONLY

    def __call__(self, grid, block, args):
        bad = [type(a).__name__ for a in args if not isinstance(a, (ndarray, np.generic))]
        grid, block, stream = tuple(grid), tuple(block), get_current_stream()
        if bad or not (len(grid) == len(block) == 3 and min(grid + block) >= 1 and np.prod(block) <= 1024):
            raise TypeError(f"{self.spec.name}: bad launch {grid} {block}, or argument types {bad}")
        launch = types.SimpleNamespace(kernel=self, spec=self.spec, grid=grid, block=block, args=tuple(args),
                                       stream=stream, captured=state.capturing is not None)
        state.launches.append(launch)
        if state.capturing is None:
            stream.pending.append(partial(self.run, launch))
        elif stream is state.capturing:
            stream.graph.launches.append(launch)
        else:
            raise CaptureError(f"{self.spec.name} launched on stream {stream.ptr:#x} while another captures")

    def run(self, launch):
        state.runs.append(launch)
        args = [a.item() if isinstance(a, np.generic) else a for a in launch.args]
        self.twin(*args, **({"grid": launch.grid} if self.wants_grid else {}))


def _memcpy_async(dst, src, size, kind, stream_ptr):
    _not_capturing("memcpyAsync")
    next(s for s in state.streams if s.ptr == stream_ptr).pending.append(lambda: ctypes.memmove(dst, src, size))


runtime = types.SimpleNamespace(memcpyAsync=_memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2,
                                getDeviceCount=lambda: 1)
device = types.SimpleNamespace(id=0, compute_capability="90",
                               synchronize=lambda: [s.synchronize() for s in state.streams])
cuda = types.SimpleNamespace(Stream=Stream, Graph=Graph, runtime=runtime, get_current_stream=get_current_stream,
                             Device=lambda device_id=0: device)
cupyx = types.ModuleType("cupyx")
cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)  # pinned host memory: a NumPy array
reset()
