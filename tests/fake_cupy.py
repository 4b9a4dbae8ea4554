"""A test-only CuPy for cullama's GPU host code: host memory as device memory, NumPy twins as kernels, and the
CUDA rules that catch host bugs: stream work (kernels, set, memcpyAsync, graphs, event records) runs when its
stream syncs (or get reads, or an event recorded after it synchronizes); set checks dtype and shape; kernels
take device arrays and NumPy scalars; a capturing stream records its launches, unrun, into its Graph, and other
work meanwhile raises CaptureError. Events time the host's perf_counter when their stream reaches them, so
elapsed times cover the twins that ran in between; an event that was not completed, or whose last record was a
plain one inside a capture (CUDA keeps such an event as a capture dependency and will not time it), raises.
The device is small (DEVICE_MEMORY, L2_BYTES), so whatever code sizes by its memory or L2 stays small on a CPU."""

import ctypes
import inspect
import time
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
    state.events = {}  # ptr -> Event, for the driver entry points that take handles
    state.null = Stream(null=True)


class CudaError(RuntimeError):
    """An error status CUDA would return (cudaErrorNotReady, cudaErrorInvalidResourceHandle, ...)."""


class CaptureError(CudaError):
    """What CUDA reports for an operation that is not permitted while a stream captures, or on an event
    whose last record was captured (cudaErrorCapturedEvent)."""


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
float16, float32, int32, uint32, uint64 = np.float16, np.float32, np.int32, np.uint32, np.uint64


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


def _stream(ptr: int) -> Stream:
    return next(s for s in state.streams if s.ptr == ptr)


class Graph:
    """nodes: kernel launches (namespaces, as state.launches holds them) and event-record nodes (Events)."""

    def __init__(self):
        self.nodes, self.replays = [], 0

    @property
    def launches(self) -> list:
        return [n for n in self.nodes if not isinstance(n, Event)]

    def launch(self, stream=None):
        _not_capturing("Graph.launch")
        self.replays += 1
        stream = stream or get_current_stream()
        for node in self.nodes:  # in capture order: an event node is recorded after the launches before it
            if isinstance(node, Event):
                node._enqueue(stream)
            else:
                stream.pending.append(partial(node.kernel.run, node))


CAPTURED = "captured"  # an Event's mark after a plain record inside a capture


