"""A request of several choices: `n` > 1 (both APIs) and a list of prompts (/v1/completions), as OpenAI and vLLM
answer them.

Each choice is one generation, a row of the engine's batch (a Job of its own, queued with the request's other rows
all at once or not at all: Engine.submit_all), so it gets exactly the tokens it would get as a request of its own
(cullama/generation/batch.py). Prompt i's choice j has index i * n + j. Its seed is the request's `seed` + j (modulo
2**64), the same for every prompt, so choice j of prompt i equals the request for prompt i alone with seed + j and
n = 1; a request without a seed draws one at random for each choice. Each choice has its own text, finish reason and
log-probabilities (with `echo`, its own prompt's text and entries first); `usage` counts each prompt's tokens once
and every choice's completion tokens. Streamed, every chunk carries one choice (its `index`), each choice's first one
its echo and (chat) its role, its last one its finish reason; the usage chunk and [DONE] come after the last choice
has finished.

A request holds one row of the server's capacity per choice: past the rows the queue has room for now, a 429; past
what the server can ever hold (--max-batch running and --max-queue waiting), a 400 naming `n` (or `prompt`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable, Sequence

from fastapi.responses import JSONResponse

from .engine import Finished, Job, Piece, Stopped
from .logprobs import Logprobs
from .protocol import ApiError, GenerationRequest
from .responses import SSE_DONE, Answer, sse

SEEDS = 2 ** 64  # the library's seeds: [0, 2**64)


def count(body: GenerationRequest, chat: bool) -> tuple[int, int]:
    """(prompts, n): the request's rows are their product."""
    return (1 if chat else len(body.prompts())), body.n


def seeds(seed: int | None, n: int) -> list[int | None]:
    """Choice j's seed: seed + j (modulo 2**64); None for each where the request gave none (each draws its own)."""
    return [None if seed is None else (seed + j) % SEEDS for j in range(n)]


def check_capacity(prompts: int, n: int, most: int) -> None:
    """A 400 naming the field where the request has more rows than the server can ever hold at once."""
    if prompts * n <= most:
        return
    param = "n" if prompts == 1 else "prompt"
    what = f"n = {n}" if prompts == 1 else f"{prompts} prompts" + (f" x n = {n}" if n > 1 else "")
    raise ApiError(400, f"{what} asks for {prompts * n} choices, each a generation of its own, and this server holds "
                        f"at most {most} at once (--max-batch running and --max-queue waiting): ask for fewer",
                   param=param)


@dataclasses.dataclass
class Row:
    """One choice's generation: its index, its prompt's, its prompt ids, Llama.stream's keyword arguments, and its
    log-probability fields (and echo) as server/logprobs.py builds them."""

    index: int
    prompt: int
    ids: list[int]
    options: dict
    scores: Logprobs


@dataclasses.dataclass
class Choices:
    """A prepared request of several choices (app.prepare_choices builds it, on a worker thread)."""

    body: GenerationRequest
    chat: bool
    rows: list[Row]

    @classmethod
    def build(cls, body: GenerationRequest, chat: bool, prepared: Sequence[tuple[list[int], dict]],
              tokenizer) -> "Choices":
        """`prepared`: each prompt's (ids, Llama.stream's keywords), in order; n rows each, seeded per choice."""
        echo = getattr(body, "echo", False)
        rows = []
        for i, (ids, options) in enumerate(prepared):
            for j, seed in enumerate(seeds(options["seed"], body.n)):
                scores = Logprobs(chat, options["logprobs"], echo, ids, tokenizer)
                rows.append(Row(i * body.n + j, i, ids, {**options, "seed": seed}, scores))
        return cls(body, chat, rows)

    def prompt_tokens(self) -> int:
        """usage.prompt_tokens: each prompt's once, however many choices it has."""
        return sum(len(row.ids) for row in self.rows if row.index % self.body.n == 0)

    def cached_tokens(self, finished: dict[int, Finished]) -> int:
        """usage.prompt_tokens_details.cached_tokens: each prompt's once, as its first choice found them."""
        return sum(finished[row.index].cached_tokens for row in self.rows if row.index % self.body.n == 0)


