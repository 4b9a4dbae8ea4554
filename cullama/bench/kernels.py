"""Compile every kernel variant for an arch without a GPU and report its resources (`cullama kernels`)."""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor

from ..runtime import ops
from ..runtime.registry import Resources, compile_module, runs_on, target_arch
from ..runtime.device import arch_number


@dataclasses.dataclass
class KernelReport:
    source: str
    defines: tuple
    name: str
    resources: Resources

    @property
    def define_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.defines) or "-"


def variants(arch: str = "sm_90") -> list[tuple[str, tuple, str]]:
    """(source, defines, NVRTC target) of every kernel variant its ops module declares that runs on `arch`: the
    target is `arch`, or its arch-specific form (sm_90a) where the module sets ARCH_SPECIFIC."""
    arch_number(arch)  # a KernelError for a malformed or too old arch
    found = []
    for stem in ops.STEMS:
        module = ops.module(stem)
        arch_specific = getattr(module, "ARCH_SPECIFIC", False)
        if runs_on(arch, arch_specific):
            found += [(module.SOURCE, tuple(d), target_arch(arch, arch_specific)) for d in module.VARIANTS]
    return found


def skipped(arch: str = "sm_90") -> list[str]:
    """The kernel sources that have no version for `arch`, each with the reason (wgmma is sm_90a code)."""
    return [f"{ops.module(stem).SOURCE}: sm_90a code (wgmma), Hopper only; the prefill uses gemm.cu (mma.sync) here"
            for stem in ops.STEMS
            if not runs_on(arch, getattr(ops.module(stem), "ARCH_SPECIFIC", False))]


def compile_all(arch: str = "sm_90", workers: int | None = None) -> list[KernelReport]:
    """Every kernel in every variant of variants(arch), compiled with NVRTC, in variants' order. Several variants
    compile at once (`workers`, default one per CPU): CuPy's NVRTC binding lets go of the GIL while NVRTC works, so
    threads scale with the cores (2 threads, 1.9x on 2 cores), and a cold cache of every variant, over a minute
    in one thread, is what a fresh GPU machine starts with. The cache's lock files keep two threads, like two
    processes, from compiling one key twice. A variant that fails raises its KernelError (the first in order)."""
    found = variants(arch)
    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        compiled = list(pool.map(lambda variant: compile_module(*variant), found))
    return [KernelReport(source, defines, name, res)
            for (source, defines, _), module in zip(found, compiled)
            for name, res in sorted(module.resources.items())]
