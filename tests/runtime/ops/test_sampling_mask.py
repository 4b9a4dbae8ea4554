"""The allowed-token mask of constrained decoding in the sample kernel (kernels_cu/sampling.cu): the spec's `allowed`
(cullama.runtime.sampling.sample), the twin reading masks[slot][offset] for a slot whose state[MASKED] is set and no
mask otherwise, and the kernel against the twin (bit for bit on the greedy path; a sampled pick within rounding of
a bucket edge, and never a disallowed id) in a decode step, a verify step (row r reads its offset's mask row) and a
batched step (each row its own slot's), on the twins here, on the CPU executor (tests/runtime/emu/test_mask_emu.py)
and on a GPU (marker gpu, below)."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.runtime import plan as plans, sampling
from cullama.runtime.ops import sampling as ops
from cullama.runtime.sampling import NO_TOKEN, SamplingParams

from tests.runtime.ops.test_sampling_kernel import assert_prepared, explained, next_input
from tests.runtime.test_verify import at_row_stride, gpu_launcher, nan, state_at, twin_launcher

D = 24
GREEDY, PENALTY, SAMPLED, CUTS = (0.0, 0, 1.0, 1.0), (0.0, 0, 1.0, 1.3), (1.0, 0, 1.0, 1.0), (0.8, 20, 0.9, 1.2)


def words(V: int) -> int:
    return plans.mask_words(V)


def random_masks(slots: int, V: int, seed: int, density: float = 0.3, tokenizer: int | None = None) -> np.ndarray:
    """masks [slots, MASK_ROWS, words(V)] uint32 of random bits (each row at least one allowed id below `tokenizer`,
    none at or past it: a padded vocabulary's ids have no piece, and no grammar allows them)."""
    rng = np.random.default_rng(seed)
    tokenizer = tokenizer or V
    bits = rng.random((slots, ops.MASK_ROWS, words(V) * 32)) < density
    bits[..., tokenizer:] = False
    bits[..., rng.integers(0, tokenizer)] = True
    return np.packbits(bits, axis=-1, bitorder="little").view(np.uint32).copy()


def allowed_of(masks, slot: int, offset: int, V: int) -> np.ndarray:
    return ops.mask_bits(masks[slot, offset], V)


def test_mask_bits_are_llguidance_bit_order():
    """Bit i & 31 of word i >> 5, least significant first (llguidance's bitmask, which the host copies as it is)."""
    row = np.zeros(3, np.uint32)
    row[0], row[1], row[2] = 1 << 0 | 1 << 31, 1 << 5, 1 << 1
    assert np.flatnonzero(ops.mask_bits(row, 70)).tolist() == [0, 31, 37, 65]
    assert ops.mask_bits(row, 65).size == 65 and not ops.mask_bits(row, 65)[64]


# -- the spec ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [GREEDY, PENALTY, SAMPLED, CUTS])
def test_spec_allowed_is_the_logits_of_the_others_at_minus_inf(options):
    """sample(allowed=a) == sample of the logits with every id outside `a` at -inf, whatever the options; an all-True
    mask is no mask; nothing allowed is nothing to draw."""
    temperature, top_k, top_p, penalty = options
    rng = np.random.default_rng(3)
    V = 517
    for trial in range(40):
        logits = (3 * rng.standard_normal(V)).astype(np.float32)
        logits[rng.integers(0, V, 3)] = np.nan
        seen = rng.random(V) < 0.1
        allowed = rng.random(V) < (0.02 if trial % 4 == 0 else 0.4)
        allowed[rng.integers(0, V)] = True
        params = SamplingParams(temperature, top_k, top_p, penalty, seed=trial)
        cut = np.where(allowed, logits, np.float32(-np.inf))
        token = sampling.sample(logits, params, seen, trial, allowed=allowed)
        assert token == sampling.sample(cut, params, seen, trial) and allowed[token]
        assert sampling.sample(logits, params, seen, trial, allowed=np.ones(V, bool)) == \
            sampling.sample(logits, params, seen, trial)
    assert sampling.sample(logits, params, seen, 0, allowed=np.zeros(V, bool)) == NO_TOKEN


def test_spec_top_k_counts_the_allowed_ids_only():
    """Top-k over a mask keeps the k best *allowed* ids: with the 3 best ids disallowed, top_k=1 is the 4th best."""
    logits = np.arange(10, dtype=np.float32)
    allowed = np.ones(10, bool)
    allowed[7:] = False
    params = SamplingParams(temperature=1.0, top_k=1, seed=5)
    assert {sampling.sample(logits, params, np.zeros(10, bool), s, allowed=allowed) for s in range(50)} == {6}


# -- the twin ---------------------------------------------------------------------------------------------------
def run_rows(launch, logits_rows, seen, state, fp, embed, table, masks, verify, ids=None):
    """The sample kernel over `table`'s rows with `masks` [slots, MASK_ROWS, W]: (picks, x, out)."""
    rows, V = logits_rows.shape
    x, picks, out = nan(rows, embed.shape[1]), np.full(rows, -7, np.int32), np.full(rows + 1, -7, np.int32)
    kernel_logits = at_row_stride(logits_rows)
    ids = np.zeros(rows, np.int32) if ids is None else np.asarray(ids, np.int32)
    nxt = next_input(x)
    launch(plans.SAMPLE, (rows,), plans.SAMPLE_THREADS,
           (kernel_logits, seen, state, fp, embed, *nxt, np.asarray(table, np.int32), ids, picks, out,
            np.zeros(1, np.uint32), masks, np.int32(V), np.int32(embed.shape[1]), np.int32(seen.shape[1]),
            np.int32(masks.shape[-1]), np.int32(verify)))
    np.testing.assert_array_equal(kernel_logits[:, :V], logits_rows)  # left as they were
    assert_prepared(nxt, 1 if verify else rows)
    return picks, x, out


def case(V, rows, slots, seed):
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((rows, V))).astype(np.float32)
    seen = np.zeros((slots, plans.seen_stride(V)), np.uint8)  # rows 4-byte aligned, as the plans make them
    seen[:, :V] = rng.random((slots, V)) < 0.1
    embed = rng.standard_normal((V, D)).astype(np.float16)
    return logits, seen, embed


