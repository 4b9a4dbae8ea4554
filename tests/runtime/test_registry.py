"""The kernel registry: NVRTC compiles every kernel for sm_90 without a GPU, with no spills; the disk
cache is keyed by everything that changes the binary and is safe under concurrent compiles."""

import datetime
import os
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cullama.runtime import registry
from cullama.cli.main import main
from cullama.common.errors import KernelError
from cullama.bench.kernels import compile_all

TOY = 'extern "C" __global__ void toy(float* out) { out[threadIdx.x] = SCALE * threadIdx.x; }\n'


@pytest.fixture
def toy_sources(tmp_path, monkeypatch):
    """A private kernels_cu/ and cache, so the test can edit sources freely."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy.cu").write_text('#include "toy.cuh"\n' + TOY)
    (src / "toy.cuh").write_text("#define SCALE 2.0f\n")
    monkeypatch.setattr(registry, "SOURCE_DIR", src)
    monkeypatch.setenv("CULLAMA_CACHE", str(tmp_path / "cache"))
    return src


def test_every_kernel_compiles_for_sm90_without_spills():
    reports = compile_all("sm_90")
    assert {r.source for r in reports} >= {"gemv_mma.cu", "attention.cu", "sampling.cu", "gemm.cu", "prefill.cu"}
    spilled = [f"{r.name} ({r.define_text}): {r.resources}" for r in reports if r.resources.spills]
    assert not spilled
    assert all(0 < r.resources.registers <= 255 for r in reports)


def test_compile_all_compiles_at_once_and_reports_in_order(monkeypatch):
    """`cullama kernels` compiles variants on several threads (a fresh GPU machine's cold cache); its report keeps
    variants' order whatever order they finish in, and a failing variant is its own KernelError."""
    import threading
    import time

    from cullama.bench import kernels as kernel_report

    found = [(f"k{i}.cu", (("N", i),), "sm_90") for i in range(6)]
    res = registry.Resources(32, 0, 0, 0, 0)
    threads, running, peak, failing = set(), [0], [0], set()
    lock = threading.Lock()

    def compile_module(source, defines, target):
        with lock:
            threads.add(threading.get_ident())
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05 * (6 - defines[0][1]))  # the first finishes last
        with lock:
            running[0] -= 1
        if source in failing:
            raise KernelError(f"{source}: NVRTC failed")
        return registry.CompiledModule("x.cubin", {f"b_{source}": res, f"a_{source}": res})

    monkeypatch.setattr(kernel_report, "variants", lambda arch: found)
    monkeypatch.setattr(kernel_report, "compile_module", compile_module)
    reports = kernel_report.compile_all("sm_90", workers=3)
    assert [r.name for r in reports] == [f"{p}_k{i}.cu" for i in range(6) for p in "ab"]
    assert [r.defines for r in reports[::2]] == [d for _, d, _ in found]
    assert peak[0] == 3 and len(threads) == 3
    failing.add("k4.cu")
    with pytest.raises(KernelError, match="k4.cu: NVRTC failed"):
        kernel_report.compile_all("sm_90", workers=3)


def test_kernels_command_prints_resources():
    result = CliRunner().invoke(main, ["kernels", "--arch", "sm_90"])
    assert result.exit_code == 0, result.output
    assert "gemv_qkv_rope" in result.stdout and "0 with spills" in result.stdout


def test_cache_key_covers_headers_and_defines(toy_sources):
    first = registry.compile_module("toy.cu", (), "sm_90")
    assert registry.compile_module("toy.cu", (), "sm_90").cubin_path == first.cubin_path  # cached
    assert first.resources["toy"].registers > 0
    (toy_sources / "toy.cuh").write_text("#define SCALE 3.0f\n")
    assert registry.compile_module("toy.cu", (), "sm_90").cubin_path != first.cubin_path
    (toy_sources / "toy.cu").write_text(TOY)  # no header: SCALE from a define
    with_define = registry.compile_module("toy.cu", (("SCALE", 4),), "sm_90")
    assert with_define.cubin_path != registry.compile_module("toy.cu", (("SCALE", 5),), "sm_90").cubin_path


