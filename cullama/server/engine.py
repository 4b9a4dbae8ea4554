"""The engine: one thread owns the Llama and runs one generation at a time, in arrival order.

Batch 1 is the point of cullama, so there is no batching to schedule: requests wait in a FIFO queue
bounded by `max_queue` (past it `submit` raises Busy, a 429), and the engine thread takes them one by
one. The HTTP side never runs the model or waits on the device (it only tokenizes the prompt, on a
worker thread): it submits a Job and awaits the job's events (Piece..., then one of Finished / Refused /
Failed / Stopped), which the engine thread posts onto the job's asyncio loop.

Cancelling (a client that went away, or the server stopping) takes a waiting job out of the queue at
once; a running one stops between tokens: the engine checks after each text piece and closes the
stream, so at most the token being computed is finished. A token whose text is held back
(the first bytes of a character, a possible start of a stop string) yields no piece and is not a
check point, so those few tokens run on. Under speculative decoding the tokens arrive in bursts, one
verify step each, and the stream hands a burst out one token at a time: after a cancel the engine
reads one more piece, the burst's next (already computed) or the first of at most one more verify
step, and the rest of the burst is dropped.
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

from ..errors import CullamaError
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

    def __init__(self, load: Callable[[], object], max_queue: int, metrics: Metrics):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue, self.metrics = max_queue, metrics
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

    # -- the HTTP side ---------------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        """Queue a job, or raise Busy (queue full) / Unavailable (not ready, stopping)."""
        with self._lock:
            if self._stopping:
                raise Unavailable("the server is shutting down")
            if self.state != "ready":
                raise Unavailable("the model is still loading; GET /health answers 200 once it is ready"
                                  if self.state == "loading" else "the model failed to load")
            # max_queue counts the jobs waiting behind the running one (an idle engine takes one at once).
            if len(self._waiting) + (self._running is not None) > self.max_queue:
                raise Busy(f"the server is busy: {len(self._waiting)} requests are waiting (--max-queue "
                           f"{self.max_queue}); retry later")
            job.state = "waiting"
            self._waiting.append(job)
            self._publish_load()
            self._lock.notify()

    def cancel(self, job: Job, reason: str = "cancelled") -> None:
        """Stop a job: out of the queue now, or between two tokens if it runs. Idempotent; a finished
        job is left alone."""
        with self._lock:
            if job.state == "waiting":
                self._waiting.remove(job)
                self._publish_load()
                self._end(job, Stopped(reason))
            elif job.state == "running" and job.stop_reason is None:
                job.stop_reason = reason

    def stop(self) -> None:
        """Shutting down: refuse new jobs, end the waiting ones, stop the running one at the next token."""
        with self._lock:
            self._stopping = True
            while self._waiting:
                self._end(self._waiting.popleft(), Stopped("shutdown"))
            if self._running is not None and self._running.stop_reason is None:
                self._running.stop_reason = "shutdown"
            self._publish_load()
            self._lock.notify_all()

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
        while (job := self._take()) is not None:
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
            self.metrics.prompt(len(job.prompt_ids))
            scores = logprob_fields.cursor(stream, job.options)  # None unless the request asked for them
            for piece in stream:
                if job.stop_reason is not None:
                    break
                job.post(Piece(piece, **scores.take()) if scores else Piece(piece))
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
        self._finish(job, Finished(result.finish_reason, len(job.prompt_ids), len(result.token_ids),
                                   **(scores.take() if scores else {})))

    def _measure(self, job: Job, started: float, result) -> None:
        """The tokens and timings of a generation, however it ended (Llama.stream's own timings)."""
        first_token_s = started - job.arrived + result.timings.prefill_s if result.timings.prefill_s else None
        self.metrics.generated(len(result.token_ids), first_token_s, result.timings.token_s)
        if result.speculative is not None:
            self.metrics.speculated(result.speculative)

    def _finish(self, job: Job, event: Event) -> None:
        with self._lock:
            self._running = None
            self._publish_load()
            self._end(job, event)

    def _end(self, job: Job, event: Event) -> None:
        """The job's last event, and its outcome in the metrics."""
        job.state = "done"
        self.metrics.count({Finished: "completed", Stopped: "cancelled", Failed: "failed",
                            Refused: "invalid"}[type(event)])
        job.post(event)

    def _publish_load(self) -> None:
        self.metrics.set_load(len(self._waiting), int(self._running is not None))