def fparams(options, slots):
    temperature, _, top_p, penalty = options
    return np.tile(np.array([temperature, top_p, penalty, 0.0], np.float32), (slots, 1))


def states(options, slots, masked, step=3):
    state = np.stack([state_at(11 + s, step=step + s, seed=1000 + s, top_k=options[1]) for s in range(slots)])
    state[:, ops.STATE_MASKED] = [int(s in masked) for s in range(slots)]
    return state


def spec_pick(logits, options, seen, step, seed, allowed):
    temperature, top_k, top_p, penalty = options
    return sampling.sample(logits, SamplingParams(temperature, top_k, top_p, penalty, seed=seed), seen, step,
                           allowed=allowed)


@pytest.mark.parametrize("options", [GREEDY, PENALTY, SAMPLED, CUTS])
def test_twin_batch_rows_draw_from_their_slots_mask_rows(options):
    """A batched step of slots 2, 0, 3, 1 with slots 0 and 3 constrained: each constrained row's pick is the spec's
    with its slot's mask row 0 (the allowed ids), the others the spec's without one."""
    V, slots, order = 517, 4, [2, 0, 3, 1]
    logits, seen, embed = case(V, 4, slots, 1)
    masks = random_masks(slots, V, 2, density=0.05)
    state = states(options, slots, masked={0, 3})
    spec = [spec_pick(logits[r], options, seen[s, :V] != 0, int(state[s, ops.STATE_STEP]), 1000 + s,
                      allowed_of(masks, s, 0, V) if s in (0, 3) else None) for r, s in enumerate(order)]
    picks, _, _ = run_rows(twin_launcher, logits, seen, state, fparams(options, slots), embed,
                           [[s, 0] for s in order], masks, 0)
    assert picks.tolist() == spec
    assert all(allowed_of(masks, s, 0, V)[picks[r]] for r, s in enumerate(order) if s in (0, 3))


