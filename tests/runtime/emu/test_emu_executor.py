"""cullama.runtime.emu itself: FP16 conversions bit for bit as NumPy's; every inline-PTX template in kernels_cu known to
the rewrite table, anything else refused with its text; hazards, deadlocks and stray accesses reported as
one-line errors naming the kernel, block, thread and line (never a hang or a crash), on small kernels written
here; CuPy's argument rules; the build cache; the portable fiber switch."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cullama.runtime import cache, emu, ops
from cullama.runtime.emu import asm, build
from cullama.common.errors import KernelError
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.plan import GEMV_THREADS
from cullama.runtime.registry import KernelSpec

pytestmark = pytest.mark.emu
REPO = Path(__file__).resolve().parents[3]

# Small kernels with one hazard or misuse each, on the kernels' own headers.
PROBES = r"""
#include "mma.cuh"

extern "C" __global__ void exits_before_barrier(float* out) {
    if (threadIdx.x == 37) return;
    __syncthreads();
    out[threadIdx.x] = 1.f;
}

extern "C" __global__ void two_barriers(float* out) {
    if (threadIdx.x < 32) __syncthreads();
    else __syncthreads();
    out[threadIdx.x] = 1.f;
}

extern "C" __global__ void shuffle_after_exit(float* out) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = warp_sum(1.f);
}

// Each warp reads what the other warp wrote, with no barrier between.
extern "C" __global__ void missing_barrier(float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = s[63 - threadIdx.x];
}

// The same within a warp: lane l reads lane l + 1's write (no __syncwarp either).
extern "C" __global__ void warp_race(float* out) {
    __shared__ float s[32];
    s[threadIdx.x] = (float)threadIdx.x;
    out[threadIdx.x] = s[(threadIdx.x + 1) % 32];
}

// cp.async: the destination before and after its wait_group, and the zero fill of src-size 0.
extern "C" __global__ void cp_async_probe(const half_t* src, half_t* before, half_t* after, half_t* zero) {
    __shared__ __align__(16) half_t s[2][32 * 8];
    const int t = threadIdx.x;
    cp_async16(smem_addr(&s[0][8 * t]), src + 8 * t, true);
    cp_async16(smem_addr(&s[1][8 * t]), src + 8 * t, false);
    cp_async_commit();
    before[t] = s[0][8 * t];
    cp_async_wait<0>();
    after[t] = s[0][8 * t];
    zero[t] = s[1][8 * t];
}

extern "C" __global__ void stray_pointer(float* out) { out[(size_t)1 << 40] = 1.f; }

extern "C" __global__ void past_the_end(float* out, int n) { out[n + threadIdx.x] = 1.f; }

extern "C" __global__ void misaligned_load(const half_t* p, float* out) {
    const uint4 v = load_stream(p + 1);
    out[0] = __uint_as_float(v.x);
}

extern "C" __global__ void dynamic_overflow(int n) {
    extern __shared__ unsigned char window[];
    window[n] = 1;
}

extern "C" __global__ void __launch_bounds__(64) bounded(float* out) { out[threadIdx.x] = 1.f; }

// The FP16 conversions as the kernels write them: common.cuh's f2h and h2f, and attention_mma.cu's packed cvt
// (first source to the upper half).
extern "C" __global__ void conversions(const float* f, half_t* h, uint32_t* packed, const half_t* halves,
                                       float* back, int n) {
    for (int i = 0; i < n; ++i) {
        h[i] = f2h(f[i]);
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed[i]) : "f"(f[i]), "f"(f[n - 1 - i]));
        back[i] = h2f(halves[i]);
    }
}

// Read with ld.global.nc (load_stream) or __ldg, or through __restrict__ pointers; written in the same launch.
extern "C" __global__ void nc_in_place(uint4* data) {
    uint4 v = load_stream(data + threadIdx.x);
    v.x += 1u;
    data[threadIdx.x] = v;
}

extern "C" __global__ void ldg_twice(const float* in, float* out) { out[threadIdx.x] = 2.f * __ldg(in + threadIdx.x); }

extern "C" __global__ void restrict_twice(const float* __restrict__ in, float* __restrict__ out) {
    out[threadIdx.x] = 2.f * in[threadIdx.x];
}

