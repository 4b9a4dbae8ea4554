"""The logprobs kernel (kernels_cu/sampling.cu) and its twin: the twin against a float64 log-softmax written
here, cullama.runtime.logprobs.from_rows' finishing (non-finite rows included), the kernel against the twin on the CPU
executor in every warp schedule (marker emu), with seeded bugs it must catch, and on a GPU (marker gpu), and every
plan launch of it against the kernel's signature. Its compile without spills for every arch: test_sampling_kernel.py
(sm_90) and test_registry.py (the others), which compile every kernel of sampling.cu."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cullama.runtime import emu, plan as plans
from cullama.model.config import preset
from cullama.runtime.logprobs import from_rows
from cullama.runtime.ops import sampling as ops
from cullama.runtime.registry import KernelSpec

from tests.conftest import poisoned
from tests.runtime.test_contracts import POINTER_DTYPES, SCALAR_TYPES, SIGNATURES

SPEC = KernelSpec("sampling.cu", "logprobs")
THREADS = plans.SAMPLE_THREADS
NEGATIVE_NAN = np.array([0xFFC00001], np.uint32).view(np.float32)[0]
# (V, stride, rows, top): odd widths, a stride past V (a verify step's), V below top, a row past the on-chip count
CASES = [(517, 520, 3, 20), (1000, 1000, 2, 5), (7, 8, 2, 20), (33001, 33004, 1, 3), (64, 64, 4, 0)]


def make_logits(V, stride, rows, seed, kind="plain"):
    """[rows, stride] float32 (the columns past V NaN, never read): normal logits with -inf, NaN (a negative
    NaN too), -0.0 and ties on a 0.5 grid, the largest at the first id (the last id in the last row); `kind`
    "inf": three +inf in row 0; "none": row 0 all NaN / -inf."""
    rng = np.random.default_rng(seed)
    l = np.full((rows, stride), np.nan, np.float32)
    for r in range(rows):
        row = np.round(2 * 3 * rng.standard_normal(V)) / 2
        row[row == 0] = -0.0
        bad = rng.choice(V, max(2, V // 50), replace=False)
        row[bad[0::2]] = -np.inf
        row[bad[1::2]] = np.nan
        row[-1 if r == rows - 1 else 0] = 20.0  # the last row's largest logit is its last id's: the edge
        l[r, :V] = row
        if V > 4:
            l[r, 3] = NEGATIVE_NAN
    if kind == "inf":
        l[0, [1, V // 2, V - 1]] = np.inf
    elif kind == "none":
        l[0, :V] = np.where(np.isnan(l[0, :V]), l[0, :V], np.float32(-np.inf))
    return l


def make_targets(V, rows, seed):
    """[2 + rows] int32: two words before the rows' (target_at = 2), one row's target -1 and one V (no id)."""
    t = np.random.default_rng(seed).integers(0, V, rows + 2).astype(np.int32)
    t[2] = -1 if rows > 1 else t[2]
    if rows > 2:
        t[4] = V
    return t


def spec_logprobs(row: np.ndarray) -> np.ndarray:
    """log p of every id of one row under the raw softmax, in float64, written from the rules in
    cullama/runtime/logprobs.py rather than from the kernel's numbers: NaN is -inf; the +inf ids share the mass."""
    l = np.where(np.isnan(row), -np.inf, row.astype(np.float64))
    if np.isposinf(l).any():
        return np.where(np.isposinf(l), -math.log(np.isposinf(l).sum()), -np.inf)
    if not np.isfinite(l).any():
        return np.full(l.shape, -np.inf)
    m = l.max()
    return l - (m + math.log(np.exp(l - m).sum()))


def run_twin(logits, targets, V, stride, top, target_at=2):
    rows = logits.shape[0]
    out = np.full((rows + 1, ops.LP_WIDTH), np.nan, np.float32)
    ops.logprobs(logits, targets, out, V, stride, target_at, top, grid=(rows, 1, 1))
    return out


