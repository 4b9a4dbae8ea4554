"""The HTTP routes: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health and /metrics.

A generation request's body must say it is JSON (`Content-Type: application/json`, else a 415: a web page
cannot send that without a CORS preflight), and is read within a time limit (past it, a 408) up to a size
the context sets (past it, a 413), while all the bodies still arriving together hold at most a budget of
bytes (past it, a 503); then it is parsed, checked (types by pydantic, the rest by `GenerationRequest.check`,
the prompt and the sampling options by the library) and tokenized on a worker thread, so that a long
prompt never holds up the other streams, and a bad request never waits; then it becomes a Job for the
engine thread, and the handler only awaits the job's events. Every answer other than 200 is an
OpenAI-shaped error, Starlette's own (unknown route, wrong method) included, and no answer carries a
stack trace.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import json
import sys
import typing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..common.errors import CullamaError, OptionError, PromptError
from ..generation.generate import GenerationOptions, check_prompt_fits
from ..generation.speculative import SpeculativeOptions
from ..common.untrusted import shown
from . import BODY_TIMEOUT_S, choices
from .engine import Busy, Engine, Failed, Finished, Job, Piece, Refused, Stopped, Unavailable
from .logprobs import Logprobs
from .metrics import Metrics
from .protocol import ApiError, ChatRequest, CompletionRequest, GenerationRequest
from .responses import SSE_DONE, Answer, sse
from .sites import CrossSite, Sites
from .structured import ToolReply, deltas, structured

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}  # Llama.stream's option names that the API spells otherwise
# A body past body_limit is refused (413) before it is parsed: no prompt that fits the context is that long,
# and parsing and tokenizing it would only cost time. 64 bytes a token is generous for text (\u-escaped
# characters included); the floor leaves a small context room for long stop lists and the like.
BODY_BYTES_PER_TOKEN, MIN_BODY_LIMIT = 64, 2 << 20
# The bodies still arriving hold at most this many bodies' worth of bytes between them (past it, a 503): a
# client that opens many uploads and never finishes them holds a bounded amount, and only until BODY_TIMEOUT_S.
BODIES_IN_FLIGHT = 16


@dataclasses.dataclass(frozen=True)
class Settings:
    model_name: str  # what /v1/models lists and requests must name (or leave out)
    context: int  # the model's context in tokens (--max-seq-len)
    api_key: str | None = None  # every /v1/* request needs `Authorization: Bearer <key>` when set
    # Llama.stream's speculative keywords (speculative, draft_tokens, adaptive_draft) for every request that
    # does not say otherwise; empty: plain decoding
    speculative: dict = dataclasses.field(default_factory=dict)
    body_timeout: float = BODY_TIMEOUT_S  # seconds a request body may take to arrive (past it, a 408)
    # The Host names and addresses requests may give besides the loopback ones (the listening address, the
    # --allowed-hosts), and the web pages (Origin) that may use the server besides its own: sites.Sites.
    hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()


def create_app(engine: Engine, settings: Settings, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="cullama", docs_url=None, redoc_url=None, openapi_url=None)
    if settings.api_key:
        app.add_middleware(BearerKey, key=settings.api_key, metrics=metrics)
    app.add_middleware(CrossSite, sites=Sites(settings.hosts, settings.allowed_origins),  # outermost: first
                       refused=lambda path, status: count_refusal(metrics, path, status))
    install_error_handlers(app, metrics)
    bodies = BodyBudget(BODIES_IN_FLIGHT * body_limit(settings.context))

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: for load balancers' probes
    async def health():
        problem = engine.problem()
        if problem is not None:
            raise ApiError(503, problem)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(settings)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name, settings)
        return model_card(settings)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, engine, settings, bodies)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatRequest, engine, settings, bodies)

    return app


def model_card(settings: Settings) -> dict:
    return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "cullama",
            "max_model_len": settings.context}


def check_model(name: str | None, settings: Settings) -> None:
    if name is not None and name != settings.model_name:
        raise ApiError(404, f"the model `{shown(name)}` does not exist: this server serves `{settings.model_name}`",
                       param="model", code="model_not_found")


def body_limit(context: int) -> int:
    """The largest request body, in bytes, that a server with a context of `context` tokens reads."""
    return max(MIN_BODY_LIMIT, BODY_BYTES_PER_TOKEN * context)


class BodyBudget:
    """The bytes held by request bodies still arriving, all requests together (read on the event loop only)."""

    def __init__(self, limit: int):
        self.limit, self.held = limit, 0

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            raise ApiError(503, f"the server is receiving too many request bodies at once ({self.held} bytes "
                                "held by unfinished uploads); retry later", code="server_busy",
                           headers={"Retry-After": "1"})
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


class ClientLeft(Exception):
    """The client closed the connection before its request body was complete: nobody to answer."""

    def __init__(self, received: int, told: str):
        super().__init__(f"{received} of {told or 'an unknown number of'} bytes")


def check_content_type(request: Request) -> None:
    """A 415 unless the body says it is JSON: a web page can send text/plain or a form to any server without
    asking (no CORS preflight), but not application/json."""
    told = request.headers.get("content-type", "")
    if told.split(";")[0].strip().lower() != "application/json":
        said = f"Content-Type: {told[:60]!r}" if told else "no Content-Type"
        raise ApiError(415, f"the request body must be JSON sent as `Content-Type: application/json` (got "
                            f"{said})", code="unsupported_media_type")


async def read_body(request: Request, context: int, bodies: BodyBudget, timeout: float) -> bytes:
    """The raw body, or a 413 once it passes body_limit: at once where Content-Length says so, else as soon
    as the chunks read add up to more (a chunked upload), keeping nothing past the limit; a 408 when it
    takes more than `timeout` seconds; a 503 when the unfinished bodies together would hold more than the
    budget; ClientLeft when the client closes the connection first."""
    limit = body_limit(context)
    too_large = ApiError(413, f"the request body is over {limit} bytes, the most this server reads for its "
                              f"context of {context} tokens: no prompt that fits is that long",
                         code="request_too_large")
    told = request.headers.get("content-length", "")
    if told.isdigit() and int(told) > limit:
        raise too_large
    chunks, size = [], 0

    async def receive() -> None:
        nonlocal size
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                raise too_large
            bodies.take(len(chunk))
            size += len(chunk)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:  # answered, and the connection closed: uvicorn would wait for the rest
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s ({size} bytes came); "
                            "send it whole", code="request_timeout", headers={"Connection": "close"}) from None
    except ClientDisconnect:
        raise ClientLeft(size, told) from None
    finally:
        bodies.give(size)
    return b"".join(chunks)


def parse(raw: bytes, model: type[GenerationRequest]) -> GenerationRequest:
    """The body as JSON, validated by `model`."""
    if not raw.strip():
        raise ApiError(400, "the request has no body: send a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        error = validation_error(exc, model)
    if error.param is None and ("surrogate" in error.message or "hex escape" in error.message):
        error = lone_surrogate(raw) or error
    raise error


def lone_surrogate(raw: bytes) -> ApiError | None:
    """The 400 for a string of the body (a value or a key) that holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF
    escape not in a pair), naming its field: pydantic's parser says only "lone leading surrogate in hex escape"
    or "unexpected end of hex escape" and where; Python's keeps the surrogate. None where Python's parser finds
    none either (another bad escape)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return None

    def refusal(path: tuple, text: str, key: str | None = None) -> ApiError | None:
        unit = next((c for c in text if "\ud800" <= c <= "\udfff"), None)
        if unit is None:
            return None
        what = dotted(path) or "the body"
        if key is not None:
            what += f" has a key, {key.encode('utf-8', 'backslashreplace').decode()[:40]!r}, that"
        return ApiError(400, f"{what} holds a lone UTF-16 surrogate (\\u{ord(unit):04x}), which is not a character: "
                             "in JSON, \\ud800-\\udbff must be followed by \\udc00-\\udfff", param=dotted(path) or None)

    pending = [((), body)]  # (the path to a node, the node)
    while pending:
        path, node = pending.pop()
        if isinstance(node, str) and (error := refusal(path, node)):
            return error
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in children:
            if isinstance(key, str) and (error := refusal(path, key, key)):
                return error
            pending.append(((*path, key), value))
    return None


