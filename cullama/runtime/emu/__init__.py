"""A CPU executor for cullama's CUDA kernels as written: each kernels_cu source is compiled by the host C++
compiler under an emulation header (cuda_emu.h), its inline PTX mapped by template to C++ (asm.py, ptx.h), and
run block by block with every CUDA thread a fiber (runtime.cpp) in a chosen warp schedule, with shared memory
poisoned, cp.async / wgmma hazards made visible and every misaligned typed access failing the launch, as it
faults on a GPU (-fsanitize=alignment, build.py); a launch that writes what it read with ld.global.nc / __ldg,
or bytes a __restrict__ argument shares with another, fails too (launch.py). The tests run every kernel against
its NumPy twin this way, and CULLAMA_FAKE_GPU=emu runs the GPU tests end to end on it.

    from cullama.runtime.emu import launch
    launch(KernelSpec("gemv_mma.cu", "gemv_residual", defines), grid, block, (inp, W, W, x, norm_w, xn, ssp, M, K, group))

It cannot see what only a GPU can show: the order in which blocks run and meet (blocks run one after another
here), the memory model between threads (every store is visible at once), or the tensor cores' and special
function units' rounding (mma and wgmma sum in double; expf, rsqrtf and ex2 are the host's).
"""

from .build import library
from .launch import SCHEDULES, EmuError, launch

__all__ = ["EmuError", "SCHEDULES", "launch", "library"]