extern "C" __global__ void plain_twice(const float* in, float* out) { out[threadIdx.x] = 2.f * in[threadIdx.x]; }

extern "C" __global__ void scalars(float* out, int i, unsigned long long u, float f) {
    out[0] = (float)i, out[1] = (float)u, out[2] = f;
}
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("probes")
    for header in SOURCE_DIR.glob("*.cuh"):
        shutil.copy(header, directory)
    (directory / "probes.cu").write_text(PROBES)
    return directory


def probe(source_dir, name, grid, block, args, schedule="forward", shared_mem=0):
    emu.launch(KernelSpec("probes.cu", name), grid, block, args, shared_mem, schedule=schedule, source_dir=source_dir)


# -- FP16 conversions: every half, and floats at and around every rounding boundary ---------------------------
HALVES = np.arange(1 << 16, dtype=np.uint16)


def float_bits(size: int = 1 << 20) -> np.ndarray:
    """uint32 float patterns: random ones, every half's value, the exact ties between neighbouring halves and the
    floats just above them, the edges of overflow and underflow, and NaNs of every sign and payload class (only
    bits that survive the cut to 10, only bits that do not, random)."""
    rng = np.random.default_rng(0)
    exact = HALVES.view(np.float16).astype(np.float32)
    finite = exact[np.isfinite(exact)].astype(np.float64)
    mids = np.float32((finite[:-1] + finite[1:]) / 2)
    payload = np.concatenate([np.arange(1, 1024, dtype=np.uint32) << 13, np.arange(1, 1 << 13, dtype=np.uint32),
                              rng.integers(1, 1 << 23, 4096, dtype=np.uint32)])
    nans = np.concatenate([0x7F800000 | payload, 0xFF800000 | payload]).astype(np.uint32)
    return np.concatenate([rng.integers(0, 2**32, size, dtype=np.uint64).astype(np.uint32), exact.view(np.uint32),
                           mids.view(np.uint32), np.nextafter(mids, np.float32(np.inf)).view(np.uint32),
                           np.array([0x477FF000, 0x477FEFFF, 0x33000000, 0x33000001, 0x7F800000, 0xFF800000],
                                    np.uint32), nans])


def test_fp16_conversions_are_numpys_for_numbers_and_nan_is_canonical():
    rt = build.runtime()
    floats = np.empty(HALVES.size, np.float32)
    rt.emu_h2f_array(HALVES.ctypes.data_as(ctypes.c_void_p), floats.ctypes.data_as(ctypes.c_void_p),
                     ctypes.c_longlong(HALVES.size))
    expected = HALVES.view(np.float16).astype(np.float32)
    nan = np.isnan(expected)
    assert np.array_equal(floats.view(np.uint32)[~nan], expected.view(np.uint32)[~nan])
    assert (floats.view(np.uint32)[nan] == 0x7FFFFFFF).all()  # NumPy keeps the payload; the GPU does not
    values = float_bits().view(np.float32)
    out = np.empty(values.size, np.uint16)
    rt.emu_f2h_array(values.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                     ctypes.c_longlong(values.size))
    nan = np.isnan(values)
    with np.errstate(over="ignore"):
        assert np.array_equal(out[~nan], values[~nan].astype(np.float16).view(np.uint16))
    assert (out[nan] == 0x7FFF).all()


