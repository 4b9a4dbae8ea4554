"""The GPU load path on the CPU: every cubin the plans can load is a whole ELF file (CuPy's getCUBIN dropped the
last byte of each) and, where cuobjdump is installed, holds every kernel's entry point; the cache never hands out
a short or old-format file; cullama writes nothing outside its cache directory (CuPy's cache included) and says
in one line what is wrong with an unusable one; and the CUDA backend's capture and reallocation rules, on the
fake CuPy."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from tests import fake_cupy
from tests.conftest import REPO
from cullama.runtime import device, elf, ops, plan as plans, registry
from cullama.runtime.backends.cuda_backend import CudaBackend
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.cli.main import main
from cullama.model.config import PRESETS
from cullama.model.layout import device_config
from cullama.common.errors import DeviceError, KernelError
from cullama.bench.kernels import variants
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.prefill_kernels import ATTENTIONS, GEMMS, PrefillKernels
from cullama.runtime.registry import target_arch
from tests.runtime.backends.test_cuda_host import GREEDY, fake, runner_on  # noqa: F401  (fake: a fixture)

TOY = 'extern "C" __global__ void toy(float* out) { out[threadIdx.x] = 2.0f * threadIdx.x; }\n'
KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(')


def plan_modules(arch: str = "sm_90") -> set[tuple[str, tuple, str]]:
    """(source, defines, target) of every module a decode or prefill plan of a shipped preset loads, with every
    prefill kernel choice that runs on `arch`, plus every variant `cullama kernels` compiles."""
    found = set(variants(arch))
    for cfg in map(device_config, PRESETS.values()):
        specs = [l.spec for l in plans.decode_plan(cfg, 64).launches]
        for kernels in (PrefillKernels(g, a) for g in GEMMS for a in ATTENTIONS):
            if kernels.runs_on(arch):
                specs += [l.spec for l in plans.prefill_plan(cfg, 64, 0, 5, "sample", kernels).launches]
        found |= {(s.source, s.defines, target_arch(arch, s.arch_specific)) for s in specs}
    return found


@pytest.fixture(scope="module")
def cubins() -> list[tuple[str, tuple, Path]]:
    return [(source, defines, registry.compile_module(source, defines, target).cubin_path)
            for source, defines, target in sorted(plan_modules())]


def test_every_cubin_the_plans_load_is_a_whole_elf(cubins):
    assert len(cubins) > 40 and {source for source, _, _ in cubins} == {ops.module(s).SOURCE for s in ops.STEMS}
    for source, defines, path in cubins:
        data = path.read_bytes()
        assert elf.problems(data) == [], (source, defines, path)
        assert max(end for _, _, end in elf.extents(data)) == len(data)


def cuobjdump() -> str | None:
    """cuobjdump on PATH, or from the nvidia-cuda-cuobjdump wheel (nvidia/cu*/bin/cuobjdump)."""
    found = shutil.which("cuobjdump")
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec and not found else []):
        found = found or next((str(p) for p in sorted(Path(base).glob("cu*/bin/cuobjdump"))), None)
    return found


def test_cuobjdump_lists_every_kernel_entry_point(cubins):
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not installed (the nvidia-cuda-cuobjdump wheel, in the `test` extra)")
    for source, defines, path in cubins:
        listed = subprocess.run([tool, "-symbols", str(path)], capture_output=True, text=True, timeout=60)
        assert listed.returncode == 0 and "does not contain device code" not in listed.stdout + listed.stderr, \
            (source, defines, listed.stdout + listed.stderr)
        entries = set(re.findall(r"FUNC\s+GLOBAL\s+\w+\s+ENTRY\s+(\w+)", listed.stdout))
        expected = set(KERNEL.findall((SOURCE_DIR / source).read_text()))
        if source == "gemv_mma.cu" and dict(defines)["BITS"] != 16:
            expected -= {"gemv_logits", "gemv_logits_x"}  # FP16 only (#if !QUANT): the lm_head stays FP16
        assert entries == expected, (source, defines)


def test_elf_problems_catch_a_short_or_padded_cubin(cubins):
    data = cubins[0][2].read_bytes()
    assert elf.problems(data) == []
    short = elf.problems(data[:-1])
    assert short and "runs past the end of the file" in short[0]  # what every getCUBIN file looked like
    assert elf.problems(data + b"\0") == [f"the file ({len(data) + 1} bytes) goes on past its last part, "
                                          f"which ends at {len(data)}"]
    assert "not a little-endian ELF64 file" in elf.problems(data[:40])[0]


@pytest.fixture
def toy_cache(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy.cu").write_text(TOY)
    monkeypatch.setattr(registry, "SOURCE_DIR", src)
    monkeypatch.setenv("CULLAMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def test_a_fresh_cache_holds_whole_cubins_and_never_hands_out_a_short_one(toy_cache, monkeypatch):
    path = registry.compile_module("toy.cu", (), "sm_90").cubin_path
    whole = path.read_bytes()
    assert path.parent == toy_cache and elf.problems(whole) == []
    path.write_bytes(whole[:-1])  # an entry cut short (as every format-1 file was): compiled again
    assert registry.compile_module("toy.cu", (), "sm_90").cubin_path.read_bytes() == whole
    monkeypatch.setattr(registry, "CACHE_FORMAT", registry.CACHE_FORMAT - 1)  # another format: another key
    assert registry.compile_module("toy.cu", (), "sm_90").cubin_path != path
    assert all(elf.problems(p.read_bytes()) == [] for p in toy_cache.glob("*.cubin"))


class NvrtcStandIn:
    """nvrtcGetCUBINSize / nvrtcGetCUBIN as whole_cubin calls them."""

    def __init__(self, cubin: bytes, status: int = 0):
        self.cubin, self.status = cubin, status
        self.nvrtcGetCUBINSize, self.nvrtcGetCUBIN = self._size, self._copy

    def _size(self, program, size_ref):
        size_ref._obj.value = len(self.cubin)
        return 0

    def _copy(self, program, buffer):
        buffer[:len(self.cubin)] = self.cubin
        return self.status


def test_whole_cubin_takes_every_byte_and_reports_nvrtc_failures():
    cubin = b"\x7fELF" + bytes(range(256)) + b"\x00\x00\xab"  # a last byte that is not a NUL, and NULs before it
    assert registry.whole_cubin(NvrtcStandIn(cubin), 0x1234) == cubin
    with pytest.raises(KernelError, match="nvrtcResult 7"):
        registry.whole_cubin(NvrtcStandIn(cubin, status=7), 0x1234)


# ---- the cache directory ---------------------------------------------------------------------------------

def clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CULLAMA_CACHE", "CUPY_CACHE_DIR", "CULLAMA_FAKE_GPU")}
    return {**env, **extra}


def cullama(*args, env) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "cullama"), *args], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)


def test_cullama_cache_that_is_not_a_directory_is_one_line(tmp_path, monkeypatch):
    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    monkeypatch.setenv("CULLAMA_CACHE", str(not_a_dir))
    result = CliRunner().invoke(main, ["kernels", "--arch", "sm_90"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1, result.output
    assert f"CULLAMA_CACHE={not_a_dir}: {not_a_dir} is not a directory" in result.stderr


def test_an_unwritable_home_is_named_not_taken_for_a_missing_install(tmp_path):
    home = tmp_path / "home-is-a-file"  # unwritable even for root, which CI runs as
    home.write_text("")
    done = cullama("kernels", env=clean_env(HOME=str(home)))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"HOME={home}" in done.stderr and "set CULLAMA_CACHE" in done.stderr and "install" not in done.stderr
    info = cullama("info", env=clean_env(HOME=str(home)))
    if device.driver_major() is None:  # no GPU here: info reports none, and why
        assert info.returncode == 0 and "set CULLAMA_CACHE" in info.stdout and "install" not in info.stdout
    else:  # a GPU machine: the cache is the error (test_a_bad_cache_on_a_gpu_machine_is_an_error)
        assert info.returncode == 2 and f"HOME={home}" in info.stderr and "set CULLAMA_CACHE" in info.stderr


@pytest.mark.parametrize("driver_version", [12080, None], ids=["CUDA driver", "no driver"])
def test_a_bad_cache_on_a_gpu_machine_is_an_error_not_a_cpu_run(tmp_path, monkeypatch, driver_version):
    # The driver is faked here: where libcuda answers, the machine has a GPU, and a cache that cannot be made
    # must not read as "no GPU" (cullama info) nor send --device auto to the CPU with only a note.
    from cullama.runtime.backends import driver

    not_a_dir = tmp_path / "cache-file"
    not_a_dir.write_text("")
    monkeypatch.setenv("CULLAMA_CACHE", str(not_a_dir))
    monkeypatch.delenv("CUPY_CACHE_DIR", raising=False)
    monkeypatch.delitem(sys.modules, "cupy", raising=False)  # CuPy's first import makes its cache directory
    monkeypatch.setattr(driver, "cuda_version", lambda default: driver_version or default)
    said = f"CULLAMA_CACHE={not_a_dir}: {not_a_dir} is not a directory; set CULLAMA_CACHE to a writable directory"
    if driver_version is None:  # no GPU to use anyway: the CPU, and the note says why
        notes = []
        assert device.resolve("auto", on_fallback=notes.append) == "cpu" and notes == [f"running on the CPU: {said}"]
        return
    for asked in ("auto", "cuda"):
        with pytest.raises(DeviceError, match=re.escape(said)):
            device.resolve(asked)
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 2 and result.stderr == f"error: {said}\n", result.output


def test_nothing_is_written_outside_the_cache_directory(tmp_path):
    home, src = tmp_path / "home", tmp_path / "src"
    home.mkdir(), src.mkdir()
    (src / "toy.cu").write_text(TOY)
    env = clean_env(HOME=str(home))
    assert cullama("info", env=env).returncode == 0  # imports CuPy, which makes its cache directory at once
    compile_toy = (f"from pathlib import Path; from cullama.runtime import registry; "
                   f"registry.SOURCE_DIR = Path({str(src)!r}); "
                   "print(registry.compile_module('toy.cu', (), 'sm_90').cubin_path)")
    done = subprocess.run([sys.executable, "-c", compile_toy], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    written = [p.relative_to(home) for p in home.rglob("*")]
    assert written and all(p.parts[:2] == (".cache", "cullama") or p == Path(".cache") for p in written), written
    assert (home / ".cache" / "cullama" / "cupy").is_dir() and not (home / ".cupy").exists()
    # the user's CUPY_CACHE_DIR is kept: CuPy is imported with it (CuPy 14.2 makes it at import, 14.0 only once it
    # caches a kernel, so what is checked is the variable CuPy reads, not the directory)
    theirs = tmp_path / "their-cupy-cache"
    show = "import os; from cullama.runtime import cache; cache.import_cupy(); print(os.environ['CUPY_CACHE_DIR'])"
    kept = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, timeout=300,
                          env={**env, "CUPY_CACHE_DIR": str(theirs)})
    assert kept.returncode == 0 and kept.stdout.strip() == str(theirs), kept.stderr
    assert cullama("info", env={**env, "CUPY_CACHE_DIR": str(theirs)}).returncode == 0


# ---- the CUDA backend on the fake CuPy ---------------------------------------------------------------------

def test_a_launch_failing_during_capture_raises_its_own_error(fake, stories_dir, monkeypatch):
    runner, cpu = runner_on(CudaBackend(), stories_dir), runner_on(NumpyBackend(), stories_dir)
    expected = [cpu.start([1, 403], GREEDY)] + [cpu.next() for _ in range(3)]
    assert runner.start([1, 403], GREEDY) == expected[0]
    real = fake_cupy.Kernel._checked_launch

    def failing(kernel, *args):
        if kernel.spec.name == "sample" and fake.capturing is not None:
            raise fake_cupy.CudaError("cudaErrorInvalidValue: the sample launch's own error")
        return real(kernel, *args)

    monkeypatch.setattr(fake_cupy.Kernel, "_checked_launch", failing)
    with pytest.raises(fake_cupy.CudaError, match="the sample launch's own error"):
        runner.next()
    assert fake.capturing is None and runner.backend.graphs == {}  # out of capture mode, nothing kept
    monkeypatch.setattr(fake_cupy.Kernel, "_checked_launch", real)
    assert [runner.start([1, 403], GREEDY)] + [runner.next() for _ in range(3)] == expected  # captured afresh


def test_reallocating_a_buffer_drops_what_holds_its_old_address(fake, stories_dir):
    runner = runner_on(CudaBackend(), stories_dir)
    backend = runner.backend
    tokens = [runner.start([1, 403], GREEDY), runner.next(), runner.next()]
    (old_graph,) = backend.graphs.values()
    logits = next(b for b in plans.runtime_buffers(runner.cfg, runner.max_seq_len) if b.name == "logits")
    old = backend.arrays["logits"]
    backend.allocate([logits])
    assert backend.graphs == {} and backend._prepared == {} and backend._calls == {}
    tokens += [runner.next(), runner.next()]
    new_graph = backend.graphs["decode"]
    assert new_graph is not old_graph and old_graph.replays == 2 and new_graph.replays == 2
    uses = [a for launch in new_graph.launches for a in launch.args if isinstance(a, np.ndarray)]
    assert any(np.shares_memory(a, backend.arrays["logits"]) for a in uses)
    assert not any(np.shares_memory(a, old) for a in uses)
    prefill = runner._prefill_plan(0, 2, "sample")
    assert all(not np.shares_memory(a, old) for _, _, _, args, _ in backend.prepared(prefill)
               for a in args if isinstance(a, np.ndarray))
    cpu = runner_on(NumpyBackend(), stories_dir)
    assert tokens == [cpu.start([1, 403], GREEDY)] + [cpu.next() for _ in range(4)]


def test_a_new_plan_of_the_same_name_is_captured_anew(fake, stories_dir):
    runner = runner_on(CudaBackend(), stories_dir)
    runner.start([1, 403], GREEDY)
    runner.next()
    first = runner.backend.graphs["decode"]
    runner.decode = plans.decode_plan(runner.cfg, runner.max_seq_len)  # equal launches, another plan object
    runner.next()
    assert runner.backend.graphs["decode"] is not first and first.replays == 1


REAL_CUDA_STATUS = device.cuda_status  # the `fake` fixture stands in for it


def test_a_gpu_without_wgmma_starts_with_the_mma_prefill(fake, stories_dir, monkeypatch):
    from cullama.runtime import prefill_kernels

    monkeypatch.setattr(prefill_kernels, "PREFERRED", PrefillKernels("wgmma", "mma"))
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "86")
    gpu, cpu = runner_on(CudaBackend(), stories_dir), runner_on(NumpyBackend(), stories_dir)
    assert gpu.prefill_kernels == PrefillKernels("mma", "mma") and cpu.prefill_kernels == PrefillKernels("wgmma", "mma")
    prompt = [1, 403, 407, 261, 378]
    assert [gpu.start(prompt, GREEDY), gpu.next()] == [cpu.start(prompt, GREEDY), cpu.next()]
    assert "gemm.cu" in {l.spec.source for l in fake.launches}
    assert "gemm_wgmma.cu" not in {l.spec.source for l in fake.launches} and not gpu.backend.overlap


def test_a_gpu_older_than_sm_80_is_refused_in_one_line(fake, monkeypatch):
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "75")
    monkeypatch.setattr(device, "cuda_status", REAL_CUDA_STATUS)
    ok, why = device.cuda_status()
    assert not ok and why == ("the GPU is unusable: sm_75: cullama's kernels need sm_80 (A100) or newer "
                              "(cp.async, mma.sync)")
    assert device.resolve("auto") == "cpu"
    with pytest.raises(KernelError, match="sm_75: cullama's kernels need sm_80"):
        CudaBackend()


# ---- which CuPy, and what to install ------------------------------------------------------------------------

def distributions(*names):
    return lambda: [type("Dist", (), {"metadata": {"Name": n}, "version": "14.2.0"})() for n in names]


def test_info_names_the_cupy_package_and_the_nvrtc_in_use():
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0, result.output
    assert re.search(r"cupy_packages: cupy-cuda1\dx \d+\.", result.stdout), result.stdout
    # one line: NVRTC's version, then the library file loaded and the wheel that installed it (NVRTC loads on the
    # CPU too): "nvrtc: 12.9 (nvidia-cuda-nvrtc-cu12 12.9.86: /.../nvidia/cuda_nvrtc/lib/libnvrtc.so.12)"
    line = re.search(r"^ *nvrtc: (\d+)\.\d+ \((nvidia-cuda-nvrtc\S*) \S+: (/\S+/libnvrtc\.so\.(\d+))\)$",
                     result.stdout, re.M)
    assert line, result.stdout
    assert Path(line[3]).is_file() and line[1] == line[4], line[0]  # the file exists and is NVRTC's major
    assert "nvrtc_library" not in result.stdout and "warning" not in result.stderr


def test_the_nvrtc_library_is_named_from_the_memory_map(tmp_path, monkeypatch):
    wheel_dir = tmp_path / "site-packages"
    library = wheel_dir / "nvidia" / "cuda_nvrtc" / "lib" / "libnvrtc.so.13"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")

    class Wheel:
        metadata, version = {"Name": "nvidia_cuda_nvrtc"}, "13.0.88"
        files = [Path("nvidia/cuda_nvrtc/lib/libnvrtc.so.13")]
        locate_file = staticmethod(lambda file: wheel_dir / file)

    def memory_map(*paths):
        lines = [f"7f00-7f10 r-xp 00000000 08:01 42 {p}\n" for p in paths]
        (tmp_path / "maps").write_text("7e00-7e10 r-xp 00000000 08:01 41 /usr/lib/libc.so.6\n" + "".join(lines))
        return str(tmp_path / "maps")

    monkeypatch.setattr(device.importlib.metadata, "distributions", lambda: [Wheel()])
    assert device.nvrtc_library(memory_map(library, library)) == f"nvidia-cuda-nvrtc 13.0.88: {library}"
    toolkit = "/usr/local/cuda-12.8/lib64/libnvrtc.so.12.8.93"
    assert device.nvrtc_library(memory_map(toolkit, "/usr/local/cuda-12.8/lib64/libnvrtc-builtins.so.12.8")) == (
        f"not from a wheel: {toolkit}")
    assert device.nvrtc_library(memory_map()) is None
    assert device.nvrtc_library(str(tmp_path / "no-such-maps")) is None


def test_two_cupy_packages_are_warned_about(monkeypatch):
    monkeypatch.setattr(device.importlib.metadata, "distributions",
                        distributions("cupy-cuda12x", "numpy", "cupy_cuda13x", "cupy-cuda12x"))
    assert device.cupy_packages() == ["cupy-cuda12x 14.2.0", "cupy-cuda13x 14.2.0"]
    result = CliRunner().invoke(main, ["info"])
    assert result.exit_code == 0 and "cupy_packages: cupy-cuda12x 14.2.0, cupy-cuda13x 14.2.0" in result.stdout
    assert "warning: 2 CuPy packages are installed" in result.stderr and "uninstall all but one" in result.stderr
    monkeypatch.setattr(device.importlib.metadata, "distributions", distributions("cupy-cuda12x"))
    assert device.two_cupys_warning() is None


@pytest.mark.parametrize("driver_version, keep", [
    (12080, "for this CUDA 12 driver: cupy-cuda12x"),
    (13000, "for this CUDA 13 driver: cupy-cuda13x"),  # it used to say cupy-cuda12x whatever the driver
    (14000, "for this CUDA 14 driver: cupy-cuda13x"),  # the newest wheel a CUDA 14 driver runs
    (None, "no driver found; cupy-cuda12x runs on CUDA 12 and 13 drivers alike")])
def test_the_two_cupys_warning_keeps_the_wheel_for_the_driver(driver_version, keep, monkeypatch):
    from cullama.runtime.backends import driver

    monkeypatch.setattr(device.importlib.metadata, "distributions", distributions("cupy-cuda12x", "cupy-cuda13x"))
    monkeypatch.setattr(driver, "cuda_version", lambda default: driver_version or default)
    assert f"uninstall all but one ({keep}) and reinstall it" in device.two_cupys_warning()


CUDA12 = "pip install 'cullama[cuda12]' (cupy-cuda12x and nvidia-cuda-nvrtc-cu12)"
CUDA13 = "pip install 'cullama[cuda13]' (cupy-cuda13x and nvidia-cuda-nvrtc)"


# The hint follows the driver: the wheels it names must run on it. A CuPy already installed is completed (its
# NVRTC wheel added) where it runs on the driver, so the hint never adds a second CuPy beside a working one; one
# that does not run there is to be uninstalled first. The first case used to expect cullama[cuda13] (the installed
# cupy-cuda13x's major) on a CUDA 12.8 driver, where the CUDA 13 wheels cannot run.
@pytest.mark.parametrize("installed, driver_version, hint", [
    (("cupy-cuda13x",), 12080, f"uninstall cupy-cuda13x (it needs a CUDA 13 driver), then install the CUDA 12 "
                               f"extras: {CUDA12}"),
    (("cupy-cuda12x",), 13000, f"install the CUDA 12 extras: {CUDA12}"),  # 12x runs on a 13 driver: complete it
    ((), 13010, f"install the CUDA 13 extras: {CUDA13}"),
    ((), 12040, f"install the CUDA 12 extras: {CUDA12}"),
    ((), 14000, f"install the CUDA 13 extras (the newest; they run on this CUDA 14 driver): {CUDA13}"),
    ((), 11080, f"install a CUDA 12 or newer driver (this one is CUDA 11) and the CUDA 12 extras: {CUDA12}"),
    (("cupy-cuda13x",), None, f"install the CUDA 13 extras: {CUDA13}"),  # no driver: the installed CuPy's
    ((), None, f"install the CUDA 12 extras: {CUDA12}")])
def test_install_hints_name_the_wheels_for_this_cuda(installed, driver_version, hint, monkeypatch):
    from cullama.runtime.backends import driver

    monkeypatch.setattr(device.importlib.metadata, "distributions", distributions(*installed))
    monkeypatch.setattr(driver, "cuda_version", lambda default: driver_version or default)
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    for broken in (device.import_cupy, registry.nvrtc):
        with pytest.raises(DeviceError, match=f"; {re.escape(hint)}$"):
            broken()


def test_the_driver_version_comes_from_cu_driver_get_version():
    from cullama.runtime.backends import driver

    class Library:
        def __init__(self, status):
            self.cuDriverGetVersion = lambda out: setattr(out._obj, "value", 13010) or status

    assert driver.cuda_version(12000, Library(0)) == 13010
    assert driver.cuda_version(12000, Library(3)) == 12000
