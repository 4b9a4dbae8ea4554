"""A test-only CuPy for cullama's GPU host code: host memory as device memory, NumPy twins as kernels, and the
CUDA rules that catch host bugs: stream work (kernels, set, memcpyAsync, graphs, event records, CuPy's own
elementwise work: setitem, fill, ufuncs, reductions, astype) runs in stream order, when its stream syncs (or get
reads, or an event recorded after it synchronizes); set checks dtype and shape; a kernel takes what its C
signature in kernels_cu/ says, as CuPy passes it (a contiguous device array of the pointee's dtype per pointer,
a NumPy scalar of the exact C type per scalar), in blocks of its __launch_bounds__ threads, with no more dynamic
shared memory than cuFuncSetAttribute allowed; NumPy refuses host arrays mixed with device ones, as CuPy does;
indexing and reductions give 0-d device arrays; a capturing stream records its launches, unrun, into its Graph,
and other work meanwhile raises CaptureError; a launch that fails during a capture invalidates it (end_capture
raises). Events time the host's perf_counter when their stream reaches them,
so elapsed times cover the twins that ran in between; an event that was not completed, or whose last record was
a plain one inside a capture (CUDA keeps such an event as a capture dependency and will not time it), raises.
`libcuda` is a stand-in driver: cuFuncSetAttribute, cuLaunchKernelEx (PDL launches of the fake kernels on the
fake streams, captured like any launch), cuEventRecordWithFlags and cuGetErrorString. The memory pool's
used_bytes counts the device arrays alive. The device is small (DEVICE_MEMORY, L2_BYTES), so whatever code
sizes by its memory or L2 stays small on a CPU.

EMULATE (conftest sets it for CULLAMA_FAKE_GPU=emu): the kernels are the real ones, kernels_cu compiled for the
CPU by cullama.runtime.emu, run in the warp schedule $CULLAMA_EMU_SCHEDULE (default forward, the fastest) instead of
their twins."""

import collections
import ctypes
import inspect
import os
import re
import sys
import time
import types
import weakref
from functools import partial

import numpy as np

from cullama.runtime import emu, ops
from cullama.kernels_cu import SOURCE_DIR

__version__ = "0.0-fake"
state = types.SimpleNamespace()
EMULATE = False  # True: kernels run as emulated CUDA (cullama.runtime.emu), not as their NumPy twins
EMU_SCHEDULE = os.environ.get("CULLAMA_EMU_SCHEDULE", "forward")


def reset() -> None:
    """A fresh device. launches: every kernel call (a namespace); runs: every launch run, eagerly or replayed."""
    state.capturing, state.current, state.streams = None, [], []  # current: the `with stream:` stack
    state.launches, state.runs, state.graphs = [], [], []
    state.events = {}  # ptr -> Event, for the driver entry points that take handles
    state.functions = weakref.WeakValueDictionary()  # CUfunction handle -> Kernel, for the driver entry points
    state.allocations = {}  # id of each live allocation's NumPy owner -> its bytes (the memory pool's used_bytes)
    state.pointers = collections.deque(maxlen=256)  # (ptr, weakref to the array) per `.data` taken: see libcuda
    state.null = Stream(null=True)


class CudaError(RuntimeError):
    """An error status CUDA would return (cudaErrorNotReady, cudaErrorInvalidResourceHandle, ...)."""


class CaptureError(CudaError):
    """What CUDA reports for an operation that is not permitted while a stream captures, or on an event
    whose last record was captured (cudaErrorCapturedEvent)."""


def _not_capturing(what: str) -> None:
    if state.capturing is not None:
        state.capturing.invalidated = True  # CUDA invalidates the capture too
        raise CaptureError(f"{what} while stream {state.capturing.ptr:#x} is capturing")


