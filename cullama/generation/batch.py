"""Batched decoding: many generations on one model at once, each getting exactly the tokens it gets alone.

    session = llm.batch()                                   # owns the model's sequence slots (max_batch of them)
    a = session.submit("Once upon a time", max_new_tokens=50, seed=1)     # Llama.stream's options, checked here
    b = session.submit([1, 403, 407], temperature=0.8, top_p=0.9, seed=2)
    while not session.idle:
        for update in session.step():                       # one scheduling iteration
            print(update.stream is a, update.pieces, update.done)
    a.result, b.result                                      # Generations, each equal to its solo generate()

`Llama.generate(list_of_prompts, **options)` runs one; `cullama serve --max-batch N` runs one on its engine thread.

Design (issue 17):
- Rows and slots. A step runs R token rows; each row belongs to a sequence slot s (its own KV cache, state, sampling
  parameters, seen flags and so its own random stream: kernels_cu/common.cuh) at an offset from that slot's position.
  A decode step is one row (s, 0), a verify step k + 1 rows (s, 0..k), a batched step B rows of B slots, (s_r, 0)
  each. Every kernel that reads a position or a slot takes the step's rows table and changes only its addressing
  with it, so row r of a B-row launch computes exactly what a one-row launch of its slot at its position computes
  (tests/test_batch_kernels*.py, on the twins, the CPU executor and a GPU; tests/runtime/test_sass_dataflow.py on the
  machine code). The table is written when the batch changes (a join or a leave), never per step, so the captured
  graph of a batch of R rows (plan.batch_plan, one per R in use) replays with no host input.
- Scheduling, at the iteration level: each step() admits waiting requests into free slots (first come, first
  served), runs one prefill chunk of the request joining (its whole prompt when nothing else runs), then one batched
  step over every running request; a request that finishes or is cancelled leaves at once and its slot is reused.
  So between two tokens of a running request at most one prefill chunk runs (a request that only scores its prompt,
  max_new_tokens=0 with prompt_logprobs, joins the same way: runner.begin_score).
- The chunk. A prompt is prefilled in the runner's own chunks (runner.prefill_chunk), never in chunks sized to the
  moment: a GPU prefill GEMM splits K by the chunk's rows (prefill_kernels.split_rule), so another chunking could
  change a K or V bit and the answer with it; the chunk is a property of the loaded model, the same for its solo and
  batched generations. A model loaded with max_batch > 1 takes plan.batch_prefill_chunk: on the H200's roofline, the
  largest multiple of 16 rows whose prefill costs no more than a decode step (the weights' read: 64 rows for a 7B
  model in FP16, 16 in INT4), so a running request's gap between tokens while a prompt joins is one chunk and one
  batched step, about two decode steps (a 256-row chunk is predicted at ~3.7 steps on 7B). From the model's shape
  only, never a timing, so that every load of the model answers alike. The price is the solo time to the first token
  of long prompts (more chunks, each reading all the weights: benchmarks/PREDICTIONS.md); max_batch 1 keeps 256 rows,
  and prefill_chunk (--prefill-chunk) sets any chunk.
- Speculative decoding next to batching: a request with speculation runs alone, always speculating (verify steps on
  its slot, as its solo stream runs them), never batched: it waits for the running requests to finish, and the
  requests behind it wait for it. A sampled speculative request draws other tokens than plain decoding does, so
  batching it without its verify steps would change its answer; a greedy one could be batched (its tokens are the
  plain greedy tokens), but its drafts would then be checked one token per step, a loss for it, and rows x (k + 1)
  verify rows per step are left for later (the H200 decides whether they pay).
- A constrained request (a grammar's mask, text/grammar.py) is a row like another: the batched step splits at the
  sample kernel where a row is constrained, its mask is computed on the host while the rows' forward runs, and only
  its slot reads one (engine.py); its tokens are its solo ones.
- One row that fails (no usable logit) fails its request alone; the others go on.

The session holds the model (generate.RunnerGuard) from its first step on: a solo generation started meanwhile ends
it, as it ends an unfinished stream (its requests then end "cancelled").
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Callable

from ..runtime import logprobs as scoring
from ..common.errors import GenerationError, SupersededError
from .generate import WAITING, GenerationOptions, GenerationStream, Runner, RunnerGuard
from ..runtime.sampling import NO_TOKEN, drawn
from .speculative import SpeculativeDecoder


@dataclasses.dataclass(frozen=True)
class Update:
    """What one step did for one request: the text that became final, and whether it ended (see stream.result)."""

    stream: "BatchedStream"
    pieces: tuple[str, ...]
    done: bool


class _Failed:
    """An inbox entry that ends the stream with `error` (its row had nothing to draw, or its prefill failed)."""

    def __init__(self, error: BaseException):
        self.error = error


class BatchedStream(GenerationStream):
    """One request of a BatchSession: a GenerationStream whose tokens the session computes and delivers (its inbox),
    so that stop strings, EOS, the budget, log-probabilities and timings work as in a solo stream. The session drives
    it (pump); it is not iterated by its owner. `decoder`: speculative decoding's, when the request asked for it."""

    def __init__(self, runner: Runner, detokenizer, prompt_ids: list[int], options: GenerationOptions,
                 eos_ids, guard: RunnerGuard, mask=None, decoder: SpeculativeDecoder | None = None):
        super().__init__(runner, detokenizer, prompt_ids, options, eos_ids, guard, mask)
        self.decoder = decoder
        self.inbox: collections.deque = collections.deque()  # delivered tokens (or a _Failed), not consumed yet
        self.records: collections.deque[scoring.TokenLogprob] = collections.deque()  # their log-probabilities
        self.slot: int | None = None  # the sequence slot while it holds one
        self.error: BaseException | None = None  # what ended it, if an exception did

    @property
    def budget(self) -> int:
        """Tokens it may get at most: max_new_tokens, or what the context leaves after the prompt."""
        return min(self.options.max_new_tokens, self.runner.max_seq_len - len(self.prompt_ids))

    @property
    def scored_only(self) -> bool:
        """Nothing to generate, its prompt to score (prompt_logprobs): its prefill gives its records, no token."""
        return self.budget <= 0 and self.options.prompt_logprobs is not None

    @property
    def exclusive(self) -> bool:
        """A request with speculative decoding: it runs alone (see the module docstring)."""
        return self.decoder is not None

    @property
    def ended(self) -> bool:
        return self.result is not None

    def deliver(self, tokens, records=()) -> None:
        self.inbox.extend(tokens)
        self.records.extend(records)

    def pump(self) -> list[str]:
        """Run the generation over what was delivered: the text pieces that became final. It stops where it needs
        a token that has not come yet, or at its end (`ended`; an exception that ended it is kept in `error`)."""
        pieces: list[str] = []
        while self.result is None:
            try:
                piece = next(self._run)
            except StopIteration:
                break
            except Exception as exc:  # it ended with "error" (the generator recorded it); the session goes on
                self.error = exc
                break
            if piece is WAITING:
                break
            pieces.append(piece)
        return pieces

    def _has_token(self, i: int) -> bool:
        return bool(self.inbox)

    def _step(self, i: int, budget: int) -> int:
        token = self.inbox.popleft()
        if isinstance(token, _Failed):
            raise token.error
        if self.token_logprobs is not None:
            self.token_logprobs.append(self.records.popleft())
        return token

    def _drain(self) -> None:
        """Nothing queued ahead of a batched stream."""

    def _score_prompt(self) -> None:
        """max_new_tokens=0 with prompt_logprobs: the session scored the prompt already (score())."""

    def _statistics(self) -> dict | None:
        unread = sum(not isinstance(token, _Failed) for token in self.inbox)  # the burst past its end
        return None if self.decoder is None else self.decoder.stats.to_dict(unused=unread)


