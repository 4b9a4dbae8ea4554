"""Kernel registry: compile `kernels_cu/*.cu` with NVRTC, cache the binaries on disk, load them with CuPy.

NVRTC is called directly (through CuPy's binding), so kernels compile for any named arch on a
machine without a GPU: CI builds everything for sm_90 and fails on register spills. Binaries are
cached under $CULLAMA_CACHE (default ~/.cache/cullama/kernels), keyed by the source, every header
in kernels_cu/, the defines, the options, the arch and the NVRTC version. Two processes compiling at
once are safe: each writes a private temp file and renames it into place (atomic on POSIX), and
a lock file keeps them from doing the same work twice.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

from .errors import DeviceError, KernelError
from .kernels_cu import SOURCE_DIR

OPTIONS = ("--std=c++17", "-Xptxas=-v")  # -v: registers, smem and spills go to the log we parse


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel: the file it lives in, its extern "C" name and its compile-time constants."""

    source: str  # e.g. "gemv.cu"
    name: str  # e.g. "gemv_residual"
    defines: tuple[tuple[str, int], ...] = ()
    arch_specific: bool = False  # compiled for the arch-specific target (sm_90 -> sm_90a: wgmma, setmaxnreg)

    def module_key(self) -> tuple:
        return (self.source, self.defines, self.arch_specific)


def target_arch(arch: str, arch_specific: bool) -> str:
    """The NVRTC target for a kernel: `arch`, or its arch-specific form (sm_90a), which runs on that exact
    arch only."""
    return arch + "a" if arch_specific and not arch.endswith("a") else arch


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
    try:
        from cupy.cuda import nvrtc as binding
        binding.getVersion()
    except Exception as exc:
        raise DeviceError(f"NVRTC is not available ({type(exc).__name__}: {exc}); "
                          "install the CUDA extras: pip install 'cullama[cuda]'") from None
    return binding


def sources() -> list[str]:
    return sorted(p.name for p in SOURCE_DIR.glob("*.cu"))


def _headers() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(SOURCE_DIR.glob("*.cuh"))}


def cache_dir() -> Path:
    root = os.environ.get("CULLAMA_CACHE") or Path.home() / ".cache" / "cullama"
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


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


def compile_module(source: str, defines: tuple = (), arch: str = "sm_90") -> CompiledModule:
    """Compile one .cu file for `arch` (cached on disk); no GPU needed."""
    if not re.fullmatch(r"sm_\d+a?", arch):
        raise KernelError(f"--arch {arch!r} is not of the form sm_90")
    path = SOURCE_DIR / source
    if not path.is_file():
        raise KernelError(f"{path}: no such kernel source")
    binding = nvrtc()
    code, headers = path.read_text(), _headers()
    options = [*OPTIONS, f"--gpu-architecture={arch}", *_defines_options(defines)]
    version = "%d.%d" % binding.getVersion()
    key = hashlib.sha256(json.dumps([source, code, headers, options, version]).encode()).hexdigest()[:32]
    directory = cache_dir()
    cubin, meta = directory / f"{key}.cubin", directory / f"{key}.json"
    if not (cubin.exists() and meta.exists()):
        with open(directory / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be compiling the same key
            if not (cubin.exists() and meta.exists()):
                binary, log = _nvrtc_compile(binding, source, code, headers, options)
                _atomic_write(cubin, binary)
                _atomic_write(meta, json.dumps({"source": source, "defines": list(defines), "arch": arch,
                                                "nvrtc": version, "log": log}).encode())
    log = json.loads(meta.read_text())["log"]
    return CompiledModule(cubin, parse_ptxas_log(log))


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
        return binding.getCUBIN(program), binding.getProgramLog(program)
    finally:
        binding.destroyProgram(program)


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def device_arch() -> str:
    import cupy

    return f"sm_{cupy.cuda.Device().compute_capability}"  # e.g. "90" on an H100 / H200


class KernelLoader:
    """Loads compiled kernels onto the current GPU, once per (source, defines)."""

    def __init__(self, arch: str | None = None):
        import cupy

        self._cupy = cupy
        self.arch = arch or device_arch()
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