class ndarray(np.ndarray):
    """A device array: a NumPy array whose views stay device arrays and share its memory."""

    @property
    def data(self):  # a cupy.cuda.MemoryPointer, as far as .ptr goes
        ptr = self.ctypes.data
        state.pointers.append((ptr, weakref.ref(self)))  # the fake driver maps a pointer back to this array
        return types.SimpleNamespace(ptr=ptr)

    def __getitem__(self, key):  # CuPy indexes to a 0-d device array, never to a host scalar
        out = super().__getitem__(key)
        if isinstance(out, np.ndarray):
            return out
        return super().__getitem__((*(key if isinstance(key, tuple) else (key,)), Ellipsis))

    def __setitem__(self, key, value):  # an elementwise kernel on the current stream, after the work before it
        _not_capturing("ndarray.__setitem__ (the fake does not capture CuPy's own kernels)")
        # a host value is copied at the call; a device value is read when the stream gets there
        key, value = _host(key), _host(value) if isinstance(value, ndarray) else np.array(value, copy=True)
        target = self.view(np.ndarray)
        get_current_stream().pending.append(lambda: target.__setitem__(key, value))

    def fill(self, value):
        self[...] = value

    def __repr__(self):  # NumPy's printing indexes elements: print the host view (whatever ran so far)
        return f"fake_cupy.{np.ndarray.__repr__(self.view(np.ndarray))}"

    __str__ = __repr__

    # CuPy's elementwise kernels and reductions (ufuncs, and the NumPy functions CuPy dispatches) run on the
    # current stream after the work queued there: the fake runs that work, then NumPy. As CuPy does, they refuse
    # a numpy.ndarray mixed in (no implicit conversion: .get() the device array, or cp.asarray the host one).
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        out = kwargs.get("out", ())
        _device_op(f"numpy.{ufunc.__name__}", (inputs, out))
        if out:
            kwargs["out"] = _host(tuple(out))
        result = getattr(ufunc, method)(*_host(inputs), **kwargs)
        if out:
            return out[0] if len(out) == 1 else tuple(out)
        return _device(result)

    def __array_function__(self, func, types_, args, kwargs):
        _device_op(f"numpy.{func.__name__}", (args, kwargs))
        return _device(func(*_host(args), **_host(kwargs)))

    def astype(self, dtype, *args, **kwargs):
        _device_op("ndarray.astype", ())
        return _device(self.view(np.ndarray).astype(dtype, *args, **kwargs))

    def copy(self, order="C"):
        _device_op("ndarray.copy", ())
        return _device(self.view(np.ndarray).copy(order))

    # CuPy reads a device scalar back with a blocking copy on the current stream
    def __bool__(self):
        return bool(self.get())

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def item(self, *args):
        return self.get().item(*args)

    def tolist(self):
        return self.get().tolist()

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray) or arr.dtype != self.dtype:
            raise TypeError(f"only a numpy.ndarray of {self.dtype} can be set to this cupy.ndarray, not {arr!r}")
        if arr.shape != self.shape or not self.flags.c_contiguous:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape} (or non-contiguous)")
        _not_capturing("ndarray.set")
        source = arr.copy()  # a pageable source is staged by the time the call returns
        target = self.view(np.ndarray)
        (stream or get_current_stream()).pending.append(lambda: np.copyto(target, source))

    def get(self, stream=None):  # blocking, CuPy's default
        _not_capturing("ndarray.get")
        (stream or get_current_stream()).synchronize()
        return np.array(self.view(np.ndarray), copy=True)


def _host(value):
    """A device array (or tuples, lists and dicts of them) as the NumPy array it is: twins and NumPy get these."""
    if isinstance(value, (tuple, list)):
        return type(value)(map(_host, value))
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    return value.view(np.ndarray) if isinstance(value, ndarray) else value


def _host_arrays(value):
    if isinstance(value, (tuple, list)):
        return [a for v in value for a in _host_arrays(v)]
    if isinstance(value, dict):
        return _host_arrays(list(value.values()))
    return [value] if isinstance(value, np.ndarray) and not isinstance(value, ndarray) else []


def _device_op(what: str, operands) -> None:
    """A CuPy kernel on device arrays: none of its operands a host array; run once the stream's work has."""
    if _host_arrays(operands):
        raise TypeError(f"{what}: a numpy.ndarray mixed with cupy.ndarray (CuPy does no implicit conversion: "
                        ".get() the device array, or cp.asarray the host one)")
    _not_capturing(f"{what} (the fake does not capture CuPy's own kernels)")
    get_current_stream().synchronize()


def _device(result):
    """A NumPy function's result on device arrays, as device arrays (new memory counts as allocated)."""
    if isinstance(result, tuple):
        return tuple(map(_device, result))
    if isinstance(result, np.generic):  # CuPy reduces to 0-d device arrays
        result = np.array(result)
    if not isinstance(result, np.ndarray):
        return result
    if result.base is None:
        _track(result)
    return result.view(ndarray)


