"""Twin of kernels_cu/gemm_wgmma.cu: the prefill path's matrix product on Hopper's warpgroup tensor cores
(wgmma, sm_90a). Same function, parameters and split-K contract as gemm.cu; only the block tile differs.

The launch geometry of a variant (its tile, threads and dynamic shared memory) is `geometry(defines)`,
computed from the defines the kernel defaults to (DEFAULTS, checked against the .cu by
tests/runtime/ops/test_gemm_wgmma.py) and the plan's overrides: grid (cdiv(N, tile_n), cdiv(M, tile_m), S), block
threads, smem_bytes of dynamic shared memory (more than 48 KB: allow it first, backends/func_attr.py).
"""

from __future__ import annotations

import dataclasses

from . import gemm as _gemm

SOURCE = "gemm_wgmma.cu"
ARCH_SPECIFIC = True  # wgmma.mma_async exists on sm_90a only: the registry compiles for the arch-specific target

DEFAULTS = {"GW_TILE_N": 192, "GW_WARPGROUPS": 2, "GW_STAGES": 5, "GW_SWIZZLE": 128}  # as in the .cu
TILE_K = 64  # K per pipeline stage: a split-K range is a multiple of it
MAX_SMEM_BYTES = 227 * 1024  # an H100 / H200 block's shared memory (static + dynamic) after the opt-in

# Compiled by CI (`cullama kernels`) and tests: the default (128 x 192, 5 stages), the two other tile widths
# worth timing at LLaMA-2-7B shapes, one warpgroup (64 x 256: short prompts, M <= 64, where a 128-row tile
# is half zeros), and the no-swizzle layout (a fallback, should the swizzled one misbehave on the GPU).
VARIANTS = [(), (("GW_TILE_N", 256), ("GW_STAGES", 4)), (("GW_TILE_N", 128), ("GW_STAGES", 6)),
            (("GW_WARPGROUPS", 1), ("GW_TILE_N", 256), ("GW_STAGES", 5)), (("GW_SWIZZLE", 0),)]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Launch geometry of one variant of gemm_wgmma."""

    tile_m: int  # rows of C per block (64 per warpgroup)
    tile_n: int  # columns of C per block (the wgmma's N)
    tile_k: int  # K per pipeline stage
    threads: int  # block size (128 per warpgroup)
    stages: int
    smem_bytes: int  # dynamic shared memory per block: the ring plus 1024 B to align it

    def grid(self, m: int, n: int, splits: int = 1) -> tuple[int, int, int]:
        return (-(-n // self.tile_n), -(-m // self.tile_m), splits)

    def workspace_floats(self, m: int, n: int, splits: int) -> int:
        """Split-K workspace the launch needs: splits x tiles partial tiles (0 when splits == 1)."""
        x, y, _ = self.grid(m, n, splits)
        return splits * x * y * self.tile_m * self.tile_n if splits > 1 else 0


def geometry(defines=()) -> Geometry:
    d = {**DEFAULTS, **dict(defines)}
    tile_m, tile_n, stages = 64 * d["GW_WARPGROUPS"], d["GW_TILE_N"], d["GW_STAGES"]
    return Geometry(tile_m, tile_n, TILE_K, 128 * d["GW_WARPGROUPS"], stages,
                    stages * (tile_m + tile_n) * TILE_K * 2 + 1024)


DEFAULT = geometry()
TILE_M, TILE_N, THREADS, SMEM_BYTES = DEFAULT.tile_m, DEFAULT.tile_n, DEFAULT.threads, DEFAULT.smem_bytes


def gemm_wgmma(A, W, C, workspace, tile_count, M, N, K, accumulate):
    """C[:M, :N] (+)= A[:M, :K] · W[:N, :K]^T in float32 from the FP16 inputs: gemm.gemm (ops/gemm.py), whose
    docstring is the contract (workspace and tile_count are split-K scratch the twin leaves untouched)."""
    _gemm.gemm(A, W, C, workspace, tile_count, M, N, K, accumulate)
