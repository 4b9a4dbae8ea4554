"""The driver calls CuPy does not wrap, on the CPU: backends/pdl.py (the ctypes mirrors of cuda.h's launch
structures, the kernel parameter array, the launcher's call into cuLaunchKernelEx) and backends/func_attr.py
(cuFuncSetAttribute), against one stand-in driver that records each call."""

import ctypes
import re

import numpy as np
import pytest

from tests.conftest import REPO
from cullama.runtime.backends import driver, func_attr, pdl
from cullama.common.errors import DeviceError
from cullama.runtime.ops import gemm_wgmma


def test_structures_have_cuda_h_layout():
    # CUlaunchAttribute: int id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: 7 uints, padding,
    # CUstream, CUlaunchAttribute*, unsigned int (+ tail padding)
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72 and pdl.LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(pdl.LaunchAttributeValue) == 64
    assert [getattr(pdl.LaunchConfig, f).offset for f in ("shared_mem_bytes", "stream", "attrs", "num_attrs")] \
        == [24, 32, 40, 48]
    assert ctypes.sizeof(pdl.LaunchConfig) == 56


class DeviceArray:  # what the launcher needs of a CuPy array
    def __init__(self, ptr):
        self.data = type("MemoryPointer", (), {"ptr": ptr})()


def test_kernel_params_point_at_each_argument_in_its_c_type():
    args = (DeviceArray(0x7f0012345600), np.int32(-5), np.float32(1.5), np.uint32(4000000000), np.uint64(2**40 + 3))
    params, alive = pdl.kernel_params(args)
    assert len(params) == 5 and len(alive) == 5
    read = lambda i, t: ctypes.cast(params[i], ctypes.POINTER(t)).contents.value  # noqa: E731
    assert read(0, ctypes.c_uint64) == 0x7f0012345600
    assert read(1, ctypes.c_int32) == -5
    assert read(2, ctypes.c_float) == 1.5
    assert read(3, ctypes.c_uint32) == 4000000000
    assert read(4, ctypes.c_uint64) == 2**40 + 3
    with pytest.raises(DeviceError, match="float64"):
        pdl.kernel_params((np.float64(1.0),))


class Symbol:  # a ctypes function as far as the caller goes: callable, takes argtypes and restype
    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        return self.call(*args)


class FakeDriver:
    """cuLaunchKernelEx, cuFuncSetAttribute and cuGetErrorString as cullama calls them; each returns `status`
    and records its call (launches in `calls`, attributes in `set_calls`)."""

    def __init__(self, status=0, error=b"an illegal memory access was encountered"):
        self.status, self.error, self.calls, self.set_calls = status, error, [], []
        self.cuLaunchKernelEx = Symbol(self._launch)
        self.cuFuncSetAttribute = Symbol(self._set)
        self.cuGetErrorString = Symbol(self._error_string)

    def _launch(self, config_ref, function, params, extra):
        config = config_ref._obj  # ctypes.byref keeps the object it points at
        attr = config.attrs[0]
        self.calls.append({"grid": (config.grid_x, config.grid_y, config.grid_z),
                           "block": (config.block_x, config.block_y, config.block_z),
                           "smem": config.shared_mem_bytes, "stream": config.stream, "num_attrs": config.num_attrs,
                           "attr": (attr.id, attr.value.programmatic_stream_serialization_allowed),
                           "function": function, "first_param": ctypes.cast(params[0], ctypes.POINTER(ctypes.c_int32))
                           .contents.value, "extra": extra})
        return self.status

    def _set(self, function, attribute, value):
        self.set_calls.append((function.value, attribute, value))
        return self.status

    def _error_string(self, status, out):
        out._obj.value = self.error
        return 0