def _track(owner: np.ndarray) -> None:
    state.allocations[id(owner)] = owner.nbytes  # held until NumPy frees the memory: the pool's used_bytes
    weakref.finalize(owner, state.allocations.pop, id(owner), None)


def _allocator(make):  # device arrays, as CuPy's zeros, empty, full make them
    def allocate(*args, **kwargs):
        _not_capturing("allocation")
        owner = make(*args, **kwargs)  # a NumPy array
        _track(owner)
        return owner.view(ndarray)
    return allocate


zeros, empty, full = map(_allocator, (np.zeros, np.empty, np.full))
_copy = _allocator(np.array)


def asarray(a, dtype=None):
    """CuPy's: a device array of the dtype is itself; anything else is copied to a new one (a host array at the
    call, a device array when the current stream gets there)."""
    if isinstance(a, ndarray):
        if dtype is None or np.dtype(dtype) == a.dtype:
            return a
        return a.astype(dtype)
    return _copy(a, dtype=dtype)
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
        state.capturing, self.graph, self.invalidated = self, Graph(), False

    def end_capture(self):
        assert state.capturing is self, "end_capture without begin_capture on this stream"
        state.capturing = None  # capture mode ends either way, as in CUDA
        if self.invalidated:
            raise CaptureError("cudaErrorStreamCaptureInvalidated: operation failed due to a previous error "
                               "during capture")
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


DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what a kernel may launch with before cuFuncSetAttribute raises its limit
OPTIN_SHARED = 232448  # the most a block may opt in to on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)


class Kernel:
    """A loaded kernel (a CuPy RawKernel): fn(grid, block, args, shared_mem=0) launches its twin on the current
    stream. `ptr` is its CUfunction for the fake driver (libcuda below), which also raises its dynamic shared
    memory limit; a launch above the limit fails as CUDA's does."""

    def __init__(self, spec):
        self.spec, self.twin = spec, ops.twin(spec.source, spec.name)
        grid = inspect.signature(self.twin).parameters.get("grid")
        self.wants_grid = grid is not None and grid.kind is inspect.Parameter.KEYWORD_ONLY
        self.ptr, self.max_dynamic_shared = id(self), DEFAULT_DYNAMIC_SHARED
        self.params, self.threads = kernel_parameters(spec.source, spec.name), block_threads(spec)
        state.functions[self.ptr] = self

    def __call__(self, grid, block, args, shared_mem=0):
        self._launch(grid, block, args, shared_mem, get_current_stream())

    def _launch(self, grid, block, args, shared_mem, stream, programmatic=False):
        try:
            self._checked_launch(grid, block, args, shared_mem, stream, programmatic)
        except Exception:  # as in CUDA, a launch that fails while a stream captures invalidates the capture
            if state.capturing is not None:
                state.capturing.invalidated = True
            raise

    def _checked_launch(self, grid, block, args, shared_mem, stream, programmatic):
        bad = [type(a).__name__ for a in args if not isinstance(a, (ndarray, np.generic))]
        dims = all(isinstance(t, tuple) and 1 <= len(t) <= 3 for t in (grid, block))
        if dims:  # CuPy takes tuples of 1 to 3 dimensions and pads them with 1s
            grid, block = (grid + (1, 1))[:3], (block + (1, 1))[:3]
        if bad or not (dims and min(grid + block) >= 1 and np.prod(block) <= 1024):
            raise TypeError(f"{self.spec.name}: bad launch {grid} {block}, or argument types {bad}")
        self._check_arguments(args)
        if self.threads is not None and int(np.prod(block)) != self.threads:
            raise CudaError(f"{self.spec.name}: a block of {block} threads; the kernel is built for {self.threads} "
                            f"(__launch_bounds__ in kernels_cu/{self.spec.source})")
        if not 0 <= shared_mem <= self.max_dynamic_shared:
            raise CudaError(f"cudaErrorInvalidValue: {self.spec.name} launched with {shared_mem} bytes of dynamic "
                            f"shared memory, above its limit {self.max_dynamic_shared} (raise it first: "
                            "cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES))")
        launch = types.SimpleNamespace(kernel=self, spec=self.spec, grid=grid, block=block, args=tuple(args),
                                       stream=stream, captured=state.capturing is not None, shared_mem=shared_mem,
                                       programmatic=programmatic)
        state.launches.append(launch)
        if state.capturing is None:
            stream.pending.append(partial(self.run, launch))
        elif stream is state.capturing:
            stream.graph.nodes.append(launch)
        else:
            raise CaptureError(f"{self.spec.name} launched on stream {stream.ptr:#x} while another captures")

    def _check_arguments(self, args) -> None:
        """What the kernel's C signature takes, as CuPy would pass it: a contiguous device array of the pointee's
        dtype for a pointer (the kernel sees its address only), a NumPy scalar of the exact C type for a scalar
        (CuPy passes an np.int64 as 8 bytes where an int takes 4: every later argument would be garbage)."""
        name = self.spec.name
        if len(args) != len(self.params):
            raise TypeError(f"{name}: {len(args)} arguments, the kernel takes {len(self.params)}")
        for i, ((kind, ctype), arg) in enumerate(zip(self.params, args)):
            if kind == "pointer":
                if not isinstance(arg, ndarray) or (ctype is not None and arg.dtype != ctype):
                    raise TypeError(f"{name}: argument {i} is a {np.dtype(ctype) if ctype else ''} pointer, "
                                    f"not {type(arg).__name__} of {getattr(arg, 'dtype', '')}")
                if not arg.flags.c_contiguous:
                    raise ValueError(f"{name}: argument {i} is a non-contiguous view {arg.shape} {arg.strides}: "
                                     "the kernel gets its address only")
            elif not isinstance(arg, np.generic) or arg.dtype != np.dtype(ctype):
                raise TypeError(f"{name}: argument {i} is a {np.dtype(ctype)} scalar, not {arg!r}")

    def run(self, launch):
        state.runs.append(launch)
        if EMULATE:  # the kernel itself: NumPy scalars as they are (the exact C types), arrays as host arrays
            emu.launch(self.spec, launch.grid, launch.block, [_host(a) for a in launch.args], launch.shared_mem,
                       schedule=EMU_SCHEDULE)
            return
        args = [a.item() if isinstance(a, np.generic) else _host(a) for a in launch.args]
        self.twin(*args, **({"grid": launch.grid} if self.wants_grid else {}))