# The GPU's conversions in plain C++ on the host's floating point, apart from cullama/runtime/emu's bit code: round to
# nearest even (nearbyint in the default rounding mode) at the half's quantum, 2^-24 below 2^-14, else 2^(e - 10);
# a NaN, whatever its sign and payload, is the canonical NaN (cuda_fp16.hpp's host __float2half_rn and
# __half2float, CUDA's own statement of what cvt.rn.f16.f32 and cvt.f32.f16 give).
REFERENCE_CONVERSIONS = r"""
#include <cmath>
#include <cstdint>
#include <cstring>
static uint16_t f2h(float f) {
    if (std::isnan(f)) return 0x7fff;
    const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
    const double a = std::fabs((double)f);
    if (a < 0x1p-14) return sign | (uint16_t)std::nearbyint(a * 0x1p24);  // 1024 there is the least normal
    int e;
    std::frexp(a, &e);                                                    // a in [2^(e-1), 2^e)
    const double q = std::nearbyint(std::ldexp(a, 11 - e));               // 1024 .. 2048 (a carry)
    const double bits = (e + 14) * 1024.0 + (q - 1024);
    return sign | (bits >= 0x7c00 ? 0x7c00 : (uint16_t)bits);             // past 65504 + half an ulp: inf
}
static float h2f(uint16_t h) {
    const int e = h >> 10 & 31, m = h & 1023;
    float v;
    if (e == 31 && m) { const uint32_t nan = 0x7fffffff; std::memcpy(&v, &nan, 4); return v; }
    v = e == 31 ? INFINITY : e ? std::ldexp(1024.f + m, e - 25) : std::ldexp((float)m, -24);
    return h & 0x8000 ? -v : v;
}
extern "C" void reference(const float* f, uint16_t* h, uint32_t* packed, const uint16_t* halves, float* back,
                          int n) {
    for (int i = 0; i < n; ++i) {
        h[i] = f2h(f[i]);
        packed[i] = (uint32_t)f2h(f[i]) << 16 | f2h(f[n - 1 - i]);
        back[i] = h2f(halves[i]);
    }
}
"""


def test_fp16_conversions_in_a_kernel_are_the_gpus_on_every_nan(probes, tmp_path):
    """common.cuh's f2h and h2f and the packed cvt.rn.f16x2.f32 (attention_mma.cu's), run by the executor, equal
    the reference above on every kind of number and NaN: a NaN comes out canonical (0x7FFF, 0x7FFFFFFF), as on
    the GPU, not with NumPy's payload."""
    source, library = tmp_path / "reference.cpp", tmp_path / "reference.so"
    source.write_text(REFERENCE_CONVERSIONS)
    subprocess.run([build.compiler(), "-std=c++17", "-O1", "-shared", "-fPIC", str(source), "-o", str(library)],
                   check=True, capture_output=True, timeout=120)
    reference = ctypes.CDLL(str(library)).reference
    f = float_bits(1 << 16).view(np.float32)
    n = f.size
    halves = np.resize(HALVES, n)
    outputs = [(np.empty(n, np.uint16), np.empty(n, np.uint32), np.empty(n, np.float32)) for _ in range(2)]
    probe(probes, "conversions", 1, 1, (f, outputs[0][0], outputs[0][1], halves, outputs[0][2], np.int32(n)))
    reference(*(a.ctypes.data_as(ctypes.c_void_p) for a in (f, outputs[1][0], outputs[1][1], halves,
                                                             outputs[1][2])), ctypes.c_int(n))
    (h, packed, back), (h_ref, packed_ref, back_ref) = outputs
    assert np.array_equal(h, h_ref) and np.array_equal(packed, packed_ref)
    assert np.array_equal(back.view(np.uint32), back_ref.view(np.uint32))
    assert (h[np.isnan(f)] == 0x7FFF).all() and (back.view(np.uint32)[(halves & 0x7FFF) > 0x7C00] == 0x7FFFFFFF).all()


# -- the rewrite table --------------------------------------------------------------------------------------
def test_every_template_in_kernels_cu_is_known_and_the_table_has_no_dead_entry():
    """Every variant's source rewrites (so each collective is asm volatile, mma.cuh's mma.sync included)."""
    used = set()
    for stem in ops.STEMS:
        module = ops.module(stem)
        extra = [(("GW_TILE_N", 64),)] if stem == "gemm_wgmma" else []  # a tile width the .cu has, no variant uses
        for defines in [*module.VARIANTS, *extra]:
            text = build.preprocess(module.SOURCE, tuple(defines), SOURCE_DIR, build.DEFAULT_ARCH,
                                    getattr(module, "ARCH_SPECIFIC", False))
            used |= set(re.findall(r"emu_ptx::(\w+)\(", asm.rewrite(text)))
    assert used == {function for function, _ in asm.PTX_TEMPLATES.values()}


