"""A batched decode step's kernels: row r of a launch over the rows of several sequence slots (the rows table,
kernels_cu/common.cuh) equals a one-row launch of that slot at that position, bit for bit, whatever the other
rows are: gemv_qkv_rope (FP16 and quantized) writing each row's K and V in its own slot at its position,
attention_decode over each row's own slot's keys, sample with each row's own slot's parameters, seen
flags, state and counter. Twins here; the real kernels on the CPU executor in test_batch_kernels_emu.py, and on
a GPU (marker gpu) below."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.runtime import plan as plans, sampling
from cullama.runtime.ops import attention as attention_twin, gemv_mma as gemv_twin, sampling as sample_twin
from cullama.model.reference import rope_tables
from cullama.runtime.registry import KernelSpec
from cullama.runtime.sampling import SamplingParams

from tests.runtime.ops.test_gemv_mma import quantized
from tests.runtime.ops.test_sampling_kernel import assert_prepared, explained, next_input
from tests.runtime.test_verify import at_row_stride, gpu_launcher, nan, state_at

STRIDE_PAD = 3  # seen rows wider than V (seen_stride = V rounded up to 4, and then some): the stride is honoured


def twin_launcher():
    """launch(spec, grid, block, args) through the kernels' NumPy twins."""
    def launch(spec, grid, block, args):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        twins = {"sample": sample_twin.sample, "attention_decode": attention_twin.attention_decode}
        values = [a.item() if isinstance(a, np.generic) else a for a in args]
        if spec.name == "gemv_qkv_rope":
            gemv_twin.gemv_qkv_rope(*values)
            return
        twins[spec.name](*values, grid=grid)
    return launch


def states(positions, steps=None, seeds=None, top_ks=None) -> np.ndarray:
    """state [slots, 8]: slot s at positions[s], its own step counter, seed and top-k."""
    n = len(positions)
    steps, seeds, top_ks = steps or [0] * n, seeds or [0] * n, top_ks or [0] * n
    return np.stack([state_at(p, st, sd, k) for p, st, sd, k in zip(positions, steps, seeds, top_ks)])


def batch_rows(slots) -> np.ndarray:
    """A batched step's rows table [B, 2]: row r is slot slots[r]'s next token (offset 0)."""
    return np.array([[s, 0] for s in slots], np.int32)


# -- gemv_qkv_rope: each row's RoPE angle and KV cache row are its slot's -----------------------------------------
QKV_CASES = [16, 4, 8]  # BITS of gemv_mma.cu: FP16, INT4 and INT8 (one kernel, one rows addressing)


def qkv_spec(bits, tokens: int) -> KernelSpec:
    return plans.gemv("gemv_qkv_rope", tokens, bits)