def test_launcher_passes_grid_block_stream_and_the_pdl_attribute():
    driver = FakeDriver()
    fn = type("Function", (), {"ptr": 0xABC})()
    pdl.PdlLauncher(driver)(fn, (96, 2, 1), (128, 1, 1), (np.int32(7),), 0x5000)
    assert driver.calls == [{"grid": (96, 2, 1), "block": (128, 1, 1), "smem": 0, "stream": 0x5000, "num_attrs": 1,
                             "attr": (pdl.PROGRAMMATIC_STREAM_SERIALIZATION, 1), "function": 0xABC,
                             "first_param": 7, "extra": None}]


def test_a_failed_launch_is_a_one_line_device_error():
    fn = type("Function", (), {"ptr": 1})()
    with pytest.raises(DeviceError, match=r"cuLaunchKernelEx .*illegal memory access.*CUresult 700"):
        pdl.PdlLauncher(FakeDriver(status=700))(fn, (1, 1, 1), (32, 1, 1), (np.int32(0),), 0)


def test_func_attr_raises_the_dynamic_shared_memory_limit():
    driver = FakeDriver()
    fn = type("Function", (), {"ptr": 0xABC0})()
    func_attr.allow_dynamic_shared(fn, gemm_wgmma.SMEM_BYTES, library=driver)
    raw_kernel = type("RawKernel", (), {"kernel": fn})()  # a CuPy RawKernel: its Function is .kernel
    func_attr.FuncAttributes(driver).allow_dynamic_shared(raw_kernel, 4096)
    assert driver.set_calls == [(0xABC0, func_attr.MAX_DYNAMIC_SHARED_SIZE_BYTES, gemm_wgmma.SMEM_BYTES),
                                (0xABC0, 8, 4096)]
    assert driver.cuFuncSetAttribute.restype is ctypes.c_int and len(driver.cuFuncSetAttribute.argtypes) == 3


def test_func_attr_errors_are_one_line_device_errors():
    fn = type("Function", (), {"ptr": 1})()
    with pytest.raises(DeviceError, match=r"cuFuncSetAttribute\(8, 205824\) failed: invalid argument \(CUresult 1\)"):
        func_attr.allow_dynamic_shared(fn, 205824, library=FakeDriver(status=1, error=b"invalid argument"))
    driver = FakeDriver()
    with pytest.raises(DeviceError, match="at most 232448"):
        func_attr.allow_dynamic_shared(fn, 232449, library=driver)
    assert driver.set_calls == []  # refused before calling the driver


# ---- every ctypes prototype against the C one ----------------------------------------------------------------

# The C prototypes of every driver (cuda.h, CUDA 12 and 13) and NVRTC (nvrtc.h) function cullama calls through
# ctypes, as the headers declare them.
PROTOTYPES = """
CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra);
CUresult cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value);
CUresult cuEventRecordWithFlags(CUevent hEvent, CUstream hStream, unsigned int flags);
CUresult cuGetErrorString(CUresult error, const char **pStr);
CUresult cuDriverGetVersion(int *driverVersion);
nvrtcResult nvrtcGetCUBINSize(nvrtcProgram prog, size_t *cubinSizeRet);
nvrtcResult nvrtcGetCUBIN(nvrtcProgram prog, char *cubin);
"""
# A C type -> the ctypes types that pass it as the x86-64 / aarch64 ABI does (enums are ints, handles pointers).
C_TYPES = {
    "CUresult": {ctypes.c_int}, "nvrtcResult": {ctypes.c_int}, "CUfunction_attribute": {ctypes.c_int},
    "int": {ctypes.c_int}, "unsigned int": {ctypes.c_uint},
    "CUfunction": {ctypes.c_void_p}, "CUevent": {ctypes.c_void_p}, "CUstream": {ctypes.c_void_p},
    "nvrtcProgram": {ctypes.c_void_p}, "void **": {ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)},
    "const CUlaunchConfig *": {ctypes.POINTER(pdl.LaunchConfig)}, "const char **": {ctypes.POINTER(ctypes.c_char_p)},
    "int *": {ctypes.POINTER(ctypes.c_int)}, "size_t *": {ctypes.POINTER(ctypes.c_size_t)},
    "char *": {ctypes.c_char_p, ctypes.POINTER(ctypes.c_char)},
}
CALLERS = [REPO / "cullama" / "runtime" / "backends" / f for f in ("driver.py", "pdl.py", "func_attr.py")] + \
    [REPO / "cullama" / "runtime" / "registry.py", REPO / "benchmarks" / "decode_step.py"]