@pytest.mark.parametrize("statement,message", [
    ('asm("cvt.rn.f16.f32 %0, %1" : "=h"(h) : "f"(f));', "inline PTX the emulator does not know"),  # no ';'
    ('asm("cvt.rn.f16.f32 %0, %1;" : "=r"(h) : "f"(f));', "operand constraints '=r f'"),
    ('asm(TEMPLATE : "=h"(h) : "f"(f));', "not a string literal"),
    ('asm("wgmma.fence.sync.aligned;" ::: "memory");', "collective (.sync.aligned) instruction: it must be asm "
                                                        "volatile"),
])
def test_an_unknown_template_fails_the_build_with_its_text(statement, message):
    with pytest.raises(KernelError, match=re.escape(message)):
        asm.rewrite(f'# 7 "kernels_cu/x.cu"\nvoid f() {{\n  {statement}\n}}\n')


def test_a_rewritten_asm_is_a_call_with_its_site_and_operands():
    text = asm.rewrite('void f() { asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), '
                       '"l"(src), "r"(valid ? 16 : 0) : "memory"); }')
    assert text == "void f() { emu_ptx::cp_async_cg_16(__FILE__, __LINE__, (dst), (src), (valid ? 16 : 0)); }"
    dynamic = asm.rewrite("extern __shared__ __align__(16) unsigned char buf[];")
    assert dynamic == "unsigned char* const buf = (unsigned char*)emu_dynamic_shared();"


# -- hazards and deadlocks ----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("name,block,message", [
    ("exits_before_barrier", 64, r"exits_before_barrier block \(0, 0, 0\): deadlock: thread \d+ waits at "
                                 r"__syncthreads \(probes.cu:6\), which thread 37 never reaches \(it exited\)"),
    ("two_barriers", 64, r"two_barriers block \(0, 0, 0\): thread \d+ waits at __syncthreads \(probes.cu:1[12]\), "
                         r"thread \d+ at another one \(probes.cu:1[12]\)"),
    ("shuffle_after_exit", 32, r"shuffle_after_exit block \(0, 0, 0\): deadlock: thread \d+ waits at a warp "
                               r"collective \(common.cuh:\d+\) that thread 3 never reaches \(exited\)"),
])
def test_a_deadlock_is_an_error_naming_kernel_block_and_barrier(probes, name, block, message, schedule):
    with pytest.raises(emu.EmuError, match=message):
        probe(probes, name, 1, block, (np.zeros(64, np.float32),), schedule)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("name,block", [("missing_barrier", 64), ("warp_race", 32)])
def test_shared_memory_is_poisoned_so_a_missing_barrier_reads_nan(probes, name, block, schedule):
    out = np.zeros(block, np.float32)
    probe(probes, name, 1, block, (out,), schedule)
    assert np.isnan(out).any()  # a read of a slot its writer has not reached yet


def test_a_cp_async_destination_is_poisoned_until_its_wait_and_src_size_0_fills_zeros(probes):
    src = np.random.default_rng(0).standard_normal(32 * 8).astype(np.float16)
    before, after, zero = (np.zeros(32, np.float16) for _ in range(3))
    probe(probes, "cp_async_probe", 1, 32, (src, before, after, zero))
    assert np.isnan(before.astype(np.float32)).all()
    np.testing.assert_array_equal(after, src[::8])
    assert (zero == 0).all()


@pytest.mark.parametrize("name,args,message", [
    ("stray_pointer", (np.zeros(4, np.float32),),
     r"stray_pointer block \(0, 0, 0\) thread \(0, 0, 0\): invalid memory access \(SIGSEGV"),
    ("past_the_end", (np.zeros(40, np.float32), np.int32(40)), r"past_the_end: wrote past the end of argument 0"),
    ("misaligned_load", (np.zeros(16, np.float16), np.zeros(1, np.float32)),
     r"misaligned_load block \(0, 0, 0\) thread \(0, 0, 0\) at common.cuh:\d+: ld.global.nc.v4.u32 of .*: not "
     r"16-byte aligned"),
])
def test_a_stray_access_is_an_error_not_a_crash(probes, name, args, message):
    with pytest.raises(emu.EmuError, match=message):
        probe(probes, name, 1, 1, args)
    out = np.zeros(4, np.float32)
    probe(probes, "scalars", 1, 1, (out, np.int32(-3), np.uint64(2**40), np.float32(0.5)))  # the process goes on
    assert out.tolist() == [-3.0, 2.0**40, 0.5, 0.0]


