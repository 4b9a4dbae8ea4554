"""gemv_mma.cu: the twins against the reference's math (CPU); the kernels against the twins bit for bit, and a token row
of a T-row launch against the same row alone and in row 0 of another launch: the check_* functions, which run on the
CPU executor in tests/runtime/emu/test_emu_gemv_mma.py (variants, warp schedules, seeded bugs they must catch) and on
a GPU here (`pytest -m gpu`: within a tolerance against the twin, since the tensor core's summation inside an MMA is
not specified; row independence bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.model import quant
from cullama.model.reference import rope_tables
from cullama.runtime.ops import gemv_mma as twin
from cullama.runtime.registry import KernelSpec
from tests.runtime.test_verify import nan, state_at


def rand(rng, *shape, scale=1.0, dtype=np.float32):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def quantized(rng, M, K, bits, group, size=0.05):
    """(qweight, qparams) of a random [M, K] weight of about `size`: uniform codes, zeros anywhere in 0 .. 2**bits
    (both ends present), scales of both signs and never 0."""
    top = 1 << bits
    codes = rng.integers(0, top, (M, K), dtype=np.uint8)  # uint8: the 7B shapes stay small on the host
    zeros = rng.integers(0, top + 1, (M, K // group))
    zeros.flat[0], zeros.flat[-1] = 0, top
    scales = size * 2 / top * rng.choice([-1.0, 1.0], zeros.shape) * (0.5 + rng.random(zeros.shape))
    return quant.pack(codes, bits), quant.params(scales, zeros)


GUARD = np.array([1.5, -2.5, 3.5], np.float32)  # past a one-row output: must stay as it is


def verify_rows(rows: int) -> np.ndarray:
    """The rows table [rows, 2] of one slot's rows at offsets 0 .. rows - 1 (plan.slot_rows_table's rows)."""
    return np.stack([np.zeros(rows, np.int32), np.arange(rows, dtype=np.int32)], axis=1)

EPS = np.float32(1e-5)

# (K, group) per BITS: K an odd multiple of the 16-byte chunk (a partial last k-block, k-blocks not a multiple of the
# 4 warps), groups of one chunk, several, 64, 128 and all of K (group ignored for FP16). Groups of whole k-blocks
# (INT8 64, 128; INT4 128 and the last case's whole row) run the KBLOCK_SCALE form (twin.kblock_scale).
CASES = {16: [(8, 0), (200, 0), (1048, 0)],
         8: [(80, 16), (224, 32), (240, 48), (448, 64), (1408, 128), (272, 272)],
         4: [(96, 32), (192, 64), (1408, 128), (1056, 1056), (1152, 1152)]}
# Odd output sizes: 3 q heads, 1 kv head, hd 6 (15 RoPE pairs: a partial block), M = 37 (a partial last n-tile of the
# second block), ff = 21, V = 45.
HEADS, KV_HEADS, HD, M, FF, V = 3, 1, 8, 37, 21, 45  # HD a power of two (plan.check_supported, rope.cuh)


def spec(name: str, defines) -> KernelSpec:
    return KernelSpec(twin.SOURCE, name, tuple(defines))


def exact(out, ref, what):
    """Bit for bit, NaN poison included."""
    out, ref = np.asarray(out), np.asarray(ref)
    bits = {2: np.uint16, 4: np.uint32}[out.dtype.itemsize]
    same = out.view(bits) == ref.view(bits)
    assert same.all(), f"{what}: {int((~same).sum())} of {same.size} elements differ"


def close(out, ref, rel, what):
    """Within `rel` of the largest |ref| (at least 1); NaN (poison never written) exactly where ref has it."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    poison = np.isnan(ref)
    assert np.isnan(out[poison]).all(), f"{what}: written outside its rows"
    out, ref = out[~poison], ref[~poison]
    assert np.isfinite(out).all(), f"{what}: {int((~np.isfinite(out)).sum())} elements not finite (unwritten?)"
    err = np.abs(out - ref).max(initial=0)
    assert err <= rel * max(1.0, np.abs(ref).max(initial=0)), f"{what}: off by {err}"


def weights(rng, bits, rows, K, group):
    """(W,) FP16 or (qweight, qparams) of a random [rows, K] weight."""
    if bits == 16:
        return (rand(rng, rows, K, scale=0.05, dtype=np.float16),)
    return quantized(rng, rows, K, bits, group)


