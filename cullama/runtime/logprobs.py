"""Log-probabilities: of a prompt's tokens (`Llama.logprobs`, the server's `echo`), of generated tokens
(`Llama.stream(logprobs=N)`), and the perplexity of a text of any length (`Llama.perplexity`, sliding windows).

The distribution reported is the model's raw softmax over the ids it can produce (the tokenizer's pieces; the
whole vocabulary without a tokenizer), before any repetition penalty, temperature, top-k or top-p: what vLLM
reports by default, and what a perplexity measures. A sampled token's log-probability therefore does not depend
on how it was drawn.

The device reduces each row of logits to a few numbers (kernels_cu/sampling.cu `logprobs`: the largest logit m,
s = sum exp(l - m), the target's logit, the top-N logits and ids), so no vocabulary row crosses to the host; this
module finishes them, log p = l - (m + log s), in float64. NaN logits count as -inf, as in sampling; where the
largest logit is +inf the +inf ids share the mass, as in sampling; a token the model gives no probability has
log p = -inf.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import numpy as np

from ..common.errors import OptionError
from .ops.sampling import LP_MAX, LP_MAX_TOP, LP_SUM, LP_TARGET, LP_TARGET_ID, LP_TOP, LP_TOP_ID
from .sampling import is_int

MAX_TOP = LP_MAX_TOP  # the most alternatives per position (OpenAI's top_logprobs limit, 20)
NO_TARGET = -1  # a row's target when it has none (a prompt's last row): outside the vocabulary, no log-probability


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One position: its token and log p(token | the ids before it), and the `top` most likely ids there with
    theirs, most likely first (lower ids first on ties). -inf where the model gives an id no probability."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def checked_top(value, name: str) -> int | None:
    """None (off) or how many alternatives to report, 0 to MAX_TOP; OptionError naming `name` otherwise."""
    if value is None:
        return None
    if not is_int(value) or not 0 <= value <= MAX_TOP:
        raise OptionError(name, f"must be None or an integer from 0 to {MAX_TOP}, got {value!r}")
    return int(value)


def from_rows(rows: np.ndarray, top: int) -> list[TokenLogprob]:
    """The TokenLogprob of each row of the logprobs kernel's output ([rows, LP_WIDTH] float32), with its first
    `top` alternatives (the kernel computed at least that many)."""
    ints = np.ascontiguousarray(rows, dtype=np.float32).view(np.int32)
    records = []
    for row, bits in zip(rows, ints):
        lp = _finisher(float(row[LP_MAX]), float(row[LP_SUM]))
        alternatives = tuple((int(bits[LP_TOP_ID + j]), lp(row[LP_TOP + j])) for j in range(top)
                             if bits[LP_TOP_ID + j] >= 0)
        records.append(TokenLogprob(int(bits[LP_TARGET_ID]), lp(row[LP_TARGET]), alternatives))
    return records


def _finisher(m: float, s: float) -> Callable[[float], float]:
    """l -> log p(l) for a row whose largest logit is m and s = sum exp(l - m) (the kernel's rules)."""
    if m == -math.inf or math.isnan(m):  # no id has a probability
        return lambda l: -math.inf
    if m == math.inf:  # the +inf ids share the mass equally: s counts them
        return lambda l: -math.log(s) if l == math.inf else -math.inf
    lse = m + math.log(s)
    return lambda l: float(l) - lse if l > -math.inf else -math.inf  # NaN and -inf: no probability


# -- perplexity -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Perplexity:
    """exp(nll): nll is the mean negative log-likelihood (nats) of the `tokens` ids scored, each given the ids
    before it within a window of at most `context` ids; windows start `stride` ids apart."""

    perplexity: float
    nll: float
    tokens: int
    windows: int
    context: int
    stride: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def windows(n: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """The sliding windows over n ids, as HuggingFace's perplexity guide lays them out: (begin, end, first) per
    window, ids [begin, end) run through the model and ids [first, end) scored there, so that every id but the
    first of the text is scored once, with as much context as the window gives it (at least stride - 1 ids after
    the first window). stride = context scores each window's first id in no window (it has no context there)."""
    if not 1 <= stride <= context:
        raise OptionError("stride", f"must be an integer from 1 to the context ({context}), got {stride!r}")
    out, scored = [], 1  # ids [0, scored) are done (the first has nothing before it)
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        first = max(scored, begin + 1)
        if first < end:
            out.append((begin, end, first))
        scored = end
        if end == n:
            break
    return out


def perplexity(score: Callable[[Sequence[int]], Sequence[float]], ids: Sequence[int], context: int,
               stride: int) -> Perplexity:
    """Perplexity of `ids` with `score(window)` = log p of window[1:], each given the ids before it (a prefill of
    the window; Llama.perplexity's). OptionError when fewer than two ids leave nothing to score."""
    if len(ids) < 2:
        plural = "s" if len(ids) != 1 else ""
        raise OptionError("ids", f"holds {len(ids)} token id{plural}: a perplexity needs at least 2")
    total, count, spans = 0.0, 0, windows(len(ids), context, stride)
    for begin, end, first in spans:
        logprobs = score(ids[begin:end])  # logprobs[i] is that of ids[begin + 1 + i]
        kept = logprobs[first - begin - 1:]
        total += math.fsum(kept)
        count += len(kept)
    nll = -total / count
    return Perplexity(_exp_or_inf(nll), nll, count, len(spans), context, stride)


def _exp_or_inf(x: float) -> float:
    """e^x, or inf where that is past the largest float (x > ~709.78), never an OverflowError."""
    try:
        return math.exp(x)
    except OverflowError:
        return math.inf
