"""Builds a kernels_cu source for the CPU: the host C++ compiler preprocesses it (with its defines and
__CUDA_ARCH__, as NVRTC would), asm.rewrite() turns its inline PTX into ptx.h calls, and the result is compiled,
after cuda_emu.h, into a shared library with one launch entry per kernel. The runtime (runtime.cpp) is one
more library, built once and loaded first with RTLD_GLOBAL: the kernel libraries call into it.

Kernel code is compiled with -fsanitize=alignment: every typed load and store checks its address against its
type's alignment (a float4 16 bytes, a uint2 8), since a misaligned access faults on the GPU but not on x86. The
checks call __ubsan_handle_type_mismatch_v1, which runtime.cpp defines (it fails the launch); the library is
linked without the sanitizer, so libubsan is neither needed nor loaded.

Libraries are cached by content hash (the rewritten source, the emulator's headers, the compiler and its flags)
in cullama's cache directory ($CULLAMA_CACHE or ~/.cache/cullama)/emu, each written to a private temp file and
renamed into place, under a lock file, as registry.py does for cubins. `source_dir` builds from another copy of
kernels_cu (the mutation tests seed bugs in one).
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from .. import cache
from ...common.errors import KernelError
from ...kernels_cu import SOURCE_DIR
from . import asm

EMU_DIR = Path(__file__).resolve().parent
FORMAT = "cullama-emu-1"  # bump when the library layout or the ABI changes
CXXFLAGS = ("-std=c++17", "-fPIC", "-shared", "-g0", "-fvisibility=hidden")
# No fused multiply-add (the twins round every float32 operation), raw-pointer casts as CUDA allows them.
# -fsanitize=alignment (recoverable, as GCC's default; the handler never returns) at compile time only.
KERNEL_FLAGS = ("-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-fno-exceptions", "-w", "-fsanitize=alignment")
RUNTIME_FLAGS = ("-O2", "-U_FORTIFY_SOURCE")  # _longjmp / siglongjmp between fiber stacks
if os.environ.get("CULLAMA_EMU_PORTABLE") == "1":  # makecontext + _setjmp / _longjmp fibers, as off x86-64
    RUNTIME_FLAGS += ("-DEMU_PORTABLE_CONTEXT",)
DEFAULT_ARCH = 900  # __CUDA_ARCH__: the kernels are written for sm_90
_KERNEL_DECL = re.compile(r'\bextern\s+"C"\s+__global__\s+void\s+')


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """One kernel of a built library: its launch entry and what the launcher checks against."""

    name: str
    entry: object  # ctypes function: int(const emu_launch*, void**)
    params: tuple[tuple[str, int], ...]  # (kind, size) per parameter: p pointer, i / u integer, f float
    max_threads: int  # __launch_bounds__'s first value, else 1024
    restrict: tuple[bool, ...]  # per parameter: declared __restrict__


def compiler() -> str:
    found = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++") or shutil.which("c++")
    if found is None:
        raise KernelError("the CUDA emulator needs a host C++ compiler (g++ or c++ on PATH, or $CXX)")
    return found


@functools.lru_cache(maxsize=None)
def _compiler_version(cxx: str) -> str:
    return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]


def cache_dir() -> Path:
    return cache.directory("emu")


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _cached_library(key: str, source: str, flags: tuple[str, ...], what: str) -> Path:
    """The library for `key`, compiling `source` with `flags` first if the cache lacks it."""
    directory = cache_dir()
    target = directory / f"{key}.so"
    if target.exists():
        return target
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same key
        if target.exists():
            return target
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src, out = Path(tmp) / "source.cpp", Path(tmp) / "library.so"
            src.write_text(source)
            obj = Path(tmp) / "library.o"
            # Compiled, then linked without `flags`: a -fsanitize flag at link time would pull in libubsan.
            for step in ([*CXXFLAGS, *flags, f"-I{EMU_DIR}", "-c", str(src), "-o", str(obj)],
                         [*CXXFLAGS, str(obj), "-o", str(out)]):
                done = subprocess.run([compiler(), *step], capture_output=True, text=True)
                if done.returncode != 0:
                    first = next((l for l in done.stderr.splitlines() if ": error" in l or "undefined" in l),
                                 done.stderr.strip()[:300])
                    raise KernelError(f"{what}: the host compiler failed: {first.strip()}")
            os.replace(out, target)
    return target


_lock = threading.Lock()
_runtime: ctypes.CDLL | None = None


def runtime() -> ctypes.CDLL:
    """The runtime library, built if needed and loaded once per process (RTLD_GLOBAL: kernels link to it)."""
    global _runtime
    with _lock:
        if _runtime is None:
            text = (EMU_DIR / "runtime.cpp").read_text()
            key = _digest(FORMAT, _compiler_version(compiler()), *RUNTIME_FLAGS, text,
                          (EMU_DIR / "emu_abi.h").read_text())
            path = _cached_library(f"runtime-{key}", text, RUNTIME_FLAGS, "cullama/runtime/emu/runtime.cpp")
            _runtime = ctypes.CDLL(str(path), mode=os.RTLD_NOW | os.RTLD_GLOBAL)
        return _runtime


def preprocess(source: str, defines: tuple, source_dir: Path, arch: int, arch_specific: bool) -> str:
    """The source as NVRTC would see it after its preprocessor: the defines, __CUDA_ARCH__ (and the
    arch-specific feature macro of sm_90a), its own headers from source_dir."""
    path = source_dir / source
    if not path.is_file():
        raise KernelError(f"{path}: no such kernel source")
    macros = [f"-D__CUDA_ARCH__={arch}", *([f"-D__CUDA_ARCH_FEAT_SM{arch // 10}_ALL"] if arch_specific else []),
              *(f"-D{name}={value}" for name, value in defines)]
    done = subprocess.run([compiler(), "-E", "-x", "c++", "-std=c++17", *macros, f"-I{source_dir}", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        first = next((l for l in done.stderr.splitlines() if ": error" in l), done.stderr.strip()[:300])
        raise KernelError(f"{source}: preprocessing failed: {first.strip()}")
    return done.stdout


def kernels_of(text: str) -> dict[str, tuple[int, tuple[bool, ...]]]:
    """extern "C" __global__ kernels of preprocessed text -> (the threads their __launch_bounds__ allow, which
    parameters are __restrict__: the function type the launcher sees drops the qualifier)."""
    found = {}
    for m in _KERNEL_DECL.finditer(text):
        i, bound = m.end(), 1024
        if text.startswith("__launch_bounds__", i):
            open_paren = text.index("(", i)
            close = asm._balanced(text, open_paren)
            first = asm._split_top(text[open_paren + 1:close], ",")[0]
            if re.fullmatch(r"[\d\s()+\-*/]+", first):  # arithmetic on numbers only, after the preprocessor
                bound = int(eval(first, {"__builtins__": {}}))
            i = close + 1
        name = re.match(r"\s*(\w+)\s*\(", text[i:])
        if name:
            open_paren = i + name.end() - 1
            params = asm._split_top(text[open_paren + 1:asm._balanced(text, open_paren)], ",")
            found[name.group(1)] = bound, tuple(bool(re.search(r"\b__restrict(?:__)?\b", p)) for p in params
                                                if p.strip() not in ("", "void"))
    return found


def _entries(names) -> str:
    out = []
    for name in names:
        out.append(
            f'extern "C" __attribute__((visibility("default"))) int emu_entry_{name}(const emu_launch* l, void** p) '
            f'{{ return emu_run(l, [](void** q) {{ emu_invoke({name}, q); }}, p, __start_cuda_shared, '
            f'__stop_cuda_shared); }}\n'
            f'extern "C" __attribute__((visibility("default"))) const char* emu_params_{name}() '
            f'{{ return emu_describe({name}); }}\n')
    return "".join(out)


@dataclasses.dataclass
class Library:
    path: Path
    kernels: dict[str, KernelEntry]


_libraries: dict[tuple, Library] = {}


def library(source: str, defines: tuple = (), arch_specific: bool = False, source_dir: Path | None = None,
            arch: int = DEFAULT_ARCH) -> Library:
    """The emulated build of kernels_cu/`source` with `defines` (cached on disk and in this process)."""
    source_dir = Path(source_dir or SOURCE_DIR).resolve()
    key = (str(source_dir), source, tuple(defines), arch_specific, arch)
    with _lock:
        found = _libraries.get(key)
    if found is not None:
        return found
    runtime()  # the kernel library resolves its emu_* symbols against it
    text = preprocess(source, tuple(defines), source_dir, arch, arch_specific)
    declared = kernels_of(text)
    if not declared:
        raise KernelError(f"{source}: no extern \"C\" __global__ kernel found")
    # In an unnamed namespace: every function internal, so the statics of inline functions are not COMDAT
    # objects, which GCC cannot put in one section with the kernels' own __shared__ variables.
    generated = ('#include "cuda_emu.h"\nnamespace {\n' + asm.rewrite(text) + "\n}  // namespace\n"
                 + _entries(declared))
    headers = [(EMU_DIR / h).read_text() for h in ("emu_abi.h", "cuda_emu.h", "ptx.h")]
    digest = _digest(FORMAT, _compiler_version(compiler()), *KERNEL_FLAGS, generated, *headers)
    path = _cached_library(f"{Path(source).stem}-{digest}", generated, KERNEL_FLAGS, source)
    lib = ctypes.CDLL(str(path), mode=os.RTLD_NOW)
    kernels = {}
    for name, (max_threads, restrict) in declared.items():
        entry = getattr(lib, f"emu_entry_{name}")
        entry.argtypes, entry.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        describe = getattr(lib, f"emu_params_{name}")
        describe.restype = ctypes.c_char_p
        params = tuple((code[0], int(code[1:])) for code in describe().decode().split())
        if len(restrict) != len(params):
            raise KernelError(f"{source}: {name}: {len(restrict)} parameters read in its declaration, {len(params)} "
                              "in its type")
        kernels[name] = KernelEntry(name, entry, params, max_threads, restrict)
    built = Library(path, kernels)
    with _lock:
        _libraries[key] = built
    return built