def test_writes_past_the_dynamic_shared_memory_are_caught(probes):
    probe(probes, "dynamic_overflow", 1, 32, (np.int32(999),), shared_mem=1000)
    with pytest.raises(emu.EmuError, match="wrote 1 bytes past the end of its 1000 bytes of dynamic shared memory"):
        probe(probes, "dynamic_overflow", 1, 32, (np.int32(1000),), shared_mem=1000)


# gemm_wgmma.cu's own pieces, one warpgroup: C = A W^T over one K tile, the threads double their accumulators,
# then C += A W^T again (3 A W^T). The fence before the second pass orders the threads' writes before it.
WGMMA_PROBE = r"""
#include "gemm_wgmma.cu"

// A [64, 64], W [GW_TILE_N, 64] FP16; C [64, GW_TILE_N] float32. GW_WARPGROUPS 1, GW_SMEM_BYTES of dynamic shared.
extern "C" __global__ void __launch_bounds__(GW_THREADS, 1) wgmma_twice(const half_t* A, const half_t* W, float* C) {
    extern __shared__ __align__(16) unsigned char gw_dynamic_smem[];
    const uint32_t smem = (smem_addr(gw_dynamic_smem) + 1023u) & ~1023u, a = gw_a_base(smem, 0);
    const uint32_t w = gw_w_base(smem, 0);
    load_tile_a(smem, 0, 0, A, 64, 64, 0, 64, 0);
    load_tile_w(smem, 0, 0, W, GW_TILE_N, 64, 0, 64, 0);
    cp_async_commit();
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();
    float acc[GW_ACC];
    for (int j = 0; j < GW_ACC; ++j) acc[j] = 0.f;
    wgmma_fence();
    for (int ks = 0; ks < 4; ++ks) wgmma_k16(acc, gw_a_desc(a, 0, ks), gw_w_desc(w, ks));
    wgmma_commit();
    wgmma_wait<0>();
    for (int j = 0; j < GW_ACC; ++j) acc[j] *= 2.f;
    wgmma_fence();  // the second pass
    for (int ks = 0; ks < 4; ++ks) wgmma_k16(acc, gw_a_desc(a, 0, ks), gw_w_desc(w, ks));
    wgmma_commit();
    wgmma_wait<0>();
    for (int j = 0; j < GW_ACC; ++j) C[gw_acc_row(threadIdx.x, j) * GW_TILE_N + gw_acc_col(threadIdx.x, j)] = acc[j];
}
"""
WGMMA_DEFINES = (("GW_WARPGROUPS", 1), ("GW_TILE_N", 64))


@pytest.mark.parametrize("bug,replacement,message", [
    (None, None, None),
    ("fence-removed", ("    wgmma_fence();  // the second pass\n", ""),
     r"wgmma_twice block \(0, 0, 0\) thread \(\d+, 0, 0\) at gemm_wgmma.cu:\d+: wgmma.mma_async: thread \d+ wrote its "
     r"accumulator \d+ after the last wgmma.fence"),
    ("written-in-flight", ("    wgmma_commit();\n    wgmma_wait<0>();\n    for (int j = 0; j < GW_ACC; ++j) acc",
                           "    wgmma_commit();\n    acc[5] = 1.f;\n    wgmma_wait<0>();\n"
                           "    for (int j = 0; j < GW_ACC; ++j) acc"),
     r"wgmma.wait_group: thread \d+ wrote its accumulator 5 while the wgmma.mma_async at gemm_wgmma.cu:\d+ on it "
     r"was in flight"),
], ids=["correct", "fence-removed", "written-in-flight"])
def test_the_wgmma_fence_rule_holds_before_every_wgmma(tmp_path, bug, replacement, message):
    """PTX ISA, wgmma.fence: between a thread's write of accumulator registers and a wgmma.mma_async that uses them
    (not only before the first); and no write while a wgmma on them is in flight. Seeded bugs in a copy of the
    probe are reported with the offending thread and register; the probe itself computes 3 A W^T."""
    source_dir = tmp_path / "kernels_cu"
    shutil.copytree(SOURCE_DIR, source_dir)
    assert bug is None or WGMMA_PROBE.count(replacement[0]) == 1
    text = WGMMA_PROBE if bug is None else WGMMA_PROBE.replace(*replacement)
    (source_dir / "wgmma_probe.cu").write_text(text)
    rng = np.random.default_rng(0)
    A, W = rng.standard_normal((64, 64)).astype(np.float16), rng.standard_normal((64, 64)).astype(np.float16)
    C = np.full((64, 64), np.nan, np.float32)
    spec = KernelSpec("wgmma_probe.cu", "wgmma_twice", WGMMA_DEFINES, arch_specific=True)
    smem = 5 * (64 + 64) * 128 + 1024  # GW_SMEM_BYTES
    if bug is None:
        emu.launch(spec, 1, 128, (A, W, C), smem, source_dir=source_dir)
        np.testing.assert_allclose(C, 3 * (A.astype(np.float64) @ W.astype(np.float64).T), rtol=1e-5, atol=1e-4)
    else:
        with pytest.raises(emu.EmuError, match=message):
            emu.launch(spec, 1, 128, (A, W, C), smem, source_dir=source_dir)


