"""`cullama serve`'s process: check the model, listen, load the weights in the background, serve, stop.

The order matters to whoever starts the server: the options, the model directory (and the draft model's,
against the target's vocabulary) are checked before anything else (a bad one is one line and exit 2), then
the socket listens, and only then do the weights load (the target's, then the draft's), on the engine
thread, while /health answers 503; it answers 200 once they are all in. SIGINT (Ctrl-C) or SIGTERM, from
the start on, stops accepting connections, ends the waiting requests with a 503 and the running generation
at its next token, gives the connections still open (a body still arriving, a reader that does not read)
`shutdown_grace` seconds to finish, closes the rest, and exits 0. A model that fails to load ends the
server with the error's exit code (a CullamaError: one line, 2 for bad input, 1 for what the machine
cannot do, such as a KV cache that does not fit), 1 for anything else (with its traceback).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..model import hub
from ..model.config import from_pretrained as read_config
from ..common.errors import CullamaError, OptionError
from . import BODY_TIMEOUT_S, SHUTDOWN_GRACE_S
from .app import Settings, create_app
from .engine import Engine
from .metrics import Metrics
from .protocol import ApiError


# The 400 of a request that is not HTTP (also the replicas' relay's, cullama/replicas/front.py).
MALFORMED_HTTP = "the request is not valid HTTP/1.1 (its request line, headers or body framing are malformed)"


class ServeError(CullamaError):
    """The server cannot start: no tokenizer to serve text with, a port it cannot listen on."""


def is_loopback(host: str) -> bool:
    """Whether `host` is only reachable from this machine (every address it resolves to is loopback)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def listen(host: str, port: int) -> socket.socket:
    """A listening socket: connections queue from here on, while the weights load (port 0: a free one)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class Server(uvicorn.Server):
    """uvicorn's server, which tells the engine first when it shuts down: the queue is answered with
    503s and the running generation ends at its next token, so uvicorn's wait for open connections is
    short rather than as long as the queued generations. uvicorn waits for every request to end, and one
    whose body never comes would keep it waiting for ever (a second signal too): after `grace` seconds the
    connections still open are closed, as if their clients had left."""

    def __init__(self, config: uvicorn.Config, engine: Engine | None, grace: float = SHUTDOWN_GRACE_S):
        super().__init__(config)  # engine None: someone else stops the generations (cullama/replicas/launch.py)
        self.engine, self.grace = engine, grace

    async def shutdown(self, sockets=None):
        if self.engine is not None:
            self.engine.stop()
        closing = asyncio.get_running_loop().call_later(self.grace, self.close_connections)
        try:
            await super().shutdown(sockets=sockets)
        finally:
            closing.cancel()

    def close_connections(self) -> None:
        for connection in list(self.server_state.connections):
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.close()


class JsonErrors(H11Protocol):
    """uvicorn's HTTP protocol on h11, whose answer to a request it cannot parse (a malformed request line,
    headers or body framing) is OpenAI's error object rather than plain text. uvicorn tells it only that the
    request is malformed, not where. h11 always, never uvicorn's pick (httptools wherever it is installed, as
    `ray[serve]` and `uvicorn[standard]` install it): httptools serves an HTTP/1.1 request without a Host header,
    which RFC 9112 and these servers refuse, so the same server would answer otherwise on another install."""

    def send_400_response(self, msg: str) -> None:
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.response_started:  # too late for a status: only the end of the connection
            self.transport.close()
            return
        body = json.dumps(ApiError(400, MALFORMED_HTTP, code="malformed_http").body(),
                          separators=(",", ":")).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def checked_api_key(key: str | None) -> str | None:
    """The API key, None for none (unset or empty); OptionError for one that no client could send back as
    it is: spaces around it (a client's `Bearer <key>` header loses them), or characters other than
    printable ASCII."""
    if not key:
        return None
    if key != key.strip():
        raise OptionError("api_key", "has spaces around it, which no Authorization header keeps: give the key "
                                     "without them (also in CULLAMA_API_KEY)")
    if not all("!" <= c <= "~" for c in key):
        raise OptionError("api_key", "must be printable ASCII without spaces, as an Authorization header carries "
                                     "it (also in CULLAMA_API_KEY)")
    return key


def _exit_zero(signum, frame):
    raise SystemExit(0)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
          max_seq_len: int | None = None, served_model_name: str | None = None, max_queue: int = 64,
          api_key: str | None = None, tokenizer: str | None = None, speculative: dict | None = None,
          draft_model: str | None = None, quantize: str | None = None, body_timeout: float = BODY_TIMEOUT_S,
          shutdown_grace: float = SHUTDOWN_GRACE_S, allowed_hosts: tuple[str, ...] = (),
          allowed_origins: tuple[str, ...] = (), max_batch: int = 8, prefill_chunk: int | None = None,
          revision: str | None = None) -> int:
    """Serve a checkpoint directory (or a HuggingFace hub id at `revision`, downloaded before the socket listens
    where the local cache lacks it: cullama/model/hub.py) until SIGINT or SIGTERM; the exit status (0, or 2 / 1 when
    the model failed to load).

    speculative: Llama.stream's speculative keywords (speculative, draft_tokens, adaptive_draft), every
    request's default ({} or None: plain decoding); draft_model: the draft model's directory, loaded with
    the target before /health answers 200; quantize: Llama.from_pretrained's (int8, int4 on load);
    allowed_hosts, allowed_origins: see sites.py; max_batch: requests decoded together (1: one at a time; each
    request's tokens are its solo tokens either way), a KV cache of the context each (checked before the weights
    load: a max_batch that does not fit is refused with the numbers); prefill_chunk: Llama.from_pretrained's (None:
    its rule, which the ready line reports)."""
    from ..llama import Llama

    settings, load = prepare(model_dir, device=device, max_seq_len=max_seq_len, served_model_name=served_model_name,
                             api_key=api_key, tokenizer=tokenizer, speculative=speculative, draft_model=draft_model,
                             quantize=quantize, body_timeout=body_timeout, allowed_hosts=allowed_hosts,
                             allowed_origins=allowed_origins, max_batch=max_batch, prefill_chunk=prefill_chunk,
                             revision=revision)
    return run(lambda: Llama.from_pretrained(**load), settings, host, port, max_queue, shutdown_grace, max_batch)


def prepare(model_dir: str, device: str = "auto", max_seq_len: int | None = None,
            served_model_name: str | None = None, api_key: str | None = None, tokenizer: str | None = None,
            speculative: dict | None = None, draft_model: str | None = None, quantize: str | None = None,
            body_timeout: float = BODY_TIMEOUT_S, allowed_hosts: tuple[str, ...] = (),
            allowed_origins: tuple[str, ...] = (), max_batch: int = 8, prefill_chunk: int | None = None,
            revision: str | None = None) -> tuple[Settings, dict]:
    """What `cullama serve` checks before it listens (serve's options; a bad one is a CullamaError, one line and exit
    2): the app's Settings (its hosts: the --allowed-hosts only, the listening address is the caller's to add) and
    Llama.from_pretrained's keywords, which load the model on the engine thread (of this process, or of each replica
    under Ray: cullama/replicas/). A hub id is resolved here (downloaded where the cache lacks it), and the keywords
    name the local directories."""
    from ..llama import check_draft, checked_context, checked_max_batch, checked_prefill_chunk
    from ..text.tokenizer import find_tokenizer, load_tokenizer
    from ..model.weights import config_layout

    api_key = checked_api_key(api_key)
    max_batch, prefill_chunk = checked_max_batch(max_batch), checked_prefill_chunk(prefill_chunk)
    # a hub id's name is the id, as vLLM serves it; a directory's, its own name
    name = served_model_name or (model_dir if hub.is_hub_id(model_dir) else Path(model_dir).resolve().name)
    model_dir = hub.resolve(model_dir, revision)
    tokenizer = None if tokenizer is None else hub.resolve(tokenizer, files=hub.TOKENIZER_FILES, what="tokenizer")
    draft_model = None if draft_model is None else hub.resolve(draft_model, what="draft model")
    config = read_config(model_dir)  # a wrong directory is an error now, not after the socket is up
    context = checked_context(config, max_seq_len)
    config_layout(config, quantize)  # so is a quantize the checkpoint cannot take
    if tokenizer is None and find_tokenizer(model_dir) is None:
        raise ServeError(f"{model_dir} has no tokenizer (tokenizer.json or tokenizer.model): the server turns "
                         "text into tokens and back, so it needs one (or name one with --tokenizer)")
    if draft_model is not None:  # a draft that cannot speak the target's tokens, too
        check_draft(draft_model, config, load_tokenizer(model_dir, override=tokenizer))
    settings = Settings(model_name=name, context=context, api_key=api_key, speculative=dict(speculative or {}),
                        body_timeout=body_timeout, hosts=tuple(allowed_hosts),
                        allowed_origins=tuple(allowed_origins))
    load = dict(path=str(model_dir), device=device, max_seq_len=max_seq_len,
                tokenizer=None if tokenizer is None else str(tokenizer),
                draft_model=None if draft_model is None else str(draft_model), quantize=quantize,
                max_batch=max_batch, prefill_chunk=prefill_chunk)
    return settings, load


def describe_speculation(default: dict) -> str:
    """The ready line's words on the requests' default decoding."""
    if not default:
        return ""
    k = f"{'adaptive, from ' if default['adaptive_draft'] else ''}{default['draft_tokens']} draft tokens"
    return f", speculative decoding by default ({default['speculative']}, {k})"


def run(load: Callable[[], object], settings: Settings, host: str, port: int, max_queue: int,
        shutdown_grace: float = SHUTDOWN_GRACE_S, max_batch: int = 1) -> int:
    """Listen, then load the model with `load()` on the engine thread, and serve until SIGINT or SIGTERM."""
    metrics = Metrics()

    def load_and_say():
        llm = load()
        for note in llm.notes:
            print(f"note: {note}", file=sys.stderr)
        decoding = describe_speculation(settings.speculative)
        print(f"cullama serve: {settings.model_name} is ready on {llm.device}{decoding}; prefill chunk "
              f"{llm.runner.prefill_chunk}", file=sys.stderr, flush=True)
        return llm

    engine = Engine(load_and_say, max_queue, metrics, max_batch)
    sock = listen(host, port)
    if not settings.api_key and not is_loopback(host):
        print(f"warning: cullama serve listens on {host} without an API key: anyone who can reach this port "
              "can use the model (set --api-key or CULLAMA_API_KEY)", file=sys.stderr)
    # Requests may name the server by the address it listens on (and by --host as given), besides loopback.
    hosts = (host, sock.getsockname()[0], *settings.hosts)
    app = create_app(engine, dataclasses.replace(settings, hosts=hosts), metrics)
    server = Server(uvicorn.Config(app, http=JsonErrors, lifespan="off", log_level="info", timeout_keep_alive=5),
                    engine, shutdown_grace)
    status = 0

    def load_failed(exc: BaseException) -> None:
        nonlocal status
        if isinstance(exc, CullamaError):
            print(f"error: {exc.for_cli()}", file=sys.stderr)
            status = exc.exit_code
        else:
            print("error: the model failed to load:", file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            status = 1
        server.should_exit = True

    print(f"cullama serve: listening on {url(sock)} (model {settings.model_name}, loading)", file=sys.stderr,
          flush=True)
    # uvicorn catches SIGINT/SIGTERM while it runs, shuts down, then raises the signal again: SIGINT
    # becomes a KeyboardInterrupt, SIGTERM (here, also before uvicorn runs) a clean exit. Only the main
    # thread handles signals (off it, uvicorn leaves them alone too).
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_zero)
    engine.start(load_failed)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.stop()
        if engine.state in ("ready", "stopped"):
            engine.join(timeout=30)  # the generation in progress ends at its next token
        sock.close()
    return status
