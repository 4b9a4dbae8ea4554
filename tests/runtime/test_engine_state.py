"""The scalars PlanRunner keeps in the device state (kernels_cu/common.cuh: position, token, step, top_k, the
seed's two 32-bit words) and in fparams (temperature, top_p, repetition penalty) make the round trip: what
start() writes is what the twin and the real kernel read back, for seeds above 2**32 too, and the position and
step move as the tokens do.

A seeded test on a peaked model hides a wrong seed (every draw lands on the same token), so the draws here
are made where they matter: temperature 1, no filters, a flat distribution (the model's lm_head zeroed: every
logit 0, each of the V tokens 1 / V likely), where the token is floor(u V) and a wrong word of the seed or a
wrong step changes it."""

from __future__ import annotations

import numpy as np
import pytest

import cullama
from cullama.runtime import emu, engine, sampling
from cullama.runtime.ops import sampling as ops
from cullama.runtime.plan import SAMPLE_THREADS
from cullama.runtime.registry import KernelSpec
from cullama.runtime.sampling import SamplingParams
from tests.runtime.ops.test_sampling_kernel import next_input

SEEDS = [2**32, 2**32 + 2**31 + 5, 0xDEADBEEFCAFEF00D, 2**63 + 12345, 2**64 - 1, 7]
PROMPT = [1, 403, 407, 261, 378]


@pytest.fixture(scope="module")
def llm(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


@pytest.fixture(scope="module")
def flat(stories_dir):
    """stories260K with lm_head zeroed: every logit is exactly 0."""
    model = cullama.Llama.from_pretrained(stories_dir, device="cpu")
    backend = model.runner.backend
    backend.bind("lm_head", np.zeros_like(backend.arrays["lm_head"]))
    assert not model.logits(PROMPT).any()
    return model


def recorded(runner, monkeypatch, names=("state", "fparams")) -> dict:
    """Copies of what the runner hands the backend for `names`, as it hands it over (state and fparams: the slot's
    row it writes, [8] and [4])."""
    seen, real_set = {}, runner.backend.set

    def set(name, array, row=0):
        if name in names:
            copy = np.array(array, copy=True)
            seen[name] = copy[0] if name in ("state", "fparams") and copy.ndim == 2 else copy
        real_set(name, array, row)

    monkeypatch.setattr(runner.backend, "set", set)
    return seen


def effective_top_k(top_k: int, V: int) -> int:
    """top_k as the sampler applies it: at or above the vocabulary it is off, as 0 is."""
    return 0 if top_k >= V else top_k


def device_state(runner) -> np.ndarray:
    """The runner's current slot's state [8] on the device."""
    return runner.backend.read("state")[runner.slot]


def flat_draws(params: SamplingParams, steps, V: int) -> list[int]:
    """What sample() draws from V equal logits at these steps."""
    return [sampling.sample(np.zeros(V, np.float32), params, np.zeros(V, bool), step) for step in steps]


@pytest.mark.parametrize("options", [
    dict(temperature=1.0, seed=2**32),
    dict(temperature=0.7, top_k=40, top_p=0.9, repetition_penalty=1.1, seed=2**32 + 2**31 + 5),
    dict(temperature=sampling.MIN_TEMPERATURE, top_k=1, top_p=1e-40, repetition_penalty=sampling.MIN_REPETITION_PENALTY,
         seed=2**64 - 1),
    dict(temperature=sampling.MAX_TEMPERATURE, top_k=511, top_p=0.3, repetition_penalty=sampling.MAX_REPETITION_PENALTY,
         seed=0xDEADBEEFCAFEF00D),
    dict(temperature=0.0, top_k=512, seed=0),  # top_k at the vocabulary: off, as 0 is
    dict(temperature=1.3, top_k=2**31 - 1, seed=2**63),  # above it: stored as the vocabulary
], ids=["seed-2^32", "all-options", "lower-bounds", "upper-bounds", "greedy-top-k-V", "top-k-int32-max"])
def test_start_stores_every_option_as_the_kernels_read_it(llm, options, monkeypatch):
    runner, V = llm.runner, llm.config.vocab_size
    written = recorded(runner, monkeypatch)
    params = SamplingParams(**options)
    token = runner.start(PROMPT, params)
    state, fparams = written["state"], written["fparams"]
    assert state.dtype == np.int32 and fparams.dtype == np.float32
    f32 = lambda value: float(np.float32(value))  # noqa: E731 (the device holds float32)
    stored = ops.params_from(state, fparams)
    assert stored == SamplingParams(f32(params.temperature), stored.top_k, f32(params.top_p),
                                    f32(params.repetition_penalty), params.seed)
    assert effective_top_k(stored.top_k, V) == effective_top_k(params.top_k, V) and 0 <= stored.top_k <= 2**31 - 1
    # The prefill's sample kernel starts at the prompt's last position and step 0, and advances both.
    assert (state[engine.POS], state[engine.STEP]) == (len(PROMPT) - 1, 0)
    after = device_state(runner)
    assert list(after[:3]) == [len(PROMPT), token, 1]
    assert list(after[3:6]) == list(state[3:6])  # top_k and the seed are read, never written
    second = runner.next()
    assert list(device_state(runner)[:3]) == [len(PROMPT) + 1, second, 2]


def test_the_seed_reaches_the_draws_through_the_state(flat):
    """Tokens on the flat model are the seed's draws at steps 0, 1, 2, ... (floor(u V)): both words of the seed
    and the step counter as the kernels' twin reads them from the state."""
    V = flat.config.vocab_size
    for seed in SEEDS:
        out = flat.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        assert out.token_ids == flat_draws(SamplingParams(1.0, seed=seed), range(6), V), hex(seed)
    # A seed that differs from another only in its high word draws other tokens.
    low = flat.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=5, ignore_eos=True).token_ids
    assert low != flat.generate(PROMPT, max_new_tokens=6, temperature=1.0, seed=5 + 2**32, ignore_eos=True).token_ids


