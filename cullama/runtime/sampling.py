"""Token sampling: the NumPy specification of the device sampling kernel.

The device kernel (one block, inside a CUDA graph) implements `sample` step by step as written
here. Everything is float32, as on the device; the only freedom the device has is the order in
which it adds floats (a tree reduction / block scan rather than NumPy's pairwise sum and
sequential cumsum) and the last-ulp accuracy of `expf`. Those move a sum by a few ulps, so the
two can disagree only on a draw whose target lies within rounding of a bucket boundary.

Randomness is counter-based, `uniform(seed, step)`: no RNG state lives on the device, so the
kernel can be replayed in a graph, and a (seed, step) pair always gives the same draw.

Non-finite logits have one rule, here and on the device: NaN counts as -inf; a token whose logit
is -inf (after the penalty and the temperature) is never drawn; if the largest is +inf, the +inf
tokens share the mass equally (greedy: the lowest such id). Where every logit is NaN or -inf, no
token can be drawn: `sample` returns NO_TOKEN and the host raises (`drawn`).

Constrained decoding (a grammar allows some ids only: cullama/text/grammar.py) is one more step before all
of them: a disallowed id's logit is -inf (`allowed`), so it is never drawn, top-k counts and top-p's
mass cover the allowed ids only, and greedy takes the best allowed id.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os

import numpy as np

from ..common.errors import GenerationError, OptionError

MASK64 = (1 << 64) - 1
INT32_MAX = (1 << 31) - 1
GOLDEN64 = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: splitmix64's increment
# The sampler runs in float32, so each option is kept where its float32 value is finite and means what it
# says. Below MIN_TEMPERATURE, l / temperature can overflow (inf - inf = NaN) for large logits, and the
# distribution is greedy in all but name anyway; above MAX_TEMPERATURE (OpenAI's API stops at 2) two logits
# 50 apart give odds under e^0.5: uniform in all but name.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 100.0
# A factor of 1000 already takes a seen token out of the running (or, below 1, makes it the pick); beyond it
# the float32 products overflow or vanish (1e-50 is 0 in float32) and the text is garbage.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 1e3
NO_TOKEN = -1  # sample()'s answer, and the kernel's state[TOKEN], when every logit is NaN or -inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # None: drawn from os.urandom once, then fixed for the generation

    def validate(self) -> None:
        """Raise OptionError, one line naming the option, for a request `sample` cannot serve."""
        for name in ("temperature", "top_p", "repetition_penalty"):
            value = getattr(self, name)
            # NaN compares False with everything, so it would slip past the range checks below.
            if not is_real(value) or not is_finite(value):
                raise OptionError(name, f"must be a finite number, got {value!r}")
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise OptionError("temperature", f"must be 0 (greedy) or from {MIN_TEMPERATURE:g} to "
                              f"{MAX_TEMPERATURE:g}, got {self.temperature!r}")
        # The device keeps top_k in an int32 (a top_k at or above the vocabulary is off, as 0 is).
        if not is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            raise OptionError("top_k", f"must be an integer from 0 (off) to {INT32_MAX}, got {self.top_k!r}")
        # A top_p below float32's smallest number is 0 on the device, and 0 is refused as such.
        if not 0 < self.top_p <= 1 or np.float32(self.top_p) == 0:
            underflow = " (0 in float32)" if 0 < self.top_p <= 1 else ""
            raise OptionError("top_p", f"must be in (0, 1] (1 = off), got {self.top_p!r}{underflow}")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise OptionError("repetition_penalty", f"must be from {MIN_REPETITION_PENALTY:g} to "
                              f"{MAX_REPETITION_PENALTY:g} (1 = off), got {self.repetition_penalty!r}")
        # The device takes the seed as a uint64.
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed <= MASK64):
            raise OptionError("seed", f"must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_finite(value: numbers.Real) -> bool:
    """math.isfinite, where a number too large for a float (the integer 10**400) is finite, not an OverflowError:
    the range checks then refuse it."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return True


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def uniform(seed: int, step: int) -> float:
    """The draw for (seed, step): a float in [0, 1) with 24 random bits (exact in float32).

    x = seed * GOLDEN64 + step + 1, then splitmix64's finaliser. All arithmetic is mod 2**64,
    written with Python ints masked to 64 bits; on the device it is plain uint64 arithmetic,
    whose wraparound is the same thing (as is np.uint64 on arrays).
    """
    x = (seed * GOLDEN64 + step + 1) & MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    # The top 24 bits: every value is exactly representable in float32, and never rounds to 1.
    return (x >> 40) / (1 << 24)


def apply_repetition_penalty(logits: np.ndarray, seen_mask: np.ndarray, penalty: float) -> np.ndarray:
    """HF semantics: a seen token's logit is divided by the penalty if positive, else multiplied,
    so penalty > 1 always makes a seen token less likely. Returns a new float32 array."""
    l = np.asarray(logits, dtype=np.float32)
    penalty32 = np.float32(penalty)
    penalised = np.where(l > 0, l / penalty32, l * penalty32)
    return np.where(seen_mask, penalised, l).astype(np.float32)


def _nucleus(p: np.ndarray, budget: np.float32) -> np.ndarray:
    """Mask of tokens i whose strictly-larger mass, sum(p_j for p_j > p_i), is < budget.

    That mass only grows as p_i shrinks, so the kept set is every token with p_i >= some
    threshold: the top tokens in order, with any ties at the boundary all kept. Here it is
    computed by sorting; the device can instead bisect the threshold on p's bit pattern
    (p >= 0, so float order is uint32 order), one block reduction per probe.
    """
    s = np.sort(p)[::-1]  # descending
    before = np.concatenate(([np.float32(0)], np.cumsum(s, dtype=np.float32)[:-1]))
    # `before` only grows along s, so the kept entries are a prefix (the top value at least).
    # Within a tie run the first member's `before` is the run's strictly-larger mass; its
    # later members are brought back by `p >= threshold`.
    threshold = s[np.count_nonzero(before < budget) - 1]
    return p >= threshold


