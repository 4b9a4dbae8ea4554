"""Attention: the twins against a plain float64 softmax attention, the kernels' compile, and (GPU) the
kernels against the twins on fresh random inputs with NaN-poisoned outputs."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.runtime import plan as plans
from cullama.model.config import preset
from cullama.model.layout import device_config
from cullama.runtime.ops import attention as ops
from cullama.runtime.registry import KernelSpec, compile_module

from tests.conftest import poisoned

THREADS = 128
ONE_ROW = np.zeros((1, 2), np.int32)  # a decode step's rows table: one row, slot 0, offset 0

# (head_dim, group, kv_heads, n keys, splits): n = 1 and n < splits leave splits empty.
DECODE_CASES = [(8, 2, 4, 1, 8), (32, 4, 2, 7, 8), (128, 1, 3, 33, 4), (128, 2, 2, 100, 32), (32, 1, 2, 100, 1),
                (8, 4, 2, 33, 5), (16, 8, 1, 517, 3), (64, 4, 2, 1000, 8)]
# (head_dim, group, kv_heads, start, rows, buffer rows, ROWS_Q): start > 0 is a later chunk of a prompt;
# rows not a multiple of ROWS_Q leaves the last block part empty; ROWS_Q as the plan picks it
# (plans.attention_rows_q: max(1, 4 // group)) except the last three, which tile more.
PREFILL_CASES = [(8, 2, 4, 0, 1, 4, 2), (32, 4, 2, 0, 33, 40, 1), (128, 1, 2, 17, 7, 8, 4), (64, 8, 1, 100, 29, 32, 1),
                 (16, 1, 3, 5, 100, 100, 4), (128, 1, 3, 0, 37, 40, 4), (64, 2, 2, 61, 19, 24, 2),
                 (8, 8, 1, 3, 5, 8, 1), (32, 1, 2, 250, 6, 8, 4), (128, 1, 2, 9, 21, 24, 8), (32, 4, 2, 1, 11, 12, 2),
                 (16, 2, 2, 0, 13, 16, 4)]
# Sliding windows (Mistral): (head_dim, group, kv_heads, n keys, splits, window) for decode, window 1 (the key
# itself), shorter than a split, across splits, of the whole context, longer than it; and (head_dim, group,
# kv_heads, start, rows, buffer rows, ROWS_Q, window) for prefill, with the window's edge inside a block of rows.
DECODE_WINDOW_CASES = [(32, 4, 2, 100, 8, 16), (64, 4, 2, 37, 8, 1), (128, 7, 1, 1000, 32, 64), (8, 2, 2, 33, 5, 33),
                       (32, 1, 2, 20, 4, 40), (128, 3, 2, 300, 4, 7), (16, 5, 1, 61, 8, 60)]
PREFILL_WINDOW_CASES = [(32, 2, 2, 0, 40, 40, 2, 16), (32, 4, 2, 37, 29, 32, 1, 5), (64, 1, 1, 100, 21, 24, 4, 1),
                        (128, 6, 1, 3, 50, 52, 1, 17), (16, 1, 2, 9, 13, 16, 8, 64), (8, 8, 1, 0, 9, 12, 1, 3)]


def reference(q, k, v, scale):
    """softmax(q k^T * scale) v in float64. q [heads, hd]; k, v [kv_heads, n, hd] -> [heads, hd]."""
    group = q.shape[0] // k.shape[0]
    k = np.repeat(k.astype(np.float64), group, axis=0)  # [heads, n, hd]
    v = np.repeat(v.astype(np.float64), group, axis=0)
    s = np.einsum("hd,hkd->hk", q.astype(np.float64), k) * scale
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return np.einsum("hk,hkd->hd", p / p.sum(axis=1, keepdims=True), v)


def reference_part(q, k, v, scale, s, splits, n, first=0):
    """Split s's (acc [heads, hd], m, l), unnormalised, over keys [first + s c, first + (s + 1) c) below n,
    c = ceil((n - first) / splits)."""
    chunk = -(-(n - first) // splits)
    begin = min(first + s * chunk, n)
    end = min(begin + chunk, n)
    if begin == end:
        return np.zeros(q.shape), np.full(q.shape[0], -np.inf), np.zeros(q.shape[0])
    group = q.shape[0] // k.shape[0]
    kk = np.repeat(k[:, begin:end].astype(np.float64), group, axis=0)
    vv = np.repeat(v[:, begin:end].astype(np.float64), group, axis=0)
    sc = np.einsum("hd,hkd->hk", q.astype(np.float64), kk) * scale
    m = sc.max(axis=1)
    p = np.exp(sc - m[:, None])
    return np.einsum("hk,hkd->hd", p, vv), m, p.sum(axis=1)


def decode_inputs(hd, group, kv_heads, n, splits, seed=0):
    """q [heads*hd] f32, caches [kv_heads, max_seq, hd] f16 (random beyond n too: must be ignored), state."""
    rng = np.random.default_rng(seed)
    heads, max_seq = kv_heads * group, n + 13
    q = (2 * rng.standard_normal(heads * hd)).astype(np.float32)
    k = rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16)
    v = rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16)
    state = np.zeros(8, np.int32)
    state[0] = n - 1
    return q, k, v, state, max_seq, np.float32(1 / np.sqrt(hd))


def prefill_inputs(hd, group, kv_heads, start, rows, buffer_rows, seed=0):
    rng = np.random.default_rng(seed)
    heads, max_seq = kv_heads * group, start + rows + 5
    q_rows = (2 * rng.standard_normal((buffer_rows, heads * hd))).astype(np.float16)
    k = rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16)
    v = rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16)
    return q_rows, k, v, max_seq, np.float32(1 / np.sqrt(hd))


def run_decode_twin(q, k, v, state, max_seq, scale, splits, window=None):
    heads, hd = q.size // k.shape[2], k.shape[2]
    part = np.full((heads, splits, hd + 2), np.nan, np.float32)
    count = np.zeros(k.shape[0], np.uint32)
    out = np.full(heads * hd, np.nan, np.float16)  # FP16: o_proj's input
    ops.attention_decode(q, k, v, part, count, out, state, ONE_ROW, max_seq, scale, window or max_seq,
                         grid=(k.shape[0], splits, 1))
    return part, count, out


def prefill_grid(kv_heads, rows, rows_q):
    return kv_heads, -(-rows // rows_q), 1


def run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale, rows_q=1, window=None):
    out_rows = np.full(q_rows.shape, np.nan, np.float16)
    ops.attention_prefill(q_rows, k, v, out_rows, start, rows, max_seq, scale, window or max_seq,
                          grid=prefill_grid(k.shape[0], rows, rows_q))
    return out_rows


def prefill_reference(q_rows, k, v, start, rows, scale, window=None):
    hd = k.shape[2]
    first = lambda r: max(0, start + r + 1 - window) if window else 0  # noqa: E731
    return np.stack([reference(q_rows[r].reshape(-1, hd), k[:, first(r):start + r + 1], v[:, first(r):start + r + 1],
                               scale).reshape(-1) for r in range(rows)])


# -- CPU: the twins are the specification ---------------------------------------------------------
@pytest.mark.parametrize("hd,group,kv_heads,n,splits", DECODE_CASES)
def test_decode_twin(hd, group, kv_heads, n, splits):
    q, k, v, state, max_seq, scale = decode_inputs(hd, group, kv_heads, n, splits)
    part, count, out = run_decode_twin(q, k, v, state, max_seq, scale, splits)
    qh = q.reshape(-1, hd)
    np.testing.assert_allclose(out.reshape(-1, hd), reference(qh, k[:, :n], v[:, :n], float(scale)),
                               rtol=1e-3, atol=1e-4)  # out is FP16 (o_proj's input): its rounding
    for s in range(splits):  # each split's unnormalised state, empty splits included
        acc, m, l = reference_part(qh, k, v, float(scale), s, splits, n)
        np.testing.assert_allclose(part[:, s, :hd], acc, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(part[:, s, hd], m, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(part[:, s, hd + 1], l, rtol=1e-4)
    assert (count == 0).all()


@pytest.mark.parametrize("hd,group,kv_heads,n,splits,window", DECODE_WINDOW_CASES)
def test_decode_twin_sliding_window(hd, group, kv_heads, n, splits, window):
    """Only the last `window` keys, n - window .. n - 1, and the splits divide those alone (a long context costs
    the window); a window of the whole context or longer is full attention, bit for bit."""
    q, k, v, state, max_seq, scale = decode_inputs(hd, group, kv_heads, n, splits)
    part, _, out = run_decode_twin(q, k, v, state, max_seq, scale, splits, window)
    first, qh = max(0, n - window), q.reshape(-1, hd)
    np.testing.assert_allclose(out.reshape(-1, hd), reference(qh, k[:, first:n], v[:, first:n], float(scale)),
                               rtol=1e-3, atol=1e-4)
    for s in range(splits):
        acc, m, l = reference_part(qh, k, v, float(scale), s, splits, n, first)
        np.testing.assert_allclose(part[:, s, :hd], acc, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(part[:, s, hd], m, rtol=1e-5, atol=1e-5)
    if window >= n:
        np.testing.assert_array_equal(out, run_decode_twin(q, k, v, state, max_seq, scale, splits)[2])


def test_decode_twin_empty_splits():
    """n smaller than splits: the tail splits are empty (m = -inf, l = 0) and weigh nothing."""
    q, k, v, state, max_seq, scale = decode_inputs(32, 2, 2, 3, 8)
    part, _, out = run_decode_twin(q, k, v, state, max_seq, scale, 8)
    assert (part[:, 3:, 32] == -np.inf).all() and (part[:, 3:, 33] == 0).all() and (part[:, 3:, :32] == 0).all()
    assert np.isfinite(part[:, :3]).all() and np.isfinite(out).all()


def test_decode_twin_ignores_split_count():
    q, k, v, state, max_seq, scale = decode_inputs(64, 4, 2, 77, 1)
    outs = [run_decode_twin(q, k, v, state, max_seq, scale, splits)[2] for splits in (1, 2, 7, 32, 100)]
    for out in outs[1:]:  # FP16 outputs: one rounding apart where the float32 sums differ
        np.testing.assert_allclose(out, outs[0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("hd,group,kv_heads,start,rows,buffer_rows,rows_q", PREFILL_CASES)
def test_prefill_twin(hd, group, kv_heads, start, rows, buffer_rows, rows_q):
    q_rows, k, v, max_seq, scale = prefill_inputs(hd, group, kv_heads, start, rows, buffer_rows)
    out_rows = run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale, rows_q)
    expected = prefill_reference(q_rows, k, v, start, rows, float(scale))
    np.testing.assert_allclose(out_rows[:rows].astype(np.float64), expected, rtol=2e-3, atol=2e-3)
    assert np.isnan(out_rows[rows:]).all()  # rows >= n_rows are not written, whatever the grid covers


def test_prefill_twin_rows_come_from_n_rows():
    """The grid's second axis counts blocks of ROWS_Q rows: the twin's rows are n_rows, whatever it is."""
    q_rows, k, v, max_seq, scale = prefill_inputs(32, 2, 2, 3, 13, 16)
    outs = [run_prefill_twin(q_rows, k, v, 3, 13, max_seq, scale, rows_q) for rows_q in (1, 2, 4, 8)]
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])


def test_prefill_twin_is_causal():
    """A row's output does not change when keys after its position change."""
    q_rows, k, v, max_seq, scale = prefill_inputs(32, 2, 2, 4, 10, 10)
    before = run_prefill_twin(q_rows, k, v, 4, 10, max_seq, scale)
    k2, v2 = k.copy(), v.copy()
    k2[:, 4 + 6:], v2[:, 4 + 6:] = 7, -7  # keys of positions >= 10: row 5 (position 9) must not see them
    after = run_prefill_twin(q_rows, k2, v2, 4, 10, max_seq, scale)
    np.testing.assert_array_equal(before[:6], after[:6])
    assert not np.array_equal(before[6:], after[6:])