def check_against_spec(out, logits, targets, V, top, target_at=2):
    for r, record in enumerate(from_rows(out[:logits.shape[0]], top)):
        expected = spec_logprobs(logits[r, :V])
        t = int(targets[target_at + r])
        assert record.token == t
        want = expected[t] if 0 <= t < V else -np.inf
        assert record.logprob == want or abs(record.logprob - want) <= 1e-5 * max(1, abs(want)), (r, t)
        l = np.where(np.isnan(logits[r, :V]), -np.inf, logits[r, :V])
        order = np.lexsort((np.arange(V), -l))[:min(top, V)]
        assert [i for i, _ in record.top] == order.tolist(), r
        got = np.array([lp for _, lp in record.top])
        np.testing.assert_allclose(got, expected[order], rtol=1e-5, atol=1e-5)


# ---- the twin and the host's finishing (CPU) --------------------------------------------------------------

@pytest.mark.parametrize("kind", ["plain", "inf", "none"])
@pytest.mark.parametrize("V,stride,rows,top", CASES)
def test_twin_and_finishing_give_the_raw_log_softmax(V, stride, rows, top, kind):
    logits, targets = make_logits(V, stride, rows, seed=V + rows, kind=kind), make_targets(V, rows, seed=V)
    out = run_twin(logits, targets, V, stride, top)
    check_against_spec(out, logits, targets, V, top)
    assert np.isnan(out[rows]).all()  # the row past the grid is not written
    ints = out.view(np.int32)
    assert (ints[:rows, ops.LP_TOP_ID + min(top, V):ops.LP_TOP_ID + top] == -1).all()  # past the V-th id
    if top < ops.LP_MAX_TOP:  # the columns past top are left as they were
        assert np.isnan(out[:rows, ops.LP_TOP + top:ops.LP_TOP_ID]).all()


def test_a_target_that_is_the_top_one_has_the_same_logprob_bit_for_bit():
    """lm-evaluation-harness decides `is_greedy` by comparing a token's logprob with the top ones' by ==."""
    logits = make_logits(300, 300, 1, seed=1)
    best = int(np.nanargmax(logits[0]))
    out = run_twin(logits, np.array([best], np.int32), 300, 300, 4, target_at=0)
    (record,) = from_rows(out[:1], 4)
    assert record.token == record.top[0][0] == best and record.logprob == record.top[0][1]


def test_finishing_the_special_rows():
    row = np.zeros(ops.LP_WIDTH, np.float32)
    ints = row.view(np.int32)
    row[[ops.LP_MAX, ops.LP_SUM, ops.LP_TARGET, ops.LP_TOP, ops.LP_TOP + 1]] = np.inf, 2, np.inf, np.inf, 5.0
    ints[[ops.LP_TARGET_ID, ops.LP_TOP_ID, ops.LP_TOP_ID + 1]] = 9, 9, 4
    (record,) = from_rows(row[None], 2)
    assert record.logprob == -math.log(2) and record.top == ((9, -math.log(2)), (4, -math.inf))
    row[[ops.LP_MAX, ops.LP_TARGET]] = -np.inf, np.nan  # nothing has a probability; a NaN target
    assert from_rows(row[None], 0)[0].logprob == -math.inf
    row[[ops.LP_MAX, ops.LP_TARGET]] = np.nan, 1.0  # a NaN maximum: no probability either, not NaN
    assert from_rows(row[None], 0)[0].logprob == -math.inf


def test_every_logprobs_launch_matches_the_kernel_signature():
    for name in ("llama-2-7b", "tiny"):
        cfg = preset(name)  # runtime buffers only: the logits, the targets and the outputs
        bufs, V = {b.name: b for b in plans.runtime_buffers(cfg, 512)}, cfg.vocab_size
        found = [plans.token_logprobs(V, 1, 20), plans.token_logprobs(V - 5, 4, 0),
                 plans.prompt_logprobs(V - 5, V, 37, 5)]
        params = SIGNATURES["sampling.cu", "logprobs"]
        for launch in found:
            assert launch.spec == SPEC
            for (ctype, pname, is_pointer), arg in zip(params, launch.args, strict=True):
                if is_pointer:
                    assert bufs[arg.name].dtype == POINTER_DTYPES[ctype], (pname, arg)
                else:
                    assert type(arg) is SCALAR_TYPES[ctype], pname