def out_rows(start: np.ndarray) -> np.ndarray:
    """An output buffer from its rows [T, width]: one row is 1-D with GUARD after it; T > 1 rows are [T, width]."""
    return np.concatenate([start[0], GUARD.astype(start.dtype)]) if start.shape[0] == 1 else start.copy()


def rows_of(out: np.ndarray, T: int, width: int, what: str) -> np.ndarray:
    if T == 1:
        exact(out[width:], GUARD.astype(out.dtype), f"{what} past its row")
    return out[:T * width].reshape(T, width)


# -- one launch of each kernel, and its twin on the same arguments --------------------------------------------------
class Case:
    """Random inputs for every kernel of one (BITS, K, group), for up to 16 token rows."""

    def __init__(self, bits, K, group, seed=0, tokens=16):
        rng = np.random.default_rng(seed)
        self.bits, self.K, self.group = bits, K, group
        self.pos, self.max_seq = 5, 5 + 2 * tokens + 2  # room for row r at pos + r, then 15 rows after it
        self.x, self.inp = rand(rng, tokens, K), rand(rng, tokens, K, dtype=np.float16)  # inp: o_proj's / down's FP16
        self.norm_w = rand(rng, K, dtype=np.float16)
        self.x0 = rand(rng, tokens, M)
        self.norm_next = rand(rng, M, dtype=np.float16)  # the norm gemv_residual prepares its new x with
        self.w_qkv = weights(rng, bits, (HEADS + 2 * KV_HEADS) * HD, K, group)
        self.bias = rand(rng, (HEADS + 2 * KV_HEADS) * HD, dtype=np.float16)
        self.w_res, self.w_gu = weights(rng, bits, M, K, group), weights(rng, bits, 2 * FF, K, group)
        self.w_lm = weights(rng, 16, V, K, group)
        self.rope = np.stack(rope_tables(HD, np.arange(self.max_seq), 10000.0), -1).astype(np.float32)
        if bits == 16:  # one signature: qparams and group unread
            self.w_qkv, self.w_res, self.w_gu = ((w[0], w[0]) for w in (self.w_qkv, self.w_res, self.w_gu))
        self.g = (np.int32(group),)

    def run(self, fn, defines, rows, pos=None, form="prep"):
        """{output: array} of every kernel on token rows `rows` (a list of indices into the case's rows), by `fn`:
        a launcher (spec, grid, block, args), or None for the twins. pos: the first row's position. form: "prep",
        the RMSNorm kernels on the input prepared from x as gemv_residual prepares it (twin.prepare); "x", the logits
        on x and the norm weights (gemv_logits_x, FP16 only: qkv and gate_up always read the prepared input)."""
        T, K = len(rows), self.K
        pos = self.pos if pos is None else pos
        x, inp, x0 = self.x[rows], self.inp[rows], self.x0[rows]
        prepared = twin.prepare(x, self.norm_w, K)
        suffix, norm_in = ("", prepared) if form == "prep" else ("_x", (x, self.norm_w))
        rpb = twin.rows_per_block(defines)
        out = {}

        def call(name, grid, args):
            if fn is None:
                getattr(twin, name)(*args)
            else:
                fn(spec(name, defines), (grid,), twin.THREADS, args)

        q = nan(T, HEADS * HD)
        kc, vc = (nan(KV_HEADS, self.max_seq, HD, dtype=np.float16) for _ in range(2))
        pairs = (HEADS + 2 * KV_HEADS) * HD // 2
        call("gemv_qkv_rope", -(-pairs // (rpb // 2)),
             (*prepared, *self.w_qkv, self.bias, q, kc, vc, self.rope, state_at(pos), verify_rows(T), np.int32(K),
              np.int32(HEADS), np.int32(KV_HEADS), np.int32(HD), np.int32(self.max_seq), EPS, *self.g))
        out["q"], out["k"], out["v"] = q, kc[:, pos:pos + T], vc[:, pos:pos + T]
        out["k outside"] = np.delete(kc, range(pos, pos + T), axis=1)
        out["v outside"] = np.delete(vc, range(pos, pos + T), axis=1)
        xr = out_rows(x0)
        xn, ssp = nan(T, M, dtype=np.float16), nan(T, -(-M // twin.SS_SPAN))
        call("gemv_residual", -(-M // rpb), (inp, *self.w_res, xr, self.norm_next, xn, ssp, np.int32(M), np.int32(K),
                                             *self.g))
        out["residual"] = rows_of(xr, T, M, "gemv_residual")
        out["residual xn"], out["residual ssp"] = xn, ssp
        h = out_rows(nan(T, FF, dtype=np.float16))
        call("gemv_gate_up_silu", -(-FF // (rpb // 2)),
             (*prepared, *self.w_gu, h, np.int32(FF), np.int32(K), EPS, *self.g))
        out["h"] = rows_of(h, T, FF, "gemv_gate_up_silu")
        if self.bits == 16:
            stride = -(-V // 4) * 4
            logits = np.full(T * stride + 3, np.nan, np.float32)
            call("gemv_logits" + suffix, -(-V // rpb), (*norm_in, *self.w_lm, logits, np.int32(V), np.int32(K), EPS))
            out["logits"] = logits
        return out


def check_against_twin(launch, bits, tokens, cases=None, seed=0, tolerance=None, forms=None):
    """Every kernel of (BITS, TOKENS) against its twin on each (K, group) case, the logits in both input forms
    (`forms`, default both where there are logits: FP16): bit for bit (tolerance None: the executor), or within
    `tolerance` relative (a GPU), NaN-poisoned outputs
    and what lies outside the rows exact."""
    forms = forms or (("prep", "x") if bits == 16 else ("prep",))
    for (K, group), form in [(c, f) for c in cases or CASES[bits] for f in forms]:
        case = Case(bits, K, group, seed=seed + K + group + tokens)
        rows = list(range(tokens))
        defines = twin.defines(bits, tokens, group)
        got, ref = case.run(launch, defines, rows, form=form), case.run(None, defines, rows, form=form)
        for name in got:
            what = f"{name}, BITS={bits} TOKENS={tokens} K={K} group={group} ({form})"
            if tolerance is None or "outside" in name:
                exact(got[name], ref[name], what)
            else:
                close(got[name], ref[name], tolerance if name not in ("k", "v") else 2e-3, what)


def check_row_independence(launch, bits, tokens, K=None, group=None, seed=1, form="prep"):
    """Row r of a TOKENS-row launch equals bit for bit the same row launched alone (TOKENS 1, at its position) and
    the same row as row 0 of a TOKENS-row launch whose other rows are different (the RMSNorm kernels' `form`: Case.run)."""
    K, group = (K, group) if K else CASES[bits][1]
    case = Case(bits, K, group, seed=seed)
    rows = list(range(tokens))
    together = case.run(launch, twin.defines(bits, tokens, group), rows, form=form)
    for r in rows:
        alone = case.run(launch, twin.defines(bits, 1, group), [r], pos=case.pos + r, form=form)
        others = [r] + [(r + 1 + i) % 16 for i in range(tokens - 1)]  # row r first, other rows of the case after it
        first = case.run(launch, twin.defines(bits, tokens, group), others, pos=case.pos + r, form=form)
        for name in ("q", "k", "v", "residual", "residual xn", "residual ssp", "h", "logits"):
            if name not in together:
                continue
            if name == "logits":
                stride = -(-V // 4) * 4
                row, one, lead = (together[name][r * stride: r * stride + V], alone[name][:V], first[name][:V])
            elif name in ("k", "v"):
                row, one, lead = together[name][:, r], alone[name][:, 0], first[name][:, 0]
            else:
                row, one, lead = together[name][r], alone[name][0], first[name][0]
            exact(row, one, f"{name}: row {r} of {tokens} against the row alone (BITS={bits})")
            exact(row, lead, f"{name}: row {r} of {tokens} against row 0 of other rows (BITS={bits})")


# -- CPU: the twins against the reference's arithmetic -----------------------------------------------------------------
@pytest.mark.parametrize("bits", twin.FORMATS)
def test_twins_are_the_reference_within_fp16_rounding(bits):
    """The twins compute W · rmsnorm(x) with A = fp16(x * norm_w) and B the FP16 weight: within FP16 rounding of the
    float64 product of the exact weights."""
    K, group = CASES[bits][2]
    case = Case(bits, K, group, seed=3)
    ref = case.run(None, twin.defines(bits, 4, group), [0, 1, 2, 3])
    x = case.x[:4].astype(np.float64)
    w = (case.w_res[0].astype(np.float64) if bits == 16 else
         quant.dequantize(*case.w_res, bits).astype(np.float64))
    want = case.x0[:4] + case.inp[:4].astype(np.float64) @ w.T
    close(ref["residual"], want, 2e-3, "residual against float64")
    w = (case.w_gu[0].astype(np.float64) if bits == 16 else quant.dequantize(*case.w_gu, bits).astype(np.float64))
    n = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-5) * case.norm_w.astype(np.float64)
    y = n @ w.T
    want = y[:, :FF] / (1 + np.exp(-y[:, :FF])) * y[:, FF:]
    close(ref["h"], want, 2e-3, "gate_up against float64")


@pytest.mark.parametrize("bits", twin.FORMATS)
def test_the_prepared_input_and_x_give_the_same_outputs_within_float32_sums(bits):
    """The logits on the prepared input (xn, Σ x² in parts) and on x (gemv_logits_x): the same A, Σ x² summed in
    another order, so within a few float32 ulps of the scale (qkv and gate_up read the prepared input either way)."""
    K, group = CASES[bits][2]
    case = Case(bits, K, group, seed=4)
    prep = case.run(None, twin.defines(bits, 3, group), [0, 1, 2], form="prep")
    raw = case.run(None, twin.defines(bits, 3, group), [0, 1, 2], form="x")
    for name in ("q", "h", "logits"):
        if name in prep:
            close(prep[name], raw[name], 1e-5, f"{name}: prepared against x (BITS={bits})")


def test_prepare_is_what_the_residual_writes():
    """twin.prepare: xn = fp16(x * norm_w), and part b the fmaf chain of x^2 over rows 32 b .. (the last part short)."""
    rng = np.random.default_rng(5)
    x, norm_w = rand(rng, 2, 70), rand(rng, 70, dtype=np.float16)
    xn, ssp = twin.prepare(x, norm_w, 70)
    assert xn.dtype == np.float16 and (xn == (x * norm_w.astype(np.float32)).astype(np.float16)).all()
    assert ssp.shape == (2, 3)
    np.testing.assert_allclose(ssp, [[(x[t, 32 * b:32 * b + 32].astype(np.float64) ** 2).sum() for b in range(3)]
                                     for t in range(2)], rtol=1e-5)
    assert twin.prepared_ss(ssp, 70) == pytest.approx((x.astype(np.float64) ** 2).sum(axis=1), rel=1e-5)


def test_fma_emulation_rounds_once():
    """_fma32 is fmaf's one rounding, also where a double sum lands on a float32 tie."""
    a = np.float32(1 + 2 ** -12)
    c = np.float32(-1)
    got = twin._fma32(np.array([a]), np.array([a]), np.array([c]))[0]  # (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24: exact
    assert got == np.float32(2 ** -11 + 2 ** -24)
    rng = np.random.default_rng(0)
    x, y, z = (rng.standard_normal(10000).astype(np.float32) for _ in range(3))
    ref = np.array([np.float32(float(np.float64(p) * q + r)) for p, q, r in zip(x, y, z)], np.float32)
    assert (twin._fma32(x, y, z) == ref).mean() > 0.999


def test_defines_and_rows():
    assert twin.defines(4, 16) == (("BITS", 4), ("TOKENS", 16))
    assert twin.rows_per_block(twin.defines(8, 3)) == 32
    with pytest.raises(ValueError, match="TOKENS must be 1..16"):
        twin.defines(16, 17)
    assert twin.defines(4, 2, 128) == (("BITS", 4), ("TOKENS", 2), ("KBLOCK_SCALE", 1))  # whole k-blocks a group
    assert twin.defines(4, 2, 1024) == twin.defines(4, 2, 128) and twin.defines(8, 1, 64)[-1] == ("KBLOCK_SCALE", 1)
    assert twin.defines(4, 2, 64) == (("BITS", 4), ("TOKENS", 2)) and twin.defines(8, 1, 48) == (("BITS", 8), ("TOKENS", 1))
    assert twin.defines(16, 1, 128) == (("BITS", 16), ("TOKENS", 1))
    assert len(twin.VARIANTS) == 16 * 5  # FP16; INT8 and INT4, each with and without KBLOCK_SCALE


# -- GPU -----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("bits", twin.FORMATS)
@pytest.mark.parametrize("tokens", [1, 2, 5, 9, 16])
def test_gpu_against_twin(bits, tokens, kernels):
    from tests.runtime.test_verify import gpu_launcher
    check_against_twin(gpu_launcher(kernels), bits, tokens, tolerance=2e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("bits", twin.FORMATS)
@pytest.mark.parametrize("tokens", [2, 9, 16])
def test_gpu_rows_are_independent(bits, tokens, kernels):
    from tests.runtime.test_verify import gpu_launcher
    check_row_independence(gpu_launcher(kernels), bits, tokens)
