"""attention_mma.cu (flash-attention 2 on mma.sync): NVRTC compiles every variant without spills or local
memory; the block marked "layout" in the .cu (all of the kernel's index math), compiled on the host and called
through ctypes, drives a lane-level NumPy emulation of the kernel: the PTX ISA's fragment layouts of ldmatrix
(.trans too) and mma.m16n8k16 (written here, independently of the kernel), cp.async copies that land only at
cp.async.wait_group and become visible to other warps only at a barrier (a read of data not yet visible, and a
copy over data another warp reads in the same barrier phase, are errors), FP16 rounding of P; run on random
data (odd row counts, start > 0, GQA, WARPS 2 and 4, max_seq clamping) against the twin, with seeded index
slips that it must catch (CPU). The kernel against the twin on fresh random data, NaN-poisoned outputs (GPU).
"""

from __future__ import annotations

import copy
import ctypes

import numpy as np
import pytest

from tests.conftest import host_layout_library, poisoned
from cullama.common.errors import KernelError
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.ops import attention as scalar_ops
from cullama.runtime.ops import attention_mma as ops
from cullama.runtime.registry import KernelSpec, compile_module

SOURCE = SOURCE_DIR / ops.SOURCE
VARIANTS = [tuple(v) for v in ops.VARIANTS]
VARIANT_IDS = ["-".join(f"{k}{v}" for k, v in d) for d in VARIANTS]
REGISTERS_PER_SM, SMEM_PER_SM, STATIC_SMEM_LIMIT = 65536, 228 * 1024, 48 * 1024
LOG2E = np.float32(1.4426950408889634)


def defines_of(hd, group, warps=ops.WARPS):
    return (("HEAD_DIM", hd), ("GROUP", group), ("WARPS", warps))


# -- NVRTC: every variant compiles for sm_90, no spills, no local memory, 2 blocks an SM --------------------
@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
def test_compiles_for_sm90_without_spills(defines):
    resources = compile_module(ops.SOURCE, defines, "sm_90").resources
    assert set(resources) == {"attention_prefill_mma"}
    res = resources["attention_prefill_mma"]
    assert not res.spills and res.stack_bytes == 0, res  # no spills, no local memory
    d = dict(defines)
    threads = ops.threads(d["WARPS"])
    assert 0 < res.registers <= 255 and 2 * res.registers * threads <= REGISTERS_PER_SM, res  # 2 blocks an SM
    assert res.smem_bytes == 2 * ops.TILE_K * (d["HEAD_DIM"] + 8) * 2, res  # the K and V tiles, static
    assert res.smem_bytes <= STATIC_SMEM_LIMIT and 2 * res.smem_bytes <= SMEM_PER_SM


def test_variants_cover_every_head_dim_group_and_the_shipped_configs():
    chosen = [dict(d) for d in VARIANTS]
    assert {d["HEAD_DIM"] for d in chosen} == set(ops.HEAD_DIMS) == {16, 32, 64, 128}
    assert {d["GROUP"] for d in chosen} == set(ops.GROUPS) == {1, 2, 4, 8}
    assert {d["WARPS"] for d in chosen} == {2, 4}
    for hd, group in ((128, 1), (32, 4), (32, 1)):  # llama-2-7b, tiny(-gqa), tiny-mha at the plan's WARPS
        assert defines_of(hd, group) in VARIANTS
    assert len(set(VARIANTS)) == len(VARIANTS) < 16


def test_head_dim_8_has_no_variant():
    """m16n8k16 needs a k of 16 for Q·K^T: HEAD_DIM 8 stays with the scalar attention_prefill."""
    assert not ops.supports(8, 2) and ops.supports(128, 1) and not ops.supports(128, 16)
    with pytest.raises(KernelError, match="attention_mma.cu"):
        compile_module(ops.SOURCE, defines_of(8, 2), "sm_90")


@pytest.mark.parametrize("group", ops.GROUPS)
@pytest.mark.parametrize("warps", [2, 4])
@pytest.mark.parametrize("n", [1, 3, 8, 63, 64, 65, 200, 256])
def test_grid_covers_the_rows_without_empty_blocks(group, warps, n):
    kv, rows_y, one = ops.grid(5, n, group, warps)
    per = ops.rows_per_block(group, warps)
    assert (kv, one) == (5, 1) and per * group == 16 * warps
    assert (rows_y - 1) * per < n <= rows_y * per
    assert ops.threads(warps) == 32 * warps and ops.THREADS == ops.threads() == 128 and ops.QUERIES == 64


def test_twin_is_attention_prefills():
    """Same function as the scalar kernel's twin, whatever grid[1] says (it counts blocks of other sizes)."""
    q_rows, k, v, max_seq, scale = inputs(32, 4, 2, 9, 13, 16, seed=1)
    a = np.full(q_rows.shape, np.nan, np.float16)
    b = a.copy()
    ops.attention_prefill_mma(q_rows, k, v, a, 9, 13, max_seq, scale, 7, grid=ops.grid(2, 13, 4))
    scalar_ops.attention_prefill(q_rows, k, v, b, 9, 13, max_seq, scale, 7, grid=(2, 13, 1))
    np.testing.assert_array_equal(a, b)
    assert np.isnan(a[13:].astype(np.float32)).all() and not np.isnan(a[:13].astype(np.float32)).any()