def c_prototypes() -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of PROTOTYPES."""
    found = {}
    for ret, name, params in re.findall(r"(\w+) (\w+)\(([^)]*)\);", PROTOTYPES):
        found[name] = (ret, [re.sub(r"\s*(\w+)$", "", p.strip()) for p in params.split(",")])
    return found


class Recorder:
    """A library whose every cu* / nvrtc* function is a Symbol returning 0, kept to read its argtypes."""

    def __init__(self):
        self.symbols = {}

    def __getattr__(self, name):
        if not name.startswith(("cu", "nvrtc")):
            raise AttributeError(name)
        return self.symbols.setdefault(name, Symbol(lambda *args: 0))


def test_every_ctypes_prototype_matches_the_c_one(monkeypatch):
    from cullama.runtime import registry

    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import decode_step

    library = Recorder()
    pdl.PdlLauncher(library), func_attr.FuncAttributes(library), decode_step.node_recorder(library)
    driver.describe(library, 1), driver.cuda_version(12000, library)
    functions = dict(library.symbols)
    nvrtc = registry._nvrtc_library(registry.nvrtc().getVersion()[0])  # the real libnvrtc, as the registry sets it
    functions.update({name: getattr(nvrtc, name) for name in ("nvrtcGetCUBINSize", "nvrtcGetCUBIN")})
    used = {name for path in CALLERS
            for name in re.findall(r'(?:\.|getattr\(\w+, ")((?:cu|nvrtc)[A-Z]\w+)', path.read_text())}
    prototypes = c_prototypes()
    assert used == set(functions) == set(prototypes)  # every function called is exercised here, and in the table
    for name, (ret, params) in prototypes.items():
        fn = functions[name]
        assert fn.restype in C_TYPES[ret], (name, fn.restype)
        assert len(fn.argtypes) == len(params), (name, fn.argtypes)
        for i, (given, c_type) in enumerate(zip(fn.argtypes, params)):
            assert given in C_TYPES[c_type], (name, i, c_type, given)


class CupyFunction:  # cupy.cuda.function.Function: the loaded CUfunction is .ptr (an int)
    def __init__(self, ptr):
        self.ptr = ptr


class CupyRawKernel:  # cupy.RawKernel, what RawModule.get_function returns: no .ptr, its Function is .kernel
    def __init__(self, ptr):
        self._function = CupyFunction(ptr)

    @property
    def kernel(self):
        return self._function


def test_the_cufunction_of_a_raw_kernel_is_its_kernel_ptr():
    from cullama.runtime.device import import_cupy

    cupy = import_cupy()
    raw_kernel, function = cupy.RawKernel, cupy.cuda.function.Function
    assert hasattr(raw_kernel, "kernel") and not hasattr(raw_kernel, "ptr") and hasattr(function, "ptr")  # the shapes
    assert driver.function_handle(CupyRawKernel(0x7F00DEAD0000)) == 0x7F00DEAD0000
    assert driver.function_handle(CupyFunction(0xBEEF)) == 0xBEEF
    recorder = FakeDriver()
    func_attr.allow_dynamic_shared(CupyRawKernel(0x7F00DEAD0000), 65536, library=recorder)
    pdl.PdlLauncher(recorder)(CupyRawKernel(0x7F00DEAD1000), (1, 1, 1), (32, 1, 1), (np.int32(3),), 0)
    assert recorder.set_calls == [(0x7F00DEAD0000, func_attr.MAX_DYNAMIC_SHARED_SIZE_BYTES, 65536)]
    assert recorder.calls[0]["function"] == 0x7F00DEAD1000
