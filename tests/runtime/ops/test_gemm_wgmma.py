"""gemm_wgmma.cu (wgmma, sm_90a): NVRTC compiles every variant with no spills and no serialized wgmma; the
layout math (the block marked "layout" in the .cu, compiled here on the host and called through ctypes)
against an independent NumPy model of the PTX ISA: every byte each matrix descriptor makes the tensor core
read is the byte the kernel's cp.async wrote, for every k16 step, and the accumulator fragment covers the
tile exactly once (CPU). The kernel against its twin, split-K against S = 1 (GPU); func_attr.py's own
tests are in test_driver.py."""

import ctypes
import json
import re

import numpy as np
import pytest

from tests.conftest import host_layout_library, poisoned
from cullama.runtime.backends import func_attr
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.ops import gemm as gemm_twin
from cullama.runtime.ops import gemm_wgmma as ops
from cullama.runtime.registry import KernelSpec, compile_module, target_arch

SOURCE = SOURCE_DIR / ops.SOURCE
VARIANTS = [tuple(v) for v in ops.VARIANTS]
VARIANT_IDS = ["-".join(f"{k[3:]}{v}" for k, v in d) or "default" for d in VARIANTS]
K16_STEPS = ops.TILE_K // 16


# -- NVRTC: every variant compiles for sm_90a, no spills, no serialized wgmma ---------------------------------
@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
def test_compiles_for_sm90a_without_spills(defines):
    assert ops.ARCH_SPECIFIC and target_arch("sm_90", ops.ARCH_SPECIFIC) == "sm_90a"
    compiled = compile_module(ops.SOURCE, defines, "sm_90a")
    res = compiled.resources["gemm_wgmma"]
    assert not res.spills, res
    assert 0 < res.registers <= 255, res
    geo = ops.geometry(defines)
    assert res.registers * geo.threads <= 65536, res  # one block fits the register file
    assert res.smem_bytes <= 1024 and res.smem_bytes + geo.smem_bytes <= ops.MAX_SMEM_BYTES, res
    log = json.loads(compiled.cubin_path.with_suffix(".json").read_text())["log"]
    # ptxas says so when it has to serialize the wgmma pipeline (e.g. wgmma under a divergent branch)
    assert "Potential Performance Loss" not in log and "C7518" not in log, log


def test_plain_sm90_cannot_compile_wgmma():
    """Why ARCH_SPECIFIC: wgmma.mma_async is rejected for the plain sm_90 target."""
    from cullama.common.errors import KernelError
    with pytest.raises(KernelError, match=r"gemm_wgmma.cu.*wgmma.* not supported on .target 'sm_90'"):
        compile_module(ops.SOURCE, (), "sm_90")