class RowJob(Job):
    """A row's Job: its events go to the request's one queue, as (choice index, event)."""

    def __init__(self, row: Row, loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
        super().__init__(row.ids, row.options, loop)
        self.index, self._shared = row.index, events

    def post(self, event) -> None:
        try:
            self._loop.call_soon_threadsafe(self._shared.put_nowait, (self.index, event))
        except RuntimeError:  # the loop closed: nobody is left to read it
            pass


def jobs(choices: Choices, loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> list[RowJob]:
    return [RowJob(row, loop, events) for row in choices.rows]


def indexed(body: dict, index: int) -> dict:
    """A single choice's answer or chunk (responses.Answer's) at choice `index`."""
    for choice in body["choices"]:
        choice["index"] = index
    return body


async def whole_answer(answer: Answer, choices: Choices, events: asyncio.Queue, event: tuple,
                       job_error: Callable) -> JSONResponse:
    """Every choice's events gathered into one answer; the first error any choice meets is the answer instead."""
    n = len(choices.rows)
    texts: list[list[str]] = [[] for _ in range(n)]
    records: list[list] = [[] for _ in range(n)]
    prompts: list = [None] * n
    finished: dict[int, Finished] = {}
    while True:
        index, got = event
        if not isinstance(got, (Piece, Finished)):
            error = job_error(got)
            return JSONResponse(error.body(), status_code=error.status, headers=error.headers)
        if prompts[index] is None:
            prompts[index] = got.prompt_logprobs
        records[index] += got.logprobs
        if isinstance(got, Piece):
            texts[index].append(got.text)
        else:
            finished[index] = got
            if len(finished) == n:
                break
        event = await events.get()
    out, completion = [], 0
    for row in choices.rows:
        end = finished[row.index]
        completion += end.completion_tokens
        one = answer.whole(row.scores.prefix + "".join(texts[row.index]), end.finish_reason, end.prompt_tokens,
                           end.completion_tokens, row.scores.value(records[row.index], prompts[row.index]))
        out += indexed(one, row.index)["choices"]
    body = answer.whole("", "stop", choices.prompt_tokens(), completion,  # the head and the usage
                        cached_tokens=choices.cached_tokens(finished))
    return JSONResponse({**body, "choices": out})


async def stream_events(answer: Answer, choices: Choices, events: asyncio.Queue, event: tuple, job_error: Callable):
    """The SSE body: each choice's chunks as its text becomes final (responses.TextChunks, as a single choice's: the
    log-probabilities of each chunk spell its text, its echo with its first), its finish reason, and once every
    choice has finished the usage if asked, then [DONE]."""
    texts = {row.index: answer.text_chunks(row.scores) for row in choices.rows}
    completion, left, finished = 0, len(choices.rows), {}
    while True:
        index, got = event
        if isinstance(got, Piece):
            for chunk in texts[index].piece(got.text, got.logprobs, got.prompt_logprobs):
                yield sse(indexed(chunk, index))
        elif isinstance(got, Finished):
            for chunk in texts[index].finished(got.finish_reason, got.logprobs, got.prompt_logprobs):
                yield sse(indexed(chunk, index))
            completion, left, finished[index] = completion + got.completion_tokens, left - 1, got
            if not left:
                if answer.include_usage:
                    yield sse(answer.usage_chunk(choices.prompt_tokens(), completion, choices.cached_tokens(finished)))
                yield SSE_DONE
                return
        elif isinstance(got, Stopped) and got.reason == "cancelled":
            return  # nobody is listening
        else:  # too late for a status code: an error event, as OpenAI's stream sends one
            yield sse(job_error(got).body())
            yield SSE_DONE
            return
        event = await events.get()