def test_read_only_loads_and_restrict_pointers_are_checked_against_the_writes(probes):
    """What ld.global.nc / __ldg read must be read-only for the whole launch; a __restrict__ argument must not share
    written bytes with another argument. Each seeded bug fails the launch naming the arguments, and leaves the
    arrays as they were; the same kernels on separate arrays (or without restrict) run."""
    data = np.arange(64, dtype=np.uint32)
    with pytest.raises(emu.EmuError, match=r"nc_in_place: argument 0 is read by ld.global.nc / __ldg, which needs it "
                                           r"read-only for the whole launch, and written by it \(16 bytes, the first "
                                           r"at byte 0\)"):
        probe(probes, "nc_in_place", 1, 16, (data,))
    assert (data == np.arange(64)).all()
    x = np.arange(33, dtype=np.float32)
    with pytest.raises(emu.EmuError, match=r"ldg_twice: argument 0 is read by ld.global.nc / __ldg.*written by it"):
        probe(probes, "ldg_twice", 1, 32, (x[:32], x[:32]))
    with pytest.raises(emu.EmuError, match=r"restrict_twice: arguments 0 and 1 share bytes that the launch wrote, "
                                           r"but argument 0 is __restrict__"):
        probe(probes, "restrict_twice", 1, 32, (x[1:], x[:32]))  # out[i] = 2 in[i + 1]: overlapping views
    assert (x == np.arange(33)).all()
    probe(probes, "plain_twice", 1, 32, (x[1:], x[:32]))  # no restrict: allowed
    assert (x[:32] == 2 * np.arange(1, 33)).all()
    for name in ("ldg_twice", "restrict_twice"):
        out = np.zeros(32, np.float32)
        probe(probes, name, 1, 32, (x[:32].copy(), out))
        assert (out == 2 * x[:32]).all()


def test_a_real_kernel_with_aliased_restrict_arguments_fails_its_launch():
    """gemv_residual(in, W, qparams, x, norm_w, xn, ssp): x += W in (and the prepared xn, ssp), every pointer
    __restrict__ (and W read with ld.global.nc). A plan
    that passed x as `in` too would read what it writes; the launch says so. (W passed twice, as the plans do for FP16
    weights, is allowed: neither copy is written.)"""
    spec = KernelSpec("gemv_mma.cu", "gemv_residual", (("BITS", 16), ("TOKENS", 1)))
    assert build.library(spec.source, spec.defines).kernels["gemv_residual"].restrict == (
        (True,) * 7 + (False,) * 3)
    rng = np.random.default_rng(0)
    W, x = rng.standard_normal((64, 64)).astype(np.float16), rng.standard_normal(64).astype(np.float32)
    prepared = (np.ones(64, np.float16), np.zeros(64, np.float16), np.zeros(2, np.float32))  # norm_w, xn, ssp
    scalars = (*prepared, np.int32(64), np.int32(64), np.int32(0))
    with pytest.raises(emu.EmuError, match="gemv_residual: arguments 0 and 3 share bytes that the launch wrote, but "
                                           "argument 0 is __restrict__"):
        emu.launch(spec, 2, GEMV_THREADS, (x, W, W, x, *scalars))
    with pytest.raises(emu.EmuError, match="gemv_residual: argument 1 is read by ld.global.nc"):
        emu.launch(spec, 2, GEMV_THREADS, (x, W, W, W.view(np.float32).reshape(-1)[:64], *scalars))
    emu.launch(spec, 2, GEMV_THREADS, (x, W, W, x.copy(), *scalars))  # W twice: read only


