"""Kernel registry: compile `kernels_cu/*.cu` with NVRTC, cache the binaries on disk, load them with CuPy.

NVRTC is called directly (through CuPy's binding), so kernels compile for any named arch on a
machine without a GPU: CI builds everything for sm_90 and fails on register spills. Binaries are
cached under $CULLAMA_CACHE (default ~/.cache/cullama/kernels), keyed by the cache format, the source,
every header in kernels_cu/, the defines, the options, the arch and the NVRTC version. Two processes
compiling at once are safe: each writes a private temp file and renames it into place (atomic on
POSIX), and a lock file keeps them from doing the same work twice.

The cubin is read from NVRTC through ctypes (nvrtcGetCUBINSize, nvrtcGetCUBIN): CuPy's getCUBIN takes
the last byte for a C string's NUL and drops it, and a cubin has none. Every cubin is checked whole
(elf.py) when it is written and again when the cache hands it out.

Architectures: every kernel needs sm_80 or newer (cp.async, ldmatrix, mma.sync); a kernel marked
arch_specific is sm_90a code (wgmma), which runs on sm_90 (H100 / H200) only, so it is compiled for
sm_90a there and for no other arch (there is no sm_80a, and sm_100a has no wgmma).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from . import cache, elf
from ..common.errors import DeviceError, KernelError
from ..kernels_cu import SOURCE_DIR
from .device import arch_number

OPTIONS = ("--std=c++17", "-Xptxas=-v")  # -v: registers, smem and spills go to the log we parse
# In every cache key: a new format never loads a file an older cullama wrote. 2: whole cubins (format 1's
# came from CuPy's getCUBIN, one byte short).
CACHE_FORMAT = 2
ARCH_SPECIFIC_ARCHS = ("sm_90",)  # the archs whose "a" target cullama's arch-specific kernels (wgmma) are for


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel: the file it lives in, its extern "C" name and its compile-time constants."""

    source: str  # e.g. "gemv_mma.cu"
    name: str  # e.g. "gemv_residual"
    defines: tuple[tuple[str, int], ...] = ()
    arch_specific: bool = False  # compiled for the arch-specific target (sm_90 -> sm_90a: wgmma, setmaxnreg)

    def module_key(self) -> tuple:
        return (self.source, self.defines, self.arch_specific)


def runs_on(arch: str, arch_specific: bool) -> bool:
    """Whether a kernel (arch_specific: sm_90a code) can be built for and run on a GPU of `arch` (sm_80 or newer)."""
    return not arch_specific or f"sm_{arch_number(arch)}" in ARCH_SPECIFIC_ARCHS


def target_arch(arch: str, arch_specific: bool) -> str:
    """The NVRTC target for a kernel on `arch`: `arch` itself, or for an arch-specific kernel the arch-specific
    form (sm_90a), which runs on that exact arch only; a KernelError where the kernel cannot run on `arch`."""
    if not runs_on(arch, arch_specific):
        raise KernelError(f"an arch-specific kernel (wgmma) is sm_90a code, for "
                          f"{' / '.join(ARCH_SPECIFIC_ARCHS)} only: it has no {arch} version")
    return f"sm_{arch_number(arch)}a" if arch_specific else arch


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ptxas reported for one kernel."""

    registers: int
    smem_bytes: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int

    @property
    def spills(self) -> bool:
        return bool(self.stack_bytes or self.spill_stores or self.spill_loads)


@dataclasses.dataclass
class CompiledModule:
    cubin_path: Path
    resources: dict[str, Resources]  # kernel name -> resources


def nvrtc():
    """CuPy's NVRTC binding, NVRTC loaded; a one-line DeviceError naming the wheel to install where either is
    missing."""
    from .device import import_cupy, install_hint

    import_cupy()
    try:
        from cupy.cuda import nvrtc as binding
        binding.getVersion()
    except Exception as exc:
        raise DeviceError(f"NVRTC is not available ({type(exc).__name__}: {exc}); {install_hint()}") from None
    return binding


@functools.lru_cache(maxsize=None)
def _nvrtc_library(major: int):
    """libnvrtc through ctypes: the copy CuPy already loaded (dlopen by its soname finds it), else the one named
    in this process's memory map."""
    names = [f"libnvrtc.so.{major}"]
    try:
        with open("/proc/self/maps") as maps:
            names += sorted({line.split()[-1] for line in maps if "/libnvrtc.so" in line})
    except OSError:
        pass
    for name in names:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        library.nvrtcGetCUBINSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        library.nvrtcGetCUBINSize.restype = ctypes.c_int
        library.nvrtcGetCUBIN.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        library.nvrtcGetCUBIN.restype = ctypes.c_int
        return library
    raise DeviceError(f"cannot open NVRTC's library (tried {', '.join(names)}) to read a compiled cubin")


def whole_cubin(library, program: int) -> bytes:
    """The cubin of a compiled NVRTC program, every byte of it: nvrtcGetCUBINSize, then nvrtcGetCUBIN into a
    buffer of that size (`library`: libnvrtc, or a stand-in in tests)."""
    size = ctypes.c_size_t()
    status = library.nvrtcGetCUBINSize(ctypes.c_void_p(program), ctypes.byref(size))
    buffer = ctypes.create_string_buffer(size.value) if status == 0 else None
    if status == 0:
        status = library.nvrtcGetCUBIN(ctypes.c_void_p(program), buffer)
    if status != 0:
        raise KernelError(f"NVRTC could not hand over the compiled cubin (nvrtcResult {status})")
    return buffer.raw


