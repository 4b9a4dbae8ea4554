"""Which kernels a prefill plan launches: the GEMM and the causal attention, each with its geometry.

Two GEMMs compute cullama/runtime/ops/gemm.py's function, with the same parameters and split-K contract:
    mma     gemm.cu: mma.sync m16n8k16, 64 x 128 tiles, three blocks per SM (two before sm_90), any GPU from sm_80
    wgmma   gemm_wgmma.cu: Hopper's warpgroup MMA, 128 x 192 tiles, one block per SM, sm_90 only
A runner starts with default_for(its GPU's arch): PREFERRED, or on a GPU without wgmma (A100, L40S, RTX 4090,
Blackwell) the same with the mma GEMM.
Two attentions compute ops/attention.py's attention_prefill:
    scalar  attention.cu: FP32 on the CUDA cores, any head_dim from 8 to 128
    mma     attention_mma.cu: tensor cores (flash-attention-2 style), head_dim 16 to 128 (else scalar)
The defaults stay mma + scalar until an H200 run (benchmarks/prefill_step.py) shows the others faster.
"""

from __future__ import annotations

import dataclasses

from . import registry
from ..model.config import LlamaConfig
from ..common.errors import KernelError
from .ops import attention_mma as attention_mma_ops
from .ops import gemm_wgmma as wgmma_ops
from .registry import KernelSpec

