"""The sampling filters at their edges, on the twin (cullama.runtime.sampling.sample) and on the real kernel
(kernels_cu/sampling.cu on the CPU executor): the same token from both, and the one the rule names.

- top-p where the kept mass lands exactly on the budget top_p * Z: the token that would take the mass past
  it is dropped (with its ties), the one that reaches it exactly is kept;
- top-k at 1, V - 1, V and above V (off, as 0 is);
- the repetition penalty and the temperature at the bounds SamplingParams allows.

Every probability here is a power of two (logits -k ln 2, whose float32 exp is exactly 2^-k), so every sum
is exact in any order: the kernel's block scan and the twin's cumsum must agree bit for bit, and a draw u
close to 1 (close to 0) picks the last (first) kept id, which tells the kept set's edge."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from cullama.runtime import emu, sampling
from cullama.runtime.ops import sampling as ops
from cullama.runtime.plan import SAMPLE_THREADS
from cullama.runtime.registry import KernelSpec
from cullama.runtime.sampling import SamplingParams

from tests.runtime.ops import test_sampling_kernel as cases

LN2 = math.log(2)
SEED = 0x9_8000_0007  # both 32-bit words non-zero, the low one with its top bit set


def step_where(predicate, seed: int = SEED) -> int:
    """The first RNG counter whose draw uniform(seed, step) satisfies `predicate`."""
    return next(step for step in range(100_000) if predicate(sampling.uniform(seed, step)))


HIGH = step_where(lambda u: 0.999 < u < 0.9999)  # a draw past 99.9 % of the kept mass: the last kept id
LOW = step_where(lambda u: 0.0001 < u < 0.001)  # a draw in the first 0.1 %: the first kept id


def dyadic(*k: float) -> np.ndarray:
    """Logits whose probabilities (relative to the largest, at k = 0) are exactly 2^-k."""
    logits = (-LN2 * np.asarray(k, np.float64)).astype(np.float32)
    assert np.array_equal(np.exp(logits - logits.max()), np.exp2(-np.asarray(k, np.float32)))  # exact, as promised
    return logits


def twin_token(logits, options, step, seen=None) -> int:
    temperature, top_k, top_p, penalty = options
    seen = np.zeros(logits.size, bool) if seen is None else seen.astype(bool)
    params = SamplingParams(temperature, top_k, top_p, penalty, seed=SEED)
    params.validate()
    return sampling.sample(logits, params, seen, step)


def kernel_token(logits, options, step, seen=None, schedule="shuffled") -> int:
    """The token the real kernel picks on the CPU executor, its parameters read from state and fparams."""
    temperature, top_k, top_p, penalty = options
    V = logits.size
    seen = np.zeros(V, np.uint8) if seen is None else seen.astype(np.uint8)
    state, fp = cases.make_state(SEED, step=step, top_k=top_k), cases.fparams(temperature, top_p, penalty)
    state[ops.STATE_TOKEN] = -2
    embed = np.zeros((V, cases.D), np.float16)
    x = np.full(cases.D, np.nan, np.float32)
    emu.launch(KernelSpec("sampling.cu", "sample"), 1, SAMPLE_THREADS,
               (np.ascontiguousarray(logits), seen, state, fp, embed, *cases.next_input(x), *cases.one_row(),
                *cases.one_row_sizes(V, cases.D)),
               schedule=schedule, seed=3)
    return int(state[ops.STATE_TOKEN])


def assert_both(logits, options, step, expected, seen=None):
    assert twin_token(logits, options, step, seen) == expected, "the twin"
    assert kernel_token(logits, options, step, seen) == expected, "the kernel"


# ---- top-p: the mass lands exactly on the budget --------------------------------------------------------
# p = 1, 1/2, 1/4, 1/8, 1/8 (Z = 2). With top_p * Z equal to the mass of the first j tokens, those j are the
# nucleus: the next one's strictly larger mass already reaches the budget, so it is out, and its tie with it.
TOP_P = dyadic(0, 1, 2, 3, 3)
TOP_P_CASES = [(0.5, 0),  # budget 1: token 0 alone reaches it
               (0.75, 1),  # budget 1.5 = 1 + 1/2: tokens 0 and 1
               (0.875, 2),  # budget 1.75 = 1 + 1/2 + 1/4: the tie 3, 4 just past it is out, both of them
               (0.8751, 4),  # a hair more: the tie is in, both of them
               (0.5001, 1)]


def test_the_draws_used_here_sit_at_the_ends_of_the_mass():
    assert 0.999 < sampling.uniform(SEED, HIGH) < 0.9999 and 0.0001 < sampling.uniform(SEED, LOW) < 0.001


@pytest.mark.parametrize("top_p, last", TOP_P_CASES)
def test_top_p_keeps_exactly_the_tokens_whose_mass_reaches_the_budget_twin(top_p, last):
    options = (1.0, 0, top_p, 1.0)
    assert twin_token(TOP_P, options, HIGH) == last  # the last kept id
    assert twin_token(TOP_P, options, LOW) == 0


@pytest.mark.emu
@pytest.mark.parametrize("top_p, last", TOP_P_CASES)
def test_top_p_keeps_exactly_the_tokens_whose_mass_reaches_the_budget_kernel(top_p, last):
    assert kernel_token(TOP_P, (1.0, 0, top_p, 1.0), HIGH) == last


def test_top_p_just_short_of_the_whole_mass_keeps_every_token():
    """p = 1, 1/2, 1/4, 1/8 (Z = 1.875), top_p 0.99: the last token's strictly larger mass, 1.75, is under the
    budget 1.856, so the smallest token (no tie to bring it back) is kept too."""
    assert twin_token(dyadic(0, 1, 2, 3), (1.0, 0, 0.99, 1.0), HIGH) == 3


@pytest.mark.emu
def test_top_p_on_the_budget_in_another_id_order():
    """The nucleus is a set of values, not of positions: shuffled ids, the same cut (budget 1.5: p = 1 and 1/2)."""
    order = [3, 0, 4, 1, 2]  # p = 1/8, 1, 1/8, 1/2, 1/4
    logits = TOP_P[order]
    assert_both(logits, (1.0, 0, 0.75, 1.0), HIGH, 3)  # p = 1/2, the last kept id
    assert_both(logits, (1.0, 0, 0.75, 1.0), LOW, 1)  # p = 1, the first kept id


# ---- top-k at its edges -----------------------------------------------------------------------------------
# Distinct logits, the least at id 0 and the greatest at id V - 1: with u near 0 the first kept id shows whether
# the least survived; with u near 1, whether anything but the greatest did.
TOP_K = dyadic(6, 5, 4, 3, 2, 1, 0)
V = TOP_K.size


@pytest.mark.emu
@pytest.mark.parametrize("top_k, first, last", [
    (1, V - 1, V - 1),  # the argmax alone
    (2, V - 2, V - 1),
    (V - 1, 1, V - 1),  # all but the least
    (V, 0, V - 1), (V + 1, 0, V - 1), (2**31 - 1, 0, V - 1), (0, 0, V - 1)])  # off
def test_top_k_at_its_edges(top_k, first, last):
    options = (1.0, top_k, 1.0, 1.0)
    assert_both(TOP_K, options, LOW, first)
    assert_both(TOP_K, options, HIGH, last)


@pytest.mark.emu
def test_top_k_keeps_a_tie_at_its_edge_and_the_cut_counts_only_real_ids():
    """top_k = 2 where the 2nd and 3rd largest tie: both kept (3 tokens). V = 5 leaves ids past V in the kernel's
    last 4-wide load: they must not count toward k."""
    logits = dyadic(0, 3, 1, 1, 5)
    assert_both(logits, (1.0, 2, 1.0, 1.0), HIGH, 3)
    assert_both(logits, (1.0, 2, 1.0, 1.0), LOW, 0)
    assert_both(logits, (1.0, 4, 1.0, 1.0), HIGH, 3)  # 4 of 5: the least (id 4) out


# ---- repetition penalty at its bounds -----------------------------------------------------------------------
def penalty_tie(penalty: float) -> tuple[np.float32, np.float32]:
    """(l, l * penalty in float32): a negative logit whose float32 product with the float32 penalty is not what
    float64 arithmetic rounded to float32 gives, so that only the device's arithmetic makes the tie."""
    p32 = np.float32(penalty)
    for l in np.float32(-3.0) - np.arange(2000, dtype=np.float32) * np.float32(1e-3):
        product = np.float32(l * p32)
        if product != np.float32(float(l) * penalty):
            return np.float32(l), product
    raise AssertionError("no such logit")