@pytest.mark.parametrize("hd,group,kv_heads,start,rows,buffer_rows,rows_q,window", PREFILL_WINDOW_CASES)
def test_prefill_twin_sliding_window(hd, group, kv_heads, start, rows, buffer_rows, rows_q, window):
    q_rows, k, v, max_seq, scale = prefill_inputs(hd, group, kv_heads, start, rows, buffer_rows)
    out_rows = run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale, rows_q, window)
    expected = prefill_reference(q_rows, k, v, start, rows, float(scale), window)
    np.testing.assert_allclose(out_rows[:rows].astype(np.float32), expected, rtol=2e-3, atol=2e-3)
    assert np.isnan(out_rows[rows:].astype(np.float32)).all()
    full = run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale, rows_q)
    seen_whole = start + np.arange(rows) < window  # rows whose window reaches back to key 0
    np.testing.assert_array_equal(out_rows[:rows][seen_whole], full[:rows][seen_whole])
    assert (out_rows[:rows][~seen_whole] != full[:rows][~seen_whole]).any() or seen_whole.all()


def test_prefill_row_matches_decode():
    """Prefill row r at position start + r is the decode step at that position."""
    hd, group, kv_heads, start, rows = 32, 4, 2, 9, 6
    q_rows, k, v, max_seq, scale = prefill_inputs(hd, group, kv_heads, start, rows, rows)
    out_rows = run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale)
    state = np.zeros(8, np.int32)
    for r in range(rows):
        state[0] = start + r
        _, _, out = run_decode_twin(q_rows[r].astype(np.float32), k, v, state, max_seq, scale, 4)
        np.testing.assert_allclose(out_rows[r].astype(np.float32), out, rtol=1e-3, atol=1e-3)
    windowed = run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale, window=5)  # and with a window
    for r in range(rows):
        state[0] = start + r
        _, _, out = run_decode_twin(q_rows[r].astype(np.float32), k, v, state, max_seq, scale, 4, window=5)
        np.testing.assert_allclose(windowed[r].astype(np.float32), out, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("defines", ops.VARIANTS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d))
