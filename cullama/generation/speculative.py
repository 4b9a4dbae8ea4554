"""Speculative decoding on the host: the loop that turns drafts and verify steps into a token stream.

Each step a drafter proposes k tokens to follow the text and the target checks them all in one verify
pass over the rows [last, *drafts] (PlanRunner.verify): it returns the longest accepted prefix of the
drafts followed by its own next token, 1 to k + 1 tokens for the price of about one decode step.

    stream = SpeculativeStream(runner, detok, prompt_ids, options, eos_ids, guard,
                               drafter=PromptLookup(), length=DraftLength(4))   # what Llama.stream builds

The stream is a GenerationStream whose tokens arrive in bursts: the tokens of a burst reach the
stream one by one, in order, and the timings record each token's arrival as a user sees it (a burst's
first token after the verify step, the others right behind it); EOS and stop strings inside a burst
end the text at that token (the rest of the burst is dropped); k shrinks near the end of
`max_new_tokens` and of the context, so no step ever computes a token past either. The result
carries the statistics: method, k, steps, drafted, accepted, tokens per step.

A constrained generation (a grammar's mask: text/grammar.py) speculates too: PlanRunner.verify drops the drafts its
grammar refuses (and those after them) before the step, and each verify row draws under the mask after the drafts
before it, so greedy output is plain constrained greedy's (tests/generation/test_constrained.py).

PlanRunner.verify is the batched step (one pass on the device). `sequential_verify` is its reference:
up to k + 1 plain next() calls, stopping at the first mismatch; under greedy sampling the batched verify
must return exactly what it returns (tests/generation/test_speculative.py checks it), and a runner without a
`verify` of its own (any other Runner) decodes speculatively through it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

from ..runtime import plan as plans
from .drafters import DraftModel, Drafter, PromptLookup
from ..common.errors import OptionError, PromptError
from .generate import GenerationOptions, GenerationStream, Runner, RunnerGuard, checked_flag
from ..runtime.sampling import SamplingParams, is_int

MAX_DRAFT = plans.MAX_DRAFT  # the most drafted tokens one verify step checks (k + 1 <= 16 rows)
DEFAULT_DRAFT_TOKENS = 4
METHODS = ("ngram", "draft")  # the names `speculative=` and `--speculative` take


# -- the verify step ------------------------------------------------------------------------------
def sequential_verify(runner: Runner, drafts: Sequence[int]) -> list[int]:
    """The reference verify: plain next() calls until the target disagrees with a draft.

    Returns the accepted drafts followed by the target's own next token; afterwards the runner's
    `cached` holds [last, *accepted[:-1]] more and `last` is accepted[-1], as PlanRunner.verify
    promises. Greedy, the batched verify must return exactly this."""
    accepted = []
    for draft in drafts:
        token = runner.next()
        accepted.append(token)
        if token != draft:
            return accepted
    accepted.append(runner.next())
    return accepted


def sequential_max_draft(runner: Runner) -> int:
    """The largest k the next verify may take: its k + 1 rows stay inside the KV cache."""
    return max(0, min(MAX_DRAFT, runner.max_seq_len - len(runner.cached) - 1))


def verify_step(runner: Runner) -> tuple[Callable[[Sequence[int]], list[int]], Callable[[], int]]:
    """(verify, max_draft) of the runner: its own batched ones, else the sequential stand-in."""
    if hasattr(runner, "verify"):
        return runner.verify, runner.max_draft
    return (lambda drafts: sequential_verify(runner, drafts)), (lambda: sequential_max_draft(runner))


# -- how many tokens to draft ---------------------------------------------------------------------
class DraftLength:
    """k for the next step: fixed, or (adaptive) one more after a step that accepted every draft and one
    fewer after a step that accepted none, within 1..MAX_DRAFT."""

    def __init__(self, k: int = DEFAULT_DRAFT_TOKENS, adaptive: bool = False):
        self.k, self.adaptive = k, adaptive

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.k + 1, MAX_DRAFT)
        elif accepted == 0:
            self.k = max(self.k - 1, 1)


@dataclasses.dataclass(frozen=True)
class SpeculativeOptions:
    """`Llama.stream`'s speculative keywords, checked before anything runs (OptionError names the option)."""

    method: object  # "ngram", "draft", or a drafter object (cullama.generation.drafters)
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    adaptive: bool = False

    @classmethod
    def checked(cls, speculative, draft_tokens: int | None = None,
                adaptive_draft: bool = False) -> "SpeculativeOptions | None":
        """None for plain decoding (speculative=None, which draft_tokens and adaptive_draft cannot go with)."""
        adaptive = checked_flag("adaptive_draft", adaptive_draft)  # the types ignore_eos takes
        if speculative is None:
            if draft_tokens is not None or adaptive:
                raise OptionError("draft_tokens" if draft_tokens is not None else "adaptive_draft",
                                  "needs speculative decoding: speculative='ngram' or 'draft'")
            return None
        named = isinstance(speculative, str)
        if named and speculative not in METHODS or \
                not named and not all(hasattr(speculative, m) for m in ("name", "reset", "extend", "propose")):
            raise OptionError("speculative", f"must be one of {', '.join(map(repr, METHODS))} or a drafter, "
                                             f"got {speculative!r}")
        k = DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens
        if not is_int(k) or not 1 <= k <= MAX_DRAFT:
            raise OptionError("draft_tokens", f"must be an integer from 1 to {MAX_DRAFT}, got {draft_tokens!r}")
        return cls(speculative, int(k), adaptive)

    def length(self) -> DraftLength:
        return DraftLength(self.draft_tokens, self.adaptive)

    def drafter(self, draft_runner=None, reuse_cache: bool = False) -> Drafter:
        """The drafter the method names, or the drafter object given. `draft_runner`: the draft model's
        runner (for "draft"); with `reuse_cache` it keeps the prefix its cache holds from the last generation."""
        if self.method == "ngram":
            return PromptLookup()
        if self.method == "draft":
            if draft_runner is None:
                raise PromptError("speculative='draft' needs a draft model: Llama.from_pretrained(..., "
                                  "draft_model=DIR) (--draft-model DIR)")
            return DraftModel(draft_runner, reuse_cache)
        return self.method


