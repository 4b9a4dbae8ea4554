"""The verify step's kernels as written, on the CPU executor (cullama.runtime.emu): row t of a k + 1-row launch equals a
one-row launch at position pos + t, bit for bit, in every warp schedule (gemv_mma.cu with TOKENS = k + 1,
attention_decode with the rows on gridDim.z), and the sample kernel over k + 1 rows gives the twin's verdict
(greedy exactly; sampled within rounding of a bucket edge, the draft's bucket first). The same checks run on a
GPU in tests/runtime/test_verify.py."""

import pytest

from tests.runtime import test_verify as checks
from cullama.runtime import emu
from tests.emulated import check_seeded_bug, emu_launcher

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("rows", [2, 5, 9])
def test_gemv_rows_are_one_row_launches(rows, schedule):
    checks.check_gemv_rows(emu_launcher(schedule), rows, d=72, ff=56, V=37, heads=3, kv_heads=1, hd=8, pos=5,
                           seed=rows)


# K = d = 4104 (513 16-byte chunks, 129 k-blocks): every warp chains 32-33 k-blocks over several batches of loads,
# the last k-block partial, and all four warps' partials are large (at d = 72 the fourth warp's is zero).
GEMV_BIG = dict(d=4104, ff=24, V=12, heads=2, kv_heads=1, hd=8, pos=5)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
def test_gemv_rows_are_one_row_launches_over_several_batches(schedule):
    checks.check_gemv_rows(emu_launcher(schedule), 5, seed=5, **GEMV_BIG)


# hd 128, GROUP 4: UNROLL 2, 16 keys a batch (LANE_GROUPS 8), and 1001-1005 keys over 4 splits: ~16 batches per
# split, the online softmax rescaled between them, the last batch partial and the split edges moving with the
# row. ATTENTION_CASES[:4] give each split one batch at most.
ATTENTION_LONG = (128, 4, 2, 1000, 5, 4)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("hd,group,kv_heads,pos,rows,splits", checks.ATTENTION_CASES[:4] + [ATTENTION_LONG])
def test_attention_rows_are_one_row_launches(hd, group, kv_heads, pos, rows, splits, schedule):
    checks.check_attention_rows(emu_launcher(schedule), hd, group, kv_heads, pos, rows, splits)


# Sliding windows (Mistral): each row its own window, its own splits of it; and ATTENTION_LONG's 1000 keys in a
# window of 300 (several batches a split, the window's start moving with the row).
@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("hd,group,kv_heads,pos,rows,splits,window", checks.WINDOW_CASES + [ATTENTION_LONG + (300,)])
def test_windowed_attention_rows_are_one_row_launches(hd, group, kv_heads, pos, rows, splits, window, schedule):
    checks.check_attention_rows(emu_launcher(schedule), hd, group, kv_heads, pos, rows, splits, window)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("V,penalty", [(517, 1.0), (517, 1.3), (33001, 1.3)])
def test_greedy_verify_sample_equals_its_twin(V, penalty, schedule):
    checks.check_greedy_sample_rows(emu_launcher(schedule), V, penalty)


@pytest.mark.parametrize("V,trials", [(517, 6), (33001, 2)])
def test_sampled_verify_sample_follows_its_twin(V, trials):
    checks.check_sampled_sample_rows(emu_launcher("shuffled"), V, trials)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
def test_verify_sample_bounds_its_drafts(schedule):
    """A draft id outside [0, V) indexes nothing (the executor faults on a stray access) and is the no-token answer."""
    checks.check_drafts_outside_the_vocabulary(emu_launcher(schedule))


# (id, file, original text, its replacement, the check that must fail): the checks above have teeth
MUTATIONS = [
    ("gemv-rows-at-one-position", "gemv_mma.cu", "const int pos = row_pos(step_rows, state, tok);",
     "const int pos = row_pos(step_rows, state, 0);",
     lambda launch: checks.check_gemv_rows(launch, 3, d=72, ff=56, V=37, heads=3, kv_heads=1, hd=8, pos=5)),
    ("attention-rows-see-the-first-row's-keys", "attention.cu", "min(row_pos(step_rows, state, row) + 1, max_seq)",
     "min(row_pos(step_rows, state, 0) + 1, max_seq)",
     lambda launch: checks.check_attention_rows(launch, 8, 2, 2, 5, 3, 4)),
    ("attention-rows-share-the-first-row's-window", "attention.cu", "const int first = max(n - window, 0);",
     "const int first = max(n - row - window, 0);",
     lambda launch: checks.check_attention_rows(launch, *checks.WINDOW_CASES[1])),
    ("gemv-bias-on-the-first-row-only", "gemv_mma.cu", "scale), b0);", "scale), b0 * (tok == 0));",
     lambda launch: checks.check_gemv_rows(launch, 3, d=72, ff=56, V=37, heads=3, kv_heads=1, hd=8, pos=5)),
    # the warps' partials added last to first in a multi-row launch only: a row's sum then depends on TOKENS
    # (decode 1, verify k + 1), as a kernel whose order follows its variant would
    ("gemv-order-depends-on-tokens", "gemv_mma.cu",
     "    float d = part.dot[0][i][tok];\n#pragma unroll\n    for (int w = 1; w < WARPS; ++w) d = __fadd_rn(d, part.dot[w][i][tok]);",
     "    float d = part.dot[TOKENS > 1 ? WARPS - 1 : 0][i][tok];\n#pragma unroll\n"
     "    for (int w = 1; w < WARPS; ++w) d = __fadd_rn(d, part.dot[TOKENS > 1 ? WARPS - 1 - w : w][i][tok]);",
     lambda launch: checks.check_gemv_rows(launch, 5, seed=5, **GEMV_BIG)),
    # l not rescaled when a later batch raises the max: wrong only where a lane group sees a second batch
    ("attention-sum-not-rescaled-between-batches", "attention.cu", "l[j] *= c;", ";",
     lambda launch: checks.check_attention_rows(launch, *ATTENTION_LONG)),
    ("sample-accepts-against-the-wrong-draft", "sampling.cu", "load_coherent(picks + j) == ids[j + 1]",
     "load_coherent(picks + j) == ids[j]", lambda launch: checks.check_greedy_sample_rows(launch, 517, 1.0)),
    ("sample-drafts-not-seen", "sampling.cu", "? draft : -1;", "? -1 : -1;",
     lambda launch: checks.check_greedy_sample_rows(launch, 517, 1.3)),
    ("sample-draft-ids-unbounded", "sampling.cu", "if (id < 0 || id >= V) marked[e] = NOT_AN_ID;",
     "if (false) marked[e] = NOT_AN_ID;",
     checks.check_drafts_outside_the_vocabulary),
    ("sample-accepts-a-no-token-pick", "sampling.cu", "while (drafts_are_ids && j + 1 < rows", "while (j + 1 < rows",
     checks.check_drafts_outside_the_vocabulary),
    ("sample-logits-not-put-back", "sampling.cu", "const_cast<float*>(row_logits)[marked[threadIdx.x]] = raw[threadIdx.x];",
     ";", lambda launch: checks.check_greedy_sample_rows(launch, 517, 1.3)),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_seeded_bug_fails_its_check(tmp_path, mutation):
    check_seeded_bug(tmp_path, mutation)