def test_the_scored_plans_are_the_plain_ones_and_the_kernel():
    cfg = preset("tiny")  # its intermediate size needs no padding
    decode, verify = plans.decode_plan(cfg, 64), plans.verify_plan(cfg, 64, 3)
    scored = plans.with_logprobs(decode, 2, [plans.token_logprobs(cfg.vocab_size, 1, 2)])
    assert scored.launches[:-1] == decode.launches and scored.name == "decode+logprobs[2]"
    assert SPEC not in decode.kernels() | verify.kernels() | plans.prefill_plan(cfg, 64, 0, 9, "sample").kernels()
    rows = plans.token_logprobs(cfg.vocab_size, 4, 0)
    assert rows.grid == (4, 1, 1) and rows.args[0] == plans.Ref("verify_logits", rows=4)
    none, logits, sample = (plans.prefill_plan(cfg, 64, 8, 9, out) for out in ("none", "logits", "sample"))
    prefill = plans.scored_prefill_plan(none, logits, sample, cfg.vocab_size, cfg.vocab_size, 9, 3, 1)
    tail = sample.launches[len(none.launches):]  # gemv_logits_x (on x: no gemv_residual before it) and sample
    assert [l.spec.name for l in tail] == ["gemv_logits_x", "sample"]
    assert prefill.launches == logits.launches + [plans.prompt_logprobs(cfg.vocab_size, cfg.vocab_size, 9, 3)] + \
        tail + [plans.token_logprobs(cfg.vocab_size, 1, 1)]
    early = plans.scored_prefill_plan(none, logits, None, cfg.vocab_size, cfg.vocab_size, 9, 3, None)
    assert early.launches == logits.launches + [plans.prompt_logprobs(cfg.vocab_size, cfg.vocab_size, 9, 3)]


# ---- the kernel on the CPU executor (emu) --------------------------------------------------------------

def check_kernel(V, stride, rows, top, kind, schedule, source_dir=None):
    """The kernel's row equals the twin's: m, the target's logit and id, the top ids and logits bit for bit; s
    within float32 summation order."""
    logits, targets = make_logits(V, stride, rows, seed=V + rows, kind=kind), make_targets(V, rows, seed=V)
    ref = run_twin(logits, targets, V, stride, top)
    out = np.full_like(ref, np.nan)
    emu.launch(SPEC, rows, THREADS, (logits, targets, out, np.int32(V), np.int32(stride), np.int32(2),
                                     np.int32(top)), 0, schedule=schedule, seed=7, source_dir=source_dir)
    exact = [ops.LP_MAX, ops.LP_TARGET, ops.LP_TARGET_ID, *range(ops.LP_TOP, ops.LP_TOP + top),
             *range(ops.LP_TOP_ID, ops.LP_TOP_ID + top)]
    same = out[:, exact].view(np.uint32) == ref[:, exact].view(np.uint32)
    assert same.all(), f"{int((~same).sum())} of {same.size} exact entries differ"
    assert np.isnan(out[:, ops.LP_TOP + top:ops.LP_TOP_ID]).all()  # past top: untouched
    s, s_ref = out[:rows, ops.LP_SUM].astype(np.float64), ref[:rows, ops.LP_SUM].astype(np.float64)
    assert np.all(np.abs(s - s_ref) <= 2e-6 * np.abs(s_ref)), (s, s_ref)


@pytest.mark.emu
@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("kind", ["plain", "inf", "none"])
def test_kernel_on_the_executor(kind, schedule):
    for V, stride, rows, top in CASES[:3]:
        check_kernel(V, stride, rows, top, kind, schedule)


