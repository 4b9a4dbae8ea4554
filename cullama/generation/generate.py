"""The generation loop, the same for every backend: prefill, decode, stop conditions, streaming, timings.

A backend is a `Runner`: it owns the weights and the KV cache, and samples on its own side (the
GPU samples inside its CUDA graph), so the loop only ever sees token ids:

    first = runner.start(prompt_ids, params)   # reset, prefill the prompt, sample the first token
    tok = runner.next(ahead=True)              # feed the last sampled token, sample the next one
    runner.drain()                             # (optional) wait for a step queued ahead

With `ahead`, a runner on an asynchronous device (the GPU) queues the following step before it waits
for this one's token, so the device never idles while the host handles a token; the loop calls
`drain()` when it stops, so that the extra step is paid for at the end of this generation rather than
at the start of the next.

One generation at a time per runner (its KV cache and sampling state hold one sequence). A
`RunnerGuard` enforces it: every runner call is made under its lock, and each generation holds a
ticket from its first runner call on. Starting a generation (a stream's first read, a `generate`,
a `logits`) takes a new ticket, which ends any unfinished stream: that stream's next read raises
SupersededError and its `result` says "cancelled". So the runner never mixes two sequences: a
stream's text is always its own. Threads are serialised by the lock (a whole `Llama.generate`
holds it), never refused.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from typing import Iterator, Protocol, Sequence

import numpy as np

from ..common.errors import OptionError, PromptError, SupersededError, option
from ..runtime.logprobs import TokenLogprob, checked_top
from ..runtime.sampling import SamplingParams, is_int
from ..runtime.token_mask import TokenMask
from ..text.grammar import Constraint, checked_constraint
from ..text.stop_strings import StopMatcher

# Why a generation ended: "eos", "stop" (a stop string), "length" (max_new_tokens or the context), or early:
# "interrupted" (KeyboardInterrupt), "cancelled" (the stream was closed or a newer generation ended it),
# "error" (an exception in the runner or the detokenizer).
FINISH_REASONS = ("eos", "stop", "length", "interrupted", "cancelled", "error")


class Runner(Protocol):
    max_seq_len: int

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, reuse: bool = False) -> int: ...

    def next(self, ahead: bool = False) -> int: ...

    def logits(self, token_ids: Sequence[int]) -> np.ndarray: ...


WAITING = object()  # what a stream yields while its next token is not there yet (generation/batch.py's streams only)


class RunnerGuard:
    """One generation at a time on one runner (see the module docstring): a lock for every runner call,
    and the ticket of the generation that owns the runner now."""

    def __init__(self):
        self.lock = threading.RLock()  # re-entrant: Llama.generate holds it around its stream's own calls
        self._ticket = 0

    def claim(self) -> int:
        """A new generation owns the runner from now on (call with `lock` held); returns its ticket."""
        self._ticket += 1
        return self._ticket

    def check(self, ticket: int) -> None:
        """SupersededError unless `ticket` still owns the runner (call with `lock` held)."""
        if ticket != self._ticket:
            raise SupersededError("this stream was ended by a newer generation on the same model "
                                  "(one generation at a time per model: finish or close a stream first)")


@dataclasses.dataclass
class Timings:
    prefill_s: float = 0.0  # prompt in, first token out (TTFT)
    token_s: list[float] = dataclasses.field(default_factory=list)  # each later token, arrival to arrival

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.token_s)
        return len(self.token_s) / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prefill_s": self.prefill_s, "token_s": list(self.token_s), "tokens_per_s": self.tokens_per_s}


@dataclasses.dataclass
class Generation:
    """One generation's outcome. `text` is what was streamed: the completion's text as it reads after the prompt's
    (its first piece keeps its space where the prompt has text: tokenizer.py), ending before `stop_string` when one
    matched, while `token_ids` keeps every sampled id (those that spelled the stop string too: the model produced
    them and the KV cache holds them); an EOS that ended the generation is in neither, but it counts in
    `completion_tokens` (every token the model produced, as many as `logprobs` has entries)."""

    text: str
    token_ids: list[int]
    finish_reason: str  # one of FINISH_REASONS
    prompt_ids: list[int]
    timings: Timings
    seed: int | None = None  # the sampling seed used (drawn at random when none was given)
    stop_string: str | None = None  # the stop string that ended it (finish_reason "stop")
    speculative: dict | None = None  # speculative decoding's statistics (generation/speculative.py); None when off
    # logprobs=N: one per token the model produced, token_ids' and the EOS that ended the generation, if one did
    logprobs: list[TokenLogprob] | None = None
    # prompt_logprobs=N: one per prompt id, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # prompt ids whose K and V the model already held, not computed again: the prefix cache's (the answer is the
    # fresh one, bit for bit: runtime/engine.py) or, with reuse_cache, every id the last generation left
    cached_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        """Every token the model produced: token_ids and the EOS that ended the generation (OpenAI's and vLLM's
        usage.completion_tokens; one a step, so len(timings.token_s) + 1 where any was produced)."""
        return len(self.token_ids) + (self.finish_reason == "eos")

    def to_dict(self) -> dict:
        record = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                  "stop_string": self.stop_string, "seed": self.seed, "prompt_ids": self.prompt_ids,
                  "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
                  "timings": self.timings.to_dict()}
        return record if self.speculative is None else {**record, "speculative": self.speculative}


def checked_flag(name: str, value) -> bool:
    """A boolean option (bool or NumPy's bool_) as a bool; OptionError naming it for anything else (1, "yes")."""
    if not isinstance(value, (bool, np.bool_)):
        raise OptionError(name, f"must be True or False, got {value!r}")
    return bool(value)


STOP_NEEDS_TEXT = "needs the model's tokenizer (a stop string is matched in the text), and this model has none"


def _stop_strings(stop) -> tuple[str, ...]:
    """None or () -> no stop strings; a str -> one; else a list or tuple of str."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise OptionError("stop", f"must be a string or a list of strings, got {stop!r}")


@dataclasses.dataclass(frozen=True)
class GenerationOptions:
    """Every option of one generation (`Llama.stream`'s keywords), type- and range-checked by `checked`,
    which needs no model: the CLI checks them before any weight loads, a server before it queues a request.
    Only top_k against the vocabulary waits for the model (a top_k at or above it is off)."""

    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None  # None: drawn at random by `resolved`, and reported in the Generation
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    reuse_cache: bool = False
    logprobs: int | None = None  # None = off; else each token's log-probability and that many alternatives (0..20)
    prompt_logprobs: int | None = None  # the same for every prompt id (the whole prompt is then prefilled)
    # constrained decoding: what the text must match (cullama/text/grammar.py); `checked` also takes it as
    # json_schema=, regex= or grammar= (at most one of the four)
    constraint: Constraint | None = None

    @classmethod
    def checked(cls, **options) -> "GenerationOptions":
        """OptionError (a PromptError) naming the first option of a wrong type or out of range; the values
        come back as plain Python types (a NumPy integer seed becomes an int). A constraint is checked for its
        type and form here, and compiled against the model's tokenizer later (Llama.stream)."""
        names = {f.name for f in dataclasses.fields(cls)}
        shorthand = {k: options.pop(k) for k in ("json_schema", "regex", "grammar") if k in options}
        constraint = checked_constraint(**shorthand, constraint=options.pop("constraint", None))
        unknown = sorted(set(options) - names - set(shorthand))
        if unknown:
            raise OptionError(unknown[0], f"is not an option (the options: {', '.join(sorted(names))})")
        o = {**{f.name: f.default for f in dataclasses.fields(cls)}, **options}
        if not is_int(o["max_new_tokens"]) or o["max_new_tokens"] < 0:
            raise OptionError("max_new_tokens", f"must be an integer >= 0, got {o['max_new_tokens']!r}")
        params = SamplingParams(temperature=o["temperature"], top_k=o["top_k"], top_p=o["top_p"],
                                repetition_penalty=o["repetition_penalty"], seed=o["seed"])
        params.validate()
        ignore_eos = checked_flag("ignore_eos", o["ignore_eos"])
        if constraint is not None and ignore_eos:
            raise OptionError("ignore_eos", f"cannot go with {option(constraint.option)}: a constrained text ends "
                                            "with EOS")
        return cls(max_new_tokens=int(o["max_new_tokens"]), temperature=float(params.temperature),
                   top_k=int(params.top_k), top_p=float(params.top_p),
                   repetition_penalty=float(params.repetition_penalty),
                   seed=None if params.seed is None else int(params.seed), stop=_stop_strings(o["stop"]),
                   ignore_eos=ignore_eos, reuse_cache=checked_flag("reuse_cache", o["reuse_cache"]),
                   logprobs=checked_top(o["logprobs"], "logprobs"),
                   prompt_logprobs=checked_top(o["prompt_logprobs"], "prompt_logprobs"), constraint=constraint)

    def resolved(self) -> "GenerationOptions":
        """The same options with a seed: a random one when none was given, so that the run can be repeated."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=int.from_bytes(os.urandom(8), "little"))

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              repetition_penalty=self.repetition_penalty, seed=self.seed)


def check_prompt_fits(n: int, max_seq_len: int, max_new_tokens: int) -> None:
    """PromptError unless a prompt of n tokens leaves room in the context (when anything is to be generated)."""
    if n == 0:
        raise PromptError("the prompt is empty: give at least one token (an empty text starts from BOS where the "
                          "tokenizer adds one)")
    if n >= max_seq_len and max_new_tokens > 0:
        raise PromptError(f"the prompt has {n} tokens and does not fit in the context of {max_seq_len} tokens "
                          "(max_seq_len, --max-seq-len)")


class GenerationStream:
    """An iterator over text pieces as they become final; `.result` holds the Generation once it ends,
    however it ends (finish_reason says how; an early end keeps what was streamed so far).

    Iterate it once, from one thread at a time. Closing it (`close()`, from the thread that reads it, or
    dropping it) ends the generation and leaves the model free; `cancel()`, from any thread, ends it before
    its next token; a newer generation on the same model ends it too (its next read raises SupersededError)."""

    def __init__(self, runner: Runner, detokenizer, prompt_ids: list[int], options: GenerationOptions,
                 eos_ids: Sequence[int], guard: RunnerGuard | None = None, mask: TokenMask | None = None):
        """`mask`: options.constraint's, a fresh one (Grammars.matcher): every token is one it allows."""
        check_prompt_fits(len(prompt_ids), runner.max_seq_len, options.max_new_tokens)
        if (mask is None) != (options.constraint is None):
            raise ValueError("a constrained generation needs its mask, and only it")
        if mask is not None and not getattr(runner, "constrains", False):
            raise OptionError(options.constraint.option, f"needs a runner that applies a grammar's mask "
                                                         f"({type(runner).__name__} does not)")
        scored = options.logprobs is not None or options.prompt_logprobs is not None
        if scored and not hasattr(runner, "take_logprobs"):
            raise OptionError("logprobs" if options.logprobs is not None else "prompt_logprobs",
                              f"needs a runner that computes log-probabilities ({type(runner).__name__} does not)")
        if options.prompt_logprobs is not None and len(prompt_ids) > runner.max_seq_len:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens: prompt_logprobs scores at most the "
                              f"context of {runner.max_seq_len}")
        self.runner, self.detok, self.prompt_ids = runner, detokenizer, list(prompt_ids)
        if detokenizer is not None:  # the completion's text is read in its prompt's context (tokenizer.py)
            detokenizer.prime(self.prompt_ids)
        self.mask = mask
        self.options = options.resolved()
        self.guard = guard or RunnerGuard()
        self.stop = StopMatcher(self.options.stop)
        self.eos_ids = () if self.options.ignore_eos else tuple(eos_ids)
        self.result: Generation | None = None
        self.token_ids: list[int] = []  # sampled so far
        self.pieces: list[str] = []  # streamed so far
        # logprobs: each token's TokenLogprob (EOS's too), paired in order from the runner's take_logprobs()
        self.token_logprobs: list[TokenLogprob] | None = None if options.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # set once the prompt is scored
        self._unpaired: collections.deque[TokenLogprob] = collections.deque()
        self.timings = Timings()
        self.cached_tokens = 0  # the prompt ids the runner did not compute again (its `reused`), once started
        self._ticket: int | None = None  # this generation's RunnerGuard ticket, from its first runner call
        self._close_reason = "cancelled"
        self._cancelled = False  # set by cancel(), from any thread; read before each token
        self._run = self._generate()  # the generator behind __next__

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._run)

    def close(self, finish_reason: str = "cancelled") -> None:
        """End the generation now; `result` keeps what was streamed, with this finish_reason."""
        self._close_reason = finish_reason
        self._run.close()
        self._finish(finish_reason)

    def cancel(self) -> None:
        """From any thread: end the generation before its next token, whether or not the last one showed any
        text (text held back, as a possible start of a stop string, is dropped); the reader's next read ends
        the stream, and `result` says "cancelled". Under speculative decoding no further verify step runs.
        Unlike close(), which belongs to the reading thread, this only asks."""
        self._cancelled = True

    def _finish(self, reason: str) -> None:
        if self.result is None:
            self.result = Generation("".join(self.pieces), list(self.token_ids), reason, self.prompt_ids,
                                     self.timings, self.options.seed, self.stop.matched if reason == "stop" else None,
                                     self._statistics(), None if self.token_logprobs is None else
                                     list(self.token_logprobs), self.prompt_logprobs, self.cached_tokens)

    def _step(self, i: int, budget: int) -> int:
        """Token i from the runner, while this generation owns it (the first call takes ownership)."""
        with self.guard.lock:
            if i == 0:
                self._ticket = self.guard.claim()
            else:
                self.guard.check(self._ticket)
            token = self._token(i, budget)
            if i == 0:
                self.cached_tokens = getattr(self.runner, "reused", 0)
            if self.token_logprobs is not None:
                self._unpaired.extend(self.runner.take_logprobs())
                self.token_logprobs.append(self._unpaired.popleft())
            if i == 0 and self.options.prompt_logprobs is not None:
                self.prompt_logprobs = [None, *self.runner.prompt_logprobs]
            return token

    def _token(self, i: int, budget: int) -> int:
        """Token i of at most `budget`, the guard's lock held (speculative decoding hands out its bursts here)."""
        if i == 0:
            return self.runner.start(self.prompt_ids, self.options.sampling, self.options.reuse_cache,
                                     **self._scoring())
        return self.runner.next(ahead=i + 1 < budget)

    def _scoring(self) -> dict:
        """start()'s log-probability and mask keywords: none unless asked for (any Runner takes that)."""
        o = self.options
        keywords = {} if self.mask is None else {"mask": self.mask}
        if o.logprobs is None and o.prompt_logprobs is None:
            return keywords
        return {**keywords, "logprobs": o.logprobs, "prompt_logprobs": o.prompt_logprobs}

    def _has_token(self, i: int) -> bool:
        """Whether token i can be had now (always, from the runner; a batched stream waits for its session)."""
        return True

    def _score_prompt(self) -> None:
        """prompt_logprobs with nothing to generate: one prefill that scores the prompt, nothing sampled."""
        started = time.perf_counter()
        with self.guard.lock:
            self._ticket = self.guard.claim()
            self.prompt_logprobs = [None, *self.runner.score(self.prompt_ids, self.options.prompt_logprobs)]
        self.timings.prefill_s = time.perf_counter() - started

    def _statistics(self) -> dict | None:
        """The result's `speculative` record (None: plain decoding)."""
        return None

    def _drain(self) -> None:
        """A step queued ahead of a stop: finish it now, not in the next prompt's TTFT."""
        drain = getattr(self.runner, "drain", None)
        if drain is None or self._ticket is None:
            return
        with self.guard.lock:
            self.guard.check(self._ticket)
            drain()

    def _generate(self) -> Iterator[str]:
        try:
            finish = yield from self._decode()
        except GeneratorExit:
            self._finish(self._close_reason)
            raise
        except SupersededError:
            self._finish("cancelled")
            raise
        except KeyboardInterrupt:
            self._finish("interrupted")
            raise
        except BaseException:
            self._finish("error")
            raise
        self._finish(finish)

    def _emit(self, piece: str) -> Iterator[str]:
        if piece:
            self.pieces.append(piece)
            yield piece

    def _decode(self) -> Iterator[str]:
        """The pieces; returns the finish reason."""
        finish = "length"
        budget = min(self.options.max_new_tokens, self.runner.max_seq_len - len(self.prompt_ids))
        if budget <= 0 and self.options.prompt_logprobs is not None:
            self._score_prompt()
        last = time.perf_counter()
        for i in range(budget):
            if self._cancelled:
                finish = "cancelled"
                break
            while not self._has_token(i):  # a batched stream: its session delivers the token later
                yield WAITING
                if self._cancelled:
                    break
            if self._cancelled:
                finish = "cancelled"
                break
            token = self._step(i, budget)
            now = time.perf_counter()
            if i == 0:
                self.timings.prefill_s = now - last
            else:
                self.timings.token_s.append(now - last)
            last = now
            if token in self.eos_ids:
                finish = "eos"
                break
            self.token_ids.append(token)
            yield from self._emit(self.stop.feed(self.detok.push(token)) if self.detok else "")
            if self.stop.stopped:
                finish = "stop"
                break
        self._drain()
        if not self.stop.stopped and self.detok and finish != "cancelled":
            tail = self.stop.feed(self.detok.flush())
            tail += "" if self.stop.stopped else self.stop.flush()
            if self.stop.stopped:
                finish = "stop"
            yield from self._emit(tail)
        return finish