# -- inputs -----------------------------------------------------------------------------------------------
def inputs(hd, group, kv_heads, start, rows, buffer_rows, seed=0, max_seq=None, poison=True):
    """q_rows [buffer_rows, heads*hd] f16 (rows >= `rows` NaN: never read), caches [kv_heads, max_seq, hd] f16
    holding keys 0..start+rows-1 (positions past them NaN when `poison`: never read; the kernel zero-fills)."""
    rng = np.random.default_rng(seed)
    heads = kv_heads * group
    max_seq = start + rows + 5 if max_seq is None else max_seq
    q_rows = (2 * rng.standard_normal((buffer_rows, heads * hd))).astype(np.float16)
    q_rows[rows:] = np.nan
    k = rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16)
    v = rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16)
    if poison:
        k[:, start + rows:], v[:, start + rows:] = np.nan, np.nan
    return q_rows, k, v, max_seq, np.float32(1 / np.sqrt(hd))


def run_twin(q_rows, k, v, start, rows, max_seq, scale, window=None):
    out = np.full(q_rows.shape, np.nan, np.float16)
    ops.attention_prefill_mma(q_rows, k, v, out, start, rows, max_seq, scale, window or max_seq,
                              grid=ops.grid(k.shape[0], rows, q_rows.shape[1] // (k.shape[0] * k.shape[2])))
    return out


# -- the layout block, compiled on the host ---------------------------------------------------------------
WRAPPERS = r"""
extern "C" {
void t_consts(long long* o) {
    const long long v[] = {AM_THREADS, AM_BLOCK_Q, AM_ROWS, AM_TILE_K, AM_PITCH, AM_CHUNKS, AM_Q_COPIES,
                           AM_KV_COPIES, AM_KSTEPS, AM_SN, AM_ON, AM_PSTEPS, HEAD_DIM, GROUP, WARPS};
    for (int i = 0; i < 15; ++i) o[i] = v[i];
}
void t_copies(int copies, int* o) {  // o[tid][i] = (row, chunk)
    for (int t = 0; t < AM_THREADS; ++t)
        for (int i = 0; i < copies; ++i) {
            o[(t * copies + i) * 2] = am_copy_row(t, i);
            o[(t * copies + i) * 2 + 1] = am_copy_chunk(t, i);
        }
}
void t_smem(int* o) {  // o[row][col], row < AM_TILE_K, col < AM_PITCH
    for (int r = 0; r < AM_TILE_K; ++r) for (int c = 0; c < AM_PITCH; ++c) o[r * AM_PITCH + c] = am_smem(r, c);
}
void t_ldm(int* q, int* k, int* v) {  // q[warp][lane][ks], k[lane][pair][ks], v[lane][kk][pair]: (row, col)
    for (int w = 0; w < WARPS; ++w)
        for (int l = 0; l < 32; ++l)
            for (int ks = 0; ks < AM_KSTEPS; ++ks) {
                int* p = q + ((w * 32 + l) * AM_KSTEPS + ks) * 2;
                p[0] = am_q_ldm_row(w, l); p[1] = am_q_ldm_col(l, ks);
            }
    for (int l = 0; l < 32; ++l) {
        for (int pr = 0; pr < AM_SN / 2; ++pr)
            for (int ks = 0; ks < AM_KSTEPS; ++ks) {
                int* p = k + ((l * (AM_SN / 2) + pr) * AM_KSTEPS + ks) * 2;
                p[0] = am_k_ldm_row(l, pr); p[1] = am_k_ldm_col(l, ks);
            }
        for (int kk = 0; kk < AM_PSTEPS; ++kk)
            for (int pr = 0; pr < AM_ON / 2; ++pr) {
                int* p = v + ((l * AM_PSTEPS + kk) * (AM_ON / 2) + pr) * 2;
                p[0] = am_v_ldm_row(l, kk); p[1] = am_v_ldm_col(l, pr);
            }
    }
}
void t_acc(int nt, int* o) {  // o[warp][lane][n][e] = (query, col), n < nt
    for (int w = 0; w < WARPS; ++w)
        for (int l = 0; l < 32; ++l)
            for (int n = 0; n < nt; ++n)
                for (int e = 0; e < 4; ++e) {
                    int* p = o + (((w * 32 + l) * nt + n) * 4 + e) * 2;
                    p[0] = am_acc_query(w, l, e); p[1] = am_acc_col(l, n, e);
                }
}
void t_p(int* o) {  // o[kk][r][h] = (tile, elem)
    for (int kk = 0; kk < AM_PSTEPS; ++kk)
        for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) {
                o[((kk * 4 + r) * 2 + h) * 2] = am_p_tile(kk, r);
                o[((kk * 4 + r) * 2 + h) * 2 + 1] = am_p_elem(r, h);
            }
}
void t_queries(long long row_stride, int* rows, long long* off) {  // rows[j], off[j][d]
    for (int j = 0; j < AM_BLOCK_Q; ++j) {
        rows[j] = am_query_row(j);
        for (int d = 0; d < HEAD_DIM; ++d) off[j * HEAD_DIM + d] = (long long)am_query_offset(j, d, (size_t)row_stride);
    }
}
void t_block(int start, int n_rows, int max_seq, int y, int* o) {  // (row0, rows, end, tiles)
    o[0] = am_row0(y); o[1] = am_rows(o[0], n_rows); o[2] = am_key_end(start, o[0], o[1], max_seq);
    o[3] = am_tiles(o[2]);
}
void t_limits(int pos0, int end, int* o) { for (int j = 0; j < AM_BLOCK_Q; ++j) o[j] = am_limit(j, pos0, end); }
void t_firsts(int pos0, int end, int window, int* o) {  // o[j] = am_first, then o[AM_BLOCK_Q] = the first tile
    for (int j = 0; j < AM_BLOCK_Q; ++j) o[j] = am_first(j, pos0, end, window);
    o[AM_BLOCK_Q] = am_first_tile(pos0, end, window);
}
void t_warps(int key0, int pos0, int end, int window, int* o) {  // o[warp] = (active, masked)
    for (int w = 0; w < WARPS; ++w) {
        o[2 * w] = am_warp_active(w, key0, pos0, end, window);
        o[2 * w + 1] = am_tile_masked(w, key0, pos0, end, window);
    }
}
}
"""


def _ptr(a):
    return a.ctypes.data_as(ctypes.c_void_p)


class Layout:
    """The .cu's layout functions for one variant, compiled with the host C++ compiler, as tables."""

    def __init__(self, lib):
        self.lib = lib
        c = np.zeros(15, np.int64)
        lib.t_consts(_ptr(c))
        (self.threads, self.block_q, self.rows_per_block, self.tile_k, self.pitch, self.chunks, self.q_copies,
         self.kv_copies, self.ksteps, self.sn, self.on, self.psteps, self.hd, self.group, self.warps) = map(int, c)
        self.copies_q = self._table("t_copies", (self.threads, self.q_copies, 2), self.q_copies)
        self.copies_kv = self._table("t_copies", (self.threads, self.kv_copies, 2), self.kv_copies)
        self.smem = self._table("t_smem", (self.tile_k, self.pitch))
        self.q_ldm = np.zeros((self.warps, 32, self.ksteps, 2), np.int32)
        self.k_ldm = np.zeros((32, self.sn // 2, self.ksteps, 2), np.int32)
        self.v_ldm = np.zeros((32, self.psteps, self.on // 2, 2), np.int32)
        lib.t_ldm(_ptr(self.q_ldm), _ptr(self.k_ldm), _ptr(self.v_ldm))
        self.nt = max(self.sn, self.on)
        self.acc = self._table("t_acc", (self.warps, 32, self.nt, 4, 2), self.nt)
        self.p = self._table("t_p", (self.psteps, 4, 2, 2))

    def _table(self, name, shape, *args):
        out = np.zeros(shape, np.int32)
        getattr(self.lib, name)(*[ctypes.c_int(a) for a in args], _ptr(out))
        return out

    def queries(self, row_stride):
        rows = np.zeros(self.block_q, np.int32)
        off = np.zeros((self.block_q, self.hd), np.int64)
        self.lib.t_queries(ctypes.c_longlong(row_stride), _ptr(rows), _ptr(off))
        return rows, off

    def block(self, start, n_rows, max_seq, y):
        return tuple(int(x) for x in self._table("t_block", (4,), start, n_rows, max_seq, y))

    def limits(self, pos0, end):
        return self._table("t_limits", (self.block_q,), pos0, end)

    def firsts(self, pos0, end, window):
        """(each query's first key [block_q], the block's first key tile)."""
        out = self._table("t_firsts", (self.block_q + 1,), pos0, end, window)
        return out[:-1], int(out[-1])

    def warp_flags(self, key0, pos0, end, window):
        return self._table("t_warps", (self.warps, 2), key0, pos0, end, window).astype(bool)


def build_layout(directory, defines) -> Layout:
    return Layout(host_layout_library(SOURCE, "AM_FN", WRAPPERS, defines, directory))


_LAYOUTS: dict = {}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """defines -> Layout, each built once per module."""
    def get(defines):
        if defines not in _LAYOUTS:
            _LAYOUTS[defines] = build_layout(tmp_path_factory.mktemp("am_layout"), defines)
        return _LAYOUTS[defines]
    yield get
    _LAYOUTS.clear()


@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
def test_layout_constants_match_python(layouts, defines):
    lay, d = layouts(defines), dict(defines)
    assert (lay.hd, lay.group, lay.warps) == (d["HEAD_DIM"], d["GROUP"], d["WARPS"])
    assert lay.threads == ops.threads(lay.warps) and lay.tile_k == ops.TILE_K
    assert lay.block_q == ops.QUERIES_PER_WARP * lay.warps and lay.rows_per_block == ops.rows_per_block(lay.group,
                                                                                                         lay.warps)
    assert lay.pitch == lay.hd + 8 and lay.sn == 8 and lay.psteps == 4 and lay.on == lay.hd // 8


@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
def test_copies_cover_each_tile_chunk_once(layouts, defines):
    lay = layouts(defines)
    for table, rows in ((lay.copies_q, lay.block_q), (lay.copies_kv, lay.tile_k)):
        seen = np.zeros((rows, lay.chunks), np.int32)
        np.add.at(seen, (table[..., 0].ravel(), table[..., 1].ravel()), 1)
        assert (seen == 1).all()
        # a warp's 32 copies of one step are consecutive chunks of whole rows (coalesced 16-byte reads)
        flat = table[:, 0, 0] * lay.chunks + table[:, 0, 1]
        assert (np.diff(flat) == 1).all()
    assert (lay.smem == np.arange(lay.tile_k)[:, None] * lay.pitch + np.arange(lay.pitch)).all()


@pytest.mark.parametrize("defines", VARIANTS, ids=VARIANT_IDS)
def test_ldmatrix_rows_are_aligned_and_conflict_free(layouts, defines):
    """Every ldmatrix row address is 16-byte aligned, inside a row's data (never the padding), and the 8 rows
    of each 8x8 matrix (one shared-memory phase) fall in 8 distinct 16-byte bank groups."""
    lay = layouts(defines)
    for table in (lay.q_ldm.transpose(0, 2, 1, 3).reshape(-1, 32, 2),
                  lay.k_ldm.transpose(1, 2, 0, 3).reshape(-1, 32, 2),
                  lay.v_ldm.transpose(1, 2, 0, 3).reshape(-1, 32, 2)):
        row, col = table[..., 0], table[..., 1]
        assert (col % 8 == 0).all() and (col >= 0).all() and (col + 8 <= lay.hd).all()
        assert (row >= 0).all() and (row < lay.tile_k).all()
        byte = (row * lay.pitch + col) * 2
        groups = (byte // 16 % 8).reshape(-1, 4, 8)
        for g in groups.reshape(-1, 8):
            assert len(set(g.tolist())) == 8, g


# -- the PTX ISA's fragment semantics (independent of the kernel) ------------------------------------------
LANES = np.arange(32)
G_, T_ = LANES // 4, LANES % 4


def ldmatrix_x4(rows, trans=False):
    """ldmatrix.sync.aligned.m8n8.x4(.trans).b16: rows [32, 8] are the 16 bytes at the address lane i gave
    (row i % 8 of matrix i // 8). Register i of lane l: elements (l/4, 2(l%4)), (l/4, 2(l%4)+1) of matrix i, or
    with .trans (2(l%4), l/4), (2(l%4)+1, l/4). Returns [32 lanes, 4 registers, 2 halves (low, high)]."""
    out = np.empty((32, 4, 2), np.float16)
    for i in range(4):
        mat = rows[8 * i:8 * i + 8]
        for h in range(2):
            out[:, i, h] = mat[2 * T_ + h, G_] if trans else mat[G_, 2 * T_ + h]
    return out


def mma_16816(d, a, b0, b1):
    """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: d [32, 4] f32, a [32, 4, 2] f16, b0, b1 [32, 2] f16
    per lane; A[g][2t+h] = a0.h, A[g+8][2t+h] = a1.h, A[g][2t+8+h] = a2.h, A[g+8][2t+8+h] = a3.h; B[2t+h][g] =
    b0.h, B[2t+8+h][g] = b1.h; C[g][2t+h] = c_h, C[g+8][2t+h] = c_(2+h). Products exact, sums in float32."""
    A, B, C = np.full((16, 16), np.nan), np.full((16, 8), np.nan), np.full((16, 8), np.nan)
    for h in range(2):
        A[G_, 2 * T_ + h], A[G_ + 8, 2 * T_ + h] = a[:, 0, h], a[:, 1, h]
        A[G_, 2 * T_ + 8 + h], A[G_ + 8, 2 * T_ + 8 + h] = a[:, 2, h], a[:, 3, h]
        B[2 * T_ + h, G_], B[2 * T_ + 8 + h, G_] = b0[:, h], b1[:, h]
        C[G_, 2 * T_ + h], C[G_ + 8, 2 * T_ + h] = d[:, h], d[:, 2 + h]
    D = (A @ B + C).astype(np.float32)
    return np.stack([D[G_, 2 * T_], D[G_, 2 * T_ + 1], D[G_ + 8, 2 * T_], D[G_ + 8, 2 * T_ + 1]], axis=1)


def test_the_fragment_models_multiply_matrices():
    """The models above are a 16x16 by 16x8 product when fed per the PTX tables (and ldmatrix.x4 of a 16x16
    block with the A addressing gives the A fragments; .trans of a [k][n] block gives B's)."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    Bt = rng.standard_normal((16, 8)).astype(np.float16)  # [k][n]
    a = ldmatrix_x4(np.stack([A[l % 16, (l // 16) * 8:(l // 16) * 8 + 8] for l in range(32)]))
    # B from a [k][n] block by .trans: matrices k 0-7 -> b0, k 8-15 -> b1 (lanes 0-15), repeated for lanes 16-31
    b = ldmatrix_x4(np.stack([Bt[l % 16, :] for l in range(32)]), trans=True)
    d = mma_16816(np.zeros((32, 4), np.float32), a, b[:, 0], b[:, 1])
    D = np.empty((16, 8))
    for h in range(2):
        D[G_, 2 * T_ + h], D[G_ + 8, 2 * T_ + h] = d[:, h], d[:, 2 + h]
    np.testing.assert_allclose(D, A.astype(np.float64) @ Bt.astype(np.float64), rtol=1e-6, atol=1e-6)


# -- cp.async and barriers --------------------------------------------------------------------------------
PENDING, LANDED, VISIBLE = 1, 2, 3


class HazardError(AssertionError):
    pass


class SharedTiles:
    """The K and V tiles (halves, padding included) with each half's state: never written (0), a copy in flight
    (issued, not waited), landed (waited, not yet behind a barrier), visible to every warp. Reads by ldmatrix
    need VISIBLE; a copy may not target data in flight or data some warp read in the current barrier phase."""

    def __init__(self, size):
        self.data = {t: np.full(size, np.nan, np.float16) for t in "kv"}
        self.state = {t: np.zeros(size, np.int8) for t in "kv"}
        self.read = {t: np.zeros(size, bool) for t in "kv"}
        self.pending = []

    def cp_async(self, tile, off, values):
        if off % 8 or off < 0 or off + 8 > self.data[tile].size:
            raise HazardError(f"cp.async to {tile}[{off}]: misaligned or out of the tile")
        span = slice(off, off + 8)
        if (self.state[tile][span] == PENDING).any():
            raise HazardError(f"two copies in flight to {tile}[{off}]")
        if self.read[tile][span].any():
            raise HazardError(f"cp.async over {tile}[{off}], read by a warp in this barrier phase")
        self.state[tile][span] = PENDING
        self.pending.append((tile, off, np.asarray(values, np.float16)))

    def wait_all(self):
        for tile, off, values in self.pending:
            self.data[tile][off:off + 8] = values
            self.state[tile][off:off + 8] = LANDED
        self.pending = []

    def barrier(self):
        for t in "kv":
            self.state[t][self.state[t] == LANDED] = VISIBLE
            self.read[t][:] = False

    def rows(self, tile, offsets):
        """The 8 halves at each of 32 row addresses (ldmatrix's lanes)."""
        offsets = np.asarray(offsets)
        if (offsets % 8).any() or (offsets < 0).any() or (offsets + 8 > self.data[tile].size).any():
            raise HazardError("ldmatrix row address misaligned or out of the tile")
        idx = offsets[:, None] + np.arange(8)
        if (self.state[tile][idx] != VISIBLE).any():
            raise HazardError(f"ldmatrix reads {tile} data that is not visible (in flight, not behind a barrier, "
                              "or never written)")
        self.read[tile][idx] = True
        return self.data[tile][idx]


# -- the kernel, lane by lane -----------------------------------------------------------------------------
def emulate(lay, q_rows, k_cache, v_cache, out_rows, start, n_rows, max_seq, scale, window, grid):
    """attention_prefill_mma on NumPy arrays, as the kernel does it (see the .cu): every block of `grid`, every
    warp, the layout functions for every index. Returns the number of writes to each element of out_rows."""
    kv_heads = grid[0]
    row_stride = kv_heads * lay.group * lay.hd
    assert q_rows.shape[1] == row_stride and out_rows.shape[1] == row_stride
    q_flat, out_flat = q_rows.reshape(-1), out_rows.reshape(-1)
    writes = np.zeros(out_flat.size, np.int32)
    query_row, query_off = lay.queries(row_stride)
    scale_log2 = np.float32(scale) * LOG2E
    for x in range(grid[0]):
        kc, vc = k_cache[x].reshape(-1), v_cache[x].reshape(-1)
        for y in range(grid[1]):
            row0, rows, end, n_tiles = lay.block(start, n_rows, max_seq, y)
            if row0 >= n_rows:
                continue
            _emulate_block(lay, q_flat, kc, vc, out_flat, writes, row0 * row_stride + x * lay.group * lay.hd,
                           start + row0, rows, end, n_tiles, query_row, query_off, scale_log2, window)
    return writes.reshape(out_rows.shape)


def _load_kv(lay, sm, tile, src, key0, begin, end):
    for tid in range(lay.threads):
        for i in range(lay.kv_copies):
            row, chunk = lay.copies_kv[tid, i]
            ok = begin <= key0 + row < end
            vals = src[(key0 + row) * lay.hd + chunk * 8:][:8] if ok else np.zeros(8, np.float16)
            sm.cp_async(tile, lay.smem[row, chunk * 8], vals)


def _emulate_block(lay, q_flat, kc, vc, out_flat, writes, block_off, pos0, rows, end, n_tiles, query_row,
                   query_off, scale_log2, window):
    sm = SharedTiles(lay.tile_k * lay.pitch)
    firsts, first_tile = lay.firsts(pos0, end, window)
    # prologue: Q through the V tile, the first K tile; wait; barrier; Q -> A fragments
    for tid in range(lay.threads):
        for i in range(lay.q_copies):
            j, chunk = lay.copies_q[tid, i]
            ok = query_row[j] < rows
            vals = q_flat[block_off + query_off[j, chunk * 8]:][:8] if ok else np.zeros(8, np.float16)
            sm.cp_async("v", lay.smem[j, chunk * 8], vals)
    begin = int(firsts[0])  # the block's first key: keys before it in the first tile are zeros, as those >= end
    _load_kv(lay, sm, "k", kc, first_tile * lay.tile_k, begin, end)
    sm.wait_all()
    sm.barrier()
    W = lay.warps
    qf = [[ldmatrix_x4(sm.rows("v", lay.smem[lay.q_ldm[w, :, ks, 0], lay.q_ldm[w, :, ks, 1]]))
           for ks in range(lay.ksteps)] for w in range(W)]
    limits = lay.limits(pos0, end)
    lim = [np.stack([limits[lay.acc[w, :, 0, 2 * h, 0]] for h in range(2)], axis=1) for w in range(W)]  # [32, 2]
    first = [np.stack([firsts[lay.acc[w, :, 0, 2 * h, 0]] for h in range(2)], axis=1) for w in range(W)]
    m = [np.full((32, 2), -np.inf, np.float32) for _ in range(W)]
    l = [np.zeros((32, 2), np.float32) for _ in range(W)]
    o = [np.zeros((lay.on, 32, 4), np.float32) for _ in range(W)]
    for kt in range(first_tile, n_tiles):
        key0 = kt * lay.tile_k
        sm.wait_all()
        sm.barrier()
        _load_kv(lay, sm, "v", vc, key0, begin, end)
        flags = lay.warp_flags(key0, pos0, end, window)
        pf = [None] * W
        for w in range(W):
            if not flags[w, 0]:
                continue
            sc = np.zeros((lay.sn, 32, 4), np.float32)
            for ks in range(lay.ksteps):
                for p in range(lay.sn // 2):
                    b = ldmatrix_x4(sm.rows("k", lay.smem[lay.k_ldm[:, p, ks, 0], lay.k_ldm[:, p, ks, 1]]))
                    sc[2 * p] = mma_16816(sc[2 * p], qf[w][ks], b[:, 0], b[:, 1])
                    sc[2 * p + 1] = mma_16816(sc[2 * p + 1], qf[w][ks], b[:, 2], b[:, 3])
            xs = sc * scale_log2
            if flags[w, 1]:
                keys = key0 + lay.acc[w, :, :lay.sn, :, 1].transpose(1, 0, 2)  # [n, lane, e]
                hidden = (keys >= lim[w][:, [0, 0, 1, 1]][None]) | (keys < first[w][:, [0, 0, 1, 1]][None])
                xs = np.where(hidden, np.float32(-np.inf), xs)
            mx = m[w].copy()
            for h in range(2):
                mx[:, h] = np.maximum(mx[:, h], xs[:, :, 2 * h:2 * h + 2].max(axis=(0, 2)))
            for o_ in (1, 2):  # shfl.xor within the quad
                mx = np.maximum(mx, mx[LANES ^ o_])
            base = np.where(mx == -np.inf, np.float32(0), mx)
            c = np.exp2(m[w] - base)
            m[w], l[w] = mx, l[w] * c
            o[w] *= c[None][:, :, [0, 0, 1, 1]]
            p_ = np.exp2(xs - base[None][:, :, [0, 0, 1, 1]]).astype(np.float32)
            l[w] = l[w] + np.stack([p_[:, :, 2 * h:2 * h + 2].sum(axis=(0, 2)) for h in range(2)], axis=1)
            pf[w] = [np.stack([np.stack([p_[lay.p[kk, r, hh, 0], :, lay.p[kk, r, hh, 1]] for hh in range(2)], axis=1)
                               for r in range(4)], axis=1).astype(np.float16) for kk in range(lay.psteps)]
        sm.wait_all()
        sm.barrier()
        if kt + 1 < n_tiles:
            _load_kv(lay, sm, "k", kc, key0 + lay.tile_k, begin, end)
        for w in range(W):
            if not flags[w, 0]:
                continue
            for kk in range(lay.psteps):
                for p in range(lay.on // 2):
                    b = ldmatrix_x4(sm.rows("v", lay.smem[lay.v_ldm[:, kk, p, 0], lay.v_ldm[:, kk, p, 1]]), trans=True)
                    o[w][2 * p] = mma_16816(o[w][2 * p], pf[w][kk], b[:, 0], b[:, 1])
                    o[w][2 * p + 1] = mma_16816(o[w][2 * p + 1], pf[w][kk], b[:, 2], b[:, 3])
    # epilogue: quad sums of l, O / l as FP16 pairs, real rows only
    for w in range(W):
        lw = l[w]
        for o_ in (1, 2):
            lw = lw + lw[LANES ^ o_]
        inv = np.float32(1) / lw
        for lane in range(32):
            for h in range(2):
                j = lay.acc[w, lane, 0, 2 * h, 0]
                if query_row[j] >= rows:
                    continue
                for n in range(lay.on):
                    col = lay.acc[w, lane, n, 2 * h, 1]
                    assert lay.acc[w, lane, n, 2 * h + 1, 1] == col + 1 and lay.acc[w, lane, n, 2 * h + 1, 0] == j
                    off = block_off + query_off[j, col]
                    assert off % 2 == 0 and query_off[j, col + 1] == query_off[j, col] + 1  # one 32-bit store
                    out_flat[off:off + 2] = (o[w][n, lane, 2 * h:2 * h + 2] * inv[lane, h]).astype(np.float16)
                    writes[off:off + 2] += 1


# (head_dim, group, warps, kv_heads, start, rows, buffer_rows, max_seq or None, window or None): odd row counts,
# start > 0 with the diagonal across two key tiles, GQA, one row, WARPS 2, and max_seq below start + rows (clamped
# keys); then sliding windows: of 1, with the window's edge inside a tile and a block's first tile past key 0, of
# a whole tile and more, across a warp's rows.
EMU_CASES = [
    (32, 1, 4, 2, 0, 70, 72, None, None),
    (32, 4, 4, 2, 37, 29, 32, None, None),
    (64, 2, 4, 1, 100, 45, 48, None, None),
    (128, 1, 4, 2, 5, 67, 70, None, None),
    (16, 8, 4, 2, 3, 9, 12, None, None),
    (128, 1, 2, 1, 63, 33, 40, None, None),
    (32, 4, 2, 2, 130, 11, 11, None, None),
    (64, 1, 4, 1, 0, 1, 1, None, None),
    (32, 2, 4, 1, 60, 20, 24, 70, None),
    (128, 8, 4, 1, 17, 13, 16, None, None),
    (32, 1, 4, 1, 0, 70, 72, None, 1),
    (32, 4, 4, 2, 140, 29, 32, None, 16),
    (64, 2, 4, 1, 100, 45, 48, None, 70),
    (32, 1, 2, 1, 200, 40, 40, None, 9),
]
EMU_IDS = ["hd{}-g{}-w{}-kv{}-s{}-r{}".format(*c[:6]) + (f"-win{c[8]}" if c[8] else "") for c in EMU_CASES]


def run_emulation(lay, q_rows, k, v, start, rows, max_seq, scale, extra_blocks=0, window=None):
    out = np.full(q_rows.shape, np.nan, np.float16)
    kv_heads = k.shape[0]
    g = ops.grid(kv_heads, rows, lay.group, lay.warps)
    writes = emulate(lay, q_rows, k, v, out, start, rows, max_seq, scale, window or max_seq,
                     (g[0], g[1] + extra_blocks, 1))
    return out, writes


@pytest.mark.parametrize("hd,group,warps,kv_heads,start,rows,buffer_rows,max_seq,window", EMU_CASES, ids=EMU_IDS)
def test_emulation_matches_the_twin(layouts, hd, group, warps, kv_heads, start, rows, buffer_rows, max_seq, window):
    lay = layouts(defines_of(hd, group, warps))
    q_rows, k, v, max_seq, scale = inputs(hd, group, kv_heads, start, rows, buffer_rows, seed=rows + start,
                                          max_seq=max_seq)
    if window:  # keys before the oldest window are never read either
        k[:, :max(0, start + 1 - window)], v[:, :max(0, start + 1 - window)] = np.nan, np.nan
    expected = run_twin(q_rows, k, v, start, rows, max_seq, scale, window)
    got, writes = run_emulation(lay, q_rows, k, v, start, rows, max_seq, scale, extra_blocks=1, window=window)
    assert (writes[:rows] == 1).all() and (writes[rows:] == 0).all()  # every (row, head, dim) once; no more
    assert np.isnan(got[rows:].astype(np.float32)).all()
    assert np.isfinite(got[:rows].astype(np.float32)).all()
    np.testing.assert_allclose(got[:rows].astype(np.float32), expected[:rows].astype(np.float32), rtol=2e-3,
                               atol=2e-3)


# -- seeded slips: the emulation must catch each ------------------------------------------------------------
def _mutant(lay, name):
    bad = copy.copy(lay)
    if name == "q_ldm_col":  # the K addressing's k offset for Q
        bad.q_ldm = lay.q_ldm.copy()
        bad.q_ldm[:, :, :, 1] = np.arange(lay.ksteps)[None, None] * 16 + ((LANES[None, :, None] // 8) % 2) * 8
    elif name == "k_ldm_row":  # the A addressing (lane % 16) for K
        bad.k_ldm = lay.k_ldm.copy()
        bad.k_ldm[:, :, :, 0] = np.arange(lay.sn // 2)[None, :, None] * 16 + LANES[:, None, None] % 16
    elif name == "v_ldm_swap":  # V's key and dim halves swapped between matrices
        bad.v_ldm = lay.v_ldm.copy()
        kk, p = np.arange(lay.psteps)[None, :, None], np.arange(lay.on // 2)[None, None, :]
        lane = LANES[:, None, None]
        bad.v_ldm[..., 0] = kk * 16 + lane % 8 + (lane // 16) * 8
        bad.v_ldm[..., 1] = p * 16 + ((lane // 8) % 2) * 8
    elif name == "acc_col":  # the pair's second column dropped
        bad.acc = lay.acc.copy()
        bad.acc[..., 1] = bad.acc[..., 1] - bad.acc[..., 1] % 2
    elif name == "p_elem":  # P's halves swapped
        bad.p = lay.p.copy()
        bad.p[:, :, :, 1] = bad.p[:, :, ::-1, 1]
    elif name == "p_tile":  # keys 16kk+8.. taken from the wrong n8 tile
        bad.p = lay.p.copy()
        bad.p[..., 0] = 2 * np.arange(lay.psteps)[:, None, None]
    elif name == "limit":  # off by one: the diagonal key masked
        bad.limits = lambda pos0, end: lay.limits(pos0, end) - 1
    elif name == "no_mask":  # the mask decided on the warp's last query instead of its first
        bad.warp_flags = lambda key0, pos0, end, window: np.stack(
            [lay.warp_flags(key0, pos0, end, window)[:, 0], key0 + lay.tile_k > lay.limits(pos0, end)[
                np.arange(lay.warps) * 16 + 15]], axis=1)
    elif name == "skip_warp":  # a warp skips a tile only its last query sees
        bad.warp_flags = lambda key0, pos0, end, window: np.stack(
            [key0 < lay.limits(pos0, end)[np.arange(lay.warps) * 16], lay.warp_flags(key0, pos0, end, window)[:, 1]],
            axis=1)
    elif name == "first":  # off by one: a key older than the window seen
        bad.firsts = lambda pos0, end, window: (np.maximum(lay.firsts(pos0, end, window)[0] - 1, 0),
                                                lay.firsts(pos0, end, window)[1])
    elif name == "window_mask":  # the window's edge never masked: only the diagonal and the end
        bad.warp_flags = lambda key0, pos0, end, window: lay.warp_flags(key0, pos0, end, end)
    elif name == "first_tile":  # the key loop starts a tile late
        bad.firsts = lambda pos0, end, window: (lay.firsts(pos0, end, window)[0], lay.firsts(pos0, end, window)[1] + 1)
    elif name == "query_off":  # row and head swapped in the Q/out offsets
        orig = lay.queries
        bad.queries = lambda rs: (orig(rs)[0], (np.arange(lay.block_q) % lay.group)[:, None] * rs
                                  + (np.arange(lay.block_q) // lay.group)[:, None] * lay.hd + np.arange(lay.hd))
    elif name == "copy_rows":  # odd K/V tile rows never copied (even ones twice)
        bad.copies_kv = lay.copies_kv.copy()
        bad.copies_kv[..., 0] = lay.copies_kv[..., 0] // 2 * 2
    else:
        raise ValueError(name)
    return bad


MUTANTS = ["q_ldm_col", "k_ldm_row", "v_ldm_swap", "acc_col", "p_elem", "p_tile", "limit", "no_mask", "skip_warp",
           "query_off", "copy_rows", "first", "window_mask", "first_tile"]
WINDOWED = {"first": 20, "window_mask": 20, "first_tile": 90}  # the window the slips of its edge show at


@pytest.mark.parametrize("mutant", MUTANTS)
def test_emulation_catches_index_slips(layouts, mutant):
    hd, group, warps, kv_heads, start, rows, buffer_rows = 32, 2, 4, 1, 50, 37, 40
    lay = _mutant(layouts(defines_of(hd, group, warps)), mutant)
    q_rows, k, v, max_seq, scale = inputs(hd, group, kv_heads, start, rows, buffer_rows, seed=7)
    window = WINDOWED.get(mutant)
    expected = run_twin(q_rows, k, v, start, rows, max_seq, scale, window)
    try:
        got, writes = run_emulation(lay, q_rows, k, v, start, rows, max_seq, scale, window=window)
    except (HazardError, AssertionError, IndexError):
        return  # caught by a hazard, alignment or store-pairing check
    ok = (writes[:rows] == 1).all() and (writes[rows:] == 0).all() and np.allclose(
        got[:rows].astype(np.float32), expected[:rows].astype(np.float32), rtol=2e-3, atol=2e-3)
    assert not ok, f"the slip {mutant!r} went unnoticed"


def test_emulation_catches_a_missing_barrier(layouts, monkeypatch):
    """Without the barrier at the top of the key loop, V_0's copies would overwrite Q while warps read it."""
    lay = layouts(defines_of(32, 1, 4))
    q_rows, k, v, max_seq, scale = inputs(32, 1, 1, 0, 20, 20, seed=2)
    calls = {"n": 0}
    real = SharedTiles.barrier

    def skip_second(self):
        calls["n"] += 1
        if calls["n"] != 2:  # the first: after the prologue's wait; the second: the key loop's first
            real(self)

    monkeypatch.setattr(SharedTiles, "barrier", skip_second)
    with pytest.raises(HazardError):
        run_emulation(lay, q_rows, k, v, 0, 20, max_seq, scale)


# -- GPU: the kernel against the twin ---------------------------------------------------------------------
def _spec(hd, group, warps=ops.WARPS):
    return KernelSpec(ops.SOURCE, "attention_prefill_mma", defines_of(hd, group, warps))


def _run_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale, hd, group, warps=ops.WARPS, extra_blocks=0,
                window=None):
    import cupy as cp

    kv_heads = k.shape[0]
    d_out = poisoned(cp, q_rows.shape, np.float16)
    g = ops.grid(kv_heads, rows, group, warps)
    kernels.function(_spec(hd, group, warps))(
        (g[0], g[1] + extra_blocks), (ops.threads(warps),),
        (cp.asarray(q_rows), cp.asarray(k), cp.asarray(v), d_out, np.int32(start), np.int32(rows),
         np.int32(max_seq), np.float32(scale), np.int32(window or max_seq)))
    return d_out.get()


GPU_SHAPES = [(32, 1), (32, 4), (64, 1), (64, 4), (128, 1), (128, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group", GPU_SHAPES, ids=[f"hd{h}-g{g}" for h, g in GPU_SHAPES])
@pytest.mark.parametrize("start", [0, 37])
@pytest.mark.parametrize("rows", [1, 7, 64, 200, 256])
def test_kernel_matches_twin(kernels, hd, group, start, rows):
    kv_heads = 2
    q_rows, k, v, max_seq, scale = inputs(hd, group, kv_heads, start, rows, rows + 3, seed=rows * 7 + start)
    expected = run_twin(q_rows, k, v, start, rows, max_seq, scale)
    got = _run_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale, hd, group)
    assert not np.isnan(got[:rows].astype(np.float32)).any()  # every (row, head) written
    assert np.isnan(got[rows:].astype(np.float32)).all()  # rows >= n_rows untouched
    np.testing.assert_allclose(got[:rows].astype(np.float32), expected[:rows].astype(np.float32), rtol=2e-3,
                               atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group", [(128, 4), (64, 4)], ids=["hd128-g4", "hd64-g4"])
@pytest.mark.parametrize("window", [1, 20, 100])
def test_kernel_sliding_window_matches_twin(kernels, hd, group, window):
    """Mistral's sliding window: 200 rows at position 37, keys older than every row's window NaN (never read)."""
    start, rows = 37, 200
    q_rows, k, v, max_seq, scale = inputs(hd, group, 2, start, rows, rows + 3, seed=window)
    k[:, :max(0, start + 1 - window)], v[:, :max(0, start + 1 - window)] = np.nan, np.nan
    expected = run_twin(q_rows, k, v, start, rows, max_seq, scale, window)
    got = _run_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale, hd, group, window=window)
    assert np.isnan(got[rows:].astype(np.float32)).all()
    np.testing.assert_allclose(got[:rows].astype(np.float32), expected[:rows].astype(np.float32), rtol=2e-3,
                               atol=2e-3)


@pytest.mark.gpu
def test_kernel_llama_7b_shape(kernels):
    """A 500-token prompt's second chunk on LLaMA-2-7B's shape: 32 kv heads, 244 rows at position 256."""
    q_rows, k, v, max_seq, scale = inputs(128, 1, 32, 256, 244, 256, seed=11, max_seq=512)
    expected = run_twin(q_rows, k, v, 256, 244, max_seq, scale)
    got = _run_kernel(kernels, q_rows, k, v, 256, 244, max_seq, scale, 128, 1)
    assert np.isnan(got[244:].astype(np.float32)).all()
    np.testing.assert_allclose(got[:244].astype(np.float32), expected[:244].astype(np.float32), rtol=2e-3,
                               atol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group", [(128, 1), (32, 4)])
def test_kernel_tiling(kernels, hd, group):
    """WARPS 2 and 4 agree; a grid taller than needed gives the same bits and writes nothing more; the scalar
    attention_prefill kernel agrees; a second launch gives the same bits."""
    start, rows = 40, 23
    q_rows, k, v, max_seq, scale = inputs(hd, group, 3, start, rows, 32, seed=5)
    run = lambda warps=4, extra=0: _run_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale, hd,  # noqa: E731
                                               group, warps, extra)
    base = run()
    np.testing.assert_array_equal(run(), base)
    np.testing.assert_allclose(run(2)[:rows].astype(np.float32), base[:rows].astype(np.float32), rtol=2e-3,
                               atol=2e-3)
    taller = run(extra=3)
    np.testing.assert_array_equal(taller[:rows], base[:rows])
    assert np.isnan(taller[rows:].astype(np.float32)).all()

    import cupy as cp
    rows_q = max(1, 4 // group)
    d_out = poisoned(cp, q_rows.shape, np.float16)
    kernels.function(KernelSpec("attention.cu", "attention_prefill",
                                (("HEAD_DIM", hd), ("GROUP", group), ("ROWS_Q", rows_q))))(
        (3, -(-rows // rows_q)), (128,),
        (cp.asarray(q_rows), cp.asarray(k), cp.asarray(v), d_out, np.int32(start), np.int32(rows),
         np.int32(max_seq), np.float32(scale), np.int32(max_seq)))
    np.testing.assert_allclose(d_out.get()[:rows].astype(np.float32), base[:rows].astype(np.float32), rtol=2e-3,
                               atol=2e-3)
