"""The engine: one thread owns the Llama and runs its generations, in arrival order.

With max_batch 1 (`--max-batch 1`) it runs one generation at a time: requests wait in a FIFO queue bounded by
`max_queue` (past it `submit` raises Busy, a 429), and the engine thread takes them one by one. With max_batch B > 1
it runs up to B together in a batch session (cullama/generation/batch.py: iteration-level scheduling, each request's
tokens exactly its solo tokens): a request joins the batch as soon as one of its slots is free, and the queue bounds the
requests waiting past the batch. The metrics count the rows of every decode step (cullama_decode_batch_size) and the
requests running (cullama_running_requests). The HTTP side never runs the model or waits on the device (it only
tokenizes the prompt, on a worker thread): it submits a Job and awaits the job's events (Piece..., then one of
Finished / Refused / Failed / Stopped), which the engine thread posts onto the job's asyncio loop.

Cancelling (a client that went away, or the server stopping) takes a waiting job out of the queue at once; a running
one stops before its next token (GenerationStream.cancel, checked after every token, its text shown or held back as
a possible start of a stop string), so at most the token being computed is finished. Under speculative decoding the
tokens arrive in bursts, one verify step each, which the stream hands out one token at a time: a cancel drops the
rest of the burst and runs no further step.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import sys
import threading
import time
import traceback
from typing import Callable, Sequence

from ..common.errors import CullamaError, GenerationError
from . import logprobs as logprob_fields
from .metrics import Metrics


@dataclasses.dataclass(frozen=True)
class Piece:
    text: str  # text that became final (the streaming detokenizer, stop strings held back)
    # A request that asked for log-probabilities (server/logprobs.py): the TokenLogprobs of the tokens produced
    # since the last event, and the prompt's (with its first event, once scored)
    logprobs: tuple = ()
    prompt_logprobs: tuple | None = None


@dataclasses.dataclass(frozen=True)
class Finished:
    finish_reason: str  # the library's: "eos", "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    logprobs: tuple = ()  # as Piece's: those of the tokens no Piece carried
    prompt_logprobs: tuple | None = None
    cached_tokens: int = 0  # prompt tokens the prefix cache gave (Generation.cached_tokens)


@dataclasses.dataclass(frozen=True)
class Refused:
    message: str  # the library refused the request (a CullamaError): the client's fault, a 400


@dataclasses.dataclass(frozen=True)
class Failed:
    message: str  # an exception inside the generation: a 500 for this request; the engine goes on


@dataclasses.dataclass(frozen=True)
class Stopped:
    reason: str  # "cancelled" (the client went away) or "shutdown" (the server is stopping)


Event = Piece | Finished | Refused | Failed | Stopped


class Busy(Exception):
    """The queue is full (a 429)."""


class Unavailable(Exception):
    """No generation can be queued now: the model is loading, failed to load, or the server stops (503)."""


class Job:
    """One generation request: its prompt ids, the keyword arguments of `Llama.stream`, and its events."""

    def __init__(self, prompt_ids: Sequence[int], options: dict, loop: asyncio.AbstractEventLoop):
        self.prompt_ids, self.options = list(prompt_ids), dict(options)
        self.arrived = time.perf_counter()
        self.state = "new"  # new -> waiting -> running -> done (changed under the engine's lock)
        self.stop_reason: str | None = None  # set to stop a running job between tokens
        self.stream = None  # its GenerationStream while it runs (set under the engine's lock)
        self._loop = loop
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    async def next_event(self) -> Event:
        return await self._events.get()

    def post(self, event: Event) -> None:
        """From any thread: hand an event to the job's loop (dropped if the loop is gone)."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the loop closed: nobody is left to read it
            pass