# -- the loop --------------------------------------------------------------------------------------
@dataclasses.dataclass
class SpeculativeStats:
    method: str
    k: int  # draft tokens asked for per step (the first k, when adaptive)
    adaptive: bool = False
    steps: int = 0  # target passes after the prefill (verify steps, k = 0 ones included)
    drafted: int = 0  # drafts checked
    accepted: int = 0  # drafts accepted
    unused: int = 0  # tokens the steps produced past the generation's end (an EOS or a stop string inside a burst)

    @property
    def tokens_per_step(self) -> float:
        """Tokens each target pass gave the generation, on average: the accepted drafts plus its own token, but
        those past the end, which the text never used."""
        return (self.accepted + self.steps - self.unused) / self.steps if self.steps else 0.0

    def to_dict(self, unused: int = 0) -> dict:
        """The record (Generation.speculative); `unused`: the last burst's tokens left unread when it ended."""
        self.unused = unused
        return {"method": self.method, "k": self.k, "adaptive": self.adaptive, "steps": self.steps,
                "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "unused": unused, "tokens_per_step": self.tokens_per_step}


class SpeculativeDecoder:
    """One generation's speculative decoding on a runner: start() prefills and samples the first token,
    step() runs one verify step and returns its burst, next() hands the bursts out one token at a time.

    A step drafts k = min(the DraftLength's k, what the budget leaves after the target's own token,
    what the KV cache leaves) tokens, so it never produces a token past the budget or writes past the
    cache."""

    def __init__(self, runner: Runner, drafter: Drafter, length: DraftLength):
        self.runner, self.drafter, self.length = runner, drafter, length
        self.stats = SpeculativeStats(drafter.name, length.k, length.adaptive)
        self._verify, self._max_draft = verify_step(runner)
        self.produced = 0  # tokens the target produced in this generation, the burst's unread ones included
        self._burst: collections.deque[int] = collections.deque()  # produced, not yet handed out

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, reuse: bool = False, **scoring) -> int:
        """The prefill and the first token; `scoring`: the runner's log-probability keywords, if any (its verify
        steps then return each accepted token's, from the verify rows)."""
        first = self.runner.start(prompt_ids, params, reuse, **scoring)
        self.begin(prompt_ids, first)
        return first

    def begin(self, prompt_ids: Sequence[int], first: int) -> None:
        """Set up for a prompt whose prefill already sampled `first` (start() without the runner's part)."""
        self.drafter.reset(prompt_ids)
        self._burst.clear()
        self.drafter.extend([first])
        self.produced = 1

    def step(self, budget: int) -> list[int]:
        """One verify step: the accepted drafts and the target's own token (1 to k + 1 ids)."""
        k = min(self.length.k, budget - self.produced - 1, self._max_draft())
        drafts = [int(d) for d in self.drafter.propose(k)[:k]] if k > 0 else []  # the runner checks the ids
        accepted = self._verify(drafts)
        self.stats.steps += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += len(accepted) - 1
        self.length.update(len(drafts), len(accepted) - 1)
        self.drafter.extend(accepted)
        self.produced += len(accepted)
        return accepted

    def next(self, budget: int) -> int:
        """The next token: the rest of the last burst first, then a new step's."""
        if not self._burst:
            self._burst.extend(self.step(budget))
        return self._burst.popleft()


class SpeculativeStream(GenerationStream):
    """A GenerationStream whose tokens come from drafts checked by verify steps (see the module doc)."""

    def __init__(self, runner: Runner, detokenizer, prompt_ids: list[int], options: GenerationOptions,
                 eos_ids: Sequence[int], guard: RunnerGuard | None = None, mask=None, *, drafter: Drafter,
                 length: DraftLength):
        super().__init__(runner, detokenizer, prompt_ids, options, eos_ids, guard, mask)
        self.decoder = SpeculativeDecoder(runner, drafter, length)

    def _token(self, i: int, budget: int) -> int:
        if i == 0:
            return self.decoder.start(self.prompt_ids, self.options.sampling, self.options.reuse_cache,
                                      **self._scoring())
        return self.decoder.next(budget)

    def _statistics(self) -> dict:
        return self.decoder.stats.to_dict(unused=len(self.decoder._burst))
