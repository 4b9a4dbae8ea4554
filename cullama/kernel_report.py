"""Compile every kernel variant for an arch without a GPU and report its resources (`cullama kernels`)."""

from __future__ import annotations

import dataclasses

from . import ops
from .registry import Resources, compile_module, target_arch


@dataclasses.dataclass
class KernelReport:
    source: str
    defines: tuple
    name: str
    resources: Resources

    @property
    def define_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.defines) or "-"


def compile_all(arch: str = "sm_90") -> list[KernelReport]:
    """Every kernel in every variant its ops module declares, compiled with NVRTC for `arch` (or its
    arch-specific form, sm_90a, where the module sets ARCH_SPECIFIC)."""
    reports = []
    for stem in ops.STEMS:
        module = ops.module(stem)
        target = target_arch(arch, getattr(module, "ARCH_SPECIFIC", False))  # e.g. wgmma kernels: sm_90a
        for defines in module.VARIANTS:
            compiled = compile_module(module.SOURCE, tuple(defines), target)
            for name, res in sorted(compiled.resources.items()):
                reports.append(KernelReport(module.SOURCE, tuple(defines), name, res))
    return reports