def test_a_verify_step_moves_the_position_and_step_as_its_tokens_do(llm, flat):
    """Speculative verify: the accepted tokens advance the position and the RNG counter by their number, and the
    draws go on at the right counter after it."""
    runner, n = llm.runner, len(PROMPT)
    greedy = SamplingParams(0.0, seed=2**40 + 3)
    continuation = llm.generate(PROMPT, max_new_tokens=8, ignore_eos=True).token_ids
    assert runner.start(PROMPT, greedy) == continuation[0]
    assert runner.verify(continuation[1:4]) == continuation[1:5]  # every draft accepted: 4 tokens
    assert list(device_state(runner)[:3]) == [n + 4, continuation[4], 5] and len(runner.cached) == n + 4
    wrong = (continuation[6] + 1) % llm.config.vocab_size
    assert runner.verify([continuation[5], wrong, continuation[7]]) == continuation[5:7]  # the 2nd draft rejected
    assert list(device_state(runner)[:3]) == [n + 6, continuation[6], 7] and len(runner.cached) == n + 6
    # Sampled, on the flat model: row 0 draws at counter 1 with the draft first in its inverse CDF; the step
    # after the verify draws at counter 2.
    runner, V = flat.runner, flat.config.vocab_size
    params = SamplingParams(1.0, seed=2**40 + 3)
    first = runner.start(PROMPT, params)
    seen = np.zeros(V, bool)
    picked = sampling.sample(np.zeros(V, np.float32), params, seen, 1, draft=(first + 1) % V)
    assert runner.verify([(first + 1) % V, 5]) == [picked]
    assert list(device_state(runner)[:3]) == [n + 1, picked, 2]
    assert runner.next() == flat_draws(params, [2], V)[0]


@pytest.mark.emu
def test_the_kernel_reads_the_seed_that_start_wrote(llm, monkeypatch):
    """The real sample kernel (CPU executor) given the state start() wrote, on V equal logits: its draws are the
    twin's for the Python seed, step after step (the kernel advances the step itself)."""
    V, D = llm.config.vocab_size, 8
    written = recorded(llm.runner, monkeypatch)
    for seed in SEEDS:
        llm.runner.start(PROMPT, SamplingParams(1.0, seed=seed))
        state, fparams = written["state"].copy(), written["fparams"]
        start = int(state[engine.STEP])
        logits, seen = np.zeros(V, np.float32), np.zeros(V, np.uint8)
        embed, x = np.zeros((V, D), np.float16), np.zeros(D, np.float32)
        tokens = []
        for _ in range(3):
            emu.launch(KernelSpec("sampling.cu", "sample"), 1, SAMPLE_THREADS,
                       (logits, seen, state, fparams, embed, *next_input(x), np.zeros((1, 2), np.int32),
                        np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(2, np.int32), np.zeros(1, np.uint32),
                        np.zeros(1, np.uint32),
                        np.int32(V), np.int32(D), np.int32(V), np.int32(-(-V // 32)), np.int32(1)), schedule="shuffled")
            tokens.append(int(state[engine.TOKEN]))
        assert tokens == flat_draws(SamplingParams(1.0, seed=seed), range(start, start + 3), V), hex(seed)
