"""The sample kernel's allowed-token mask (constrained decoding) as written, on the CPU executor (cullama.runtime.emu), in
every warp schedule: a batched step's constrained rows draw only from their own slot's mask row, the unconstrained
rows read no mask (theirs allow nothing, and their picks are the twin's), a verify step's row r reads its offset's
mask row; ids past V (the greedy path's unrolled loads) are never looked up. The same checks run on the twins and on
a GPU in tests/runtime/ops/test_sampling_mask.py; the seeded bugs below show they have teeth."""

import pytest

from cullama.runtime import emu
from tests.emulated import check_seeded_bug, emu_launcher
from tests.runtime.ops import test_sampling_mask as checks

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("options", [checks.GREEDY, checks.PENALTY, checks.SAMPLED, checks.CUTS],
                         ids=["greedy", "penalty", "sampled", "cuts"])
def test_masked_batch_rows_are_the_twins(options, schedule):
    checks.check_masked_batch(emu_launcher(schedule), 517, options)


def past_the_on_chip_ids(launch, options):
    """check_masked_batch at V = 33001 > 1024 x 32 (the sampled path's 36 ids a thread, the last 4 re-read by key1)
    with a padded vocabulary, on 3 seeds: one draw per constrained row can land on the same allowed id with or without
    the mask on the re-read ids (seed 0's two do since MASK_ROWS 16 changed its masks; seeds 1 and 2 do not)."""
    for seed in range(3):
        checks.check_masked_batch(launch, 33001, options, tokenizer=33001 - 59, seed=seed)


@pytest.mark.parametrize("options", [checks.GREEDY, checks.CUTS], ids=["greedy", "cuts"])
def test_masked_rows_past_the_on_chip_ids(options):
    """V = 33001 > 1024 x 32: the sampled path re-reads ids past its on-chip cache (key1), the greedy path's last
    unrolled loads lie past V; a padded vocabulary (no mask allows the last 59 ids)."""
    past_the_on_chip_ids(emu_launcher("forward"), options)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("options", [checks.GREEDY, checks.PENALTY], ids=["greedy", "penalty"])
def test_masked_verify_rows_are_the_twins(options, schedule):
    checks.check_masked_verify(emu_launcher(schedule), 517, options)


def batch(launch):
    checks.check_masked_batch(launch, 517, checks.GREEDY)


# (id, file, original text, its replacement, the check that must fail)
MUTATIONS = [
    ("mask-ignored-on-the-vector-path", "sampling.cu",
     "const uint32_t bits = masked && i < V ? row_mask[i >> 5] >> (i & 31) : 0xfu;", "const uint32_t bits = 0xfu;",
     batch),
    ("mask-ignored-past-the-on-chip-ids", "sampling.cu",
     "return masked && !allowed(i) ? NEG_INF_KEY : float_key(v);", "return float_key(v);",
     lambda launch: past_the_on_chip_ids(launch, checks.CUTS)),
    ("mask-read-whatever-the-state", "sampling.cu", "const bool masked = st[STATE_MASKED] != 0;",
     "const bool masked = true;", lambda launch: checks.check_masked_batch(launch, 517, checks.CUTS)),
    ("mask-rows-of-slot-0", "sampling.cu", "const int at = slot * MASK_ROWS + step_rows", "const int at = step_rows",
     batch),
    ("mask-verify-rows-read-row-0", "sampling.cu", "const int at = slot * MASK_ROWS + step_rows[row * ROW_FIELDS + "
     "ROW_OFFSET];", "const int at = slot * MASK_ROWS;",
     lambda launch: checks.check_masked_verify(launch, 517, checks.GREEDY)),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_seeded_bug_fails_its_check(tmp_path, mutation):
    check_seeded_bug(tmp_path, mutation)
