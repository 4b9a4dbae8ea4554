"""The identity of compiled modules: every compile-time define and option is part of the key a cubin is cached
under and of the key a module is loaded under, so two variants of one source never share a binary or a loaded
module. The fake GPU of the other tests replaces KernelLoader.function, so it cannot see this: here NVRTC and
CuPy are stubs that record what is compiled and what is loaded, and the registry's own code runs unchanged."""

from __future__ import annotations

import json
import types

import pytest

from cullama.runtime import device, registry
from cullama.runtime.registry import KernelLoader, KernelSpec


class Recorder:
    """Stands in for NVRTC (compile) and for CuPy (RawModule, get_function): the binaries name what built them."""

    def __init__(self):
        self.compiled: list[tuple[str, tuple]] = []  # (source, options) of each NVRTC compile
        self.loaded: list[str] = []  # the cubin of each RawModule
        self.functions: list[str] = []  # the name of each get_function
        self.version = (12, 9)

    # NVRTC
    def getVersion(self):
        return self.version

    def getSupportedArchs(self):
        return (75, 80, 86, 89, 90, 100, 120)

    def compile(self, binding, source, code, headers, options):
        self.compiled.append((source, tuple(options)))
        return json.dumps([source, options]).encode(), f"ptxas info    : Compiling entry function 'k' for {options}"

    # CuPy
    def module(self, path: str):
        self.loaded.append(path)
        built = json.loads(open(path, "rb").read())

        def get_function(name):
            self.functions.append(name)
            return name, built

        return types.SimpleNamespace(get_function=get_function)


@pytest.fixture
def recorder(tmp_path, monkeypatch):
    rec = Recorder()
    monkeypatch.setenv("CULLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "nvrtc", lambda: rec)
    monkeypatch.setattr(registry, "_nvrtc_compile", rec.compile)
    monkeypatch.setattr(registry.elf, "problems", lambda data: [])  # the stub's cubins are not ELF files
    monkeypatch.setattr(device, "import_cupy", lambda: types.SimpleNamespace(RawModule=lambda path: rec.module(path)))
    return rec


def built_with(module) -> tuple[str, list]:
    """(source, options) that produced a compiled module's cubin."""
    return tuple(json.loads(module.cubin_path.read_bytes()))


def test_each_define_arch_and_option_has_its_own_cubin(recorder):
    first = registry.compile_module("gemv_mma.cu", (("NTILES", 4), ("UNROLL", 8)), "sm_90")
    variants = {
        "another value": registry.compile_module("gemv_mma.cu", (("NTILES", 2), ("UNROLL", 8)), "sm_90"),
        "another define": registry.compile_module("gemv_mma.cu", (("NTILES", 4), ("TOKENS", 8)), "sm_90"),
        "one define fewer": registry.compile_module("gemv_mma.cu", (("NTILES", 4),), "sm_90"),
        "another arch": registry.compile_module("gemv_mma.cu", (("NTILES", 4), ("UNROLL", 8)), "sm_80"),
        "the a target": registry.compile_module("gemv_mma.cu", (("NTILES", 4), ("UNROLL", 8)), "sm_90a"),
        "another source": registry.compile_module("attention.cu", (("NTILES", 4), ("UNROLL", 8)), "sm_90"),
    }
    assert len(recorder.compiled) == 1 + len(variants)
    paths = {first.cubin_path, *(m.cubin_path for m in variants.values())}
    assert len(paths) == 1 + len(variants), "two variants share a cached cubin"
    assert built_with(first) == ("gemv_mma.cu", [*registry.OPTIONS, "--gpu-architecture=sm_90", "-DNTILES=4",
                                                 "-DUNROLL=8"])
    for what, module in variants.items():  # each cubin is the one its own options built
        source, options = built_with(module)
        assert (source, tuple(options)) in recorder.compiled, what
    assert "--gpu-architecture=sm_80" in built_with(variants["another arch"])[1]
    assert "-DNTILES=2" in built_with(variants["another value"])[1]
    # The same request again: the cache, no compile.
    again = registry.compile_module("gemv_mma.cu", (("NTILES", 4), ("UNROLL", 8)), "sm_90")
    assert again.cubin_path == first.cubin_path and len(recorder.compiled) == 1 + len(variants)


def test_the_key_follows_the_nvrtc_version_the_cache_format_and_the_headers(recorder, monkeypatch, tmp_path):
    first = registry.compile_module("sampling.cu", (), "sm_90").cubin_path
    recorder.version = (13, 0)
    newer_nvrtc = registry.compile_module("sampling.cu", (), "sm_90").cubin_path
    monkeypatch.setattr(registry, "CACHE_FORMAT", registry.CACHE_FORMAT + 1)
    newer_format = registry.compile_module("sampling.cu", (), "sm_90").cubin_path
    headers = registry._headers()
    monkeypatch.setattr(registry, "_headers", lambda: {**headers, "common.cuh": headers["common.cuh"] + "\n// edited"})
    edited_header = registry.compile_module("sampling.cu", (), "sm_90").cubin_path
    assert len({first, newer_nvrtc, newer_format, edited_header}) == 4 and len(recorder.compiled) == 4


def test_the_loader_loads_one_module_per_variant_and_each_function_from_its_own(recorder):
    loader = KernelLoader("sm_90")
    rows4 = KernelSpec("gemv_mma.cu", "gemv_residual", (("NTILES", 4), ("UNROLL", 8)))
    rows4_logits = KernelSpec("gemv_mma.cu", "gemv_logits", (("NTILES", 4), ("UNROLL", 8)))  # the same module
    rows2 = KernelSpec("gemv_mma.cu", "gemv_residual", (("NTILES", 2), ("UNROLL", 8)))
    wgmma = KernelSpec("gemm_wgmma.cu", "gemm_wgmma", (("BM", 128),))
    wgmma_a = KernelSpec("gemm_wgmma.cu", "gemm_wgmma", (("BM", 128),), arch_specific=True)
    functions = {spec: loader.function(spec) for spec in (rows4, rows4_logits, rows2, wgmma, wgmma_a)}
    assert len(recorder.loaded) == 4 and len(set(recorder.loaded)) == 4  # rows4 and rows4_logits share one
    for spec, (name, (source, options)) in functions.items():
        target = "sm_90a" if spec.arch_specific else "sm_90"
        assert (name, source) == (spec.name, spec.source)
        assert options == [*registry.OPTIONS, f"--gpu-architecture={target}",
                           *(f"-D{k}={v}" for k, v in spec.defines)], spec
    assert len(recorder.functions) == len(functions)
    # Asked again, nothing is compiled, loaded or looked up; each spec keeps its own function.
    done = len(recorder.compiled), len(recorder.loaded), len(recorder.functions)
    for spec, function in functions.items():
        assert loader.function(spec) == function
    assert (len(recorder.compiled), len(recorder.loaded), len(recorder.functions)) == done


def test_module_keys_tell_every_variant_apart():
    specs = [KernelSpec("gemv_mma.cu", "k"), KernelSpec("gemv_mma.cu", "k", (("NTILES", 4),)),
             KernelSpec("gemv_mma.cu", "k", (("NTILES", 2),)), KernelSpec("gemv_mma.cu", "k", (("UNROLL", 4),)),
             KernelSpec("gemv_mma.cu", "k", arch_specific=True), KernelSpec("gemm.cu", "k")]
    assert len({s.module_key() for s in specs}) == len(specs)
    same = [KernelSpec("gemv_mma.cu", name, (("NTILES", 4),)).module_key() for name in ("a", "b")]  # one module
    assert same[0] == same[1]