def test_wgmma_instruction_shape_matches_the_tile():
    """The inline asm names m64n<GW_TILE_N>k16 with GW_TILE_N / 2 accumulator operands for every tile width,
    the descriptors and scale-d right after them (ptxas checks the count; this checks the numbering)."""
    text = SOURCE.read_text()
    regs = {int(g): re.findall(r"%(\d+)", s) for g, s in re.findall(r'#define GW_R(\d) "([^"]*)"', text)}
    for g, numbers in regs.items():
        assert numbers == [str(16 * g + i) for i in range(16)], g
    for n in (64, 128, 192, 256):
        block = re.search(rf"GW_TILE_N == {n}\n(.*?)#(?:elif|else)", text, re.S) if n < 256 else \
            re.search(r"#else\n(#define GW_REGS.*?)#endif", text, re.S)
        body = block.group(1)
        groups = [int(g) for g in re.findall(r"GW_R(\d)", body.split("GW_TAIL")[0])]
        assert groups == list(range(n // 32)), n
        acc = n // 2
        assert f'"%{acc}, %{acc + 1}, p, 1, 1, 0, 0;' in body and f'GW_SCALE "%{acc + 2}"' in body, n
        assert [int(b) for b in re.findall(r"GW_F16\(d, (\d+)\)", body)] == list(range(0, acc, 16)), n


# -- the layout block, compiled on the host ---------------------------------------------------------------
WRAPPERS = r"""
extern "C" {
void t_consts(long long* o) {
    const long long v[] = {GW_TILE_M, GW_TILE_N, GW_TILE_K, GW_THREADS, GW_STAGES, GW_SWIZZLE, GW_SMEM_BYTES,
                           GW_A_BYTES, GW_W_BYTES, GW_STAGE_BYTES, GW_A_COPIES, GW_W_COPIES, GW_ACC, GW_KSTEP_BYTES};
    for (int i = 0; i < 14; ++i) o[i] = v[i];
}
void t_chunk_offsets(int rows, uint32_t* o) {
    for (int r = 0; r < rows; ++r) for (int c = 0; c < 8; ++c) o[r * 8 + c] = gw_chunk_offset(r, c);
}
void t_bases(uint32_t smem, uint32_t* o) {
    for (int s = 0; s < GW_STAGES; ++s) { o[2 * s] = gw_a_base(smem, s); o[2 * s + 1] = gw_w_base(smem, s); }
}
void t_descs(uint32_t smem, uint64_t* a, uint64_t* w) {  // a[stage][wg][ks], w[stage][ks]
    for (int s = 0; s < GW_STAGES; ++s)
        for (int ks = 0; ks < GW_TILE_K / 16; ++ks) {
            for (int g = 0; g < GW_WARPGROUPS; ++g)
                a[(s * GW_WARPGROUPS + g) * (GW_TILE_K / 16) + ks] = gw_a_desc(gw_a_base(smem, s), g, ks);
            w[s * (GW_TILE_K / 16) + ks] = gw_w_desc(gw_w_base(smem, s), ks);
        }
}
void t_loads(int copies, int* o) {  // o[tid][i] = (row, chunk)
    for (int t = 0; t < GW_THREADS; ++t)
        for (int i = 0; i < copies; ++i) {
            o[(t * copies + i) * 2] = gw_load_row(t, i);
            o[(t * copies + i) * 2 + 1] = gw_load_chunk(t);
        }
}
void t_acc(int* o) {  // o[tid][j] = (row, col)
    for (int t = 0; t < GW_THREADS; ++t)
        for (int j = 0; j < GW_ACC; ++j) {
            o[(t * GW_ACC + j) * 2] = gw_acc_row(t, j);
            o[(t * GW_ACC + j) * 2 + 1] = gw_acc_col(t, j);
        }
}
void t_slots(int* o) {
    for (int t = 0; t < GW_THREADS; ++t)
        for (int p = 0; p < GW_ACC / 2; ++p) o[t * (GW_ACC / 2) + p] = gw_slot_float2(t, p);
}
void t_tiles(int linear_count, int tiles_m, int* o) {
    for (int l = 0; l < linear_count; ++l) { o[2 * l] = gw_tile_m(l, tiles_m); o[2 * l + 1] = gw_tile_n(l, tiles_m); }
}
void t_k_range(int K, int splits, int* o) {
    for (int z = 0; z < splits; ++z) gw_k_range(K, splits, z, o + 2 * z, o + 2 * z + 1);
}
}
"""


class Layout:
    """The .cu's layout functions for one variant, compiled with the host C++ compiler."""

    def __init__(self, lib):
        self.lib = lib
        out = np.zeros(14, np.int64)
        lib.t_consts(out.ctypes.data_as(ctypes.c_void_p))
        (self.tile_m, self.tile_n, self.tile_k, self.threads, self.stages, self.swizzle, self.smem_bytes, self.a_bytes,
         self.w_bytes, self.stage_bytes, self.a_copies, self.w_copies, self.acc, self.kstep) = map(int, out)
        self.warpgroups = self.threads // 128

    def _call(self, name, shape, dtype, *args):
        out = np.zeros(shape, dtype)
        getattr(self.lib, name)(*[ctypes.c_int(a) if isinstance(a, int) else a for a in args],
                                out.ctypes.data_as(ctypes.c_void_p))
        return out

    def chunk_offsets(self, rows):
        return self._call("t_chunk_offsets", (rows, 8), np.uint32, rows).astype(np.int64)

    def bases(self, smem):
        return self._call("t_bases", (self.stages, 2), np.uint32, ctypes.c_uint32(smem)).astype(np.int64)

    def descs(self, smem):
        a = np.zeros((self.stages, self.warpgroups, K16_STEPS), np.uint64)
        w = np.zeros((self.stages, K16_STEPS), np.uint64)
        self.lib.t_descs(ctypes.c_uint32(smem), a.ctypes.data_as(ctypes.c_void_p), w.ctypes.data_as(ctypes.c_void_p))
        return a, w

    def loads(self, copies):
        return self._call("t_loads", (self.threads, copies, 2), np.int32, copies)

    def acc_map(self):
        return self._call("t_acc", (self.threads, self.acc, 2), np.int32)

    def slots(self):
        return self._call("t_slots", (self.threads, self.acc // 2), np.int32)

    def tiles(self, tiles_m, tiles_n):
        return self._call("t_tiles", (tiles_m * tiles_n, 2), np.int32, tiles_m * tiles_n, tiles_m)

    def k_ranges(self, K, splits):
        return self._call("t_k_range", (splits, 2), np.int32, K, splits)


def build_layout(directory, defines) -> Layout:
    return Layout(host_layout_library(SOURCE, "GW_FN", WRAPPERS, defines, directory))


@pytest.fixture(scope="module", params=VARIANTS, ids=VARIANT_IDS)
def layout(request, tmp_path_factory):
    lay = build_layout(tmp_path_factory.mktemp("gw_layout"), request.param)
    lay.defines = request.param
    return lay


@pytest.fixture(scope="module")
def default_layout(tmp_path_factory):
    return build_layout(tmp_path_factory.mktemp("gw_default"), ())


def test_python_geometry_matches_the_kernel(layout):
    geo = ops.geometry(layout.defines)
    assert (geo.tile_m, geo.tile_n, geo.tile_k, geo.threads, geo.stages, geo.smem_bytes) == \
        (layout.tile_m, layout.tile_n, layout.tile_k, layout.threads, layout.stages, layout.smem_bytes)
    assert layout.smem_bytes == layout.stages * (layout.a_bytes + layout.w_bytes) + 1024
    assert layout.a_bytes == 128 * layout.tile_m and layout.w_bytes == 128 * layout.tile_n
    assert layout.acc == layout.tile_n // 2 and layout.tile_k == ops.TILE_K == 64


def test_defaults_are_the_kernels(default_layout):
    d = {"GW_TILE_N": default_layout.tile_n, "GW_WARPGROUPS": default_layout.warpgroups,
         "GW_STAGES": default_layout.stages, "GW_SWIZZLE": default_layout.swizzle}
    assert d == ops.DEFAULTS
    assert (ops.TILE_M, ops.TILE_N, ops.THREADS, ops.SMEM_BYTES) == \
        (default_layout.tile_m, default_layout.tile_n, default_layout.threads, default_layout.smem_bytes)


# -- the PTX ISA's model of what a descriptor makes the tensor core read (independent of the kernel) ----------
def decode(desc):
    """Fields of a wgmma matrix descriptor (PTX ISA "Matrix Descriptor Format"); reserved bits must be 0."""
    d = int(desc)
    assert d & ~((0x3FFF) | (0x3FFF << 16) | (0x3FFF << 32) | (0x7 << 49) | (0x3 << 62)) == 0, hex(d)
    return dict(start=(d & 0x3FFF) << 4, lbo=((d >> 16) & 0x3FFF) << 4, sbo=((d >> 32) & 0x3FFF) << 4,
                base_offset=(d >> 49) & 0x7, mode=d >> 62)


def tensor_core_reads(desc, rows):
    """[rows, 16] byte addresses of the FP16 elements (row i of the operand, k) that one m64nNk16 wgmma reads
    for a K-major operand, from the canonical layouts (in 16-byte units, T = 8 halves):
      128-byte swizzle (mode 1): Swizzle<3,4,3> o ((8,m),2):((8,SBO),1): row i at (i/8) SBO + (i%8) 128 B, its
        two 8-element k chunks 16 B apart (LBO unused), then bits 4-6 of the byte address ^= bits 7-9; the
        pattern repeats from 1024-byte boundaries (base offset 0).
      no swizzle (mode 0): ((8,m),2):((1,SBO),LBO): row i at (i/8) SBO + (i%8) 16 B, k chunk j at j LBO."""
    f = decode(desc)
    assert f["start"] % 16 == 0 and f["base_offset"] == 0
    i, k = np.meshgrid(np.arange(rows), np.arange(16), indexing="ij")
    if f["mode"] == 1:
        lin = f["start"] + (i // 8) * f["sbo"] + (i % 8) * 128 + (k // 8) * 16 + (k % 8) * 2
        return lin ^ (((lin >> 7) & 7) << 4)
    if f["mode"] == 0:
        return f["start"] + (i // 8) * f["sbo"] + (i % 8) * 16 + (k // 8) * f["lbo"] + (k % 8) * 2
    raise AssertionError(f"unexpected swizzle mode {f['mode']}")


def kernel_writes(lay, smem):
    """Byte address the kernel's cp.async writes each FP16 element to: [stage] -> (A [tile_m, 64], W [tile_n, 64])."""
    bases = lay.bases(smem)
    out = []
    for s in range(lay.stages):
        tiles = []
        for base, rows in ((bases[s, 0], lay.tile_m), (bases[s, 1], lay.tile_n)):
            chunk = lay.chunk_offsets(rows)  # [rows, 8]: 16-byte chunk c holds k = 8c .. 8c + 7
            kk = np.arange(64)
            tiles.append(base + chunk[:, kk // 8] + (kk % 8) * 2)
        out.append(tiles)
    return out


SMEM_BASES = [0, 1024, 7 * 1024, 13 * 1024]  # 1024-aligned, as the kernel aligns its buffer


def check_reads_equal_writes(lay, smem, a_desc, w_desc):
    """For every stage, warpgroup and k16 step: the bytes read for A (64 x 16) and W (tile_n x 16) are exactly
    the bytes written for rows 64 g.. / 0.. and k = 16 ks.. of that stage's tiles. Returns the mismatches."""
    bad = 0
    writes = kernel_writes(lay, smem)
    for s in range(lay.stages):
        wa, ww = writes[s]
        for ks in range(K16_STEPS):
            for g in range(lay.warpgroups):
                rows = wa[64 * g:64 * g + 64, 16 * ks:16 * ks + 16]
                bad += int((tensor_core_reads(a_desc[s, g, ks], 64) != rows).sum())
            bad += int((tensor_core_reads(w_desc[s, ks], lay.tile_n) != ww[:, 16 * ks:16 * ks + 16]).sum())
    return bad


@pytest.mark.parametrize("smem", SMEM_BASES)
def test_every_operand_byte_read_is_the_byte_written(layout, smem):
    a_desc, w_desc = layout.descs(smem)
    assert check_reads_equal_writes(layout, smem, a_desc, w_desc) == 0
    for desc in [*a_desc.ravel(), *w_desc.ravel()]:
        f = decode(desc)
        assert f["mode"] == (1 if layout.swizzle == 128 else 0) and f["sbo"] == 1024
        assert f["lbo"] == (16 if layout.swizzle == 128 else 128)  # swizzled K-major: unused, "assumed 1"
        if f["mode"] == 1:  # the swizzle pattern starts on a 1024-byte boundary: the start is inside row 0
            assert f["start"] % 1024 in (0, 32, 64, 96)


def test_the_written_ring_is_disjoint_and_fits(layout):
    """Every (stage, operand, row, 16-byte chunk) has its own 16 bytes, all inside the dynamic buffer after
    aligning it, and every swizzle atom (8 rows) starts on a 1024-byte boundary."""
    smem = 1024
    slots = []
    for s, (wa, ww) in enumerate(kernel_writes(layout, smem)):
        for tile in (wa, ww):
            assert (tile[:, ::8] % 16 == 0).all()
            slots.append(tile[:, ::8].ravel() // 16)
            for r in range(0, tile.shape[0], 8):  # one atom: 8 rows x 128 B = a whole aligned 1024-byte block
                block = np.unique(tile[r:r + 8] // 1024)
                assert len(block) == 1 and np.unique(tile[r:r + 8]).size == 8 * 64
    slots = np.concatenate(slots)
    assert np.unique(slots).size == slots.size
    assert slots.min() * 16 >= smem and (slots.max() + 1) * 16 <= smem + layout.smem_bytes - 1024
    assert layout.smem_bytes + 16 <= ops.MAX_SMEM_BYTES  # + the static is_last flag


@pytest.mark.parametrize("mutation", ["no_swizzle_bit", "sbo_512", "kstep_16", "misaligned_base", "row_swap"])
def test_the_check_catches_layout_bugs(default_layout, mutation):
    """The address check has teeth: each plausible bug makes reads and writes disagree somewhere."""
    lay, smem = default_layout, 2048
    a_desc, w_desc = lay.descs(smem)
    if mutation == "no_swizzle_bit":
        a_desc, w_desc = a_desc & ~np.uint64(3 << 62), w_desc & ~np.uint64(3 << 62)
    elif mutation == "sbo_512":
        clear = ~np.uint64(0x3FFF << 32)
        a_desc, w_desc = (a_desc & clear) | np.uint64(32 << 32), (w_desc & clear) | np.uint64(32 << 32)
    elif mutation == "kstep_16":  # advancing the start by 16 B instead of 32 per k16 step
        steps = np.arange(K16_STEPS, dtype=np.uint64)
        a_desc, w_desc = a_desc - steps, w_desc - steps
    elif mutation == "misaligned_base":  # the buffer not aligned to 1024 B: the hardware's XOR uses bits 7-9
        a_desc, w_desc = lay.descs(smem + 512)
        assert check_reads_equal_writes(lay, smem + 512, a_desc, w_desc) > 0
        return
    elif mutation == "row_swap":  # operand A of warpgroup 1 pointed at warpgroup 0's rows
        a_desc = a_desc.copy()
        a_desc[:, 1] = a_desc[:, 0]
    assert check_reads_equal_writes(lay, smem, a_desc, w_desc) > 0


def test_loads_cover_each_tile_chunk_once_coalesced(layout):
    for copies, rows in ((layout.a_copies, layout.tile_m), (layout.w_copies, layout.tile_n)):
        assert copies * layout.threads == rows * 8
        got = layout.loads(copies)  # [tid, i, (row, chunk)]
        flat = got[..., 0] * 8 + got[..., 1]
        assert np.array_equal(np.sort(flat.ravel()), np.arange(rows * 8))
        # eight consecutive threads copy one row's 128 contiguous bytes, chunks 0..7 in order
        by8 = got.reshape(layout.threads // 8, 8, copies, 2)
        assert (by8[:, :, :, 0] == by8[:, :1, :, 0]).all() and (by8[:, :, :, 1] == np.arange(8)[None, :, None]).all()


def ptx_accumulator_fragment(threads, n):
    """Row and column of register j of thread t, from the PTX ISA figure "WGMMA .m64nNk16 register fragment
    layout for accumulator matrix D", per warpgroup (rows 64 g .. 64 g + 63)."""
    t, j = np.meshgrid(np.arange(threads), np.arange(n // 2), indexing="ij")
    g, warp, lane = t // 128, (t % 128) // 32, t % 32
    row = 64 * g + 16 * warp + lane // 4 + 8 * ((j // 2) % 2)
    col = 8 * (j // 4) + 2 * (lane % 4) + j % 2
    return row, col


def test_accumulator_mapping_is_the_ptx_fragment_and_covers_the_tile_once(layout):
    got = layout.acc_map()
    row, col = ptx_accumulator_fragment(layout.threads, layout.tile_n)
    assert np.array_equal(got[..., 0], row) and np.array_equal(got[..., 1], col)
    flat = row * layout.tile_n + col
    assert np.array_equal(np.sort(flat.ravel()), np.arange(layout.tile_m * layout.tile_n))
    # acc[2p], acc[2p + 1]: one row, adjacent columns (a workspace float2)
    assert (row[:, 0::2] == row[:, 1::2]).all() and (col[:, 1::2] == col[:, 0::2] + 1).all()


def test_workspace_slot_is_a_bijection(layout):
    slots = layout.slots()
    assert np.array_equal(np.sort(slots.ravel()), np.arange(layout.tile_m * layout.tile_n // 2))
    # a warp's store of one p is one contiguous 256-byte run
    assert (np.diff(slots[:32, 0]) == 1).all()


@pytest.mark.parametrize("tiles_m,tiles_n", [(1, 1), (2, 64), (2, 115), (3, 7), (4, 250)])
def test_block_to_tile_map_is_a_bijection_with_row_tiles_adjacent(default_layout, tiles_m, tiles_n):
    got = default_layout.tiles(tiles_m, tiles_n)
    assert got[:, 0].max() < tiles_m and got[:, 1].max() < tiles_n
    assert np.unique(got[:, 0] * tiles_n + got[:, 1]).size == tiles_m * tiles_n
    assert (got[:tiles_m, 1] == 0).all()  # the first tiles_m blocks share W's first column tile


@pytest.mark.parametrize("K", [8, 40, 64, 264, 4096, 11008])
@pytest.mark.parametrize("splits", [1, 2, 3, 4, 7])
def test_split_k_ranges_partition_k(default_layout, K, splits):
    r = default_layout.k_ranges(K, splits)
    assert r[0, 0] == 0 and r[-1, 1] == K and (r[1:, 0] == r[:-1, 1]).all() and (r[:, 1] >= r[:, 0]).all()
    assert ((r[:, 0] % 64 == 0) | (r[:, 0] == r[:, 1])).all()  # each range starts on a K tile, or is empty
    kz = -(-(-(-K // splits)) // 64) * 64
    assert all(r[z, 0] == min(K, z * kz) for z in range(splits))


def test_twin_is_gemm():
    rng = np.random.default_rng(3)
    M, N, K = 7, 200, 72
    A, W = rng.standard_normal((M + 2, K)).astype(np.float16), rng.standard_normal((N, K)).astype(np.float16)
    for accumulate in (0, 1):
        C0 = rng.standard_normal((M + 2, N)).astype(np.float32)
        ours, ref = C0.copy(), C0.copy()
        ops.gemm_wgmma(A, W, ours, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, accumulate)
        gemm_twin.gemm(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, accumulate)
        np.testing.assert_array_equal(ours, ref)


def test_geometry_grid_and_workspace():
    geo = ops.geometry()
    assert geo.grid(256, 12288) == (64, 2, 1) and geo.grid(1, 1, 3) == (1, 1, 3)
    assert geo.workspace_floats(64, 4096, 3) == 3 * 22 * 1 * 128 * 192 and geo.workspace_floats(64, 4096, 1) == 0


# -- GPU: the kernel against its twin, fresh random data, odd and tile-edge sizes -----------------------------
def rand(rng, *shape, scale=1.0, dtype=np.float16):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def rel_err(out, ref):
    return float(np.linalg.norm(out.astype(np.float64) - ref) / np.linalg.norm(ref))


_ALLOWED = set()


def launch(kernels, cp, defines, A, W, C, M, N, K, accumulate, splits=1, workspace=None, tile_count=None):
    """Launch gemm_wgmma as the plan should: grid (cdiv(N, tile_n), cdiv(M, tile_m), splits), geo.threads,
    geo.smem_bytes of dynamic shared memory (allowed once per function through backends/func_attr.py).
    S = 1 gets a one-element NaN workspace and counter (it must touch neither); S > 1 a NaN-poisoned workspace
    of exactly splits * tiles partial tiles and zeroed counters, unless given."""
    geo = ops.geometry(defines)
    fn = kernels.function(KernelSpec(ops.SOURCE, "gemm_wgmma", tuple(defines), arch_specific=True))
    if id(fn) not in _ALLOWED:
        func_attr.allow_dynamic_shared(fn, geo.smem_bytes)
        _ALLOWED.add(id(fn))
    grid = geo.grid(M, N, splits)
    tiles = grid[0] * grid[1]
    if workspace is None:
        workspace = poisoned(cp, (max(1, geo.workspace_floats(M, N, splits)),), np.float32)
    if tile_count is None:
        tile_count = cp.zeros(tiles if splits > 1 else 1, dtype=cp.uint32)
    fn(grid, (geo.threads,), (A, W, C, workspace, tile_count, np.int32(M), np.int32(N), np.int32(K),
                              np.int32(accumulate)), shared_mem=geo.smem_bytes)
    cp.cuda.runtime.deviceSynchronize()
    return workspace, tile_count


SIZES = [(1, 8, 8), (1, 4096, 4096), (7, 200, 72), (7, 12289, 64), (64, 193, 520), (64, 192, 64), (200, 1000, 264),
         (200, 385, 1096), (256, 300, 11008), (256, 4100, 4096), (129, 255, 128), (3, 32000, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", SIZES)
@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
def test_gpu_gemm_wgmma_matches_twin(kernels, defines, M, N, K):
    import cupy as cp

    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K, scale=0.05)
    ref = np.empty((M, N), np.float32)
    ops.gemm_wgmma(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, 0)
    dC = poisoned(cp, (M, N), np.float32)  # NaN: every element must be written
    launch(kernels, cp, defines, cp.asarray(A), cp.asarray(W), dC, M, N, K, 0)
    out = dC.get()
    assert np.isfinite(out).all()
    assert rel_err(out, ref) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(1, 8, 8), (7, 200, 72), (200, 1000, 264), (256, 4096, 11008)])
def test_gpu_gemm_wgmma_accumulates(kernels, M, N, K):
    import cupy as cp

    rng = np.random.default_rng()
    A, W, C0 = rand(rng, M, K), rand(rng, N, K, scale=0.02), rand(rng, M, N, dtype=np.float32)
    ref = C0.copy()
    ops.gemm_wgmma(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, 1)
    dC = cp.asarray(C0)
    launch(kernels, cp, (), cp.asarray(A), cp.asarray(W), dC, M, N, K, 1)
    assert rel_err(dC.get() - C0, ref - C0) <= 1e-3  # the product itself, not just C0


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
def test_gpu_gemm_wgmma_does_not_write_outside_c(kernels, splits):
    """C is a view into a larger poisoned buffer: the guard rows after it stay NaN."""
    import cupy as cp

    M, N, K = 70, 200, 808
    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K)
    buf = poisoned(cp, ((M + 128) * N,), np.float32)  # C: its first M rows (row stride N), as a
    # [M + 128, N] view: the kernel gets the same pointer, the twin (CULLAMA_FAKE_GPU=1) the rows it indexes
    _, count = launch(kernels, cp, (), cp.asarray(A), cp.asarray(W), buf.reshape(M + 128, N), M, N, K, 0, splits=splits)
    out = buf.get()
    assert np.isfinite(out[:M * N]).all() and np.isnan(out[M * N:]).all()
    ref = np.empty((M, N), np.float32)
    ops.gemm_wgmma(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, 0)
    assert rel_err(out[:M * N].reshape(M, N), ref) <= 1e-3
    assert not count.get().any()


SPLIT_SIZES = [(1, 4096, 4096), (7, 4096, 11008), (64, 4096, 4096), (200, 136, 40), (1, 136, 11008),
               (256, 4096, 11008), (7, 32000, 264)]


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate", [0, 1])
@pytest.mark.parametrize("M,N,K", SPLIT_SIZES)
def test_gpu_split_k_matches_one_split(kernels, M, N, K, accumulate):
    """S = 2 and 4 equal S = 1 to float32 rounding, bitwise alike on a rerun, with every counter back at 0.
    K = 40 with S = 4 has empty K ranges; the workspace starts NaN, so a partial read unwritten shows."""
    import cupy as cp

    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K, scale=0.05)
    C0 = rand(rng, M, N, dtype=np.float32) if accumulate else np.full((M, N), np.nan, np.float32)
    dA, dW = cp.asarray(A), cp.asarray(W)
    geo = ops.geometry()
    workspace = cp.empty(geo.workspace_floats(M, N, 4), dtype=cp.float32)
    count = cp.zeros(geo.grid(M, N)[0] * geo.grid(M, N)[1], dtype=cp.uint32)  # zeroed once, for every launch

    def run(splits):
        dC = cp.asarray(C0)
        workspace.fill(np.nan)
        launch(kernels, cp, (), dA, dW, dC, M, N, K, accumulate, splits, workspace, count)
        assert not count.get().any(), f"S={splits}: tile_count not reset"
        assert splits > 1 or np.isnan(workspace.get()).all(), "S=1 wrote the workspace"
        return dC.get()

    one = run(1)
    ref = C0.copy() if accumulate else np.empty((M, N), np.float32)
    ops.gemm_wgmma(A, W, ref, np.empty(1, np.float32), np.zeros(1, np.uint32), M, N, K, accumulate)
    assert np.isfinite(one).all() and rel_err(one, ref) <= 1e-3
    bound = np.abs(A).astype(np.float32) @ np.abs(W).astype(np.float32).T + (np.abs(C0) if accumulate else 0)
    for splits in (2, 4):
        out = run(splits)
        assert np.isfinite(out).all(), f"S={splits}: unwritten elements"
        excess = np.abs(out.astype(np.float64) - one) - 1e-5 * bound
        assert excess.max() <= 0, f"S={splits}: differs from S=1 beyond float32 rounding at {np.argmax(excess)}"
        np.testing.assert_array_equal(run(splits), out, err_msg=f"S={splits}: not deterministic")


@pytest.mark.gpu
def test_gpu_gemm_wgmma_equals_gemm_within_rounding(kernels):
    """The plan may swap gemm for gemm_wgmma: on the same inputs both agree to float32 rounding (of sums in
    another order: a few ulps of the sum of |products| over K = 4096; a layout bug is off by O(1))."""
    import cupy as cp

    from cullama.runtime.prefill_kernels import MMA_GEMM, cdiv

    M, N, K = 244, 4096, 4096
    rng = np.random.default_rng()
    A, W = rand(rng, M, K), rand(rng, N, K, scale=0.02)
    dA, dW = cp.asarray(A), cp.asarray(W)
    ours, theirs = poisoned(cp, (M, N), np.float32), poisoned(cp, (M, N), np.float32)
    launch(kernels, cp, (), dA, dW, ours, M, N, K, 0)
    kernels.function(MMA_GEMM.spec)((cdiv(N, MMA_GEMM.tile_n), cdiv(M, MMA_GEMM.tile_m), 1), (MMA_GEMM.threads,),
                                    (dA, dW, theirs, cp.full(1, np.nan, cp.float32), cp.zeros(1, cp.uint32),
                                     np.int32(M), np.int32(N), np.int32(K), np.int32(0)))
    cp.cuda.runtime.deviceSynchronize()
    bound = np.abs(A).astype(np.float32) @ np.abs(W).astype(np.float32).T
    assert (np.abs(ours.get().astype(np.float64) - theirs.get()) <= 1e-4 * bound).all()