class Engine:
    """Owns the model: `load()` runs on the engine thread, then the thread serves the queue."""

    def __init__(self, load: Callable[[], object], max_queue: int, metrics: Metrics, max_batch: int = 1):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_queue, self.metrics, self.max_batch = max_queue, metrics, max_batch
        self._batched: set[Job] = set()  # the jobs in the batch session (max_batch > 1)
        self.llm = None  # the Llama, once loaded
        self.state = "loading"  # loading -> ready -> stopped, or loading -> failed
        self.load_error: BaseException | None = None
        self._load = load
        self._lock = threading.Condition()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: Job | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._main, name="cullama-engine", daemon=True)

    def start(self, on_load_failure: Callable[[BaseException], None] = lambda exc: None) -> None:
        self._on_load_failure = on_load_failure
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def problem(self) -> str | None:
        """Why the engine serves no request now (None: it serves): loading, failed, stopped, or its thread gone
        while ready (an error outside any one request's: /health answers 503, and a replica under Ray is
        unhealthy and replaced)."""
        with self._lock:
            if self.state != "ready":
                return "the model is loading" if self.state == "loading" else f"the model is not served ({self.state})"
            if not self._thread.is_alive():
                return "the model is not served (its engine thread ended)"
            return None

    # -- the HTTP side ---------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job, or raise Busy (queue full) / Unavailable (not ready, stopping)."""
        with self._lock:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            if self.state != "ready":
                raise Unavailable("the model is still loading; GET /health answers 200 once it is ready"
                                  if self.state == "loading" else "the model failed to load")
            # max_queue counts the jobs waiting behind the running ones (an idle engine takes max_batch at once).
            if len(self._waiting) + self._held() > self.max_queue + self.max_batch - 1:
                raise Busy(f"the server is busy: {len(self._waiting)} requests are waiting (--max-queue "
                           f"{self.max_queue}); retry later")
            job.state = "waiting"
            self._waiting.append(job)
            self._publish_load()
            self._lock.notify()

    def submit_all(self, jobs: Sequence[Job]) -> None:
        """Queue the rows of one request (n > 1, a list of prompts: server/choices.py) all together, each counting as a
        request against --max-batch and --max-queue, or none of them: Busy where they do not all fit now."""
        with self._lock:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            if self.state != "ready":
                raise Unavailable("the model is still loading; GET /health answers 200 once it is ready"
                                  if self.state == "loading" else "the model failed to load")
            if len(self._waiting) + self._held() + len(jobs) > self.max_queue + self.max_batch:
                raise Busy(f"the server is busy: {len(self._waiting)} requests are waiting (--max-queue "
                           f"{self.max_queue}) and this one's {len(jobs)} choices do not fit behind them; retry later")
            for job in jobs:
                job.state = "waiting"
                self._waiting.append(job)
            self._publish_load()
            self._lock.notify_all()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job: out of the queue now, or between two tokens if it runs. Idempotent; a finished
        job is left alone."""
        with self._lock:
            if job.state == "waiting":
                self._waiting.remove(job)
                self._publish_load()
                self._end(job, Stopped(reason))
            elif job.state == "running" and job.stop_reason is None:
                self._stop_running(job, reason)

    def stop(self) -> None:
        """Shutting down: refuse new jobs, end the waiting ones, stop the running one at the next token."""
        with self._lock:
            self._stopping = True
            while self._waiting:
                self._end(self._waiting.popleft(), Stopped("shutdown"))
            for job in [self._running, *self._batched]:
                if job is not None and job.stop_reason is None:
                    self._stop_running(job, "shutdown")
            self._publish_load()
            self._lock.notify_all()

    def _stop_running(self, job: Job, reason: str) -> None:
        """The running job ends before its next token (call with the lock held)."""
        job.stop_reason = reason
        if job.stream is not None:
            job.stream.cancel()

    # -- the engine thread --------------------------------------------------------------------------
    def _main(self) -> None:
        try:
            llm = self._load()
        except BaseException as exc:  # reported by on_load_failure (the server exits), not swallowed
            with self._lock:
                self.state, self.load_error = "failed", exc
            self._on_load_failure(exc)
            return
        with self._lock:
            self.llm, self.state = llm, "ready"
        if self.max_batch > 1:
            self._serve_batched()
        while self.max_batch == 1 and (job := self._take()) is not None:
            self._run(job)
        with self._lock:
            self.state = "stopped"

    def _take(self) -> Job | None:
        with self._lock:
            while not self._waiting and not self._stopping:
                self._lock.wait()
            if self._stopping:
                return None
            job = self._running = self._waiting.popleft()
            job.state = "running"
            self._publish_load()
            return job

    def _run(self, job: Job) -> None:
        started = time.perf_counter()
        if job.stop_reason is not None:  # cancelled between leaving the queue and starting
            return self._finish(job, Stopped(job.stop_reason))
        stream = None
        try:
            stream = self.llm.stream(job.prompt_ids, **job.options)
            with self._lock:  # from here a cancel reaches the stream itself, between any two tokens
                job.stream = stream
                if job.stop_reason is not None:
                    stream.cancel()
            self.metrics.prompt(len(job.prompt_ids))
            scores = logprob_fields.cursor(stream, job.options)  # None unless the request asked for them
            for piece in stream:
                if job.stop_reason is not None:
                    break
                job.post(Piece(piece, **scores.take()) if scores else Piece(piece))
        except GenerationError as exc:  # the model's numbers gave nothing to draw: the server's fault, a 500
            return self._finish(job, Failed(str(exc)))
        except CullamaError as exc:  # the library refused the request's options
            return self._finish(job, Refused(str(exc)))
        except Exception as exc:  # the request fails, the server goes on
            print(f"cullama serve: a generation failed ({type(exc).__name__}):", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            return self._finish(job, Failed(f"the generation failed ({type(exc).__name__}); the server "
                                            "logged the details"))
        finally:
            if stream is not None:
                stream.close()  # ends a generation cut short between two tokens; its result keeps its tokens
                self._measure(job, started, stream.result)
        if job.stop_reason is not None:
            return self._finish(job, Stopped(job.stop_reason))
        result = stream.result
        if result.finish_reason not in ("eos", "stop", "length"):  # a way to end that no request asked for
            return self._finish(job, Failed(f"the generation ended early ({result.finish_reason})"))
        self._finish(job, Finished(result.finish_reason, len(job.prompt_ids), result.completion_tokens,
                                   cached_tokens=result.cached_tokens, **(scores.take() if scores else {})))

    def _measure(self, job: Job, started: float, result) -> None:
        """The tokens and timings of a generation, however it ended (Llama.stream's own timings)."""
        first_token_s = started - job.arrived + result.timings.prefill_s if result.timings.prefill_s else None
        self.metrics.generated(result.completion_tokens, first_token_s, result.timings.token_s, result.cached_tokens)
        if result.speculative is not None:
            self.metrics.speculated(result.speculative)
        elif self.max_batch == 1:  # each token after the first: a decode step of one row
            self.metrics.decode_steps(1, len(result.timings.token_s))

    def _finish(self, job: Job, event: Event) -> None:
        with self._lock:
            self._running, job.stream = None, None
            self._publish_load()
            self._end(job, event)

    def _end(self, job: Job, event: Event) -> None:
        """The job's last event, and its outcome in the metrics."""
        job.state = "done"
        self.metrics.count({Finished: "completed", Stopped: "cancelled", Failed: "failed",
                            Refused: "invalid"}[type(event)])
        job.post(event)

    def _held(self) -> int:
        """Jobs the model holds now (running, or joining the batch)."""
        return (self._running is not None) + len(self._batched)

    def _publish_load(self) -> None:
        self.metrics.set_load(len(self._waiting), int(self._held() > 0))
        self.metrics.set_running(self._held())

    # -- batched (max_batch > 1) ----------------------------------------------------------------------
    def _serve_batched(self) -> None:
        """Serve the queue through one batch session until stopped: admit what fits, step, hand out the pieces."""
        session = self.llm.batch()
        jobs: dict[int, tuple] = {}  # id(stream) -> (job, its logprobs cursor or None, when it started)
        while True:
            with self._lock:
                while not self._waiting and session.idle and not self._stopping:
                    self._lock.wait()
                if self._stopping and session.idle:
                    return
                while self._waiting and session.holding < self.max_batch and not self._stopping:
                    self._join(session, self._waiting.popleft(), jobs)
                self._publish_load()
            try:
                updates = session.step()
            except Exception as exc:  # a fault of the session itself: its requests fail, the server goes on
                print(f"cullama serve: a batched step failed ({type(exc).__name__}):", file=sys.stderr)
                traceback.print_exc(file=sys.stderr)
                for job, _, _ in jobs.values():
                    self._close(job, Failed(f"the generation failed ({type(exc).__name__}); the server logged "
                                            "the details"))
                jobs.clear()
                session = self.llm.batch()
                continue
            if session.last_batch:
                self.metrics.decode_steps(session.last_batch)
            for update in updates:
                entry = jobs.get(id(update.stream))
                if entry is None:
                    continue
                job, scores, started = entry
                for piece in update.pieces:
                    if job.stop_reason is None:
                        job.post(Piece(piece, **scores.take()) if scores else Piece(piece))
                if update.done:
                    del jobs[id(update.stream)]
                    self._ended(job, update.stream, scores, started)

    def _join(self, session, job: Job, jobs: dict) -> None:
        """A waiting job into the session (the lock held): its options are checked here, before it joins."""
        job.state = "running"
        if job.stop_reason is not None:
            return self._end(job, Stopped(job.stop_reason))
        try:
            stream = session.submit(job.prompt_ids, **job.options)
        except CullamaError as exc:
            return self._end(job, Refused(str(exc)))
        except Exception as exc:  # this request fails, the engine thread and the batch go on (as _run)
            print(f"cullama serve: a request could not join the batch ({type(exc).__name__}):", file=sys.stderr)
            traceback.print_exc(file=sys.stderr)
            return self._end(job, Failed(f"the generation failed ({type(exc).__name__}); the server logged the "
                                         "details"))
        job.stream = stream
        self._batched.add(job)
        jobs[id(stream)] = (job, logprob_fields.cursor(stream, job.options), time.perf_counter())
        self.metrics.prompt(len(job.prompt_ids))

    def _ended(self, job: Job, stream, scores, started: float) -> None:
        """A batched job's last event, from how its stream ended."""
        result = stream.result
        self._measure(job, started, result)
        if job.stop_reason is not None:
            return self._close(job, Stopped(job.stop_reason))
        if isinstance(stream.error, GenerationError):  # its row had nothing to draw: a 500, as a solo stream's
            return self._close(job, Failed(str(stream.error)))
        if isinstance(stream.error, CullamaError):
            return self._close(job, Refused(str(stream.error)))
        if stream.error is not None or result.finish_reason not in ("eos", "stop", "length"):
            what = type(stream.error).__name__ if stream.error is not None else result.finish_reason
            return self._close(job, Failed(f"the generation ended early ({what})"))
        self._close(job, Finished(result.finish_reason, len(job.prompt_ids), result.completion_tokens,
                                  cached_tokens=result.cached_tokens, **(scores.take() if scores else {})))

    def _close(self, job: Job, event: Event) -> None:
        with self._lock:
            self._batched.discard(job)
            job.stream = None
            self._publish_load()
            self._end(job, event)