# -- CuPy's launch rules --------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,message", [
    ((np.zeros(4, np.float32), np.int64(1), np.uint64(1), np.float32(1)), "argument 1 is a 4-byte signed scalar"),
    ((np.zeros(4, np.float32), 1, np.uint64(1), np.float32(1)), "argument 1 is a 4-byte signed scalar"),
    ((np.zeros(4, np.float32), np.int32(1), np.uint64(1), np.float64(1)), "argument 3 is a 4-byte float scalar"),
    ((np.zeros(8, np.float32)[::2], np.int32(1), np.uint64(1), np.float32(1)), "argument 0 is a pointer"),
    ((np.zeros(4, np.float32), np.int32(1)), "2 arguments, the kernel takes 4"),
])
def test_arguments_must_be_what_the_kernel_takes(probes, args, message):
    with pytest.raises(emu.EmuError, match=message):
        probe(probes, "scalars", 1, 1, args)


def test_launch_bounds_and_dimensions(probes):
    probe(probes, "bounded", 1, (32, 2), (np.zeros(64, np.float32),))
    with pytest.raises(emu.EmuError, match=r"a block of 65 threads, above its __launch_bounds__ \(64\)"):
        probe(probes, "bounded", 1, 65, (np.zeros(65, np.float32),))
    with pytest.raises(emu.EmuError, match="schedule 'sideways'"):
        probe(probes, "bounded", 1, 1, (np.zeros(1, np.float32),), schedule="sideways")
    with pytest.raises(emu.EmuError, match="grid"):
        probe(probes, "bounded", (0, 1), 1, (np.zeros(1, np.float32),))


# -- the build ------------------------------------------------------------------------------------------------
def test_builds_are_cached_by_content_under_the_cullama_cache(probes, tmp_path):
    first = build.library("probes.cu", (), source_dir=probes)
    assert first.path.parent == cache.root() / "emu" and first.path.exists()
    assert build.library("probes.cu", (), source_dir=probes) is first
    other = tmp_path / "copy"
    shutil.copytree(probes, other)
    (other / "probes.cu").write_text(PROBES.replace("out[2] = f;", "out[2] = f + 1.f;"))
    assert build.library("probes.cu", (), source_dir=other).path != first.path  # another text, another library
    rows = [build.library("gemv_mma.cu", (("BITS", 16), ("TOKENS", t))).path for t in (1, 2)]
    assert rows[0] != rows[1]  # another define, another text


def test_a_compile_error_is_one_line_naming_the_source(probes, tmp_path):
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void broken(float* out) { out[0] = undefined; }\n')
    with pytest.raises(KernelError, match=r"broken.cu: the host compiler failed: .*undefined"):
        build.library("broken.cu", (), source_dir=tmp_path)


def test_the_portable_fiber_switch_runs_the_kernels_too():
    """Off x86-64 the fibers switch with makecontext + _setjmp / _longjmp: forced here (CULLAMA_EMU_PORTABLE=1,
    a fresh process: one runtime per process), on kernels with barriers, shuffles, cp.async and mma."""
    code = ("from tests.runtime.emu import test_emu_kernels as k; k.check_prefill('shuffled'); "
            "k.check_gemm(k.MMA_GEMM.spec, 64, 128, 256, 0, 'reverse', cases=k.GEMM_CASES[:2]); "
            "k.check_sample(k.SAMPLE_OPTIONS[3], 1000, 'forward', draws=1)")
    env = {**os.environ, "CULLAMA_EMU_PORTABLE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
