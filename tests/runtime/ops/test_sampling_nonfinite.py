"""Non-finite logits, in the spec (cullama.runtime.sampling.sample) and in the sample kernel's twin: NaN counts as -inf,
a -inf token is never drawn, +inf tokens share the mass equally (greedy: the lowest id), and where every logit is NaN
or -inf the answer is NO_TOKEN, which the host turns into a one-line GenerationError; never an index out of bounds.
The kernel itself is checked against the twin on the same inputs in test_sampling_kernel.py (GPU, or the CPU
executor once it runs kernels)."""

import numpy as np
import pytest

from cullama.runtime import sampling
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.common.errors import GenerationError
from cullama.runtime.ops import sampling as ops
from cullama.runtime.plan import Buffer
from cullama.runtime.sampling import NO_TOKEN, Sampler, SamplingParams, sample
from tests.runtime.ops.test_sampling_kernel import assert_prepared, next_input, one_row, one_row_sizes

V = 67
# (temperature, top_k, top_p, repetition penalty): greedy, plain, top-k, top-p, a low temperature, and penalties
OPTIONS = {"greedy": (0.0, 0, 1.0, 1.0), "greedy-penalty": (0.0, 0, 1.0, 1.3), "temperature": (1.0, 0, 1.0, 1.0),
           "low-temperature": (0.05, 0, 1.0, 1.0), "top-k": (0.8, 5, 1.0, 1.0), "top-p": (0.9, 0, 0.7, 1.0),
           "all": (1.3, 7, 0.9, 1.2), "penalty-below-1": (0.7, 0, 1.0, 0.6)}
NEGATIVE_NAN = np.array([0xFFC00001], np.uint32).view(np.float32)[0]  # a NaN with the sign bit set


def params(options, seed=99) -> SamplingParams:
    temperature, top_k, top_p, penalty = options
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty, seed=seed)


def logits_and_seen(seed: int):
    rng = np.random.default_rng(seed)
    return (2 * rng.standard_normal(V)).astype(np.float32), rng.random(V) < 0.2


@pytest.mark.parametrize("name", OPTIONS)
def test_nan_is_minus_infinity(name):
    for seed in range(8):
        logits, seen = logits_and_seen(seed)
        bad = np.random.default_rng(seed).choice(V, 12, replace=False)
        with_nan, with_inf = logits.copy(), logits.copy()
        with_nan[bad[:6]], with_nan[bad[6:]] = np.nan, NEGATIVE_NAN
        with_inf[bad] = -np.inf
        for step in range(6):
            token = sample(with_nan, params(OPTIONS[name], seed), seen, step)
            assert token == sample(with_inf, params(OPTIONS[name], seed), seen, step)
            assert 0 <= token < V and token not in bad


@pytest.mark.parametrize("name", OPTIONS)
def test_plus_infinity_tokens_share_the_mass(name):
    logits, seen = logits_and_seen(1)
    logits[[9, 30, 51]] = np.inf
    logits[[3, 4]] = np.nan
    seen[30] = True  # +inf / penalty and +inf * penalty stay +inf
    drawn = [sample(logits, params(OPTIONS[name]), seen, step) for step in range(600)]
    if OPTIONS[name][0] == 0:
        assert set(drawn) == {9}  # greedy: the lowest id of the largest logit
    else:
        counts = np.bincount(drawn, minlength=V)
        assert set(np.flatnonzero(counts)) == {9, 30, 51} and counts[[9, 30, 51]].min() > 150  # 200 each expected


def test_a_temperature_overflow_to_infinity_is_drawn_like_plus_infinity():
    logits = np.array([1.0, 3e38, -2.0, 2e38, 3e38], np.float32)  # / 0.05 -> inf for ids 1, 3 and 4
    drawn = {sample(logits, params((0.05, 0, 1.0, 1.0)), np.zeros(5, bool), step) for step in range(200)}
    assert drawn == {1, 3, 4}
    assert sample(-logits, params((0.05, 0, 1.0, 1.0)), np.zeros(5, bool), 0) == 2  # the others -inf


@pytest.mark.parametrize("name", OPTIONS)
def test_no_drawable_logit_is_no_token(name):
    for logits in (np.full(V, np.nan, np.float32), np.full(V, -np.inf, np.float32),
                   np.where(np.arange(V) % 2, np.float32(np.nan), np.float32(-np.inf)).astype(np.float32)):
        assert sample(logits, params(OPTIONS[name]), np.ones(V, bool), 3) == NO_TOKEN
        sampler = Sampler(params(OPTIONS[name]), V, [1, 2])
        with pytest.raises(GenerationError, match="NaN or -inf"):
            sampler(logits)
        assert sampler.seen.sum() == 2 and sampler.step == 0  # nothing recorded


def test_twin_writes_no_token_leaves_seen_and_zeroes_x():
    embed = np.random.default_rng(0).standard_normal((V, 24)).astype(np.float16)
    for name, options in OPTIONS.items():
        temperature, top_k, top_p, penalty = options
        state = np.array([11, 5, 3, top_k, 7, 0, 0, 0], np.int32)
        fparams = np.array([temperature, top_p, penalty, 0], np.float32)
        seen = (np.arange(V) % 3 == 0).astype(np.uint8)
        x = np.full(24, np.nan, np.float32)
        nxt = next_input(x)
        ops.sample(np.full(V, np.nan, np.float32), seen, state, fparams, embed, *nxt, *one_row(),
                   *one_row_sizes(V, 24), grid=(1, 1, 1))
        assert_prepared(nxt)  # x = 0: xn 0, every Σ x² part 0
        assert state.tolist() == [12, NO_TOKEN, 4, top_k, 7, 0, 0, 0], name
        np.testing.assert_array_equal(seen, (np.arange(V) % 3 == 0).astype(np.uint8))
        np.testing.assert_array_equal(x, np.zeros(24, np.float32))


def test_the_backend_raises_when_the_kernel_drew_nothing():
    backend = NumpyBackend()
    backend.allocate([Buffer("state", (8,), "int32", "state")])
    backend.set("state", np.array([4, NO_TOKEN, 1, 0, 0, 0, 0, 0], np.int32))
    with pytest.raises(GenerationError, match="no token can be drawn"):
        backend.read_token()
    with pytest.raises(GenerationError):
        backend.token(0)
    backend.set("state", np.array([4, 17, 1, 0, 0, 0, 0, 0], np.int32))
    assert backend.read_token() == backend.token(1) == 17
    assert sampling.drawn(0) == 0