def test_twin_reads_no_mask_for_a_slot_without_state_masked():
    """The masks of an unconstrained slot are never read: a masks argument that refuses every read changes no
    pick of a batch whose rows are all unconstrained."""
    class Unreadable:
        def __array__(self, *args, **kwargs):
            raise AssertionError("the masks were read")

        shape = (1,)

    V, slots = 517, 3
    logits, seen, embed = case(V, 3, slots, 5)
    state = states(CUTS, slots, masked=set())
    x, picks, out = nan(3, D), np.full(3, -7, np.int32), np.zeros(4, np.int32)
    ops.sample(at_row_stride(logits), seen, state, fparams(CUTS, slots), embed, *next_input(x),
               np.array([[0, 0], [1, 0], [2, 0]], np.int32), np.zeros(3, np.int32), picks, out, np.zeros(1, np.uint32),
               Unreadable(), V, D, seen.shape[1], words(V), 0, grid=(3, 1, 1))
    assert (picks >= 0).all()


# -- the kernel against the twin (a launcher: the twin, the CPU executor, a GPU) ---------------------------------
def check_masked_batch(launch, V, options, tokenizer=None, seed=0):
    """A batched step over 5 slots in the order 3, 0, 4, 1 (slot 2 idle), slots 3 and 1 constrained, the others'
    mask rows all zero (which would allow nothing if they were read): each row's pick is the twin's (greedy exactly;
    sampled within rounding, and always an allowed id), and state, seen and x follow from it. `tokenizer`: no mask
    allows an id at or past it (a padded vocabulary)."""
    slots, order, masked = 5, [3, 0, 4, 1], {3, 1}
    logits, seen, embed = case(V, 4, slots, seed)
    masks = random_masks(slots, V, seed + 1, density=0.02, tokenizer=tokenizer)
    for s in set(range(slots)) - masked:
        masks[s] = 0
    state = states(options, slots, masked)
    table = [[s, 0] for s in order]
    fp = fparams(options, slots)
    kernel_seen, kernel_state = seen.copy(), state.copy()
    picks, x, _ = run_rows(launch, logits, kernel_seen, kernel_state, fp, embed, table, masks, 0)
    twin_seen, twin_state = seen.copy(), state.copy()
    twin_picks, twin_x, _ = run_rows(twin_launcher, logits, twin_seen, twin_state, fp, embed, table, masks, 0)
    for r, s in enumerate(order):
        token = int(picks[r])
        assert token != NO_TOKEN and (s not in masked or allowed_of(masks, s, 0, V)[token]), (r, s, token)
        if tokenizer is not None and s in masked:
            assert token < tokenizer
        if token != twin_picks[r]:
            assert options[0] != 0, (r, token, twin_picks[r])
            allowed = allowed_of(masks, s, 0, V) if s in masked else np.ones(V, bool)
            params = ops.params_from(state[s], fp[s])
            assert explained(token, np.where(allowed, logits[r], np.float32(-np.inf)), params, seen[s, :V] != 0,
                             int(state[s, ops.STATE_STEP])), (r, token)
        else:
            np.testing.assert_array_equal(x[r], twin_x[r])
            np.testing.assert_array_equal(kernel_state[s], twin_state[s])
            np.testing.assert_array_equal(kernel_seen[s], twin_seen[s])