SMS = 132  # streaming multiprocessors of the target GPU (H100 / H200 SXM), for the split-K rule
MAX_SPLIT = 4  # most K splits of one prefill GEMM (partials per tile in gemm_workspace)
SPLIT_K = True  # False: every prefill GEMM runs with S = 1 (no split-K), to compare; read at plan time


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class GemmKernel:
    """One prefill GEMM: its kernel, block tile, and the split-K rule that fills the GPU with it."""

    name: str
    spec: KernelSpec
    tile_m: int
    tile_n: int
    tile_k: int  # K per pipeline stage: a split's K range is a multiple of it
    threads: int
    smem: int  # dynamic shared memory per block, bytes (0: static only)
    full_tiles: int  # from this many tiles on, the GPU is full without splitting K
    split_k_unit: int  # the least K a split takes

    def tiles(self, m: int, n: int) -> int:
        return cdiv(n, self.tile_n) * cdiv(m, self.tile_m)

    def grid(self, m: int, n: int, k: int) -> tuple[int, int, int]:
        return cdiv(n, self.tile_n), cdiv(m, self.tile_m), self.splits(m, n, k)

    def split_rule(self, m: int, n: int, k: int) -> int:
        """S = 1 from full_tiles tiles on; below, S = min(MAX_SPLIT, SMS // tiles, k // split_k_unit), at
        least 1: at most one wave of S x tiles blocks, at most MAX_SPLIT partials to sum per tile."""
        tiles = self.tiles(m, n)
        if tiles >= self.full_tiles:
            return 1
        return max(1, min(MAX_SPLIT, SMS // tiles, k // self.split_k_unit))

    def splits(self, m: int, n: int, k: int) -> int:
        """K splits S of this GEMM (its grid's z; the deterministic split-K of gemm.cu's header)."""
        return self.split_rule(m, n, k) if SPLIT_K else 1

    def split_tiles(self, cfg: LlamaConfig, chunk: int) -> int:
        """Most tiles (blocks per split) of any split-K launch of a prefill of up to `chunk` rows (whatever
        SPLIT_K says), at least 1."""
        tiles = [cdiv(n, self.tile_n) * row_tiles for n, k in gemm_shapes(cfg)
                 for row_tiles in range(1, cdiv(chunk, self.tile_m) + 1)
                 if self.split_rule(row_tiles * self.tile_m, n, k) > 1]
        return max(tiles, default=1)

    def workspace_floats(self, cfg: LlamaConfig, chunk: int) -> int:
        """gemm_workspace floats that any split-K launch of this GEMM needs: MAX_SPLIT partial tiles each."""
        return MAX_SPLIT * self.split_tiles(cfg, chunk) * self.tile_m * self.tile_n


# gemm.cu: 64 x 128 tiles, up to three blocks per SM; split below 66 tiles with at least 256 of K (8 pipeline tiles)
# a split. On LLaMA-2-7B that splits o_proj and down_proj (n = 4096: 32 tiles) 4 ways for prompts of up to
# 64 rows and 2 ways for 65..128 rows. A first guess: benchmarks/gemm_sweep.py decides.
MMA_GEMM = GemmKernel("mma", KernelSpec("gemm.cu", "gemm"), tile_m=64, tile_n=128, tile_k=32, threads=256, smem=0,
                      full_tiles=SMS // 2, split_k_unit=256)
# gemm_wgmma.cu: 128 x 192 tiles, one block per SM; split below 99 tiles (3/4 of the SMs) with at least 1024
# of K a split: at a 256-row chunk, o_proj and down_proj (44 tiles) split 3 ways = 132 blocks.
WGMMA_GEMM = GemmKernel("wgmma", KernelSpec("gemm_wgmma.cu", "gemm_wgmma", arch_specific=True),
                        tile_m=wgmma_ops.TILE_M, tile_n=wgmma_ops.TILE_N, tile_k=wgmma_ops.TILE_K,
                        threads=wgmma_ops.THREADS, smem=wgmma_ops.SMEM_BYTES, full_tiles=3 * SMS // 4,
                        split_k_unit=1024)
GEMMS = {kernel.name: kernel for kernel in (MMA_GEMM, WGMMA_GEMM)}


def quant_gemm(bits: int) -> GemmKernel:
    """gemm_quant.cu on INT4 / INT8 weights (ops/gemm_quant.py): the mma GEMM's tiles, threads and split-K rule,
    so the workspace sized for MMA_GEMM serves it too."""
    return dataclasses.replace(MMA_GEMM, name=f"mma_int{bits}",
                               spec=KernelSpec("gemm_quant.cu", "gemm_quant", (("BITS", bits),)))


ATTENTIONS = ("scalar", "mma")


def gemm_shapes(cfg: LlamaConfig) -> list[tuple[int, int]]:
    """(n, k) of every prefill GEMM: qkv, o_proj, gate_up, down, lm_head."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return [(cfg.qkv_dim, d), (d, cfg.q_dim), (2 * ff, d), (d, ff), (cfg.vocab_size, d)]


@dataclasses.dataclass(frozen=True)
class PrefillKernels:
    """The prefill plan's choice of GEMM (GEMMS) and attention (ATTENTIONS)."""

    gemm: str = "mma"
    attention: str = "scalar"

    def __post_init__(self):
        if self.gemm not in GEMMS:
            raise KernelError(f"prefill GEMM {self.gemm!r} is not one of {', '.join(GEMMS)}")
        if self.attention not in ATTENTIONS:
            raise KernelError(f"prefill attention {self.attention!r} is not one of {', '.join(ATTENTIONS)}")

    @property
    def gemm_kernel(self) -> GemmKernel:
        return GEMMS[self.gemm]

    def runs_on(self, arch: str | None) -> bool:
        """Whether the GPU (`arch`, e.g. "sm_90"; None: the CPU twins, any choice) can run them: wgmma is
        sm_90a code, which runs on compute capability 9.0 only; the rest runs on every GPU cullama supports."""
        return arch is None or registry.runs_on(arch, self.gemm_kernel.spec.arch_specific)

    def check_arch(self, arch: str | None) -> None:
        """runs_on, as a one-line KernelError."""
        if not self.runs_on(arch):
            raise KernelError(f"the wgmma prefill GEMM needs an sm_90 GPU (H100 / H200); this one is {arch}")

    def mma_attention(self, cfg: LlamaConfig) -> bool:
        """Whether the tensor-core attention runs for this model (chosen, and its head_dim is supported)."""
        return self.attention == "mma" and attention_mma_ops.supports(cfg.head_dim, cfg.group_size)


PREFERRED = PrefillKernels()  # what a plan uses where the GPU runs it (benchmarks/prefill_step.py decides)


def default_for(arch: str | None) -> PrefillKernels:
    """The prefill kernels a runner starts with on a GPU of `arch` (None: the CPU twins): PREFERRED where it
    runs there, else PREFERRED with the mma.sync GEMM, which runs on every GPU cullama supports (sm_80 on)."""
    if PREFERRED.runs_on(arch):
        return PREFERRED
    return dataclasses.replace(PREFERRED, gemm=MMA_GEMM.name)


def workspace_floats(cfg: LlamaConfig, chunk: int) -> int:
    """gemm_workspace floats that fit every GEMM's split-K launches, so the choice can change at run time."""
    return max(kernel.workspace_floats(cfg, chunk) for kernel in GEMMS.values())


def tile_counters(cfg: LlamaConfig, chunk: int) -> int:
    """gemm_tile_count entries that fit every GEMM's split-K launches (one arrival counter per tile)."""
    return max(kernel.split_tiles(cfg, chunk) for kernel in GEMMS.values())