@pytest.mark.emu
def test_kernel_on_the_executor_over_a_large_vocabulary():
    check_kernel(*CASES[3], "plain", "shuffled")


# ---- the kernel on a GPU ------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["plain", "inf", "none"])
@pytest.mark.parametrize("V,stride,rows,top", CASES + [(32000, 32000, 64, 1), (128256, 128256, 2, 20)])
def test_kernel_matches_twin_on_the_gpu(kernels, V, stride, rows, top, kind):
    import cupy as cp

    logits, targets = make_logits(V, stride, rows, seed=V + rows, kind=kind), make_targets(V, rows, seed=V)
    ref = run_twin(logits, targets, V, stride, top)
    out = poisoned(cp, ref.shape, np.float32)
    kernels.function(SPEC)((rows,), (THREADS,), (cp.asarray(logits), cp.asarray(targets), out, np.int32(V),
                                                 np.int32(stride), np.int32(2), np.int32(top)))
    out = out.get()
    exact = [ops.LP_MAX, ops.LP_TARGET, ops.LP_TARGET_ID, *range(ops.LP_TOP, ops.LP_TOP + top),
             *range(ops.LP_TOP_ID, ops.LP_TOP_ID + top)]
    np.testing.assert_array_equal(out[:, exact].view(np.uint32), ref[:, exact].view(np.uint32))
    np.testing.assert_allclose(out[:rows, ops.LP_SUM], ref[:rows, ops.LP_SUM], rtol=1e-5)
    check_against_spec(out, logits, targets, V, top)


# Seeded bugs the executor check must catch (as tests/runtime/emu/test_emu_mutations.py does for the other kernels):
# (id, original text, replacement, the schedules that must catch it: a race in every one, a wrong result in one);
# each original must be in sampling.cu exactly once.
MUTATIONS = [
    ("top-pass-takes-the-last-pick-again", "best = r < below && r > best ? r : best;",
     "best = r <= below && r > best ? r : best;", ("shuffled",)),
    ("infinite-max-counts-nothing", "s += e == e ? expf(e) : 1.f;", "s += e == e ? expf(e) : 0.f;", ("reverse",)),
    ("max-pass-misses-the-last-id", "for (int i = threadIdx.x; i < V; i += THREADS) best = max(best, ranked(",
     "for (int i = threadIdx.x; i < V - 1; i += THREADS) best = max(best, ranked(", ("forward",)),
    ("rows-at-a-stride-of-V", "const float* row = logits + (size_t)blockIdx.x * stride;",
     "const float* row = logits + (size_t)blockIdx.x * V;", ("shuffled",)),
    ("top-passes-share-one-scratch", "best = block_max_u64(best, best_of[j & 1]);",
     "best = block_max_u64(best, best_of[0]);", emu.SCHEDULES),
]


@pytest.mark.emu
@pytest.mark.parametrize("original,mutated,schedule", [(m[1], m[2], s) for m in MUTATIONS for s in m[3]],
                         ids=[f"{m[0]}-{s}" for m in MUTATIONS for s in m[3]])
def test_the_executor_check_catches_a_seeded_bug(original, mutated, schedule, tmp_path):
    import shutil

    from cullama.common.errors import CullamaError
    from cullama.kernels_cu import SOURCE_DIR

    for path in SOURCE_DIR.iterdir():
        if path.suffix in (".cu", ".cuh"):
            shutil.copy(path, tmp_path / path.name)
    source = (tmp_path / "sampling.cu").read_text()
    assert source.count(original) == 1, original
    (tmp_path / "sampling.cu").write_text(source.replace(original, mutated))
    with pytest.raises((AssertionError, CullamaError)):
        for kind in ("plain", "inf"):
            for case in CASES[:3]:
                check_kernel(*case, kind, schedule, source_dir=tmp_path)