def check_qkv_batch(launch, bits, positions=(7, 0, 30, 12), table=((2, 0), (0, 0), (3, 0), (1, 0), (2, 1)),
                    d=64, heads=3, kv_heads=1, hd=16, seed=0):
    """gemv_qkv_rope (with a q|k|v bias) over rows of several slots (the table: any order, a slot left out, the last
    row a second row of slot 2 at offset 1) against one-row launches of each row's slot: q bit for bit, and each
    row's K and V in its slot's cache at its position, nothing else of any cache written (caches NaN-poisoned)."""
    rng = np.random.default_rng(seed)
    table = np.array(table, np.int32)
    rows, slots, max_seq = len(table), len(positions), max(positions) + 4
    x = rng.standard_normal((rows, d)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(d)).astype(np.float16)
    M = (heads + 2 * kv_heads) * hd
    if bits == 16:  # one signature: W passed twice (qparams unread) and group 0, as the plans do
        W = rng.standard_normal((M, d)).astype(np.float16) * np.float16(0.1)
        weights, group = (W, W), (np.int32(0),)
    else:
        weights, group = quantized(rng, M, d, bits, 32), (np.int32(32),)
    per_block, threads = plans.gemv_rows(rows), plans.GEMV_THREADS
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
    bias = (0.5 * rng.standard_normal(M)).astype(np.float16)  # [q|k|v rows] (Qwen2's; every row adds it alike)
    state = states(list(positions))
    shape = (np.int32(d), np.int32(heads), np.int32(kv_heads), np.int32(hd), np.int32(max_seq), np.float32(1e-5))

    def run(xs, rows_table, per_block):
        n = len(rows_table)
        q = nan(n, heads * hd)
        caches = [nan(slots, kv_heads, max_seq, hd, dtype=np.float16) for _ in range(2)]
        xn, ssp = gemv_twin.prepare(xs, g, d)  # the input as gemv_residual prepares it
        launch(qkv_spec(bits, n), (-(-M // per_block),), threads,
               (xn, ssp, *weights, bias, q, *caches, rope, state.copy(), rows_table, *shape, *group))
        return q, caches

    q, (k, v) = run(x, table, per_block)
    one_row = plans.gemv_rows(1)  # the decode step's
    written = np.zeros(k.shape[:1] + k.shape[2:3], bool)  # [slots, max_seq]
    for r, (slot, offset) in enumerate(table):
        q1, (k1, v1) = run(x[r:r + 1], table[r:r + 1], one_row)
        pos = positions[slot] + offset
        np.testing.assert_array_equal(q[r], q1[0], err_msg=f"q of row {r}")
        for name, many, single in (("k", k, k1), ("v", v, v1)):
            np.testing.assert_array_equal(many[slot, :, pos], single[slot, :, pos], err_msg=f"{name} of row {r}")
        written[slot, pos] = True
    for cache in (k, v):  # no other slot or position written
        assert np.isnan(cache.transpose(0, 2, 1, 3)[~written]).all()
        assert not np.isnan(cache.transpose(0, 2, 1, 3)[written]).any()


@pytest.mark.parametrize("bits", QKV_CASES, ids=["fp16", "int4", "int8"])
def test_qkv_twin_batch_rows_are_one_row_launches(bits):
    check_qkv_batch(twin_launcher(), bits)


# -- attention_decode ----------------------------------------------------------------------------------------
# (head_dim, group, kv_heads, splits, each slot's position, the rows table): rows in another order than the
# slots, slots left out, lengths that fill fewer splits than there are and ones that take several batches; the
# last case mixes a verify step's rows of one slot with another slot's row (rows x (k + 1)).
ATTENTION_BATCHES = [
    (8, 2, 4, 8, [0, 5, 17], [[2, 0], [0, 0], [1, 0]]),
    (32, 4, 2, 8, [40, 3, 0, 9, 120], [[4, 0], [1, 0], [3, 0]]),
    (128, 1, 3, 4, [300, 7], [[1, 0], [0, 0]]),
    (16, 8, 1, 3, [100, 2, 61], [[0, 0], [2, 0], [1, 0]]),
    (64, 1, 2, 32, [517, 30, 0, 250], [[3, 0], [2, 0], [1, 0], [0, 0]]),
    (32, 2, 2, 4, [20, 50], [[1, 0], [1, 1], [1, 2], [0, 0]]),
]


def attention_batch(hd, group, kv_heads, positions, rows, seed=0):
    """q [rows, heads*hd] f32 and caches [slots, kv_heads, max_seq, hd] f16 (random past every slot's keys too)."""
    rng = np.random.default_rng(seed)
    max_seq = max(positions) + len(rows) + 4
    q = (2 * rng.standard_normal((len(rows), kv_heads * group * hd))).astype(np.float32)
    k, v = (rng.standard_normal((len(positions), kv_heads, max_seq, hd)).astype(np.float16) for _ in range(2))
    return q, k, v, max_seq, np.float32(1 / np.sqrt(hd))


def check_attention_batch(launch, hd, group, kv_heads, splits, positions, table, seed=0, window=None):
    """attention_decode over the rows `table` of several slots against one-row launches of each row's slot and
    position (rows table [[slot, offset]]): the same bits (out and the split partials), counters left at zero;
    and close to the twin and to a float32 reference over the row's own slot's keys (the last `window` of them
    with a sliding window)."""
    table = np.array(table, np.int32)
    q, k, v, max_seq, scale = attention_batch(hd, group, kv_heads, positions, table, seed)
    window = window or max_seq
    state, heads, rows = states(positions), kv_heads * group, len(table)
    spec = KernelSpec("attention.cu", "attention_decode", (("HEAD_DIM", hd), ("GROUP", group)))

    def run(qs, step_rows):
        n = len(step_rows)
        out, part = nan(n, heads * hd, dtype=np.float16), nan(n, heads, splits, hd + 2)  # out: FP16
        count = np.zeros((n, kv_heads), np.uint32)
        launch(spec, (kv_heads, splits, n), plans.ATTENTION_THREADS,
               (qs.copy(), k, v, part, count, out, state.copy(), step_rows, np.int32(max_seq), np.float32(scale),
                np.int32(window)))
        assert not count.any()
        return out, part

    out, part = run(q, table)
    for r, row in enumerate(table):
        out1, part1 = run(q[r:r + 1], row[None].copy())
        np.testing.assert_array_equal(out[r:r + 1], out1, err_msg=f"row {r} {row.tolist()}")
        np.testing.assert_array_equal(part[r:r + 1], part1, err_msg=f"row {r} {row.tolist()}")
    twin_out = nan(rows, heads * hd, dtype=np.float16)
    attention_twin.attention_decode(q, k, v, nan(rows, heads, splits, hd + 2), np.zeros((rows, kv_heads), np.uint32),
                                    twin_out, state, table, max_seq, scale, window, grid=(kv_heads, splits, rows))
    np.testing.assert_allclose(out, twin_out, rtol=1e-3, atol=1e-4)
    for r, (slot, offset) in enumerate(table):  # and right: the row's slot's keys (its window), nobody else's
        n = positions[slot] + offset + 1
        keys, values = (c[slot, :, max(0, n - window):n].astype(np.float32) for c in (k, v))
        qh = q[r].reshape(kv_heads, group, hd)
        s = np.einsum("kgd,knd->kgn", qh, keys) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("kgn,knd->kgd", p / p.sum(-1, keepdims=True), values).reshape(-1)
        np.testing.assert_allclose(out[r], ref, rtol=2e-3, atol=2e-4)


@pytest.mark.parametrize("hd,group,kv_heads,splits,positions,table", ATTENTION_BATCHES)
def test_attention_twin_batch_rows_are_one_row_launches(hd, group, kv_heads, splits, positions, table):
    check_attention_batch(twin_launcher(), hd, group, kv_heads, splits, positions, table)


# A sliding window (Mistral's) over slots some of whose rows see fewer keys than the window, some more
WINDOW_BATCH = (32, 4, 2, 4, [40, 3, 0, 9, 120], [[4, 0], [1, 0], [0, 0], [3, 0]], 0, 11)


def test_attention_twin_batch_rows_with_a_sliding_window():
    check_attention_batch(twin_launcher(), *WINDOW_BATCH)


# -- sample: each row its own slot's draw ----------------------------------------------------------------------
# Per slot: (temperature, top_k, top_p, repetition penalty): greedy and sampled sequences side by side.
SLOT_OPTIONS = [(0.0, 0, 1.0, 1.0), (0.9, 40, 0.95, 1.2), (0.0, 0, 1.0, 1.3), (1.0, 0, 1.0, 1.0), (0.7, 5, 0.8, 0.8),
                (0.0, 3, 0.5, 1.0)]


def sample_batch(V, options, seed=0, D=24):
    """logits [slots, V] (one row per slot), seen [slots, stride], state [slots, 8] (each slot's own step, seed,
    top-k and position), fparams [slots, 4], embed [V, D]. Slot s's row is topped by id 7 s + 1, which only slot
    s has seen, just ahead of id 7 s + 2: a penalty over 1 (its own seen flags) turns the pick to the second."""
    rng = np.random.default_rng(seed)
    slots = len(options)
    logits = (3 * rng.standard_normal((slots, V))).astype(np.float32)
    stride = plans.seen_stride(V) + 4 * STRIDE_PAD
    seen = np.zeros((slots, stride), np.uint8)
    seen[:, :V] = rng.random((slots, V)) < 0.1
    seen[:, V:] = 0xAA  # past V: never read
    for s in range(slots):
        top, second = 7 * s + 1, 7 * s + 2
        logits[s, top], logits[s, second] = logits[s].max() + 1.0, logits[s].max() + 0.5
        seen[:, [top, second]] = 0
        seen[s, top] = 1
    state = states([5 + 3 * s for s in range(slots)], steps=[7 * s + 1 for s in range(slots)],
                   seeds=[2**63 + 11 * s for s in range(slots)], top_ks=[o[1] for o in options])
    fparams = np.array([[t, p, r, 0.0] for t, _, p, r in options], np.float32)
    return logits, seen, state, fparams, rng.standard_normal((V, D)).astype(np.float16)


def run_sample(launch, logits_rows, seen, state, fparams, embed, table, verify):
    """The sample kernel over the rows `table` (logits_rows [rows, V], row r's): (picks, x [rows, D])."""
    rows, V = logits_rows.shape
    x, picks = nan(rows, embed.shape[1]), np.full(rows, -7, np.int32)
    kernel_logits = at_row_stride(logits_rows)
    nxt = next_input(x)
    launch(plans.SAMPLE, (rows,), plans.SAMPLE_THREADS,
           (kernel_logits, seen, state, fparams, embed, *nxt, np.array(table, np.int32), np.zeros(rows, np.int32),
            picks, np.full(rows + 1, -7, np.int32), np.zeros(1, np.uint32), np.zeros(1, np.uint32), np.int32(V),
            np.int32(embed.shape[1]), np.int32(seen.shape[1]), np.int32(-(-V // 32)), np.int32(verify)))
    np.testing.assert_array_equal(kernel_logits[:, :V], logits_rows)  # the logits are left as they were
    assert_prepared(nxt, 1 if verify else rows)  # each written row's next input, prepared for layer 0's qkv
    return picks, x


def check_sample_batch(launch, V, options, order, seed=0):
    """The sample kernel in batch mode (verify 0) over rows of the slots `order` against a one-row decode step of
    each row's slot (verify 1, its own copy of the state and seen): the same pick, state row, seen row and next
    input, bit for bit; the slots not in the batch untouched; the picks are the spec's (within rounding of a bucket
    edge where sampled)."""
    logits, seen, state, fparams, embed = sample_batch(V, options, seed)
    table = batch_rows(order)
    batch_seen, batch_state = seen.copy(), state.copy()
    picks, x = run_sample(launch, logits[order], batch_seen, batch_state, fparams, embed, table, verify=0)
    for r, slot in enumerate(order):
        one_seen, one_state = seen.copy(), state.copy()
        one_picks, one_x = run_sample(launch, logits[slot:slot + 1], one_seen, one_state, fparams, embed,
                                      [[slot, 0]], verify=1)
        where = f"row {r} (slot {slot}, {options[slot]})"
        assert picks[r] == one_picks[0], where
        np.testing.assert_array_equal(batch_state[slot], one_state[slot], err_msg=where)
        np.testing.assert_array_equal(batch_seen[slot], one_seen[slot], err_msg=where)
        np.testing.assert_array_equal(x[r], one_x[0], err_msg=where)
        params = sample_twin.params_from(state[slot], fparams[slot])
        expected = sampling.sample(logits[slot], params, seen[slot, :V] != 0, int(state[slot, 2]))
        assert picks[r] == expected or (params.temperature and explained(picks[r], logits[slot], params,
                                                                          seen[slot, :V] != 0, int(state[slot, 2])))
        assert batch_state[slot].tolist()[:3] == [state[slot, 0] + 1, picks[r], state[slot, 2] + 1]
    left_out = [s for s in range(len(options)) if s not in order]
    np.testing.assert_array_equal(batch_state[left_out], state[left_out])
    np.testing.assert_array_equal(batch_seen[left_out], seen[left_out])


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [4, 0, 5], [3], [5, 2, 1, 0]])
def test_sample_twin_batch_rows_are_one_row_steps(order):
    check_sample_batch(twin_launcher(), 517, SLOT_OPTIONS, order)


def test_sample_twin_batch_row_with_nothing_to_draw_fails_alone():
    """A row whose logits are all NaN gets NO_TOKEN (its slot's state says so, x row 0, nothing seen); the other
    rows are drawn as if it were not there."""
    logits, seen, state, fparams, embed = sample_batch(517, SLOT_OPTIONS[:3], seed=4)
    logits[1] = np.nan
    batch_seen, batch_state = seen.copy(), state.copy()
    picks, x = run_sample(twin_launcher(), logits, batch_seen, batch_state, fparams, embed, batch_rows([0, 1, 2]), 0)
    assert picks[1] == sampling.NO_TOKEN and batch_state[1, 1] == sampling.NO_TOKEN and not x[1].any()
    np.testing.assert_array_equal(batch_seen[1], seen[1])
    for r in (0, 2):
        one_seen, one_state = seen.copy(), state.copy()
        one_picks, _ = run_sample(twin_launcher(), logits[r:r + 1], one_seen, one_state, fparams, embed, [[r, 0]], 1)
        assert picks[r] == one_picks[0] != sampling.NO_TOKEN


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group,kv_heads,splits,positions,table",
                         ATTENTION_BATCHES + [(128, 1, 32, 8, [500, 3, 250, 77, 499, 1, 12, 300],
                                               [[7, 0], [6, 0], [5, 0], [4, 0], [3, 0], [2, 0], [1, 0], [0, 0]])])
def test_gpu_attention_batch_rows_are_one_row_launches(kernels, hd, group, kv_heads, splits, positions, table):
    check_attention_batch(gpu_launcher(kernels), hd, group, kv_heads, splits, positions, table)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [517, 32000])
def test_gpu_sample_batch_rows_are_one_row_steps(kernels, V):
    check_sample_batch(gpu_launcher(kernels), V, SLOT_OPTIONS, [4, 0, 5, 2, 1, 3])


@pytest.mark.gpu
@pytest.mark.parametrize("bits", QKV_CASES, ids=["fp16", "int4", "int8"])
def test_gpu_qkv_batch_rows_are_one_row_launches(kernels, bits):
    check_qkv_batch(gpu_launcher(kernels), bits)


@pytest.mark.gpu
def test_gpu_attention_batch_rows_with_a_sliding_window(kernels):
    check_attention_batch(gpu_launcher(kernels), *WINDOW_BATCH)

