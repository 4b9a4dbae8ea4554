"""Row independence of the decode GEMVs on a GPU (issue 26, `pytest -m gpu`): every GEMV kernel the decode, verify and
batch plans launch (read off the plans by cullama/bench/gemvs.py, with the plans' own arguments: gemv.cu /
gemv_quant.cu's TOKENS variants today, gemv_mma.cu's 1..16 rows once the plans launch it), in FP16, int8 and int4, run
with T token rows of random content; each row r must equal, bit for bit, the same row run alone (the plans' 1-row
launch: a decode step's kernel) and the same row run in row 0 of T rows (its content and its rows-table entry swapped
with row 0's); and the T-row launch must match its NumPy twin within TOLERANCE. Tensor cores are believed to compute
each output from its own A row and B column only; no document promises it, so the first GPU run is what shows it. On
the fake GPU (CULLAMA_FAKE_GPU=1) the kernels are their twins: the test's own code runs, the claim is not tested;
without a GPU the tests skip.

The launches are a batched step's (plan.batch_plan: the verify step's kernels, on the verify buffers' first T rows), the
arguments bound as the backends bind them (Ref.of on each buffer), so a change of the kernels' parameters in the plans
needs no change here. The shapes are a small model's with odd sizes (a 1001-id vocabulary, 5 query heads of 64 on one
key/value head, an intermediate size that quantized layouts pad from 200 to 224: int4 groups of 64 and 32).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cullama.bench import gemvs
from cullama.model.config import preset
from cullama.runtime import ops, plan as plans
from cullama.runtime.plan import Ref

CFG = dataclasses.replace(preset("tiny"), name="rows-test", hidden_size=320, intermediate_size=200, vocab_size=1001,
                          num_heads=5, num_kv_heads=1, head_dim=64, num_layers=1)
MAX_SEQ = 64
# The twins sum in float32 in another order than the kernels (and the tensor cores' internal sum is unspecified;
# gemv_mma.cu rounds x to FP16 for its A operand as its twin does): within this much of the largest |output|.
TOLERANCE = 2e-3
VARIANTS = gemvs.plan_variants(CFG)
MANY = [v for v in VARIANTS if v.rows > 1]
LAYOUTS = {fmt: gemvs.layout_for(CFG, fmt) for fmt in gemvs.FORMATS}


def permuted(bufs: dict, launch: plans.Launch, order: list[int]) -> dict:
    """The buffers with the token rows in `order` (row i of the result is row order[i]): every buffer the launch
    takes by token rows, and its rows table."""
    out = {n: a.copy() for n, a in bufs.items()}
    for a in launch.args:
        if isinstance(a, Ref) and a.rows is not None:  # a buffer's first rows: the whole buffer's rows
            out[a.name][:len(order)] = bufs[a.name][order]
        elif isinstance(a, Ref) and bufs[a.name].dtype == np.int32 and a.name != "state":  # the rows table
            a.of(out[a.name])[:len(order)] = a.of(bufs[a.name])[order]
    return out


def row_values(bufs: dict, launch: plans.Launch, r: int) -> dict[str, np.ndarray]:
    """Token row r's values after a launch: its row of every buffer taken by token rows, and its key and value (each
    cache at its slot and position)."""
    out = {}
    table = next((a.of(bufs[a.name]) for a in launch.args if isinstance(a, Ref) and bufs[a.name].dtype == np.int32
                  and a.name != "state"), None)  # only gemv_qkv_rope takes one (RoPE's angle, its K/V rows)
    for a in launch.args:
        if isinstance(a, Ref) and a.rows is not None:
            out[a.name] = a.of(bufs[a.name])[r]
        elif isinstance(a, Ref) and a.name in ("k_cache", "v_cache"):
            slot, pos = int(table[r, 0]), MAX_SEQ - gemvs.POSITION_ROOM + int(table[r, 1])
            out[a.name] = a.of(bufs[a.name])[slot][:, pos]
    return out


def run(kernels, launch: plans.Launch, bufs: dict) -> dict:
    """The launch on the GPU on copies of `bufs`; the buffers after it, on the host."""
    import cupy as cp

    dev = {n: cp.asarray(a) for n, a in bufs.items()}
    args = tuple(a.of(dev[a.name]) if isinstance(a, Ref) else a for a in launch.args)
    kernels.function(launch.spec)(launch.grid, (launch.block,), args)
    cp.cuda.Device().synchronize()
    return {n: a.get() for n, a in dev.items()}


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    view = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    return a.shape == b.shape and bool((a.view(view) == b.view(view)).all())


def test_the_cases_cover_every_plan_gemv():
    """Every format, shape and token count the plans launch at this model's shapes, each with its launch."""
    assert {(v.fmt, v.rows) for v in MANY} == {(f, t) for f in gemvs.FORMATS
                                               for t in range(2, max(v.rows for v in VARIANTS) + 1)}
    for v in MANY[:: len(MANY) // 7]:
        launch = gemvs.batch_launches(LAYOUTS[v.fmt], v.rows)[v.shape]
        assert (launch.spec.source, launch.spec.name, launch.spec.defines, launch.grid) == \
            (v.source, v.kernel, v.defines, v.grid)


@pytest.mark.gpu
@pytest.mark.parametrize("v", MANY, ids=[v.label for v in MANY])
def test_gpu_gemv_rows_are_independent_of_each_other(kernels, v):
    layout = LAYOUTS[v.fmt]
    key = v.shape
    launch, one = gemvs.batch_launches(layout, v.rows)[key], gemvs.batch_launches(layout, 1)[key]
    bufs = gemvs.launch_buffers(launch, layout, np.random.default_rng(v.rows * 7919 + len(v.label)), MAX_SEQ)
    full = run(kernels, launch, bufs)
    host = {n: a.copy() for n, a in bufs.items()}  # the twin on the same buffers, within TOLERANCE
    ops.twin(launch.spec.source, launch.spec.name)(*(a.of(host[a.name]) if isinstance(a, Ref) else a
                                                     for a in launch.args))
    for r in range(v.rows):
        got, want = row_values(full, launch, r), row_values(host, launch, r)
        for name in got:
            out, ref = got[name].astype(np.float64), want[name].astype(np.float64)
            assert np.isfinite(out).all(), f"{v.label} row {r} {name}: not finite"
            err = np.abs(out - ref).max(initial=0)
            assert err <= TOLERANCE * max(1.0, np.abs(ref).max(initial=0)), f"{v.label} row {r} {name}: off by {err}"
    for r in range(v.rows):
        expected = row_values(full, launch, r)
        alone = row_values(run(kernels, one, permuted(bufs, one, [r])), one, 0)
        order = list(range(v.rows))
        order[0], order[r] = r, 0
        first = row_values(run(kernels, launch, permuted(bufs, launch, order)), launch, 0)
        for name in expected:
            assert same_bits(alone[name], expected[name]), f"{v.label}: row {r} alone differs ({name})"
            assert same_bits(first[name], expected[name]), f"{v.label}: row {r} in row 0 differs ({name})"
