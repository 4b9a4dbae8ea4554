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
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, Protocol, Sequence

import numpy as np

from .errors import PromptError
from .sampling import SamplingParams


class Runner(Protocol):
    max_seq_len: int

    def start(self, prompt_ids: Sequence[int], params: SamplingParams, reuse: bool = False) -> int: ...

    def next(self, ahead: bool = False) -> int: ...

    def logits(self, token_ids: Sequence[int]) -> np.ndarray: ...


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
    text: str
    token_ids: list[int]  # generated ids; an EOS that ended the generation is not included
    finish_reason: str  # "eos", "stop" (a stop string), or "length" (max_new_tokens or the context)
    prompt_ids: list[int]
    timings: Timings
    speculative: dict | None = None  # speculative decoding's statistics (cullama/speculative.py); None when off

    def to_dict(self) -> dict:
        record = {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                  "prompt_ids": self.prompt_ids, "timings": self.timings.to_dict()}
        return record if self.speculative is None else {**record, "speculative": self.speculative}


class StopMatcher:
    """Holds back streamed text that might still turn into a stop string; cuts at the first one."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now; sets `stopped` when a stop string appears."""
        if not self.stops:
            return text
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            out, self.pending = self.pending[:min(hits)], ""
            return out
        keep = 0  # the longest tail of pending that is a proper prefix of some stop string
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), keep, -1):
                if self.pending.endswith(s[:n]):
                    keep = n
                    break
        out = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(self.pending) - keep:]
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class GenerationStream:
    """Iterates over text pieces as they become final; `.result` holds the Generation at the end."""

    def __init__(self, runner: Runner, detokenizer, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams, stop: Sequence[str], eos_ids: Sequence[int], ignore_eos: bool,
                 reuse_cache: bool = False):
        if max_new_tokens < 0:
            raise PromptError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
        if not prompt_ids:
            raise PromptError("the prompt is empty: give at least one token (an empty text prompt starts from BOS)")
        if len(prompt_ids) >= runner.max_seq_len and max_new_tokens > 0:
            raise PromptError(f"the prompt has {len(prompt_ids)} tokens and does not fit in the context of "
                              f"{runner.max_seq_len} tokens (--max-seq-len)")
        self.runner, self.detok, self.prompt_ids = runner, detokenizer, list(prompt_ids)
        self.max_new_tokens, self.params = max_new_tokens, params
        self.stop = StopMatcher(stop)
        self.eos_ids = () if ignore_eos else tuple(eos_ids)
        self.reuse_cache = reuse_cache
        self.result: Generation | None = None

    def _step(self, i: int, budget: int) -> int:
        """Token i of at most `budget` (speculative decoding hands out its bursts here)."""
        return self.runner.start(self.prompt_ids, self.params, self.reuse_cache) if i == 0 \
            else self.runner.next(ahead=i + 1 < budget)

    def _statistics(self) -> dict | None:
        """The result's `speculative` record (None: plain decoding)."""
        return None

    def __iter__(self) -> Iterator[str]:
        timings, ids, pieces = Timings(), [], []
        finish = "length"
        budget = min(self.max_new_tokens, self.runner.max_seq_len - len(self.prompt_ids))
        last = time.perf_counter()
        for i in range(budget):
            token = self._step(i, budget)
            now = time.perf_counter()
            if i == 0:
                timings.prefill_s = now - last
            else:
                timings.token_s.append(now - last)
            last = now
            if token in self.eos_ids:
                finish = "eos"
                break
            ids.append(token)
            piece = self.stop.feed(self.detok.push(token)) if self.detok else ""
            if piece:
                pieces.append(piece)
                yield piece
            if self.stop.stopped:
                finish = "stop"
                break
        drain = getattr(self.runner, "drain", None)
        if drain is not None:
            drain()  # a step queued ahead of a stop: finish it now, not in the next prompt's TTFT
        if not self.stop.stopped and self.detok:
            tail = self.stop.feed(self.detok.flush())
            tail += "" if self.stop.stopped else self.stop.flush()
            if self.stop.stopped:
                finish = "stop"
            if tail:
                pieces.append(tail)
                yield tail
        self.result = Generation("".join(pieces), ids, finish, self.prompt_ids, timings, self._statistics())