def sample(logits: np.ndarray, params: SamplingParams, seen_mask: np.ndarray, step: int,
           draft: int | None = None, allowed: np.ndarray | None = None) -> int:
    """Pick the next token id from one row of logits [vocab]. params.seed must be resolved.

    NaN logits count as -inf; NO_TOKEN where every logit is NaN or -inf (the module's rule).
    `allowed` (bool [vocab], constrained decoding): the ids that may be drawn; every other id's logit is -inf
    before anything else. None: every id.

    `draft` (speculative decoding: a drafted token for this position) moves the draft's bucket to the
    front of the inverse CDF: the draw returns the draft with probability p(draft), and otherwise a token
    drawn from p with the draft removed, renormalised. That is speculative sampling with a point mass for
    the draft distribution (accept with probability min(1, p/q) = p(draft), else resample from the
    residual), and the result is distributed as p itself. Greedy ignores it. Without a draft: plain id order.
    """
    if params.seed is None:
        raise ValueError("sample() needs a resolved seed; Sampler draws one")
    # 1. Repetition penalty, over the prompt and everything generated so far; NaN is -inf (it stays
    #    NaN through the penalty and the temperature, so replacing it first or last is the same).
    l = np.asarray(logits, dtype=np.float32)
    l = np.where(np.isnan(l), np.float32(-np.inf), l)
    if allowed is not None:  # 0. the grammar's mask
        l = np.where(allowed, l, np.float32(-np.inf))
    if params.repetition_penalty != 1.0:
        l = apply_repetition_penalty(l, seen_mask, params.repetition_penalty)
    # 2. Greedy: the argmax, lowest index on ties (np.argmax returns the first).
    if params.greedy:
        token = int(np.argmax(l))
        return token if l[token] > -np.inf else NO_TOKEN
    # 3. Temperature (a large logit over a small temperature may become +-inf).
    with np.errstate(over="ignore"):
        l = l / np.float32(params.temperature)
    top = l.max()
    if top == -np.inf:
        return NO_TOKEN
    # 4. Top-k: keep everything >= the k-th largest value, so ties at the threshold all survive.
    vocab = l.shape[0]
    kept = np.ones(vocab, dtype=bool)
    if 0 < params.top_k < vocab:
        kth_largest = np.partition(l, vocab - params.top_k)[vocab - params.top_k]
        kept = l >= kth_largest
    # 5. Unnormalised probabilities. The maximum is always kept, so max over all of l is the
    #    max over kept tokens and every exponent is <= 0 (no overflow). p = 1 at the maximum
    #    (exp(0) for a finite one; a +inf maximum gives inf - inf, so the +inf tokens get 1 each).
    with np.errstate(invalid="ignore"):
        e = np.exp(l - top)
    p = np.where(kept, np.where(l == top, np.float32(1), e), np.float32(0)).astype(np.float32)
    z = p.sum(dtype=np.float32)
    # 6. Top-p: the nucleus, measured against the mass top-k left; then renormalise.
    if params.top_p < 1.0:
        p = np.where(_nucleus(p, np.float32(params.top_p) * z), p, np.float32(0)).astype(np.float32)
        z = p.sum(dtype=np.float32)
    # 7. Inverse CDF in id order, after the draft's bucket [0, p(draft)) if there is a draft. A token
    #    with p = 0 never raises the cumulative sum, so it can never be the first to exceed the target:
    #    only kept tokens with p > 0 are chosen.
    p_draft = np.float32(0)
    if draft is not None:
        p_draft, p = p[draft], np.where(np.arange(vocab) == draft, np.float32(0), p).astype(np.float32)
        z = p.sum(dtype=np.float32)  # the rest's mass
    target = np.float32(uniform(params.seed, step)) * (z + p_draft)
    if target < p_draft:
        return int(draft)
    target = target - p_draft
    cumulative = np.cumsum(p, dtype=np.float32)
    (hits,) = np.nonzero(cumulative > target)
    if hits.size:
        return int(hits[0])
    # The cumsum's rounding can leave its total at or below target (z is summed in another
    # order): the draw belongs to the last bucket (the draft's, when nothing else has mass).
    rest = np.flatnonzero(p > 0)
    return int(rest[-1]) if rest.size else int(draft)


def drawn(token: int) -> int:
    """A sampled token, or a GenerationError where sampling found nothing to draw (NO_TOKEN)."""
    if token == NO_TOKEN:
        raise GenerationError("no token can be drawn: every logit is NaN or -inf (the model's numbers overflowed; "
                              "check the weights)")
    return token


class Sampler:
    """Sampling state for one generation: params (seed resolved), the seen mask, the step."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids=()) -> None:
        params.validate()
        if params.seed is None:
            # Drawn once here, so the whole generation is reproducible from self.params.seed.
            params = dataclasses.replace(params, seed=int.from_bytes(os.urandom(8), "little"))
        self.params = params
        # HF penalises repeats of prompt tokens too, so the prompt starts out seen.
        self.seen = np.zeros(vocab_size, dtype=bool)
        self.seen[np.asarray(prompt_ids, dtype=np.int64)] = True
        self.step = 0

    def __call__(self, logits: np.ndarray) -> int:
        token = drawn(sample(logits, self.params, self.seen, self.step))
        self.seen[token] = True
        self.step += 1
        return token