@pytest.mark.emu
@pytest.mark.parametrize("penalty", [sampling.MIN_REPETITION_PENALTY, sampling.MAX_REPETITION_PENALTY])
def test_repetition_penalty_at_its_bounds_is_float32_arithmetic(penalty):
    """Greedy, a seen token penalised into an exact tie with an unseen one: the lower id (the seen one) wins, on
    both; a penalty applied in float64, or the penalty's float32 rounding skipped, breaks the tie."""
    if penalty < 1:
        l, penalised = penalty_tie(penalty)  # negative: multiplied
    else:
        l = np.float32(3.0) + np.float32(2**-22) * 3  # positive: divided (float32 division is correctly rounded)
        penalised = np.float32(l / np.float32(penalty))
    logits = np.array([l, penalised, penalised - 1], np.float32)
    seen = np.array([1, 0, 0], np.uint8)
    assert_both(logits, (0.0, 0, 1.0, penalty), 0, 0, seen)
    # One ulp less on the unseen token: the seen one still wins; one ulp more: the unseen one does.
    logits[1] = np.nextafter(penalised, np.float32(-np.inf))
    assert_both(logits, (0.0, 0, 1.0, penalty), 0, 0, seen)
    logits[1] = np.nextafter(penalised, np.float32(np.inf))
    assert_both(logits, (0.0, 0, 1.0, penalty), 0, 1, seen)