# -- a generation --------------------------------------------------------------------------------
async def generate(request: Request, model: type[GenerationRequest], engine: Engine, settings: Settings,
                   bodies: BodyBudget):
    check_content_type(request)
    raw = await read_body(request, settings.context, bodies, settings.body_timeout)
    # Parsing and tokenizing megabytes take a second: meanwhile the event loop goes on serving the others.
    body, ids, options, tools = await asyncio.to_thread(admit, raw, model, engine, settings)
    if isinstance(ids, choices.Choices):  # n > 1, or a list of prompts: a row of the batch per choice
        return await generate_choices(request, ids, engine, settings)
    chat = isinstance(body, ChatRequest)
    job = Job(ids, options, asyncio.get_running_loop())
    echo = getattr(body, "echo", False)
    scoring = functools.partial(Logprobs, chat, options["logprobs"], echo, ids, engine.llm.tokenizer)
    # an echo decodes the whole prompt, and completions' logprobs read it too (their text_offset)
    scores = await asyncio.to_thread(scoring) if echo or options["logprobs"] is not None else scoring()
    try:
        engine.submit(job)
    except Busy as exc:
        raise ApiError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
    except Unavailable as exc:
        raise ApiError(503, str(exc)) from None
    # The client may leave while its job waits or runs (uvicorn does not cancel a handler when it does).
    watcher = asyncio.ensure_future(cancel_on_disconnect(request, engine, job))
    answer, streaming = Answer(chat, settings.model_name, body.include_usage()), False
    try:
        first = await job.next_event()
        if body.stream and isinstance(first, (Piece, Finished)):
            # The status is known once the generation has produced something: an error before that is
            # still a proper 4xx/5xx rather than an event inside a 200 stream.
            events = stream_events(answer, job, first, scores, tools)
            streaming = True  # from here the stream's own `finally` ends the watcher and the job
            return StreamingResponse(closing(events, engine, job, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole_answer(answer, job, first, scores, tools)
    finally:
        if not streaming:
            watcher.cancel()
            engine.cancel(job)  # a no-op once the job is done; else the handler itself was cancelled


def admit(raw: bytes, model: type[GenerationRequest], engine: Engine,
          settings: Settings) -> tuple[GenerationRequest, list[int], dict, ToolReply | None]:
    """The request parsed and checked, its prompt's ids, the keyword arguments of Llama.stream and how its tool
    calls are read (None: it has none), or the ApiError that keeps it from queuing. On a worker thread: it reads the
    engine's state and model only (and compiles the request's grammar, if it has one)."""
    body = parse(raw, model)
    body.check()
    check_model(body.model, settings)
    if engine.state != "ready":
        raise ApiError(503, "the model is still loading; GET /health answers 200 once it is ready"
                       if engine.state == "loading" else "the model failed to load")
    if choices.count(body, isinstance(body, ChatRequest)) != (1, 1):
        return body, prepare_choices(engine, body, isinstance(body, ChatRequest), settings), None, None
    return (body, *prepare(engine.llm, body, isinstance(body, ChatRequest), settings.speculative))


def prepare_choices(engine: Engine, body: GenerationRequest, chat: bool, settings: Settings) -> choices.Choices:
    """A request of several choices (server/choices.py) prepared as `prepare` prepares one: each prompt checked and
    tokenized (a 400 names the prompt at fault), its rows seeded; a 400 naming `n` or `prompt` where it has more
    rows than the server can ever hold."""
    prompts, n = choices.count(body, chat)
    choices.check_capacity(prompts, n, engine.max_batch + engine.max_queue)
    prepared = []
    for i, prompt in enumerate([None] if chat else body.prompts()):
        one = body if chat else body.model_copy(update={"prompt": prompt})
        try:
            ids, options, tools = prepare(engine.llm, one, chat, settings.speculative)
        except ApiError as exc:
            if prompts == 1:
                raise
            param = f"prompt.{i}" if exc.param == "prompt" else exc.param
            raise ApiError(exc.status, f"prompt {i}: {exc.message}", param=param, code=exc.code) from None
        if tools is not None:  # each choice's calls would need reading apart (server/structured.py): not yet
            raise ApiError(400, "tools are served with one choice only (n = 1, one prompt)", param="n")
        prepared.append((ids, options))
    return choices.Choices.build(body, chat, prepared, engine.llm.tokenizer)


async def generate_choices(request: Request, prepared: choices.Choices, engine: Engine, settings: Settings):
    """`generate` for a request of several choices: its rows queued together, their events answered as one."""
    loop, events = asyncio.get_running_loop(), asyncio.Queue()
    jobs = choices.jobs(prepared, loop, events)
    try:
        engine.submit_all(jobs)
    except Busy as exc:
        raise ApiError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
    except Unavailable as exc:
        raise ApiError(503, str(exc)) from None

    def cancel() -> None:
        for job in jobs:
            engine.cancel(job)  # a no-op once the job is done

    async def watch() -> None:  # the client may leave while its jobs wait or run
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel()

    async def closing_all(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            watcher.cancel()
            cancel()

    watcher = asyncio.ensure_future(watch())
    answer, streaming = Answer(prepared.chat, settings.model_name, prepared.body.include_usage()), False
    try:
        first = await events.get()
        if prepared.body.stream and isinstance(first[1], (Piece, Finished)):
            chunks = choices.stream_events(answer, prepared, events, first, job_error)
            streaming = True
            return StreamingResponse(closing_all(chunks), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await choices.whole_answer(answer, prepared, events, first, job_error)
    finally:
        if not streaming:
            watcher.cancel()
            cancel()


def prepare(llm, body: GenerationRequest, chat: bool, speculative: dict) -> tuple[list[int], dict, ToolReply | None]:
    """The prompt's ids, the keyword arguments of Llama.stream and how the reply's tool calls are read (None: it
    has none), checked by the library before the request may queue: a 400 naming the field at fault.
    `speculative`: the server's default speculative keywords. response_format, tools and tool_choice become a
    constraint (server/structured.py)."""
    param = "messages" if chat else "prompt"
    constraint, tools, shown = structured(llm, body)
    try:
        ids = llm.chat_ids([m.as_dict() for m in body.messages], tools=shown) if chat else llm.encode(body.prompt)
    except CullamaError as exc:
        raise ApiError(400, str(exc), param=param) from None
    context = llm.runner.max_seq_len
    options = {"max_new_tokens": body.max_new_tokens(context),
               "temperature": body.temperature, "top_k": body.top_k, "top_p": body.sampling_top_p(),
               "repetition_penalty": body.repetition_penalty, "seed": body.sampling_seed(), "stop": body.stops(),
               "ignore_eos": body.ignore_eos, **body.logprob_options()}
    if constraint is not None:
        options["constraint"] = constraint
    try:
        GenerationOptions.checked(**options)
    except OptionError as exc:
        raise ApiError(400, str(exc), param=OPENAI_NAMES.get(exc.option, exc.option)) from None
    check_fits(len(ids), context, options["max_new_tokens"], body.token_limit(), param)
    if options["prompt_logprobs"] is not None and len(ids) > context:  # echo scores the prompt in one prefill
        raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has {len(ids)}, "
                            "too many to score (echo with logprobs)", param=param, code="context_length_exceeded")
    return ids, {**options, **speculation(llm, body, speculative)}, tools


def check_fits(prompt_tokens: int, context: int, max_new_tokens: int, limit: tuple[str, int] | None,
               param: str) -> None:
    """The library's rule (the prompt must leave room in the context), then OpenAI's: a cap on the completion
    that the request gives must fit beside the prompt, where the library would stop at the context's end
    unasked (finish_reason "length"). A request that gives none may run to there."""
    try:
        check_prompt_fits(prompt_tokens, context, max_new_tokens)
    except PromptError as exc:
        raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
    if limit is not None and prompt_tokens + limit[1] > context:
        name, asked = limit
        raise ApiError(400, f"this model's maximum context length is {context} tokens; the prompt has "
                            f"{prompt_tokens} and {name} asks for {asked} more: ask for at most "
                            f"{context - prompt_tokens}", param=name, code="context_length_exceeded")


def speculation(llm, body: GenerationRequest, default: dict) -> dict:
    """The request's speculative keywords for Llama.stream ({}: plain decoding), checked by SpeculativeOptions:
    a 400 naming the field at fault; "draft" needs the draft model the server was started with."""
    method, draft_tokens, adaptive = body.speculation(default)
    if method == "draft" and llm.draft is None:
        raise ApiError(400, "speculative 'draft' needs a draft model and this server has none (cullama serve "
                            "--draft-model DIR); use 'ngram' or 'off'", param="speculative")
    try:
        spec = SpeculativeOptions.checked(method, draft_tokens, adaptive)
    except OptionError as exc:
        raise ApiError(400, str(exc), param=exc.option) from None
    if spec is None:
        return {}
    return {"speculative": spec.method, "draft_tokens": spec.draft_tokens, "adaptive_draft": spec.adaptive}


async def whole_answer(answer: Answer, job: Job, event, scores: Logprobs, tools: ToolReply | None) -> JSONResponse:
    pieces, records, prompt = [], [], event.prompt_logprobs if isinstance(event, (Piece, Finished)) else None
    while isinstance(event, Piece):
        pieces.append(event.text)
        records += event.logprobs
        event = await job.next_event()
    if isinstance(event, Finished):
        records += event.logprobs
        text, finish, calls = scores.prefix + "".join(pieces), event.finish_reason, None
        if tools is not None:
            text, calls, n = tools.whole(text)
            finish = tools.finish_reason(finish, n)
        return JSONResponse(answer.whole(text, finish, event.prompt_tokens, event.completion_tokens,
                                         scores.value(records, prompt), calls, event.cached_tokens))
    return error_response(job_error(event))


async def stream_events(answer: Answer, job: Job, event, scores: Logprobs, tools: ToolReply | None = None):
    """The SSE body: chunks as the text becomes final, the finish reason, the usage if asked, [DONE]. Without tools
    the chunks are responses.TextChunks' (each chunk's log-probabilities spell its text; an echo's prompt text and
    its log-probabilities go with the first). With tools, the text goes through the reply's ToolStreamer: content and
    tool-call deltas, each piece's log-probabilities on its first chunk (or the next one)."""
    streamer = tools.streamer() if tools is not None else None
    text = answer.text_chunks(scores)
    first = True  # (with tools) no chunk sent yet
    held = None  # log-probabilities of pieces that made no chunk yet (text a ToolStreamer holds back)
    while True:
        if isinstance(event, Piece) and streamer is not None:
            logprobs = scores.value(event.logprobs, event.prompt_logprobs)
            held = logprobs if held is None else _joined(held, logprobs)
            for piece, calls in deltas(streamer.push(event.text)):
                yield sse(answer.chunk(piece, first=first, logprobs=held, tool_calls=calls))
                first, held = False, None
        elif isinstance(event, Piece):
            for chunk in text.piece(event.text, event.logprobs, event.prompt_logprobs):
                yield sse(chunk)
        elif isinstance(event, Finished):
            if streamer is not None:
                rest = scores.value(event.logprobs, event.prompt_logprobs) \
                    if event.logprobs or event.prompt_logprobs else None  # the tokens no piece carried (an EOS)
                rest = rest if held is None else _joined(held, rest)
                for piece, calls in deltas(streamer.finish()):
                    yield sse(answer.chunk(piece, first=first, logprobs=rest, tool_calls=calls))
                    first, rest = False, None
                finish = tools.finish_reason(event.finish_reason, streamer.read)
                yield sse(answer.chunk(None, finish, first=first, logprobs=rest))
            else:
                for chunk in text.finished(event.finish_reason, event.logprobs, event.prompt_logprobs):
                    yield sse(chunk)
            if answer.include_usage:
                yield sse(answer.usage_chunk(event.prompt_tokens, event.completion_tokens, event.cached_tokens))
            yield SSE_DONE
            return
        elif isinstance(event, Stopped) and event.reason == "cancelled":
            return  # nobody is listening
        else:  # too late for a status code: an error event, as OpenAI's stream sends one
            yield sse(job_error(event).body())
            yield SSE_DONE
            return
        event = await job.next_event()


def _joined(a: dict | None, b: dict | None) -> dict | None:
    """Two chat logprobs values ({"content": [...]}) as one."""
    if a is None or b is None:
        return a if b is None else b
    return {**a, "content": [*(a.get("content") or []), *(b.get("content") or [])]}


async def closing(events, engine: Engine, job: Job, watcher: asyncio.Future):
    """`events`, then (also when the client left and Starlette cancelled the stream) the job's end."""
    try:
        async for chunk in events:
            yield chunk
    finally:
        watcher.cancel()
        engine.cancel(job)


async def cancel_on_disconnect(request: Request, engine: Engine, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.cancel(job)


def job_error(event) -> ApiError:
    if isinstance(event, Refused):
        return ApiError(400, event.message)
    if isinstance(event, Failed):
        return ApiError(500, event.message)
    assert isinstance(event, Stopped), event
    if event.reason == "shutdown":
        return ApiError(503, "the server is shutting down")
    return ApiError(499, "the request was cancelled")  # the client left: nobody reads this


# -- errors ----------------------------------------------------------------------------------------
def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def count_refusal(metrics: Metrics, path: str, status: int) -> None:
    """A generation request answered before it became a job (the engine counts the others)."""
    if path in GENERATION_PATHS:
        metrics.count("rejected" if status in (429, 503) else "failed" if status >= 500 else "invalid")


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def answer(request: Request, error: ApiError) -> JSONResponse:
        count_refusal(metrics, request.url.path, error.status)
        return error_response(error)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return answer(request, exc)

    @app.exception_handler(ClientLeft)
    async def client_left(request: Request, exc: ClientLeft):  # one line in the log, not a traceback
        print(f"cullama serve: {request.method} {request.url.path}: the connection closed before the body came "
              f"({exc})", file=sys.stderr, flush=True)
        metrics.count("cancelled")
        return Response(status_code=499)  # nobody is left to read it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return answer(request, ApiError(exc.status_code, message, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception):  # Starlette re-raises it after this, and uvicorn logs it
        return answer(request, ApiError(500, f"internal error ({type(exc).__name__}); the server logged "
                                             "the details"))


def validation_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    """pydantic's first complaint as one OpenAI-shaped 400 naming the field as the request spells it. A field
    that takes one of several types gets a complaint per type, each under a tag ('stop.str', 'stop.list[str]'):
    the answer says what the field takes instead, with the complaint that went deepest where there is one
    (the value had that type's shape, but a part of it is wrong)."""
    errors = exc.errors()
    error, loc = errors[0], errors[0]["loc"]
    if error["type"] == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {error.get('ctx', {}).get('error', error['msg'])}")
    if not loc:
        return ApiError(400, f"the body must be a JSON object: {error['msg']}")
    path, union = field_path(model, loc)
    if union is None:
        param = dotted(path)
        return ApiError(400, f"{param}: {error['msg']}", param=param)
    at, field = union
    param = dotted(loc[:at])
    members = [e for e in errors if e["loc"][:at] == loc[:at] and len(e["loc"]) > at]
    takes = field.description or " or ".join(dict.fromkeys(str(e["loc"][at]) for e in members))
    deepest = max(members, key=lambda e: len(e["loc"]))
    detail = f" ({dotted(field_path(model, deepest['loc'])[0])}: {deepest['msg']})" \
        if len(deepest["loc"]) > at + 1 else ""
    return ApiError(400, f"{param} must be {takes}{detail}", param=param)


def field_path(model: type[BaseModel], loc: tuple) -> tuple[list, tuple[int, FieldInfo] | None]:
    """pydantic's `loc` as the request's own path (field names and list indices), without the tags it adds
    after a union field for each of its types ('str', 'list[str]'), and (index in loc, field) of the first
    such tag, None if none. A part is a field's name where the model at that point has such a field."""
    path, union, node, field = [], None, model, None
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path.append(part)
        elif node is not None and part in node.model_fields:
            field = node.model_fields[part]
            path.append(part)
            node = model_in(field.annotation)
        elif union is None:
            union = i, field
    return path, union


def model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model a field's type holds (Message in list[Message] | None), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, map(model_in, typing.get_args(annotation))), None)


def dotted(path) -> str:
    return ".".join(str(part) for part in path)


class BearerKey:
    """ASGI middleware: every /v1/* request needs `Authorization: Bearer <key>`, compared in constant
    time; checked before the body is read, so a client without the key learns nothing else."""

    def __init__(self, app, key: str, metrics: Metrics):
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self.authorized(scope):
            count_refusal(self.metrics, scope["path"], 401)
            error = ApiError(401, "a valid API key is needed: send `Authorization: Bearer <key>`",
                             code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)

    def authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
