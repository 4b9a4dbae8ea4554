"""A batched decode step's kernels as written, on the CPU executor (cullama.runtime.emu), in every warp schedule: row r
of a launch over several sequence slots equals a one-row launch of its slot at its position, bit for bit
(gemv_qkv_rope, FP16 and INT4 / INT8 with a bias, writing each row's K and V in its own slot; attention_decode over
each row's own slot's keys, with and without a sliding window; sample with each row's own slot's parameters, seen flags, state
and counter). The same checks run on the twins and on a GPU in tests/runtime/ops/test_batch_kernels.py."""

import pytest

from tests.runtime.ops import test_batch_kernels as checks
from cullama.runtime import emu
from tests.emulated import check_seeded_bug, emu_launcher

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("bits", checks.QKV_CASES, ids=["fp16", "int4", "int8"])
def test_qkv_batch_rows_are_one_row_launches(bits, schedule):
    checks.check_qkv_batch(emu_launcher(schedule), bits)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("hd,group,kv_heads,splits,positions,table", checks.ATTENTION_BATCHES)
def test_attention_batch_rows_are_one_row_launches(hd, group, kv_heads, splits, positions, table, schedule):
    checks.check_attention_batch(emu_launcher(schedule), hd, group, kv_heads, splits, positions, table)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
def test_attention_batch_rows_with_a_sliding_window(schedule):
    checks.check_attention_batch(emu_launcher(schedule), *checks.WINDOW_BATCH)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("V,order", [(517, [4, 0, 5, 2, 1, 3]), (33001, [1, 3])])
def test_sample_batch_rows_are_one_row_steps(V, order, schedule):
    checks.check_sample_batch(emu_launcher(schedule), V, checks.SLOT_OPTIONS, order)


# (id, file, original text, its replacement, the check that must fail): the checks above have teeth
MUTATIONS = [
    ("qkv-every-row-writes-slot-0", "gemv_mma.cu",
     "const size_t slot_off = (size_t)row_slot(step_rows, tok) * n_kv_heads * max_seq * hd;",
     "const size_t slot_off = 0;", lambda launch: checks.check_qkv_batch(launch, 16)),
    ("qkv-rows-ignore-their-offset", "common.cuh",
     "return state[row_slot(rows, r) * STATE_LEN + STATE_POS] + rows[r * ROW_FIELDS + ROW_OFFSET];",
     "return state[row_slot(rows, r) * STATE_LEN + STATE_POS];", lambda launch: checks.check_qkv_batch(launch, 4)),
    ("attention-every-row-reads-slot-0", "attention.cu",
     "((size_t)row_slot(step_rows, row) * gridDim.x + kv)", "((size_t)0 * gridDim.x + kv)",
     lambda launch: checks.check_attention_batch(launch, *checks.ATTENTION_BATCHES[0])),
    ("attention-rows-at-the-first-row's-position", "attention.cu",
     "min(row_pos(step_rows, state, row) + 1, max_seq)", "min(row_pos(step_rows, state, 0) + 1, max_seq)",
     lambda launch: checks.check_attention_batch(launch, *checks.ATTENTION_BATCHES[1])),
    ("sample-batch-rows-count-as-drafts", "sampling.cu",
     "offset = verify ? row : 0;", "offset = row;",
     lambda launch: checks.check_sample_batch(launch, 517, checks.SLOT_OPTIONS, [4, 0, 5, 2, 1, 3])),
    ("sample-every-row-uses-slot-0's-parameters", "sampling.cu",
     "const float* const fp = fparams + slot * FPARAMS_LEN;", "const float* const fp = fparams;",
     lambda launch: checks.check_sample_batch(launch, 517, checks.SLOT_OPTIONS, [4, 0, 5, 2, 1, 3])),
    ("sample-seen-of-slot-0", "sampling.cu", "const int seen_at = slot * seen_stride;", "const int seen_at = 0;",
     lambda launch: checks.check_sample_batch(launch, 517, checks.SLOT_OPTIONS, [4, 0, 5, 2, 1, 3])),
    ("sample-batch-rows-write-x-row-0", "sampling.cu",
     "const size_t at = verify ? 0 : row,", "const size_t at = 0,",
     lambda launch: checks.check_sample_batch(launch, 517, checks.SLOT_OPTIONS, [4, 0, 5])),
    # each row's prepared input (the next step's first qkv reads it) in row 0's place
    ("sample-batch-rows-prepare-into-row-0", "sampling.cu", "xn + at * d,", "xn,",
     lambda launch: checks.check_sample_batch(launch, 517, checks.SLOT_OPTIONS, [4, 0, 5])),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_seeded_bug_fails_its_check(tmp_path, mutation):
    check_seeded_bug(tmp_path, mutation)