@pytest.mark.emu
def test_a_penalty_only_touches_seen_tokens_and_both_signs_at_the_bounds():
    logits = np.array([2.0, -2.0, 1.0, -1.0], np.float32)
    seen = np.array([1, 1, 0, 0], np.uint8)
    # 1e3: 2 -> 0.002 and -2 -> -2000; the unseen 1.0 leads. 1e-3: 2 -> 2000 leads.
    assert_both(logits, (0.0, 0, 1.0, sampling.MAX_REPETITION_PENALTY), 0, 2, seen)
    assert_both(logits, (0.0, 0, 1.0, sampling.MIN_REPETITION_PENALTY), 0, 0, seen)
    # -2 * 1e-3 = -0.002 beats the unseen -1.0 once the seen 2.0 is gone
    logits[0] = -np.inf
    assert_both(logits, (0.0, 0, 1.0, sampling.MIN_REPETITION_PENALTY), 0, 2, seen)
    logits[2] = -np.inf
    assert_both(logits, (0.0, 0, 1.0, sampling.MIN_REPETITION_PENALTY), 0, 1, seen)


# ---- temperature at its bounds --------------------------------------------------------------------------------
@pytest.mark.emu
def test_temperature_at_its_bounds():
    """1e-6: logits 1e-5 apart are e^10 apart in odds, so draws at 0.01 % and 99.99 % both take the largest (at
    temperature 1 they would take ids 0 and 3); 100: logits 3 apart are near-equal (e^-0.03), so the ends of the
    mass are the first and the last id."""
    logits = np.array([-1e-5, 0.0, -2e-5, -3.0], np.float32)
    assert_both(logits, (sampling.MIN_TEMPERATURE, 0, 1.0, 1.0), HIGH, 1)
    assert_both(logits, (sampling.MIN_TEMPERATURE, 0, 1.0, 1.0), LOW, 1)
    assert_both(logits, (sampling.MAX_TEMPERATURE, 0, 1.0, 1.0), LOW, 0)
    assert_both(logits, (sampling.MAX_TEMPERATURE, 0, 1.0, 1.0), HIGH, 3)


# ---- the options' own bounds, as validate() draws them ------------------------------------------------------------
@pytest.mark.parametrize("name, inside, outside", [
    ("top_k", [0, 1, 2**31 - 1], [-1, 2**31]),  # the device's int32
    ("seed", [0, 2**32, 2**64 - 1], [-1, 2**64]),  # the device's uint64
    ("temperature", [0.0, sampling.MIN_TEMPERATURE, sampling.MAX_TEMPERATURE],
     [-1e-6, np.nextafter(sampling.MIN_TEMPERATURE, 0), np.nextafter(sampling.MAX_TEMPERATURE, 1e3)]),
    ("repetition_penalty", [sampling.MIN_REPETITION_PENALTY, 1.0, sampling.MAX_REPETITION_PENALTY],
     [np.nextafter(sampling.MIN_REPETITION_PENALTY, 0), np.nextafter(sampling.MAX_REPETITION_PENALTY, 1e4), 0.0]),
    ("top_p", [1.0, 0.5, 1e-45], [0.0, np.nextafter(1.0, 2.0), 1e-46]),  # 1e-46 is 0 in float32
])
def test_each_option_is_valid_up_to_its_bound_and_refused_past_it(name, inside, outside):
    for value in inside:
        SamplingParams(**{name: value}).validate()
    for value in outside:
        with pytest.raises(sampling.OptionError, match=f"^{name} "):
            SamplingParams(**{name: value}).validate()


@pytest.mark.parametrize("name, value", [("temperature", "0.7"), ("top_p", None), ("repetition_penalty", True),
                                         ("temperature", math.nan), ("top_p", math.inf), ("top_p", -math.inf)])
