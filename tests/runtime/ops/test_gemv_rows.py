"""Row independence of the decode GEMVs on a GPU (issue 26, `pytest -m gpu`): every GEMV kernel the decode, verify and
batch plans launch (read off the plans by cullama/bench/gemvs.py: gemv.cu / gemv_quant.cu's TOKENS variants today,
gemv_mma.cu's 1..16 rows once the plans launch it), in FP16, int8 and int4, run with T token rows of random content;
each row r must equal, bit for bit, the same row run alone (the plans' 1-row kernel: a decode step) and the same row
run in row 0 of T rows (its content and its rows-table entry swapped with row 0's); and the T-row launch must match
its NumPy twin within TOLERANCE. Tensor cores are believed to compute each output from its own A row and B column
only; no document promises it, so the first GPU run is what shows it. On the fake GPU (CULLAMA_FAKE_GPU=1) the
kernels are their twins: the test's own code runs, the claim is not tested; without a GPU the tests skip.

The shapes are a small model's with odd sizes (a 1001-id vocabulary, 5 query heads of 64 on one key/value head, an
intermediate size that quantized layouts pad from 200 to 224: int4 groups of 64 and 32), as its plans launch them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cullama.bench import gemvs
from cullama.model import quant
from cullama.model.config import preset
from cullama.runtime import ops, plan as plans
from cullama.runtime.ops import gemv as gemv_twin
from cullama.runtime.registry import KernelSpec
from tests.conftest import poisoned

CFG = dataclasses.replace(preset("tiny"), name="rows-test", hidden_size=320, intermediate_size=200, vocab_size=1001,
                          num_heads=5, num_kv_heads=1, head_dim=64, num_layers=1)
EPS = np.float32(1e-5)
MAX_SEQ = 64
# The twins sum in float32 in another order than the kernels (and the tensor cores' internal sum is unspecified;
# gemv_mma.cu rounds x to FP16 for its A operand as its twin does): within this much of the largest |output|.
TOLERANCE = 2e-3
FIELD = {"qkv": "wqkv", "o_proj": "wo", "gate_up": "w_gate_up", "down": "w_down"}
VARIANTS = gemvs.plan_variants(CFG)
ONE_ROW = {(v.fmt, v.shape): v for v in VARIANTS if v.rows == 1}
MANY = [v for v in VARIANTS if v.rows > 1]


def weights(rng, v: gemvs.Variant) -> list[np.ndarray]:
    """The launch's weight arguments: W [M, K] FP16, or (qweight, qparams) in the layout's format (random codes,
    zeros anywhere in 0 .. 2**bits, scales of both signs)."""
    if v.fmt == "float16" or v.shape == "lm_head":
        return [(0.05 * rng.standard_normal((v.M, v.K))).astype(np.float16)]
    fmt = gemvs.layout_for(CFG, v.fmt).linear(0, FIELD[v.shape]).format
    top = 1 << fmt.bits
    codes = rng.integers(0, top, (v.M, v.K), dtype=np.uint8)
    zeros = rng.integers(0, top + 1, (v.M, v.K // fmt.group))
    scales = 0.1 / top * rng.choice([-1.0, 1.0], zeros.shape) * (0.5 + rng.random(zeros.shape))
    return [quant.pack(codes, fmt.bits), quant.params(scales, zeros), np.int32(fmt.group)]


@dataclasses.dataclass
class Rows:
    """T token rows of one launch: x (or in) [T, K], the residual's x [T, M] before it, each row's rows-table entry."""

    x: np.ndarray
    x0: np.ndarray | None
    table: np.ndarray  # [T, 2] (slot 0, offset)

    def pick(self, order) -> Rows:
        order = list(order)
        return Rows(self.x[order], None if self.x0 is None else self.x0[order], self.table[order])


def make_rows(rng, v: gemvs.Variant) -> Rows:
    x0 = rng.standard_normal((v.rows, v.M)).astype(np.float32) if v.kernel == "gemv_residual" else None
    table = np.stack([np.zeros(v.rows, np.int32), np.arange(v.rows, dtype=np.int32)], axis=1)
    return Rows(rng.standard_normal((v.rows, v.K)).astype(np.float32), x0, table)


def arguments(v: gemvs.Variant, w: list, rows: Rows, fixed: dict, xp) -> tuple[list, dict]:
    """(the kernel's arguments as xp arrays, the outputs by name); outputs poisoned (the residual's x its x0)."""
    T, cfg = len(rows.x), CFG
    arr = xp.asarray
    out_f32 = lambda *shape: poisoned(xp, shape, np.float32)  # noqa: E731
    w = [arr(a) if isinstance(a, np.ndarray) else a for a in w]
    quant_args = w[1:]  # (qparams, group) or nothing; W or qweight first
    if v.kernel == "gemv_qkv_rope":
        outs = {"q": out_f32(T, cfg.q_dim), "k": poisoned(xp, fixed["cache"], np.float16),
                "v": poisoned(xp, fixed["cache"], np.float16)}
        group = quant_args[-1:] if quant_args else []
        args = [arr(rows.x), arr(fixed["norm_w"]), *w[:len(w) - len(group)], arr(fixed["bias"]), outs["q"], outs["k"],
                outs["v"], arr(fixed["rope"]), arr(fixed["state"]), arr(rows.table), np.int32(v.K),
                np.int32(cfg.num_heads), np.int32(cfg.num_kv_heads), np.int32(cfg.head_dim), np.int32(MAX_SEQ), EPS,
                *group]
        return args, outs
    if v.kernel == "gemv_residual":
        outs = {"x": arr(rows.x0.copy())}
        group = quant_args[-1:] if quant_args else []
        return [arr(rows.x), *w[:len(w) - len(group)], outs["x"], np.int32(v.M), np.int32(v.K), *group], outs
    if v.kernel == "gemv_gate_up_silu":
        outs = {"h": out_f32(T, v.M // 2)}
        group = quant_args[-1:] if quant_args else []
        return [arr(rows.x), arr(fixed["norm_w"]), *w[:len(w) - len(group)], outs["h"], np.int32(v.M // 2),
                np.int32(v.K), EPS, *group], outs
    outs = {"logits": out_f32(T, gemv_twin.logits_stride(v.M))}
    return [arr(rows.x), arr(fixed["norm_w"]), *w, outs["logits"], np.int32(v.M), np.int32(v.K), EPS], outs


def fixed_inputs(rng, v: gemvs.Variant) -> dict:
    state = np.zeros(8, np.int32)
    state[0] = MAX_SEQ - 16  # row t at MAX_SEQ - 16 + offset
    return {"norm_w": (1 + 0.1 * rng.standard_normal(v.K)).astype(np.float16),
            "bias": (0.1 * rng.standard_normal(CFG.qkv_dim)).astype(np.float16),
            "rope": plans.rope_table(CFG, MAX_SEQ), "state": state,
            "cache": (CFG.num_kv_heads, MAX_SEQ, CFG.head_dim)}


def row_outputs(v: gemvs.Variant, outs: dict, rows: Rows, r: int) -> dict:
    """Token row r's outputs (host arrays): its output row, and for qkv its key and value at its position."""
    get = lambda a: a.get() if hasattr(a, "get") else a  # noqa: E731
    if v.kernel == "gemv_qkv_rope":
        pos = MAX_SEQ - 16 + int(rows.table[r, 1])
        return {"q": get(outs["q"])[r], "k": get(outs["k"])[:, pos], "v": get(outs["v"])[:, pos]}
    name = next(iter(outs))
    return {name: get(outs[name])[r][:v.M]}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return a.shape == b.shape and bool((a.view(view) == b.view(view)).all())