def loader_function(loader, spec) -> Kernel:
    """KernelLoader.function on the fake: one fake kernel per spec and loader, as the real loader caches them
    (so a kernel's dynamic shared memory limit, once raised, stays raised)."""
    kernels = loader.__dict__.setdefault("_fake_kernels", {})
    if spec not in kernels:
        kernels[spec] = Kernel(spec)
    return kernels[spec]


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


def _synchronize_device():
    _not_capturing("deviceSynchronize")
    for stream in state.streams:
        stream.synchronize()


runtime = types.SimpleNamespace(memcpyAsync=_memcpy_async, memcpyHostToDevice=1, memcpyDeviceToHost=2,
                                deviceSynchronize=_synchronize_device,
                                getDeviceCount=lambda: 1, getDeviceProperties=_device_properties,
                                memGetInfo=lambda: (DEVICE_MEMORY, DEVICE_MEMORY),
                                driverGetVersion=lambda: CUDA_VERSION, runtimeGetVersion=lambda: CUDA_VERSION)
device = types.SimpleNamespace(id=0, compute_capability="90", attributes={"MultiProcessorCount": SMS},
                               synchronize=_synchronize_device)
cuda = types.SimpleNamespace(Stream=Stream, Graph=Graph, Event=Event, get_elapsed_time=get_elapsed_time,
                             get_current_stream=get_current_stream, runtime=runtime, Device=lambda device_id=0: device)


class MemoryPool:
    """CuPy's default pool, as far as its byte counts go: used_bytes is the memory of every device array still
    alive (an allocation stays used while any view of it lives); nothing is cached, NumPy frees the rest."""

    def used_bytes(self) -> int:
        return sum(state.allocations.values())

    total_bytes = used_bytes

    def free_all_blocks(self) -> None:
        pass


_pool = MemoryPool()


def get_default_memory_pool():
    return _pool


CUDA_SUCCESS, CUDA_ERROR_INVALID_VALUE, CU_EVENT_RECORD_EXTERNAL = 0, 1, 1
CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 400, 900
ERROR_STRINGS = {CUDA_ERROR_INVALID_VALUE: b"invalid argument", CUDA_ERROR_INVALID_HANDLE: b"invalid resource handle",
                 CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: b"operation not permitted when stream is capturing"}
FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 8, 9
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\(([^)]*)\)\s+)?(\w+)\s*\(([^)]*)\)', re.S)
_INCLUDE = re.compile(r'^[ \t]*#include[ \t]+"([^"]+)"', re.M)
_DEFINE = re.compile(r"^[ \t]*#define[ \t]+(\w+)[ \t]+([^\n]*?)[ \t]*(?://.*)?$", re.M)
_SCALARS = {"int": ctypes.c_int32, "unsigned int": ctypes.c_uint32, "float": ctypes.c_float,
            "size_t": ctypes.c_uint64, "unsigned long long": ctypes.c_uint64}
_POINTEES = {"half_t": np.float16, "float": np.float32, "int": np.int32, "unsigned char": np.uint8,
             "unsigned int": np.uint32, "uint4": None}  # uint4: raw 16-byte data, any dtype
_kernels: dict = {}


def _with_headers(name: str, seen: set) -> str:
    """kernels_cu/`name`, then the text of each kernels_cu header it includes (recursively, each once): a
    constant such as THREADS may live in a header the kernels share (gemm.cuh, common.cuh)."""
    text = (SOURCE_DIR / name).read_text()
    parts = [text]
    for header in _INCLUDE.findall(text):
        if header not in seen and (SOURCE_DIR / header).is_file():
            seen.add(header)
            parts.append(_with_headers(header, seen))
    return "\n".join(parts)


def _parse(source: str) -> None:
    text = _with_headers(source, set())
    macros = {}
    for name, expr in _DEFINE.findall(text):
        macros.setdefault(name, expr)  # the first: an #ifndef default, before any alternative
    for bounds, kernel, params in _KERNEL.findall(text):
        parsed = []
        for param in (p.strip() for p in params.split(",") if p.strip()):
            words = re.sub(r"\b(const|__restrict__)\b", " ", param).replace("*", " * ").split()
            base = " ".join(w for w in words[:-1] if w != "*")
            parsed.append(("pointer", _POINTEES.get(base, None)) if "*" in words else ("scalar", _SCALARS[base]))
        _kernels[source, kernel] = (parsed, bounds.split(",")[0].strip() or None, macros)


def kernel_parameters(source: str, name: str) -> list:
    """The C parameters of kernel `name` in kernels_cu/`source` (parsed as tests/runtime/test_contracts.py does):
    ("pointer", the NumPy dtype it points at, None for raw data) or ("scalar", its ctypes type)."""
    if (source, name) not in _kernels:
        _parse(source)
    return _kernels[source, name][0]


def block_threads(spec) -> int | None:
    """The threads per block the kernel is built for: its __launch_bounds__ (a launch with more fails; these
    kernels size their loops and shared memory by it, so a launch with fewer computes something else), with the
    spec's defines over the source's; None where the fake cannot evaluate it."""
    kernel_parameters(spec.source, spec.name)
    _, expr, macros = _kernels[spec.source, spec.name]
    macros = {**macros, **{k: str(v) for k, v in spec.defines}}
    for _ in range(16):
        if expr is None:
            return None
        done = re.sub(r"\b[A-Za-z_]\w*\b", lambda w: f"({macros.get(w.group(), w.group())})", expr)
        if done == expr:
            break
        expr = done
    return int(eval(expr, {})) if expr and re.fullmatch(r"[\d\s()+*]+", expr) else None


def _device_array(ptr: int, taken: set):
    """The device array whose address the caller took last (`.data.ptr`) at `ptr`, among those not yet matched
    to a parameter of this launch: pdl.kernel_params takes each argument's address just before the launch."""
    for i in range(len(state.pointers) - 1, -1, -1):
        at, ref = state.pointers[i]
        if at == ptr and i not in taken and ref() is not None:
            taken.add(i)
            return ref()
    return None


def _func_set_attribute(function, attribute: int, value: int) -> int:
    """cuFuncSetAttribute: the dynamic shared memory limit (up to the opt-in maximum) and the carveout."""
    kernel = state.functions.get(getattr(function, "value", function) or 0)
    if kernel is None:
        return CUDA_ERROR_INVALID_HANDLE
    if attribute == FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES and 0 <= value <= OPTIN_SHARED:
        kernel.max_dynamic_shared = value
        return CUDA_SUCCESS
    if attribute == FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT and -1 <= value <= 100:
        return CUDA_SUCCESS
    return CUDA_ERROR_INVALID_VALUE