def test_compiles_without_spills(defines):
    resources = compile_module(ops.SOURCE, defines, "sm_90").resources
    assert set(resources) == {"attention_decode", "attention_prefill"}
    for name, res in resources.items():
        assert not res.spills, (name, res)
    d = dict(defines)
    if d["ROWS_Q"] * d["GROUP"] <= plans.ATTENTION_PREFILL_QUERIES:  # the plan's tiling: 4 blocks per SM
        assert resources["attention_prefill"].registers <= 128, resources["attention_prefill"]


def test_variants_cover_every_head_dim_and_group():
    chosen = [dict(d) for d in ops.VARIANTS]
    assert {d["HEAD_DIM"] for d in chosen} == {8, 16, 32, 64, 128}
    assert {d["GROUP"] for d in chosen} == set(range(1, 9))
    assert len(chosen) < 20
    for hd, group in ((64, 4), (128, 4), (64, 8), (128, 3), (128, 5), (128, 6), (128, 7), (128, 8)):
        # LLaMA-3.2-1B, LLaMA-3-8B and Mistral-7B, TinyLlama, LLaMA-3.2-3B, Qwen2.5 (14B, 1.5B, 7B), LLaMA-3-70B
        assert any((d["HEAD_DIM"], d["GROUP"]) == (hd, group) for d in chosen), (hd, group)
    for d in chosen[:11]:  # the plan's own ROWS_Q for every (HEAD_DIM, GROUP) listed
        assert d["ROWS_Q"] == max(1, plans.ATTENTION_PREFILL_QUERIES // d["GROUP"]), d


@pytest.mark.parametrize("name", ["llama-2-7b", "tiny"])
@pytest.mark.parametrize("n", [1, 3, 4, 37, 256])
def test_prefill_launch_tiles_rows(name, n):
    """The plan's attention_prefill: ROWS_Q only in its spec (not decode's), a compiled variant, and a
    grid whose ceil(n / ROWS_Q) blocks of ROWS_Q rows cover the n rows, none of them empty."""
    cfg = device_config(preset(name))
    launches = {l.spec.name: l for l in plans.prefill_plan(cfg, 512, 64, n, "none").launches}
    launch = launches["attention_prefill"]
    rows_q = dict(launch.spec.defines)["ROWS_Q"]
    assert rows_q == plans.attention_rows_q(cfg) == max(1, 4 // cfg.group_size)
    assert launch.spec.defines in ops.VARIANTS
    assert launch.grid == (cfg.num_kv_heads, -(-n // rows_q), 1)
    assert (launch.grid[1] - 1) * rows_q < n <= launch.grid[1] * rows_q
    assert int(launch.args[5]) == n  # n_rows
    decode = {l.spec.name: l for l in plans.decode_plan(cfg, 512).launches}["attention_decode"]
    assert "ROWS_Q" not in dict(decode.spec.defines)


# -- GPU: the kernels against the twins -----------------------------------------------------------
def _spec(name, hd, group, rows_q=None):
    defines = (("HEAD_DIM", hd), ("GROUP", group)) + ((("ROWS_Q", rows_q),) if rows_q else ())
    return KernelSpec("attention.cu", name, defines)


GPU_DECODE_CASES = [c + (None,) for c in DECODE_CASES + [(128, 1, 4, 4096, 8), (128, 8, 2, 3001, 32)]]
GPU_DECODE_CASES += DECODE_WINDOW_CASES + [(128, 4, 8, 8000, 32, 4096)]  # Mistral-7B's window at 8000 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group,kv_heads,n,splits,window", GPU_DECODE_CASES)
def test_decode_kernel(kernels, hd, group, kv_heads, n, splits, window):
    import cupy as cp

    q, k, v, state, max_seq, scale = decode_inputs(hd, group, kv_heads, n, splits, seed=n)
    part, _, out = run_decode_twin(q, k, v, state, max_seq, scale, splits, window)
    heads = kv_heads * group
    d_part = poisoned(cp, part.shape, np.float32)
    d_out = poisoned(cp, out.shape, np.float16)
    d_count = cp.zeros(kv_heads, np.uint32)
    args = (cp.asarray(q), cp.asarray(k), cp.asarray(v), d_part, d_count, d_out, cp.asarray(state),
            cp.asarray(ONE_ROW), np.int32(max_seq), np.float32(scale), np.int32(window or max_seq))
    fn = kernels.function(_spec("attention_decode", hd, group))
    fn((kv_heads, splits), (THREADS,), args)
    first = d_out.get()
    assert (d_count.get() == 0).all()  # reset by the last block: the next launch starts clean
    np.testing.assert_allclose(d_part.get(), part, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(first, out, rtol=1e-3, atol=1e-4)
    assert first.shape == (heads * hd,)
    d_out.fill(np.nan)
    fn((kv_heads, splits), (THREADS,), args)  # a second launch: same bits (fixed combine order)
    np.testing.assert_array_equal(d_out.get(), first)
    assert (d_count.get() == 0).all()


def _run_prefill_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale, hd, group, rows_q, extra_blocks=0,
                        window=None):
    import cupy as cp

    kv_heads = k.shape[0]
    d_out = poisoned(cp, q_rows.shape, np.float16)
    grid = prefill_grid(kv_heads, rows, rows_q)
    kernels.function(_spec("attention_prefill", hd, group, rows_q))(
        (grid[0], grid[1] + extra_blocks), (THREADS,),
        (cp.asarray(q_rows), cp.asarray(k), cp.asarray(v), d_out, np.int32(start), np.int32(rows),
         np.int32(max_seq), np.float32(scale), np.int32(window or max_seq)))
    return d_out.get()


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group,kv_heads,start,rows,buffer_rows,rows_q,window",
                         [c + (None,) for c in PREFILL_CASES] + PREFILL_WINDOW_CASES)
def test_prefill_kernel(kernels, hd, group, kv_heads, start, rows, buffer_rows, rows_q, window):
    q_rows, k, v, max_seq, scale = prefill_inputs(hd, group, kv_heads, start, rows, buffer_rows, seed=rows)
    expected = run_prefill_twin(q_rows, k, v, start, rows, max_seq, scale, rows_q, window)
    got = _run_prefill_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale, hd, group, rows_q, window=window)
    np.testing.assert_allclose(got[:rows].astype(np.float32), expected[:rows].astype(np.float32),
                               rtol=2e-3, atol=2e-3)
    assert not np.isnan(got[:rows].astype(np.float32)).any()  # every (row, head) written
    assert np.isnan(got[rows:].astype(np.float32)).all()  # rows >= n_rows untouched


@pytest.mark.gpu
def test_prefill_kernel_tiling(kernels):
    """ROWS_Q changes which block computes a row (and the keys per batch), not the result: 1, 2, 4 and 8
    rows a block agree; a grid taller than needed (whole blocks past n_rows) gives the same bits and
    writes nothing more."""
    hd, group, start, rows = 64, 1, 40, 23
    q_rows, k, v, max_seq, scale = prefill_inputs(hd, group, 3, start, rows, 32, seed=5)
    run = lambda rows_q, extra=0: _run_prefill_kernel(kernels, q_rows, k, v, start, rows, max_seq, scale,  # noqa: E731
                                                      hd, group, rows_q, extra)
    base = run(4)
    for rows_q in (1, 2, 8):
        np.testing.assert_allclose(run(rows_q)[:rows].astype(np.float32), base[:rows].astype(np.float32),
                                   rtol=2e-3, atol=2e-3)
    taller = run(4, extra=3)
    np.testing.assert_array_equal(taller[:rows], base[:rows])
    assert np.isnan(taller[rows:].astype(np.float32)).all()