def sources() -> list[str]:
    return sorted(p.name for p in SOURCE_DIR.glob("*.cu"))


def _headers() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(SOURCE_DIR.glob("*.cuh"))}


def cache_dir() -> Path:
    return cache.directory("kernels")


_RESOURCE_LINES = {
    "entry": re.compile(r"Compiling entry function '(\w+)'"),
    "frame": re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"),
    "regs": re.compile(r"Used (\d+) registers"),
    "smem": re.compile(r"(\d+) bytes smem"),
}


def parse_ptxas_log(log: str) -> dict[str, Resources]:
    """Per-kernel registers, shared memory, stack frame and spills from ptxas -v output."""
    found: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        if m := _RESOURCE_LINES["entry"].search(line):
            current = found.setdefault(m.group(1), {"smem": 0, "stack": 0, "st": 0, "ld": 0, "regs": 0})
        elif current is None:
            continue
        elif m := _RESOURCE_LINES["frame"].search(line):
            current["stack"], current["st"], current["ld"] = map(int, m.groups())
        elif m := _RESOURCE_LINES["regs"].search(line):
            current["regs"] = int(m.group(1))
            if s := _RESOURCE_LINES["smem"].search(line):
                current["smem"] = int(s.group(1))
    return {name: Resources(v["regs"], v["smem"], v["stack"], v["st"], v["ld"]) for name, v in found.items()}


def _defines_options(defines) -> list[str]:
    return [f"-D{name}={value}" for name, value in defines]


def _check_arch(binding, arch: str) -> None:
    """A KernelError, one line, for an arch cullama's kernels or this NVRTC cannot build for."""
    known = tuple(binding.getSupportedArchs())
    if arch_number(arch) not in known:
        raise KernelError(f"--arch {arch}: NVRTC {'%d.%d' % binding.getVersion()} cannot compile for it (it knows "
                          f"sm_{min(known)} to sm_{max(known)}); a newer CUDA's CuPy and NVRTC wheels can")


def compile_module(source: str, defines: tuple = (), arch: str = "sm_90") -> CompiledModule:
    """Compile one .cu file for `arch` (cached on disk); no GPU needed."""
    arch_number(arch)  # before NVRTC: a bad --arch is the user's error whether or not CuPy is installed
    path = SOURCE_DIR / source
    if not path.is_file():
        raise KernelError(f"{path}: no such kernel source")
    binding = nvrtc()
    _check_arch(binding, arch)
    code, headers = path.read_text(), _headers()
    options = [*OPTIONS, f"--gpu-architecture={arch}", *_defines_options(defines)]
    version = "%d.%d" % binding.getVersion()
    key = hashlib.sha256(json.dumps([CACHE_FORMAT, source, code, headers, options, version]).encode()).hexdigest()[:32]
    directory = cache_dir()
    cubin, meta = directory / f"{key}.cubin", directory / f"{key}.json"
    if not _cached(cubin, meta):
        with open(directory / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same key
            if not _cached(cubin, meta):
                binary, log = _nvrtc_compile(binding, source, code, headers, options)
                _atomic_write(cubin, binary)
                _atomic_write(meta, json.dumps({"source": source, "defines": list(defines), "arch": arch,
                                                "nvrtc": version, "log": log}).encode())
    log = json.loads(meta.read_text())["log"]
    return CompiledModule(cubin, parse_ptxas_log(log))


def _cached(cubin: Path, meta: Path) -> bool:
    """Whether the cache holds this key, its cubin whole (a damaged file is compiled again, never loaded)."""
    return cubin.exists() and meta.exists() and not elf.problems(cubin.read_bytes())


def _nvrtc_compile(binding, source: str, code: str, headers: dict[str, str], options: list[str]):
    program = binding.createProgram(code, source, [h.encode() for h in headers.values()],
                                     [n.encode() for n in headers.keys()])
    try:
        try:
            binding.compileProgram(program, options)
        except Exception:
            log = binding.getProgramLog(program)
            first = next((l for l in log.splitlines() if "error" in l), log.strip()[:300])
            raise KernelError(f"{source}: NVRTC failed ({' '.join(options[2:])}): {first.strip()}") from None
        binary = whole_cubin(_nvrtc_library(binding.getVersion()[0]), program)
        if problems := elf.problems(binary):
            raise KernelError(f"{source}: NVRTC handed over a broken cubin ({' '.join(options[2:])}): {problems[0]}")
        return binary, binding.getProgramLog(program)
    finally:
        binding.destroyProgram(program)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def device_arch() -> str:
    from .device import import_cupy

    return f"sm_{import_cupy().cuda.Device().compute_capability}"  # e.g. "90" on an H100 / H200


class KernelLoader:
    """Loads compiled kernels onto the current GPU, once per (source, defines)."""

    def __init__(self, arch: str | None = None):
        from .device import import_cupy

        self._cupy = import_cupy()
        self.arch = arch or device_arch()
        arch_number(self.arch)  # a KernelError on a GPU older than MIN_ARCH
        self._modules: dict[tuple, object] = {}
        self._functions: dict[KernelSpec, object] = {}

    def function(self, spec: KernelSpec):
        fn = self._functions.get(spec)
        if fn is None:
            module = self._modules.get(spec.module_key())
            if module is None:
                compiled = compile_module(spec.source, spec.defines, target_arch(self.arch, spec.arch_specific))
                module = self._modules[spec.module_key()] = self._cupy.RawModule(path=str(compiled.cubin_path))
            fn = self._functions[spec] = module.get_function(spec.name)
        return fn
