"""`cullama serve`'s process: check the model, listen, load the weights in the background, serve, stop.

The order matters to whoever starts the server: the model directory (and the draft model's, against the
target's vocabulary) is checked before anything else (a bad path is one line and exit 2), then the socket
listens, and only then do the weights load (the target's, then the draft's), on the engine thread, while
/health answers 503; it answers 200 once they are all in. SIGINT (Ctrl-C) or
SIGTERM stops accepting connections, ends the waiting requests with a 503 and the running generation
at its next token, and exits 0. A model that fails to load ends the server: exit 2 for a CullamaError
(one line), 1 for anything else (with its traceback).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

import uvicorn

from ..config import from_pretrained as read_config
from ..errors import CullamaError
from .app import Settings, create_app
from .engine import Engine
from .metrics import Metrics


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
    short rather than as long as the queued generations."""

    def __init__(self, config: uvicorn.Config, engine: Engine):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None):
        self.engine.stop()
        await super().shutdown(sockets=sockets)


def _exit_zero(signum, frame):
    raise SystemExit(0)


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 8000, device: str = "auto",
          max_seq_len: int | None = None, served_model_name: str | None = None, max_queue: int = 64,
          api_key: str | None = None, tokenizer: str | None = None, speculative: dict | None = None,
          draft_model: str | None = None) -> int:
    """Serve a checkpoint directory until SIGINT or SIGTERM; the exit status (0, or 2 / 1 when the model
    failed to load).

    speculative: Llama.stream's speculative keywords (speculative, draft_tokens, adaptive_draft), every
    request's default ({} or None: plain decoding); draft_model: the draft model's directory, loaded with
    the target before /health answers 200."""
    from ..llama import Llama, check_draft
    from ..tokenizer import find_tokenizer, load_tokenizer

    config = read_config(model_dir)  # a wrong directory is an error now, not after the socket is up
    if tokenizer is None and find_tokenizer(model_dir) is None:
        raise ServeError(f"{model_dir} has no tokenizer (tokenizer.json or tokenizer.model): the server turns "
                         "text into tokens and back, so it needs one (or name one with --tokenizer)")
    if draft_model is not None:  # a draft that cannot speak the target's tokens, too
        check_draft(draft_model, config, load_tokenizer(model_dir, override=tokenizer))
    name = served_model_name or Path(model_dir).resolve().name
    settings = Settings(model_name=name, context=max_seq_len or config.max_seq_len, api_key=api_key or None,
                        speculative=dict(speculative or {}))
    return run(lambda: Llama.from_pretrained(model_dir, device=device, max_seq_len=max_seq_len,
                                             tokenizer=tokenizer, draft_model=draft_model),
               settings, host, port, max_queue)


def describe_speculation(default: dict) -> str:
    """The ready line's words on the requests' default decoding."""
    if not default:
        return ""
    k = f"{'adaptive, from ' if default['adaptive_draft'] else ''}{default['draft_tokens']} draft tokens"
    return f", speculative decoding by default ({default['speculative']}, {k})"


def run(load: Callable[[], object], settings: Settings, host: str, port: int, max_queue: int) -> int:
    """Listen, then load the model with `load()` on the engine thread, and serve until SIGINT or SIGTERM."""
    metrics = Metrics()

    def load_and_say():
        llm = load()
        for note in llm.notes:
            print(f"note: {note}", file=sys.stderr)
        decoding = describe_speculation(settings.speculative)
        print(f"cullama serve: {settings.model_name} is ready on {llm.device}{decoding}", file=sys.stderr, flush=True)
        return llm

    engine = Engine(load_and_say, max_queue, metrics)
    sock = listen(host, port)
    if not settings.api_key and not is_loopback(host):
        print(f"warning: cullama serve listens on {host} without an API key: anyone who can reach this port "
              "can use the model (set --api-key or CULLAMA_API_KEY)", file=sys.stderr)
    app = create_app(engine, settings, metrics)
    server = Server(uvicorn.Config(app, lifespan="off", log_level="info", timeout_keep_alive=5), engine)
    status = 0

    def load_failed(exc: BaseException) -> None:
        nonlocal status
        if isinstance(exc, CullamaError):
            print(f"error: {exc.for_cli()}", file=sys.stderr)
            status = 2
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