def test_two_processes_compiling_at_once(toy_sources, tmp_path):
    script = ("import sys; from cullama.runtime import registry; from pathlib import Path; "
              f"registry.SOURCE_DIR = Path({str(toy_sources)!r}); "
              "print(registry.compile_module('toy.cu', (), 'sm_90').cubin_path)")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    paths = {p.communicate()[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    assert not list((tmp_path / "cache" / "kernels").glob("*.tmp"))


def test_compile_errors_name_the_file(toy_sources):
    (toy_sources / "bad.cu").write_text('extern "C" __global__ void bad() { undefined_thing(); }\n')
    with pytest.raises(KernelError, match="bad.cu"):
        registry.compile_module("bad.cu", (), "sm_90")
    with pytest.raises(KernelError, match="arch"):
        registry.compile_module("toy.cu", (), "90")


def test_ptxas_log_parsing():
    log = """ptxas info    : Compiling entry function 'k' for 'sm_90'
ptxas info    : Function properties for k
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem"""
    res = registry.parse_ptxas_log(log)["k"]
    assert (res.registers, res.smem_bytes, res.stack_bytes, res.spills) == (40, 1024, 8, True)


def test_arch_specific_kernels_compile_for_the_a_target():
    from cullama.runtime.registry import KernelSpec, target_arch
    assert target_arch("sm_90", True) == "sm_90a" and target_arch("sm_90", False) == "sm_90"
    assert target_arch("sm_90a", True) == "sm_90a"
    plain, specific = KernelSpec("gemm.cu", "gemm"), KernelSpec("gemm.cu", "gemm", arch_specific=True)
    assert plain.module_key() != specific.module_key()  # loaded as two modules


# ---- architectures ------------------------------------------------------------------------------------------

OTHER_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_100", "sm_120")  # A100, RTX 30xx / A40, L40S / RTX 4090, Blackwell


def representative(arch: str) -> list:
    """The first and last variant of each kernel source that runs on `arch` (the first is the LLaMA-2-7B one): a
    third of the compile time of all of them, which `cullama kernels --arch` compiles."""
    from cullama.bench.kernels import variants

    by_source: dict = {}
    for variant in variants(arch):
        by_source.setdefault(variant[0], []).append(variant)
    return sorted({v for found in by_source.values() for v in (found[0], found[-1])})


def test_each_arch_gets_what_it_can_run_and_never_a_false_a_target():
    from cullama.bench.kernels import skipped, variants

    for arch in ("sm_90", *OTHER_ARCHS):
        targets = {(source, target) for source, _, target in variants(arch)}
        wgmma = {t for s, t in targets if s == "gemm_wgmma.cu"}
        assert {t for s, t in targets if s != "gemm_wgmma.cu"} == {arch}
        assert wgmma == ({"sm_90a"} if arch == "sm_90" else set())
        assert bool(skipped(arch)) == (arch != "sm_90") and all("gemm_wgmma.cu" in n for n in skipped(arch))
        assert registry.target_arch(arch, False) == arch
        if arch != "sm_90":
            with pytest.raises(KernelError, match=f"sm_90a code.*no {arch} version"):
                registry.target_arch(arch, True)
    assert registry.target_arch("sm_90", True) == registry.target_arch("sm_90a", True) == "sm_90a"


def archs_compiled_whole() -> set[str]:
    """The other archs whose every variant this run compiles (sm_90's all are, above): CULLAMA_TEST_ARCHS names them
    (comma-separated, or "all": about a minute each on 2 cores), else one a day in turn, so that five days of CI
    runs cover every variant on every arch. Issue 30 item 10: the CUDA-core GEMV's ROWS 8 UNROLL 2, neither first
    nor last, spilled on sm_100 and sm_120, and no test compiled it there."""
    named = os.environ.get("CULLAMA_TEST_ARCHS")
    if named:
        return set(OTHER_ARCHS) if named == "all" else set(named.split(","))
    return {OTHER_ARCHS[datetime.date.today().toordinal() % len(OTHER_ARCHS)]}


@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_kernels_command_compiles_each_arch_without_spills(arch, monkeypatch):
    from cullama.bench import kernels as kernel_report

    chosen = kernel_report.variants(arch) if arch in archs_compiled_whole() else representative(arch)
    monkeypatch.setattr(kernel_report, "variants", lambda a: chosen if a == arch else pytest.fail(a))
    result = CliRunner().invoke(main, ["kernels", "--arch", arch])
    assert result.exit_code == 0, result.output
    assert f"kernels compiled for {arch}; 0 with spills" in result.stdout
    assert "skipped gemm_wgmma.cu: sm_90a code (wgmma), Hopper only" in result.stdout
    compiled = set(re.findall(r"^(\w+) ", result.stdout, re.M))
    assert {"gemm", "sample", "attention_prefill_mma", "gemv_logits"} <= compiled


def test_archs_too_old_or_unknown_to_nvrtc_are_one_line_errors():
    with pytest.raises(KernelError, match="sm_75: cullama's kernels need sm_80"):
        registry.compile_module("sampling.cu", (), "sm_75")
    with pytest.raises(KernelError, match=r"--arch sm_990: NVRTC \d+\.\d+ cannot compile for it"):
        registry.compile_module("sampling.cu", (), "sm_990")
    result = CliRunner().invoke(main, ["kernels", "--arch", "sm_70"])
    assert result.exit_code == 2 and "need sm_80" in result.stderr


def test_the_runtime_picks_prefill_kernels_the_gpu_runs(monkeypatch):
    from cullama.runtime import prefill_kernels
    from cullama.runtime.prefill_kernels import PrefillKernels, default_for

    assert default_for("sm_80") == default_for("sm_90") == default_for(None) == prefill_kernels.PREFERRED
    monkeypatch.setattr(prefill_kernels, "PREFERRED", PrefillKernels(gemm="wgmma", attention="mma"))
    assert default_for("sm_90") == default_for(None) == PrefillKernels("wgmma", "mma")
    for arch in OTHER_ARCHS:
        assert default_for(arch) == PrefillKernels("mma", "mma") and default_for(arch).runs_on(arch)
        assert not PrefillKernels("wgmma").runs_on(arch)