def _launch_kernel_ex(config_ref, function, params, extra) -> int:
    """cuLaunchKernelEx (backends/pdl.py): the kernel's parameters read through kernelParams by its C signature
    (a pointer must be the address of a live device array), launched on the stream the config names: queued,
    captured into that stream's graph, or refused while another stream captures, as a plain launch is."""
    config, kernel = config_ref._obj, state.functions.get(function)
    streams = [st for st in state.streams if st.ptr == (config.stream or 0)]
    if kernel is None or not streams or extra is not None:
        return CUDA_ERROR_INVALID_HANDLE if kernel is None or not streams else CUDA_ERROR_INVALID_VALUE
    attrs = [config.attrs[i] for i in range(config.num_attrs)]
    if any(a.id != LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION for a in attrs):
        return CUDA_ERROR_INVALID_VALUE  # the only attribute the fake knows
    args, taken = [], set()
    for i, (kind, ctype) in reversed(list(enumerate(kernel_parameters(kernel.spec.source, kernel.spec.name)))):
        if kind == "pointer":
            array = _device_array(ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p)).contents.value or 0, taken)
            if array is None:
                return CUDA_ERROR_INVALID_VALUE
            args.append(array)
        else:
            value = ctypes.cast(params[i], ctypes.POINTER(ctype)).contents.value
            args.append(np.dtype(ctype).type(value))
    programmatic = any(a.value.programmatic_stream_serialization_allowed for a in attrs)
    try:
        kernel._launch((config.grid_x, config.grid_y, config.grid_z), (config.block_x, config.block_y, config.block_z),
                       args[::-1], config.shared_mem_bytes, streams[0], programmatic=programmatic)
    except CaptureError:
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    except (CudaError, TypeError):
        return CUDA_ERROR_INVALID_VALUE
    return CUDA_SUCCESS


def _get_error_string(status: int, out_ref) -> int:
    if status not in ERROR_STRINGS:
        return CUDA_ERROR_INVALID_VALUE
    out_ref._obj.value = ERROR_STRINGS[status]  # a module constant: the char* stays valid
    return CUDA_SUCCESS


def _event_record_with_flags(event_ptr: int, stream_ptr: int, flags: int) -> int:
    """cuEventRecordWithFlags with CU_EVENT_RECORD_EXTERNAL (the one flag the fake has): valid only in a
    capturing stream, whose graph gains an event-record node (the event is recorded at each replay)."""
    assert flags == CU_EVENT_RECORD_EXTERNAL, f"flags {flags}: the fake implements CU_EVENT_RECORD_EXTERNAL only"
    event, stream = state.events[event_ptr], _stream(stream_ptr)
    if stream is not state.capturing:
        return CUDA_ERROR_INVALID_VALUE
    stream.graph.nodes.append(event)
    return CUDA_SUCCESS


def _driver_function(fn):  # each entry point its own object: callers set argtypes and restype on them
    def call(*args):
        return fn(*args)
    return call


# the driver, as ctypes loads it (conftest's CULLAMA_FAKE_GPU=1 hands it to backends/driver.py)
libcuda = types.SimpleNamespace(cuEventRecordWithFlags=_driver_function(_event_record_with_flags),
                                cuFuncSetAttribute=_driver_function(_func_set_attribute),
                                cuLaunchKernelEx=_driver_function(_launch_kernel_ex),
                                cuGetErrorString=_driver_function(_get_error_string))
cupyx = types.ModuleType("cupyx")
cupyx.empty_pinned = lambda shape, dtype=float: np.empty(shape, dtype)  # pinned host memory: a NumPy array
reset()


def install(monkeypatch) -> types.SimpleNamespace:
    """This fake as CuPy for one test (monkeypatch undoes it all): a fresh device, KernelLoader loading fake kernels
    (loader_function), and cullama.runtime.device seeing one GPU. Returns `state`, the device's record."""
    from cullama.runtime import device
    from cullama.runtime.registry import KernelLoader

    reset()
    monkeypatch.setitem(sys.modules, "cupy", sys.modules[__name__])
    monkeypatch.setitem(sys.modules, "cupyx", cupyx)
    monkeypatch.setattr(KernelLoader, "function", loader_function)
    monkeypatch.setattr(device, "cuda_status", lambda: (True, "1 GPU(s) (fake CuPy)"))
    return state