def check_masked_verify(launch, V, options, seed=0):
    """A verify step of 5 rows of slot 2 (constrained), row r reading mask row masks[2][r] (each row's mask its own,
    drafted ids allowed where they are, a draft the grammar refuses in row 3): the picks, verdict, state and seen
    are the twin's (greedy: exactly), and every pick is allowed by its row's mask."""
    slots, slot, rows = 3, 2, 5
    logits, seen, embed = case(V, rows, slots, seed)
    masks = random_masks(slots, V, seed + 1, density=0.05)
    rng = np.random.default_rng(seed)
    ids = [int(rng.integers(0, V))]
    for r in range(rows - 1):  # row r's argmax under its mask as the draft, but for row 2's (refused by row 3)
        allowed = allowed_of(masks, slot, r, V)
        draft = int(np.argmax(np.where(allowed, logits[r], -np.inf)))
        ids.append(draft)
    refused = int(np.flatnonzero(~allowed_of(masks, slot, 3, V))[0])
    ids[3] = refused
    state = states(options, slots, masked={slot})
    table = plans.slot_rows_table(slots)[slot, :rows]
    fp = fparams(options, slots)
    kernel_seen, kernel_state = seen.copy(), state.copy()
    picks, x, out = run_rows(launch, logits, kernel_seen, kernel_state, fp, embed, table, masks, 1, ids)
    twin_seen, twin_state = seen.copy(), state.copy()
    twin_picks, twin_x, twin_out = run_rows(twin_launcher, logits, twin_seen, twin_state, fp, embed, table, masks, 1,
                                            ids)
    for r in range(rows):
        assert allowed_of(masks, slot, r, V)[picks[r]], (r, picks[r])
    if options[0] == 0:
        np.testing.assert_array_equal(picks, twin_picks)
        np.testing.assert_array_equal(out, twin_out)
        np.testing.assert_array_equal(kernel_state, twin_state)
        np.testing.assert_array_equal(kernel_seen, twin_seen)
        np.testing.assert_array_equal(x[0], twin_x[0])
        assert out[0] <= 3  # the refused draft (row 2's, ids[3]) is never accepted


@pytest.mark.parametrize("options", [GREEDY, PENALTY, SAMPLED, CUTS])
def test_twin_masked_batch_is_the_twin(options):  # the check's own code, on the twin against itself
    check_masked_batch(twin_launcher, 517, options)


@pytest.mark.parametrize("options", [GREEDY, PENALTY])
def test_twin_verify_rows_read_their_offsets_mask_rows(options):
    """Row r of a constrained verify step is the spec's pick with masks[slot][r] (and the drafts before it seen)."""
    V, slots, slot, rows = 517, 3, 2, 5
    logits, seen, embed = case(V, rows, slots, 9)
    masks = random_masks(slots, V, 10, density=0.05)
    ids = [5, *(int(np.argmax(np.where(allowed_of(masks, slot, r, V), logits[r], -np.inf))) for r in range(4))]
    state = states(options, slots, masked={slot})
    picks, _, out = run_rows(twin_launcher, logits, seen.copy(), state.copy(), fparams(options, slots), embed,
                             plans.slot_rows_table(slots)[slot, :rows], masks, 1, ids)
    for r in range(rows):
        before = (seen[slot, :V] != 0) | np.isin(np.arange(V), ids[1:r + 1])
        assert picks[r] == spec_pick(logits[r], options, before, int(state[slot, ops.STATE_STEP]) + r, 1000 + slot,
                                     allowed_of(masks, slot, r, V))
    assert out[0] == rows  # the drafts are each row's masked argmax: all accepted
    check_masked_verify(twin_launcher, V, options)


# -- on a GPU (CULLAMA_FAKE_GPU=1 | emu runs these on the CPU) ----------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("V", [517, 32000, 152065])
@pytest.mark.parametrize("options", [GREEDY, PENALTY, SAMPLED, CUTS])
def test_gpu_masked_batch_rows_are_the_twins(kernels, V, options):
    check_masked_batch(gpu_launcher(kernels), V, options, tokenizer=V - 59 if V == 152065 else None)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [517, 32000])
@pytest.mark.parametrize("options", [GREEDY, PENALTY])
def test_gpu_masked_verify_rows_are_the_twins(kernels, V, options):
    check_masked_verify(gpu_launcher(kernels), V, options)