def test_an_option_that_is_not_a_finite_number_says_so(name, value):
    with pytest.raises(sampling.OptionError, match=f"^{name} must be a finite number, got {re.escape(repr(value))}$"):
        SamplingParams(**{name: value}).validate()


@pytest.mark.parametrize("top_p, note", [(1e-46, True), (0.0, False), (-0.5, False), (1.5, False)])
def test_a_top_p_out_of_range_says_whether_float32_made_it_0(top_p, note):
    with pytest.raises(sampling.OptionError, match="^top_p must be in") as info:
        SamplingParams(top_p=top_p).validate()
    assert str(info.value).endswith(" (0 in float32)") == note, str(info.value)


def test_sampling_params_are_a_value():
    params = SamplingParams(temperature=0.7, seed=3)
    with pytest.raises(dataclasses.FrozenInstanceError):  # shared between a Sampler, a plan and a result
        params.seed = 4
    assert {params: 1}[SamplingParams(temperature=0.7, seed=3)] == 1


def test_top_p_1_is_off_even_for_a_token_below_the_totals_rounding(monkeypatch):
    """p = 3e-8 beside p = 1: the float32 total is 1, as if it were not there, yet with top_p = 1 nothing is cut:
    a draw of exactly 0 picks it (first in id order), as it does with no top_p at all."""
    monkeypatch.setattr(sampling, "uniform", lambda seed, step: 0.0)
    logits = np.array([-17.3, 0.0], np.float32)
    assert np.float32(1) + np.exp(np.float32(-17.3)) == np.float32(1)
    for options in ((1.0, 0, 1.0, 1.0), (1.0, 2, 1.0, 1.0)):
        assert twin_token(logits, options, 0) == 0


@pytest.mark.emu
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_no_drawable_logit_is_the_same_no_token_on_both(temperature):
    logits = np.array([-np.inf, np.nan, -np.inf], np.float32)
    assert_both(logits, (temperature, 0, 1.0, 1.0), 0, sampling.NO_TOKEN)
    assert sampling.NO_TOKEN == -1  # kernels_cu/sampling.cu's NO_TOKEN


@pytest.mark.parametrize("u, token", [(0.0, 1), (0.2499, 1), (0.25, 0), (0.7499, 0), (0.75, 2), (0.8749, 2),
                                      (0.875, 3), (0.9999, 3)])
def test_a_draft_takes_the_first_bucket_and_the_rest_follow_in_id_order(monkeypatch, u, token):
    """p = 1, 1/2, 1/4, 1/4 (Z = 2), draft 1: u Z below p(draft) = 1/2 is the draft; past it, the other tokens'
    buckets in id order (0, 2, 3), the draft's own mass taken out of them. The edges are exact (dyadic)."""
    monkeypatch.setattr(sampling, "uniform", lambda seed, step: u)
    logits = dyadic(0, 1, 2, 2)
    params = SamplingParams(1.0, seed=SEED)
    assert sampling.sample(logits, params, np.zeros(4, bool), 0, draft=1) == token


def test_the_penalty_divides_positive_logits_and_multiplies_the_others_whatever_their_size():
    logits = np.array([-0.5, 0.5, 0.0, -0.0, 1.0, -1.0, 2.5, -2.5], np.float32)
    out = sampling.apply_repetition_penalty(logits, np.ones(8, bool), 2.0)
    assert out.tolist() == [-1.0, 0.25, 0.0, -0.0, 0.5, -2.0, 1.25, -5.0]
    assert np.signbit(out[3]) and not np.signbit(out[2])


@pytest.mark.emu
def test_a_small_seen_logit_is_penalised_by_its_sign_on_both():
    """-0.5 seen, penalty 2: -1.0, below the unseen -0.75 (a rule by magnitude would give -0.25 and pick it);
    0.5 seen: 0.25, below the unseen 0.3."""
    seen = np.array([1, 0], np.uint8)
    assert_both(np.array([-0.5, -0.75], np.float32), (0.0, 0, 1.0, 2.0), 0, 1, seen)
    assert_both(np.array([0.5, 0.3], np.float32), (0.0, 0, 1.0, 2.0), 0, 1, seen)


def test_an_integer_too_large_for_a_float_is_out_of_range_not_unreadable():
    with pytest.raises(sampling.OptionError, match=r"^temperature must be 0 \(greedy\) or from"):
        SamplingParams(temperature=10**400).validate()


def test_an_unseeded_generation_draws_all_64_bits_of_its_seed():
    seeds = [sampling.Sampler(SamplingParams(temperature=1.0), 4).params.seed for _ in range(16)]
    assert max(seeds) >= 2**60 and len(set(seeds)) == 16  # all below 2**60: 1 chance in 2**64