class Event:
    """A CUDA event. Each record queues a mark on its stream, timestamped when the stream runs it; the event
    answers for its latest record only, as in CUDA."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self.ptr, self.timing, self._mark = id(self), not disable_timing, None  # None: never recorded
        state.events[self.ptr] = self

    def _enqueue(self, stream):
        mark = self._mark = types.SimpleNamespace(time=None, stream=stream)
        stream.pending.append(lambda: setattr(mark, "time", time.perf_counter()))

    def record(self, stream=None):
        stream = stream or get_current_stream()
        if state.capturing is None:
            self._enqueue(stream)
        elif stream is state.capturing:  # a dependency of the capture, not a node of the graph
            self._mark = CAPTURED
        else:
            raise CaptureError(f"Event.record on stream {stream.ptr:#x} while another captures")

    def _check_not_captured(self):
        if self._mark is CAPTURED:
            raise CaptureError("cudaErrorCapturedEvent: the event was last recorded in a capturing stream")

    def synchronize(self):
        _not_capturing("Event.synchronize")
        self._check_not_captured()
        mark = self._mark
        while mark is not None and mark.time is None:  # its stream's work up to the mark, no further
            mark.stream.pending.pop(0)()


def get_elapsed_time(start_event: Event, end_event: Event) -> float:
    """Milliseconds between two completed events (CuPy's cupy.cuda.get_elapsed_time, which does not wait)."""
    for event in (start_event, end_event):
        event._check_not_captured()
        if event._mark is None or not event.timing:
            raise CudaError("cudaErrorInvalidResourceHandle: an event never recorded, or without timing")
        if event._mark.time is None:
            raise CudaError("cudaErrorNotReady: the event has not completed (synchronize it first)")
    return (end_event._mark.time - start_event._mark.time) * 1e3


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
        dims = all(isinstance(t, tuple) and 1 <= len(t) <= 3 for t in (grid, block))
        if dims:  # CuPy takes tuples of 1 to 3 dimensions and pads them with 1s
            grid, block = (grid + (1, 1))[:3], (block + (1, 1))[:3]
        if bad or not (dims and min(grid + block) >= 1 and np.prod(block) <= 1024):
            raise TypeError(f"{self.spec.name}: bad launch {grid} {block}, or argument types {bad}")
        stream = get_current_stream()
        launch = types.SimpleNamespace(kernel=self, spec=self.spec, grid=grid, block=block, args=tuple(args),
                                       stream=stream, captured=state.capturing is not None)
        state.launches.append(launch)
        if state.capturing is None:
            stream.pending.append(partial(self.run, launch))
        elif stream is state.capturing:
            stream.graph.nodes.append(launch)
        else:
            raise CaptureError(f"{self.spec.name} launched on stream {stream.ptr:#x} while another captures")

    def run(self, launch):
        state.runs.append(launch)
        args = [a.item() if isinstance(a, np.generic) else a for a in launch.args]
        self.twin(*args, **({"grid": launch.grid} if self.wants_grid else {}))


def _memcpy_async(dst, src, size, kind, stream_ptr):
    _not_capturing("memcpyAsync")
    _stream(stream_ptr).pending.append(lambda: ctypes.memmove(dst, src, size))


DEVICE_MEMORY, L2_BYTES, SMS, CUDA_VERSION = 16 << 20, 1 << 20, 132, 12080
PROPERTIES = {"name": b"fake GPU (NumPy twins)", "major": 9, "minor": 0, "multiProcessorCount": SMS,
              "totalGlobalMem": DEVICE_MEMORY, "l2CacheSize": L2_BYTES, "clockRate": 1_980_000,
              "memoryClockRate": 2_619_000}


def _device_properties(device_id: int) -> dict:
    assert device_id == 0, f"device {device_id}: the fake has one"
    return dict(PROPERTIES)


runtime = types.SimpleNamespace(memcpyAsync=_memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2,
                                getDeviceCount=lambda: 1, getDeviceProperties=_device_properties,
                                memGetInfo=lambda: (DEVICE_MEMORY, DEVICE_MEMORY),
                                driverGetVersion=lambda: CUDA_VERSION, runtimeGetVersion=lambda: CUDA_VERSION)
device = types.SimpleNamespace(id=0, compute_capability="90", attributes={"MultiProcessorCount": SMS},
                               synchronize=lambda: [s.synchronize() for s in state.streams])
cuda = types.SimpleNamespace(Stream=Stream, Graph=Graph, Event=Event, get_elapsed_time=get_elapsed_time,
                             get_current_stream=get_current_stream, runtime=runtime, Device=lambda device_id=0: device)
_pool = types.SimpleNamespace(free_all_blocks=lambda: None)  # nothing is cached: host memory is freed by NumPy


def get_default_memory_pool():
    return _pool


CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CU_EVENT_RECORD_EXTERNAL = 0, 1, 1


def _event_record_with_flags(event_ptr: int, stream_ptr: int, flags: int) -> int:
    """cuEventRecordWithFlags with CU_EVENT_RECORD_EXTERNAL (the one flag the fake has): valid only in a
    capturing stream, whose graph gains an event-record node (the event is recorded at each replay)."""
    assert flags == CU_EVENT_RECORD_EXTERNAL, f"flags {flags}: the fake implements CU_EVENT_RECORD_EXTERNAL only"
    event, stream = state.events[event_ptr], _stream(stream_ptr)
    if stream is not state.capturing:
        return CUDA_ERROR_INVALID_VALUE
    stream.graph.nodes.append(event)
    return CUDA_SUCCESS


libcuda = types.SimpleNamespace(cuEventRecordWithFlags=_event_record_with_flags)  # the driver, as ctypes loads it
cupyx = types.ModuleType("cupyx")
cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)  # pinned host memory: a NumPy array
reset()