def run(kernels, v: gemvs.Variant, w, rows: Rows, fixed) -> dict:
    import cupy as cp

    args, outs = arguments(v, w, rows, fixed, cp)
    kernels.function(KernelSpec(v.source, v.kernel, v.defines))(v.grid, (v.threads,), tuple(args))
    cp.cuda.Device().synchronize()
    return outs


def test_the_cases_cover_every_plan_gemv():
    """Every format, shape and token count the plans launch at this model's shapes, with a 1-row kernel to compare."""
    assert {(v.fmt, v.shape) for v in MANY} == set(ONE_ROW)
    assert {v.rows for v in MANY} == set(range(2, max(v.rows for v in VARIANTS) + 1))
    assert {v.fmt for v in MANY} == set(gemvs.FORMATS) and len({v.shape for v in MANY}) == 5


@pytest.mark.gpu
@pytest.mark.parametrize("v", MANY, ids=[v.label for v in MANY])
def test_gpu_gemv_rows_are_independent_of_each_other(kernels, v):
    rng = np.random.default_rng(v.rows * 7919 + len(v.label))
    w, fixed, rows = weights(rng, v), fixed_inputs(rng, v), make_rows(rng, v)
    full = run(kernels, v, w, rows, fixed)
    # the kernel against its twin, within TOLERANCE
    twin_args, twin_outs = arguments(v, w, rows, fixed, np)
    ops.twin(v.source, v.kernel)(*twin_args)
    for r in range(v.rows):
        got, want = row_outputs(v, full, rows, r), row_outputs(v, twin_outs, rows, r)
        for name in got:
            out, ref = got[name].astype(np.float64), want[name].astype(np.float64)
            assert np.isfinite(out).all(), f"{v.label} row {r} {name}: not every element written"
            err = np.abs(out - ref).max(initial=0)
            assert err <= TOLERANCE * max(1.0, np.abs(ref).max(initial=0)), f"{v.label} row {r} {name}: off by {err}"
    one = ONE_ROW[v.fmt, v.shape]
    for r in range(v.rows):
        expected = row_outputs(v, full, rows, r)
        alone = row_outputs(one, run(kernels, one, w, rows.pick([r]), fixed), rows.pick([r]), 0)
        order = list(range(v.rows))
        order[0], order[r] = r, 0
        swapped = rows.pick(order)
        first = row_outputs(v, run(kernels, v, w, swapped, fixed), swapped, 0)
        for name in expected:
            assert same_bits(alone[name], expected[name]), f"{v.label}: row {r} alone differs ({name})"
            assert same_bits(first[name], expected[name]), f"{v.label}: row {r} in row 0 differs ({name})"
