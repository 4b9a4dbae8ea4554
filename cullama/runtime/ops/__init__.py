"""NumPy twins of the CUDA kernels: one module per `kernels_cu/<stem>.cu`, one function per kernel.

A twin has the kernel's name and parameters in the same order (arrays where the kernel takes
pointers, shaped as the plan's buffers; numbers where it takes scalars), writes its outputs in
place, and computes the same function: it is the kernel's specification and its CPU implementation.
Each module also names its SOURCE file and the VARIANTS (compile-time defines) that CI compiles, and
sets ARCH_SPECIFIC = True where its kernels need the arch-specific target (sm_90a: wgmma).
"""

from importlib import import_module

STEMS = ("gemv_mma", "attention", "sampling", "gemm", "gemm_wgmma", "prefill", "bandwidth", "fill", "attention_mma",
         "gather", "gemm_quant")


def module(stem: str):
    return import_module(f"{__name__}.{stem}")


def twin(source: str, name: str):
    """The twin of kernel `name` in kernels_cu/`source`."""
    return getattr(module(source.removesuffix(".cu")), name)
