"""The relay's HTTP/1.1 server: plain asyncio protocols parsing the clients' requests with httptools (C, llhttp),
each request handed to the relay (relay.py) as it comes, the answers written back as the relay passes them on.

Why not uvicorn with an ASGI app, as before: every streamed chunk then crossed an ASGI send (a coroutine, a dict,
h11's framing) and the relay's own read loop, 48 to 73 us of CPU a chunk against a fake replica (100 in the
`--replicas 1` process), and on the CPU here that CPU is the engine's: every gap between tokens grew. Here a chunk is
one callback from the replica's socket into the client's: 20 to 40 us (54 in the process; docs/replicas.md).

What it answers as `cullama serve` (uvicorn on h11) does:
- HTTP/1.1 and 1.0; keep-alive (an idle connection closed after KEEP_ALIVE_S); pipelined requests answered in order;
  `Expect: 100-continue` answered when the request is passed on.
- A request it cannot parse (a malformed request line, headers or body framing, an HTTP/1.1 request without Host, a
  head over HEAD_LIMIT bytes): a 400 with OpenAI's error object (code malformed_http), and the connection closed;
  after an answer has begun, only the connection's end. Never a traceback.
- A client that leaves: the relay closes that request's connection to its replica (the replica's server sees the
  disconnect and cancels the generation). A client that does not read: the replica's connection is not read either.
- stop(): no new connections; idle ones closed, the others after their answer; after `grace` seconds all of them.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import threading

import httptools

try:  # ray[serve] installs it (uvicorn[standard]) wherever it runs, and the replicas' own servers run on it
    import uvloop
except ImportError:  # (Windows, PyPy)
    uvloop = None

from ..server.launch import MALFORMED_HTTP
from .relay import Exchange, Relay, Request, error_body

HEAD_LIMIT = 16 * 1024  # bytes of request line and headers (uvicorn's h11 refuses past 16 KiB too)
KEEP_ALIVE_S = 5.0  # an idle connection's life (as the relay's uvicorn had it)
CLOSE_WAIT_S = 1.0  # after `grace`: how long the closed connections get to go
# The event loop: uvloop's (libuv, C) where installed, asyncio's otherwise. Both in front of one replica, interleaved
# (docs/replicas.md): gap p50 at 1 client lower on uvloop in 5 runs of 5 (x1.028 a single server's against x1.052),
# TTFT p50 too; the relay's CPU a chunk was within the noise of these shared cores (20 to 40 us on either).
LOOPS = ("uvloop", "asyncio") if uvloop is not None else ("asyncio",)


class Malformed(Exception):
    """A request the front refuses with a 400 (raised inside httptools' callbacks, caught around feed_data)."""


class Connection(asyncio.Protocol):
    """One client's connection: its requests parsed as they come, answered one after another."""

    def __init__(self, front: Front):
        self.front, self.relay = front, front.relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.headers, self.head_bytes = b"", [], 0
        self.current: Exchange | None = None  # the exchange whose request body is being parsed
        self.active: Exchange | None = None  # the exchange answering now
        self.waiting: collections.deque[Exchange] = collections.deque()  # pipelined behind it
        self.timer: asyncio.TimerHandle | None = None  # an idle connection's end
        self.closing = False  # nothing more after the active answer

    # -- the connection
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.front.connections.add(self)
        self.idle()

    def connection_lost(self, exc) -> None:
        self.front.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        for exchange in (self.active, *self.waiting):
            if exchange is not None:
                exchange.client_gone()
        self.active, self.current = None, None
        self.waiting.clear()

    def pause_writing(self) -> None:  # the client reads slower than the replica writes
        if self.active is not None:
            self.active.pause(True)

    def resume_writing(self) -> None:
        if self.active is not None:
            self.active.pause(False)

    def data_received(self, data: bytes) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:  # served as a plain request (nothing here upgrades)
            self.parser = httptools.HttpRequestParser(self)
            if upgrade.args and len(data) > upgrade.args[0]:
                self.data_received(data[upgrade.args[0]:])
        except (httptools.HttpParserError, Malformed):
            self.malformed()

    def malformed(self) -> None:
        """A 400 where no answer has begun on this connection, then its end."""
        if self.transport.is_closing():
            return
        if self.active is None or not self.active.started:
            body = error_body(400, MALFORMED_HTTP, "malformed_http")
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                                 b"%d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def idle(self) -> None:
        if self.closing or self.front.stopping:
            self.transport.close()
        else:
            self.timer = asyncio.get_running_loop().call_later(KEEP_ALIVE_S, self.transport.close)

    # -- httptools' callbacks
    def on_message_begin(self) -> None:
        self.url, self.headers, self.head_bytes = b"", [], 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self.count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))
        self.count(len(name) + len(value) + 4)

    def count(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > HEAD_LIMIT:
            raise Malformed

    def on_headers_complete(self) -> None:
        version = self.parser.get_http_version()
        if version == "1.1" and not any(name == b"host" for name, _ in self.headers):
            raise Malformed  # RFC 9112 3.2, as h11 refuses it
        request = Request(self.parser.get_method(), self.url, self.headers, version == "1.1",
                          version == "1.1" and self.parser.should_keep_alive())
        if request.path is None:
            raise Malformed
        self.current = Exchange(self.relay, self, request)
        if self.active is None:
            self.begin(self.current)
        else:
            self.waiting.append(self.current)

    def on_body(self, body: bytes) -> None:
        self.current.client_body(body)

    def on_message_complete(self) -> None:
        exchange, self.current = self.current, None
        exchange.client_end()

    # -- the exchanges, one after another
    def begin(self, exchange: Exchange) -> None:
        self.active = exchange
        if exchange.request.expects_continue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        exchange.begin()

    def write(self, data: bytes) -> None:
        if not self.transport.is_closing():
            self.transport.write(data)

    def done(self, exchange: Exchange, keep: bool) -> None:
        """The active exchange's answer is complete; `keep`: the connection may serve another request."""
        if exchange is not self.active:
            return
        self.active = None
        self.transport.resume_reading()  # (where a replica slower to read the body had it paused)
        if not keep or self.closing or self.front.stopping:
            self.transport.close()
        elif self.waiting:
            self.begin(self.waiting.popleft())
        else:
            self.idle()

    def abort(self) -> None:
        """The end of the connection, an answer cut short (its framing shows the client it is incomplete)."""
        self.transport.close()

    def shutdown(self) -> None:
        """Stop: an idle connection closes now, a busy one after its answer."""
        self.closing = True
        if self.active is None:
            self.transport.close()


class Front:
    """The relay's listening socket served on an event loop of its own (run() blocks: launch.py runs it on a thread).
    stop() from any thread."""

    def __init__(self, relay: Relay, grace: float, loop: str = LOOPS[0]):
        if loop not in LOOPS:
            raise ValueError(f"loop must be one of {', '.join(LOOPS)}, got {loop!r}")
        self.relay, self.grace, self.loop_kind = relay, grace, loop
        self.connections: set[Connection] = set()
        self.stopping = False
        self.started = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stopped: asyncio.Event | None = None

    def run(self, sock: socket.socket) -> None:
        loop = uvloop.new_event_loop() if self.loop_kind == "uvloop" else asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.serve(sock))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    async def serve(self, sock: socket.socket) -> None:
        self.loop, self.stopped = asyncio.get_running_loop(), asyncio.Event()
        # (create_server listens again: with `cullama serve`'s backlog, not asyncio's 100)
        server = await self.loop.create_server(lambda: Connection(self), sock=sock, backlog=2048)
        self.started.set()
        if not self.stopping:
            await self.stopped.wait()
        self.stopping = True
        server.close()
        for connection in list(self.connections):
            connection.shutdown()
        self.relay.close_idle()
        deadline = self.loop.time() + self.grace
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for connection in list(self.connections):  # past the grace: as if their clients had left
            connection.transport.close()
        deadline = self.loop.time() + CLOSE_WAIT_S
        while (self.connections or self.relay.busy()) and self.loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.relay.close_idle()

    def stop(self) -> None:
        self.stopping = True
        loop, stopped = self.loop, self.stopped
        if loop is not None and stopped is not None:
            try:
                loop.call_soon_threadsafe(stopped.set)
            except RuntimeError:  # the loop has ended
                pass
