"""Sampling: uniform() bit for bit, and sample()'s distributions measured over many draws.

Every draw uses a fixed seed, so these tests are deterministic; the tolerances are several
standard deviations wide all the same, so a correct sampler passes for any seed.
"""

import math
import re
import warnings

import numpy as np
import pytest

from cullama.runtime import sampling
from cullama.common.errors import PromptError
from cullama.runtime.sampling import Sampler, SamplingParams, apply_repetition_penalty, sample, uniform

M64 = 2**64
GOLDEN = 0x9E3779B97F4A7C15
N = 20000  # draws per distribution check: one frequency's standard deviation is <= 0.0036


def mix64(z: int) -> int:
    """splitmix64's finaliser, written here independently of cullama, in pure Python ints."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    return z ^ (z >> 31)


def expected_uniform(seed: int, step: int) -> float:
    return (mix64((seed * GOLDEN + step + 1) % M64) >> 40) / 2**24


def softmax(x) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def frequencies(logits, n: int = N, seen=None, **options) -> np.ndarray:
    logits = np.asarray(logits, dtype=np.float32)
    seen = np.zeros(logits.shape, dtype=bool) if seen is None else np.asarray(seen)
    params = SamplingParams(seed=1234, **options)
    draws = [sample(logits, params, seen, step) for step in range(n)]
    return np.bincount(draws, minlength=logits.size) / n


def assert_distribution(freq: np.ndarray, expected: np.ndarray, n: int = N) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    # Truncated tokens must never be drawn, not merely rarely.
    assert freq[expected == 0].sum() == 0, (freq, expected)
    # 5 standard deviations of the worst case, a frequency near 1/2.
    assert np.abs(freq - expected).max() < 5 * math.sqrt(0.25 / n), (freq, expected)
    support = expected > 0
    chi2 = n * np.sum((freq[support] - expected[support]) ** 2 / expected[support])
    dof = max(int(support.sum()) - 1, 1)
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, freq, expected)


def probs_to_logits(p, temperature: float = 1.0) -> np.ndarray:
    return (temperature * np.log(np.asarray(p, dtype=np.float64))).astype(np.float32)


# ---- uniform -------------------------------------------------------------------------------

def test_mix64_matches_published_splitmix64_outputs():
    # splitmix64 seeded with 0 (Vigna's reference): state += GOLDEN, output mix64(state).
    state, outputs = 0, []
    for _ in range(3):
        state = (state + GOLDEN) % M64
        outputs.append(mix64(state))
    assert outputs == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


@pytest.mark.parametrize("seed, step, bits", [
    (0, 0, 5673494), (1, 0, 9505325), (42, 7, 6888699), (M64 - 1, 123456, 1036158)])
def test_uniform_known_values(seed, step, bits):
    # `bits` pins the 24-bit value, so the device kernel's test can share these pairs.
    assert uniform(seed, step) == expected_uniform(seed, step) == bits / 2**24


def test_uniform_equals_uint64_wraparound_arithmetic():
    # What the device computes: uint64 arithmetic that silently wraps.
    seed, steps = 0xDEADBEEFCAFEF00D, np.arange(1000, dtype=np.uint64)
    x = np.uint64(seed) * np.array([GOLDEN], dtype=np.uint64) + steps + np.uint64(1)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    device = (x >> np.uint64(40)).astype(np.float64) / 2**24
    assert [uniform(seed, s) for s in range(1000)] == device.tolist()


@pytest.mark.parametrize("vary", ["step", "seed"])
def test_uniform_range_and_histogram(vary):
    n, bins = 50000, 32
    u = np.array([uniform(7, i) if vary == "step" else uniform(i, 3) for i in range(n)])
    assert u.min() >= 0 and u.max() < 1
    assert np.all(u * 2**24 == np.floor(u * 2**24))  # exactly 24 bits: exact in float32
    assert np.all(np.float32(u) == u)
    counts = np.bincount((u * bins).astype(int), minlength=bins)
    chi2 = np.sum((counts - n / bins) ** 2 / (n / bins))
    assert chi2 < (bins - 1) + 6 * math.sqrt(2 * (bins - 1))


# ---- greedy and repetition penalty ---------------------------------------------------------

def test_greedy_is_argmax_lowest_index_on_ties():
    logits = np.array([1.0, 3.0, 3.0, -2.0], dtype=np.float32)
    seen = np.zeros(4, dtype=bool)
    for step in range(20):
        # top_k / top_p / seed do not matter when greedy.
        assert sample(logits, SamplingParams(seed=step, top_k=1, top_p=0.1), seen, step) == 1
    assert sample(np.zeros(5, np.float32), SamplingParams(seed=0), np.zeros(5, bool), 0) == 0


def test_repetition_penalty_hf_semantics():
    logits = np.array([2.0, -2.0, 0.5, -0.5, 0.0], dtype=np.float32)
    seen = np.array([True, True, False, False, True])
    # Penalty > 1: positive seen logits shrink, negative ones grow more negative.
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [1.0, -4.0, 0.5, -0.5, 0.0]
    # Penalty < 1 does the opposite.
    assert apply_repetition_penalty(logits, seen, 0.5).tolist() == [4.0, -1.0, 0.5, -0.5, 0.0]
    out = apply_repetition_penalty(logits, seen, 1.3)
    assert out.dtype == np.float32
    # transformers' RepetitionPenaltyLogitsProcessor: where(score < 0, score * p, score / p).
    hf = np.where(logits < 0, logits * np.float32(1.3), logits / np.float32(1.3))
    np.testing.assert_array_equal(out, np.where(seen, hf, logits))


def test_repetition_penalty_steers_greedy_and_sampling():
    logits = np.array([1.0, 3.0, 2.5, 0.0], dtype=np.float32)
    seen = np.array([False, True, False, False])
    params = SamplingParams(repetition_penalty=2.0, seed=0)
    assert sample(logits, params, seen, 0) == 2  # 3.0 -> 1.5 loses to 2.5
    freq = frequencies(logits, seen=seen, temperature=1.0, repetition_penalty=2.0)
    assert_distribution(freq, softmax([1.0, 1.5, 2.5, 0.0]))


# ---- distributions -------------------------------------------------------------------------

LOGITS = [1.0, 0.5, 0.0, -1.0, 2.0, -np.inf, 0.3, 1.5]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_the_distribution(temperature):
    expected = softmax(np.array(LOGITS) / temperature)  # the -inf token: probability 0
    assert_distribution(frequencies(LOGITS, temperature=temperature), expected)


def test_top_k_keeps_the_k_largest():
    expected = softmax(LOGITS) * np.isin(np.arange(8), [0, 4, 7])
    assert_distribution(frequencies(LOGITS, temperature=1.0, top_k=3), expected / expected.sum())


def test_top_k_keeps_all_ties_at_the_threshold():
    logits = [0.0, 2.0, 1.0, 1.0, 1.0, -1.0]
    expected = softmax(logits) * np.array([0, 1, 1, 1, 1, 0])
    assert_distribution(frequencies(logits, temperature=1.0, top_k=2), expected / expected.sum())


# Probabilities 0.4 > 0.2 = 0.2 > 0.1 > 0.05 = 0.05; the mass strictly above each is
# 0, 0.4, 0.4, 0.8, 0.9, 0.9. A token is kept iff that mass is < top_p.
NUCLEUS_P = [0.1, 0.2, 0.4, 0.2, 0.05, 0.05]


@pytest.mark.parametrize("top_p, kept", [
    (0.3, [2]), (0.5, [1, 2, 3]), (0.85, [0, 1, 2, 3]), (0.95, [0, 1, 2, 3, 4, 5])])
def test_top_p_keeps_exactly_the_nucleus_with_ties(top_p, kept):
    expected = np.array(NUCLEUS_P) * np.isin(np.arange(6), kept)
    freq = frequencies(probs_to_logits(NUCLEUS_P), N // 2, temperature=1.0, top_p=top_p)
    assert_distribution(freq, expected / expected.sum(), N // 2)


def test_top_k_then_top_p_on_the_renormalised_mass():
    # Top-3 leaves 0.3, 0.25, 0.2 -> 0.4, 0.33, 0.27 of the remaining mass; top_p = 0.6 then
    # keeps two tokens. (Measured against the untruncated mass it would keep three: 0.55 < 0.6.)
    p = [0.3, 0.25, 0.2, 0.15, 0.1]
    logits = probs_to_logits(p, temperature=2.0)  # temperature applies before both cuts
    freq = frequencies(logits, temperature=2.0, top_k=3, top_p=0.6)
    assert_distribution(freq, np.array([0.3, 0.25, 0, 0, 0]) / 0.55)


@pytest.mark.parametrize("u, top_k, token", [(1.0, 2, 2), (1.0, 0, 3), (0.0, 2, 1), (0.0, 0, 1)])
def test_extreme_draws_pick_only_kept_tokens(monkeypatch, u, top_k, token):
    # u = 0: the first kept token, never a truncated one before it. u = 1 (outside uniform's
    # range) puts the target at the total mass, past every cumulative sum: the rounding guard
    # must pick the last kept token, not a truncated one after it.
    monkeypatch.setattr(sampling, "uniform", lambda seed, step: u)
    logits = np.array([-np.inf, 3.0, 2.0, 1.0, -np.inf], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=top_k, seed=0)
    assert sample(logits, params, np.zeros(5, dtype=bool), 0) == token


# ---- Sampler and seeds ---------------------------------------------------------------------

def run(params: SamplingParams, steps: int = 64, prompt=(3,)) -> list[int]:
    sampler = Sampler(params, 16, prompt)
    return [sampler(np.zeros(16, dtype=np.float32)) for _ in range(steps)]


def test_same_seed_same_sequence_different_seed_different():
    params = SamplingParams(temperature=1.0, seed=5)
    assert run(params) == run(params)
    assert run(params) != run(SamplingParams(temperature=1.0, seed=6))


def test_sampler_tracks_seen_tokens_and_steps():
    params = SamplingParams(temperature=0.8, top_k=10, repetition_penalty=1.5, seed=99)
    logits = np.linspace(-1.0, 1.0, 16, dtype=np.float32)
    sampler = Sampler(params, 16, [3, 7, 3])
    seen = np.isin(np.arange(16), [3, 7])  # the prompt starts out seen
    np.testing.assert_array_equal(sampler.seen, seen)
    for step in range(30):
        expected = sample(logits, params, seen.copy(), step)
        assert sampler(logits) == expected
        seen[expected] = True
        np.testing.assert_array_equal(sampler.seen, seen)
    assert sampler.step == 30


def test_unseeded_sampler_draws_a_seed_once():
    a, b = Sampler(SamplingParams(temperature=1.0), 16), Sampler(SamplingParams(temperature=1.0), 16)
    assert isinstance(a.params.seed, int) and 0 <= a.params.seed < M64
    assert a.params.seed != b.params.seed  # 64 random bits each
    # The drawn seed reproduces the generation.
    replay = Sampler(SamplingParams(temperature=1.0, seed=a.params.seed), 16)
    logits = np.zeros(16, dtype=np.float32)
    assert [a(logits) for _ in range(20)] == [replay(logits) for _ in range(20)]


@pytest.mark.parametrize("options, name", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"temperature": 1e-9}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": math.nan}, "top_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"repetition_penalty": math.nan}, "repetition_penalty"), ({"seed": -1}, "seed"),
    # beyond float32, or where its float32 arithmetic overflows or vanishes
    ({"temperature": 1e39}, "temperature"), ({"temperature": 101.0}, "temperature"),
    ({"temperature": 10**400}, "temperature"), ({"repetition_penalty": 1e300}, "repetition_penalty"),
    ({"repetition_penalty": 1e-50}, "repetition_penalty"), ({"repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"repetition_penalty": 1e4}, "repetition_penalty"), ({"top_p": 1e-50}, "top_p")])
def test_validation_names_the_option(options, name):
    with pytest.raises(PromptError, match=name) as info:
        SamplingParams(**options).validate()
    assert "\n" not in str(info.value)
    with pytest.raises(PromptError, match=name):
        Sampler(SamplingParams(**options), 16)


def test_defaults_are_valid_and_greedy():
    SamplingParams().validate()
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=0).validate()
    assert SamplingParams().greedy and not SamplingParams(temperature=0.7).greedy


def test_out_of_range_messages_say_the_bounds():
    for options, message in [({"temperature": 1e39}, "temperature must be 0 (greedy) or from 1e-06 to 100"),
                             ({"repetition_penalty": 1e-50}, "repetition_penalty must be from 0.001 to 1000"),
                             ({"top_p": 1e-50}, "top_p must be in (0, 1] (1 = off), got 1e-50 (0 in float32)")]:
        with pytest.raises(PromptError, match=re.escape(message)):
            SamplingParams(**options).validate()


def test_the_extreme_options_allowed_stay_finite_in_float32():
    """At the bounds, with large logits and every token seen: no overflow, no NumPy warning, a token drawn."""
    logits = np.array([3e4, -3e4, 10.0, -10.0], dtype=np.float32)
    seen = np.ones(4, dtype=bool)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for temperature in (sampling.MIN_TEMPERATURE, sampling.MAX_TEMPERATURE):
            for penalty in (sampling.MIN_REPETITION_PENALTY, sampling.MAX_REPETITION_PENALTY):
                params = SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=5)
                params.validate()
                assert 0 <= sample(logits, params, seen, 0) < 4
        assert sample(logits, SamplingParams(temperature=1.0, top_p=1e-40, seed=5), seen, 0) == 0  # denormal > 0