class BatchSession:
    """Many generations at once on one model (see the module docstring). `make_stream(prompt, **options)` builds a
    BatchedStream (Llama.batch gives its own: options checked, prompt encoded); the session's runner has
    runner.slots sequence slots."""

    def __init__(self, runner, guard: RunnerGuard, make_stream: Callable[..., BatchedStream]):
        self.runner, self.guard, self._make_stream = runner, guard, make_stream
        self.free: list[int] = list(range(runner.slots))  # slots nobody holds, lowest first
        self._admitted = 0  # requests admitted so far
        self._last_admitted: dict[int, int] = {}  # slot -> the number (_admitted) of the last request it took
        self.pending: collections.deque[BatchedStream] = collections.deque()  # submitted, waiting for a slot
        self.joining: BatchedStream | None = None  # its prompt on its way into its slot
        self._prefill = None  # the joining request's runner.Prefill
        self.running: list[BatchedStream] = []  # in slots, decoding, in the order they joined
        self._rows: list[int] | None = None  # the slots of the device's batch rows (runner.set_batch), if current
        self._ticket: int | None = None
        self.last_batch = 0  # rows the last step() decoded (0: it decoded none): for metrics

    # -- the owner's side ----------------------------------------------------------------------------------------
    def submit(self, prompt, **options) -> BatchedStream:
        """A new request, queued for a slot; its options are checked here (OptionError, PromptError), before it
        joins anything. Its clock (time to first token) starts now."""
        stream = self._make_stream(prompt, **options)
        if not stream.scored_only:  # (one that is only scored ends at its first pump: after its prompt's records)
            stream.pump()  # starts it: it waits for its first token
        self.pending.append(stream)
        return stream

    @property
    def idle(self) -> bool:
        return not (self.pending or self.joining or self.running)

    @property
    def holding(self) -> int:
        """Requests submitted and not ended: waiting for a slot, joining or running."""
        return len(self.pending) + (self.joining is not None) + len(self.running)

    def cancel(self, stream: BatchedStream) -> None:
        """End a request now (its result says "cancelled"); its slot is free for the next step. From the thread
        that steps the session (any thread may call stream.cancel(), which the next step sees)."""
        stream.cancel()
        self._end_cancelled(stream)

    def run(self) -> None:
        """Step until every request has ended."""
        while not self.idle:
            self.step()

    def step(self) -> list[Update]:
        """One iteration: admit, one prefill chunk, one decode step (see the module docstring). Returns what each
        request it touched got."""
        pieces: dict[int, tuple[BatchedStream, list[str]]] = {}
        self.last_batch = 0  # until this step decodes
        with self.guard.lock:
            try:
                self._own()
            except SupersededError:
                for stream in self._all():
                    stream.close("cancelled")
                    pieces[id(stream)] = (stream, [])
                self.pending.clear()
                self.joining, self._prefill, self.running = None, None, []
                return [Update(s, (), True) for s, _ in pieces.values()]
            for stream in list(self._all()):
                if stream._cancelled:
                    self._end_cancelled(stream)
                    pieces[id(stream)] = (stream, [])
            self._admit(pieces)
            if self.joining is not None:
                self._prefill_step(pieces)
            if self.running:
                self._decode(pieces)
        return [Update(s, tuple(p), s.ended) for s, p in pieces.values()]

    # -- the steps -----------------------------------------------------------------------------------------------
    def _own(self) -> None:
        if self._ticket is None:
            self._ticket = self.guard.claim()
        else:
            self.guard.check(self._ticket)

    def _all(self):
        yield from self.pending
        if self.joining is not None:
            yield self.joining
        yield from self.running

    def _release(self, stream: BatchedStream) -> None:
        if stream.slot is not None:
            self.free.append(stream.slot)
            self.free.sort()
            stream.slot = None
        if stream in self.running:
            self.running.remove(stream)
            self._rows = None  # a later request may take its slot at its row: the rows' inputs are set again

    def _end_cancelled(self, stream: BatchedStream) -> None:
        if stream in self.pending:
            self.pending.remove(stream)
        if stream is self.joining:
            self.joining, self._prefill = None, None
        self._release(stream)
        stream.close("cancelled")

    def _collect(self, pieces: dict, stream: BatchedStream, new: list[str]) -> None:
        pieces.setdefault(id(stream), (stream, []))[1].extend(new)
        if stream.ended:
            self._release(stream)

    def _admit(self, pieces: dict) -> None:
        """Requests into free slots, first come first served: one joins at a time; an exclusive one only into an
        empty session, and nothing joins while it holds one."""
        while self.pending and self.joining is None and self.free:
            head = self.pending[0]
            if any(s.exclusive for s in self.running) or (head.exclusive and self.running):
                return
            self.pending.popleft()
            head.slot = self._slot_for(head)
            self.runner.slot = head.slot
            if head.budget <= 0 and not head.scored_only:  # nothing to compute: it ends
                self._collect(pieces, head, head.pump())
                continue
            o = head.options
            try:
                self._prefill = self.runner.begin_score(head.prompt_ids, o.prompt_logprobs) if head.scored_only \
                    else self.runner.begin(head.prompt_ids, o.sampling, False, o.logprobs, o.prompt_logprobs,
                                           head.mask)
            except Exception as exc:
                head.deliver([_Failed(exc)])
                self._collect(pieces, head, head.pump())
                continue
            self.joining = head

    def _slot_for(self, stream: BatchedStream) -> int:
        """A free slot for the request: the one whose prefix cache holds the most of its prompt (a conversation
        that comes back finds its turns where it left them; the answer is the same in any slot), else the one
        idle the longest, whose cache the fewest recent requests may still want."""

        def preference(s: int) -> tuple[int, int, int]:  # a slot never taken: 0, idle longest, the lowest first
            return self.runner.prefix_rows(stream.prompt_ids, s), -self._last_admitted.get(s, 0), -s

        slot = max(self.free, key=preference)
        self.free.remove(slot)
        self._admitted += 1
        self._last_admitted[slot] = self._admitted
        return slot

    def _prefill_step(self, pieces: dict) -> None:
        """One chunk of the joining request's prompt; all of it when nothing else runs. On its last chunk the
        request gets its first token and starts decoding with the next step (one only scored ends)."""
        stream, prefill = self.joining, self._prefill
        self.runner.slot = stream.slot
        try:
            first = prefill.advance()
            while first is None and not self.running:
                first = prefill.advance()
        except Exception as exc:  # no usable logit for its first token, or a failure inside its prefill
            self.joining, self._prefill = None, None
            stream.deliver([_Failed(exc)])
            self._collect(pieces, stream, stream.pump())
            return
        if first is None:
            return
        self.joining, self._prefill = None, None
        stream.cached_tokens = self.runner.reused
        if stream.scored_only:  # `first` is its prompt's records
            stream.prompt_logprobs = [None, *first]
            self._collect(pieces, stream, stream.pump())
            return
        if stream.options.prompt_logprobs is not None:
            stream.prompt_logprobs = [None, *self.runner.prompt_logprobs]
        if stream.decoder is not None:
            stream.decoder.begin(stream.prompt_ids, first)
        stream.deliver([first], self.runner.take_logprobs())
        self.running.append(stream)
        self._collect(pieces, stream, stream.pump())

    def _decode(self, pieces: dict) -> None:
        if self.running[0].exclusive:  # alone (nothing joins while it runs)
            return self._speculate(self.running[0], pieces)
        slots = [s.slot for s in self.running]
        if slots != self._rows:
            self.runner.set_batch(slots)
            self._rows = slots
        wanted = [s.options.logprobs for s in self.running if s.options.logprobs is not None]
        top = max(wanted) if wanted else None
        tokens = self.runner.batch_step(top)
        scores = self.runner.batch_scores() if top is not None else None
        self.last_batch = len(slots)
        for r, (stream, token) in enumerate(zip(list(self.running), tokens)):
            if token == NO_TOKEN:
                try:
                    drawn(token)
                except GenerationError as exc:
                    stream.deliver([_Failed(exc)])
            else:
                records = () if stream.options.logprobs is None else \
                    scoring.from_rows(scores[r:r + 1], stream.options.logprobs)
                stream.deliver([token], records)
            self._collect(pieces, stream, stream.pump())

    def _speculate(self, stream: BatchedStream, pieces: dict) -> None:
        """The request runs alone and speculates: one verify step on its slot, a burst of 1 to k + 1 tokens."""
        self.runner.slot = stream.slot
        self._rows = None  # the batch rows' inputs are not what a verify step leaves behind
        try:
            burst = stream.decoder.step(stream.budget)
        except GenerationError as exc:
            stream.deliver([_Failed(exc)])
        else:
            stream.deliver(burst, self.runner.take_logprobs())
        self._collect(pieces, stream, stream.pump())
