"""The public address of `cullama serve --replicas N`: each request passed to one replica's own port, its answer
back as it comes (front.py is the HTTP/1.1 server around it, in launch.py's process).

Why a relay of our own: Ray Serve's direct ingress gives each replica a port of its own (the replica's app served by
uvicorn in the replica's process); in front of them, Ray's Python proxy added 8 to 9 ms to the first token and made
the gaps between streamed tokens 1.4 to 1.6 times as long on the CPU here, and its HAProxy mode cuts a stream whose
replica dies (a truncated chunked body) and binds fixed ports on every interface. This relay costs less than a
millisecond of TTFT at the median and some 20 to 55 us of CPU a chunk (docs/replicas.md has the figures), and it is
what turns a replica's death into an answer.

- Targets: the replicas Serve runs now and their ports (launch.py reads them from Serve's controller every
  REFRESH_S and calls set_targets); a replica whose port refuses a connection is left out for DOWN_S, or until the
  controller drops it.
- Routing: to the replica holding the fewest of this relay's requests, ties in turn. A connection that is refused,
  or not made within CONNECT_S, is tried on another replica (nothing reached the first).
- Connections to the replicas are kept alive and reused (a pool per replica, an idle one kept POOL_IDLE_S): no
  connect per request. One that the replica closed just as a request went out on it (nothing answered, the request
  kept whole) is retried once on a new connection to the same replica.
- The request line and headers go through with the application's route prefix before the path (hop-by-hop headers
  left out), the body as it comes (chunked as the client chunked it). The answer's status and headers come back, and
  its body as it comes, each piece written to the client from the callback that read it from the replica: no task,
  no buffering; an SSE body (text/event-stream) at event boundaries, so that an error event never lands inside half
  of one (the replica sends whole events, so in practice every piece goes at once).
- A replica that stops before its answer is complete: a stream ends with an OpenAI-shaped error event
  (code replica_failed) and `data: [DONE]`; an answer not yet started is a 502 of the same shape; a whole answer cut
  short closes the client's connection (its Content-Length or chunked framing tells the client it is incomplete).
  Never a hang, never a truncated answer presented as complete.
- A client that leaves closes its request's connection to the replica, whose server sees the disconnect and cancels
  the generation, as with one `cullama serve`.
- /metrics and /metrics/replicas: every replica's /metrics, summed or labelled by replica (prometheus.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from http import HTTPStatus
from typing import NamedTuple

import httptools

from .prometheus import labelled, summed

DOWN_S = 2.0  # seconds a replica whose port refused a connection is left out
CONNECT_S = 5.0  # seconds to make a connection to a replica (one on another machine that does not answer)
METRICS_S = 2.0  # seconds a replica has to answer for /metrics (past them it is counted silent)
POOL_IDLE_S = 30.0  # an idle connection to a replica is closed after this (Serve's replicas keep them 90 s)
POOL_SIZE = 64  # idle connections kept per replica
RETRY_BYTES = 1 << 20  # a request is kept for the retry on a stale connection up to this size
READ_BYTES = 65536
# Hop-by-hop headers (RFC 9110 7.6.1), and Expect (the front answers 100-continue itself): not passed on.
HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
                 b"proxy-connection", b"proxy-authenticate", b"proxy-authorization", b"expect"})
STOPPED = "the replica serving this request stopped before finishing it"
NO_BODY = frozenset({204, 304})


class Target(NamedTuple):
    replica: str  # Serve's replica id
    host: str  # where its port is reached from here
    port: int


def error_body(status: int, message: str, code: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}},
                      separators=(",", ":")).encode()


class Request:
    """A client's request as the front parsed it: its head, and how its body and answer are framed."""

    __slots__ = ("method", "path", "headers", "http11", "keep_alive", "chunked", "expects_continue")

    def __init__(self, method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], http11: bool,
                 keep_alive: bool):
        self.method, self.headers, self.http11, self.keep_alive = method, headers, http11, keep_alive
        self.path = request_path(target)  # None: not a request target
        self.chunked = any(k == b"transfer-encoding" for k, _ in headers)
        self.expects_continue = http11 and any(k == b"expect" and v.lower() == b"100-continue" for k, v in headers)


def request_path(target: bytes) -> bytes | None:
    """The path and query of a request target (origin form, or the absolute form a proxy client sends)."""
    if target.startswith(b"/"):
        return target
    try:
        url = httptools.parse_url(target)
    except httptools.HttpParserInvalidURLError:
        return None
    if not url.schema:
        return None
    return (url.path or b"/") + (b"?" + url.query if url.query else b"")


class Relay:
    """The replicas, the routing and the connections to them (on the front's event loop; set_targets from any
    thread)."""

    def __init__(self, route_prefix: str = "/"):
        self.prefix = route_prefix.rstrip("/").encode()  # "" for "/"
        self.targets: list[Target] = []
        self.held: dict[Target, int] = {}  # requests in flight per replica (this relay's)
        self.down: dict[Target, float] = {}  # replica -> until when it is left out
        self.turn = itertools.count()
        self.pool: dict[Target, list[Upstream]] = {}  # idle connections per replica, the newest last
        self.opened = 0  # connections made to replicas (the tests count them)

    def set_targets(self, targets: list[Target]) -> None:
        """The replicas now (from any thread: one assignment)."""
        self.targets = list(targets)

    def pick(self, tried: set[Target]) -> Target | None:
        now = time.monotonic()
        ready = [t for t in self.targets if t not in tried and self.down.get(t, 0.0) <= now]
        if not ready:
            return None
        fewest = min(self.held.get(t, 0) for t in ready)
        ties = [t for t in ready if self.held.get(t, 0) == fewest]
        return ties[next(self.turn) % len(ties)]

    # -- connections to the replicas
    def idle_connection(self, target: Target) -> Upstream | None:
        idle, now = self.pool.get(target), time.monotonic()
        while idle:
            upstream = idle.pop()
            if not upstream.lost and now - upstream.idle_since < POOL_IDLE_S:
                return upstream
            upstream.transport.close()
        return None

    async def connect(self, target: Target) -> Upstream:
        loop = asyncio.get_running_loop()
        _, upstream = await asyncio.wait_for(loop.create_connection(lambda: Upstream(self, target), target.host,
                                                                    target.port), CONNECT_S)
        self.opened += 1
        return upstream

    def keep(self, upstream: Upstream) -> None:
        """A connection whose answer is complete, for the next request to its replica."""
        upstream.exchange = None
        upstream.idle_since = time.monotonic()
        upstream.transport.resume_reading()  # (where a slow client had it paused)
        idle = self.pool.setdefault(upstream.target, [])
        if len(idle) >= POOL_SIZE:
            return upstream.transport.close()
        idle.append(upstream)

    def forget(self, upstream: Upstream) -> None:
        idle = self.pool.get(upstream.target)
        if idle and upstream in idle:
            idle.remove(upstream)

    def close_idle(self) -> None:
        for idle in self.pool.values():
            for upstream in idle:
                upstream.transport.close()
        self.pool.clear()

    def busy(self) -> bool:
        return any(self.held.values())

    # -- /metrics
    async def metrics(self, request: Request, by_replica: bool) -> tuple[int, list, bytes]:
        """(status, headers, body): every replica's /metrics at once (its Host and Authorization headers passed on;
        a replica that refuses the request, for its Host or Origin, has its refusal passed on), summed or labelled
        by replica."""
        targets = list(self.targets)
        headers = [(k, v) for k, v in request.headers if k in (b"host", b"authorization", b"origin")]
        answers = await asyncio.gather(*(self.fetch_metrics(t, headers) for t in targets))
        refusal = next((a for a in answers if isinstance(a, tuple)), None)
        if refusal is not None:
            return refusal
        if by_replica:
            text = labelled({t.replica: a for t, a in zip(targets, answers)})
        else:
            text = summed(answers)
        return 200, [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8")], text.encode()

    async def fetch_metrics(self, target: Target, headers) -> str | tuple | None:
        """The replica's /metrics text; (status, headers, body) where it refused; None where it did not answer."""
        upstream = Collected()

        async def read():
            reader, writer = await asyncio.open_connection(target.host, target.port)
            try:
                writer.write(b"GET " + self.prefix + b"/metrics HTTP/1.1\r\n"
                             + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"connection: close\r\n\r\n")
                while not upstream.complete and (data := await reader.read(READ_BYTES)):  # (not its close)
                    upstream.parser.feed_data(data)
            finally:
                writer.close()

        try:
            await asyncio.wait_for(read(), METRICS_S)
        except (OSError, asyncio.TimeoutError, httptools.HttpParserError):
            return None
        if upstream.status is None or not upstream.complete:
            return None
        body = b"".join(upstream.body)
        if upstream.status != 200:
            kept = [(k, v) for k, v in upstream.headers if k not in HOP and k != b"content-length"]  # (answer's own)
            return upstream.status, kept, body
        return body.decode()


class Collected:
    """A whole answer read from a replica (for /metrics)."""

    def __init__(self):
        self.status, self.headers, self.body, self.complete = None, [], [], False
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes):
        self.headers.append((name.lower(), value))

    def on_headers_complete(self):
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes):
        self.body.append(body)

    def on_message_complete(self):
        self.complete = True


class Upstream(asyncio.Protocol):
    """A connection to a replica, serving one exchange at a time; its answer parsed with httptools, every callback
    passed to the exchange."""

    def __init__(self, relay: Relay, target: Target):
        self.relay, self.target = relay, target
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.lost = False
        self.idle_since = 0.0
        self.reason, self.headers, self.interim = b"", [], False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.relay.forget(self)
        if self.exchange is not None:
            self.exchange.upstream_lost()

    def data_received(self, data: bytes) -> None:
        if self.exchange is None:  # nothing asked: a replica that talks out of turn is not reused
            return self.transport.close()
        self.exchange.answered = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # garbage from the replica: as if it died there
            self.transport.close()

    def pause_writing(self) -> None:  # the replica reads the request slower than the client sends it
        if self.exchange is not None:
            self.exchange.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.exchange is not None:
            self.exchange.client.transport.resume_reading()

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.reason, self.headers = b"", []

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self.interim = status < 200  # (a 1xx the replica should not send: nothing asks for one) skipped
        if self.exchange is not None and not self.interim:
            self.exchange.response_start(status, self.reason, self.headers, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        if self.exchange is not None:
            self.exchange.response_body(body)

    def on_message_complete(self) -> None:
        if self.exchange is not None and not self.interim:
            self.exchange.response_end()


class Exchange:
    """One request through the relay: the client's connection (front.py) on one side, a replica's on the other."""

    def __init__(self, relay: Relay, client, request: Request):  # client: front.py's Connection
        self.relay, self.client, self.request = relay, client, request
        self.pending_body: list[bytes] = []  # the request's body framed, before a replica's connection is there
        self.kept: list[bytes] | None = None  # what went out on a reused connection (for its retry)
        self.kept_bytes = 0
        self.request_done = False
        self.target: Target | None = None
        self.upstream: Upstream | None = None
        self.reused = False
        self.answered = False  # a byte of the answer came from the replica
        self.started = False  # the answer's head went to the client
        self.finished = False
        self.gone = False  # the client left
        self.sse = self.chunked = self.until_close = self.keep_upstream = False
        self.keep_client = request.keep_alive
        self.events = b""  # an SSE body's part after its last whole event

    # -- the client's side
    def begin(self) -> None:
        """The request is the connection's turn: pass it on (or answer /metrics)."""
        path = self.request.path.split(b"?", 1)[0]
        if path in (b"/metrics", b"/metrics/replicas") and self.request.method in (b"GET", b"HEAD"):
            asyncio.ensure_future(self.guarded(self.metrics(path == b"/metrics/replicas")))
        else:
            asyncio.ensure_future(self.guarded(self.connect()))

    async def guarded(self, step) -> None:
        """A step of the relay's own that fails (a bug: its traceback logged) answers the client, never hangs it."""
        try:
            await step
        except Exception:  # noqa: BLE001 - said below
            logging.getLogger(__name__).exception("the relay failed on a request")
            if not self.started:
                return self.reply(500, "the relay failed on this request", "relay_error")
            self.finish(client=False)
            self.client.abort()

    def client_body(self, body: bytes) -> None:
        if self.finished or self.gone:
            return
        if self.request.chunked:
            body = b"%x\r\n%b\r\n" % (len(body), body)
        self.send(body)

    def client_end(self) -> None:
        self.request_done = True
        if self.request.chunked and not (self.finished or self.gone):
            self.send(b"0\r\n\r\n")

    def send(self, data: bytes) -> None:
        if self.upstream is None:
            self.pending_body.append(data)
            return
        self.upstream.transport.write(data)
        if self.kept is not None:
            self.keep_for_retry(data)

    def keep_for_retry(self, data: bytes) -> None:
        self.kept_bytes += len(data)
        if self.kept_bytes > RETRY_BYTES:
            self.kept = None
        else:
            self.kept.append(data)

    def client_gone(self) -> None:
        """The client left (or the relay stops): the replica's connection closes, which the replica sees."""
        self.gone = True
        if self.upstream is not None and not self.finished:
            self.upstream.transport.close()
        self.release()

    def pause(self, paused: bool) -> None:
        if self.upstream is not None and not self.finished:
            (self.upstream.transport.pause_reading if paused else self.upstream.transport.resume_reading)()

    # -- a replica
    async def connect(self) -> None:
        tried: set[Target] = set()
        while True:
            target = self.relay.pick(tried)
            if target is None:
                return self.reply(503, "no replica is ready to serve (the replicas are starting, or all of them are "
                                       "down); retry later", "no_replica", [(b"retry-after", b"1")])
            tried.add(target)
            upstream = self.relay.idle_connection(target)
            if upstream is not None:
                break
            try:
                upstream = await self.relay.connect(target)
                break
            except (OSError, asyncio.TimeoutError):  # nothing reached it: another may serve
                self.relay.down[target] = time.monotonic() + DOWN_S
        if self.gone:
            return self.relay.keep(upstream)
        self.target = target
        self.relay.held[target] = self.relay.held.get(target, 0) + 1
        self.attach(upstream, reused=upstream.idle_since > 0)

    def attach(self, upstream: Upstream, reused: bool) -> None:
        self.upstream, self.reused = upstream, reused
        upstream.exchange = self
        request = self.request
        head = [b"%s %s%s HTTP/1.1\r\n" % (request.method, self.relay.prefix, request.path)]
        head += [k + b": " + v + b"\r\n" for k, v in request.headers if k not in HOP]
        head.append(b"transfer-encoding: chunked\r\n\r\n" if request.chunked else b"\r\n")
        data = b"".join(head) + b"".join(self.pending_body)
        self.pending_body = []
        self.kept, self.kept_bytes = ([] if reused else None), 0
        self.send(data)

    def upstream_lost(self) -> None:
        """The replica's connection ended before the answer did."""
        if self.finished or self.gone:
            return
        upstream, self.upstream = self.upstream, None
        upstream.exchange = None
        if self.reused and not self.answered and self.kept is not None and self.request_done:
            # a kept-alive connection the replica closed as the request went out: once more on a new one
            self.pending_body, self.kept = self.kept, None
            self.reused = False
            return asyncio.ensure_future(self.guarded(self.reconnect()))
        if self.until_close:  # an answer framed by the end of its connection: complete
            return self.response_end()
        if not self.started:
            return self.reply(502, f"{STOPPED}; retry the request", "replica_failed")
        if self.sse:  # after the last whole event (a half one is dropped)
            error = b"data: " + error_body(500, f"{STOPPED}; the answer is incomplete", "replica_failed")
            self.piece(error + b"\n\ndata: [DONE]\n\n")
            self.events = b""
            return self.response_end()
        self.finish(client=False)
        self.client.abort()

    async def reconnect(self) -> None:
        try:
            upstream = await self.relay.connect(self.target)
        except (OSError, asyncio.TimeoutError):
            self.relay.down[self.target] = time.monotonic() + DOWN_S
            return self.reply(502, f"{STOPPED}; retry the request", "replica_failed")
        if self.gone:
            return upstream.transport.close()
        data, self.pending_body = b"".join(self.pending_body), []
        self.upstream, self.reused = upstream, False
        upstream.exchange = self
        self.send(data)

    # -- the answer
    def response_start(self, status: int, reason: bytes, headers: list[tuple[bytes, bytes]], keep: bool) -> None:
        self.keep_upstream = keep
        request = self.request
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
        length = chunked = False
        for k, v in headers:
            if k in HOP:
                chunked = chunked or k == b"transfer-encoding"
                continue
            if k == b"content-type" and v.startswith(b"text/event-stream"):
                self.sse = True
            elif k == b"content-length":
                length = True
            head.append(k + b": " + v + b"\r\n")
        if request.method == b"HEAD" or status in NO_BODY:
            if request.method == b"HEAD" and chunked:
                head.append(b"transfer-encoding: chunked\r\n")
        elif not length:
            self.until_close = not chunked
            if request.http11:
                head.append(b"transfer-encoding: chunked\r\n")
                self.chunked = True
            else:
                self.keep_client = False  # the end of the connection ends the answer
        if not self.keep_client:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        self.write(b"".join(head))
        self.started = True
        if request.method == b"HEAD":  # (httptools would wait for a body: this connection is not reused)
            self.keep_upstream = False
            self.response_end()

    def response_body(self, body: bytes) -> None:
        if self.finished or not body:
            return
        if self.sse and (self.events or not body.endswith(b"\n\n")):  # whole events only (the replica's pieces
            events = self.events + body                                      # are whole events: rarely here)
            cut = events.rfind(b"\n\n") + 2
            if cut < 2:
                self.events = events
                return
            body, self.events = events[:cut], events[cut:]
        self.piece(body)

    def piece(self, body: bytes) -> None:
        """A piece of the answer's body, framed for the client."""
        self.write(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)

    def response_end(self) -> None:
        if self.finished:
            return
        if self.events:
            self.piece(self.events)
        if self.chunked:
            self.write(b"0\r\n\r\n")
        self.finish(client=self.keep_client and self.request_done)

    def write(self, data: bytes) -> None:
        if not self.gone:
            self.client.write(data)

    def finish(self, client: bool) -> None:
        """The answer is complete (or cut): the replica's connection kept for another request or closed, the
        client's connection told whether it may serve another (`client`)."""
        self.finished = True
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            if self.keep_upstream and self.request_done and not upstream.lost and not upstream.transport.is_closing():
                self.relay.keep(upstream)
            else:
                upstream.exchange = None
                upstream.transport.close()
        self.release()
        if not self.gone:
            self.client.done(self, client)

    def release(self) -> None:
        if self.target is not None:
            self.relay.held[self.target] -= 1
            self.target = None

    def reply(self, status: int, message: str, code: str, headers: list | None = None) -> None:
        """An answer of the relay's own: an OpenAI error object."""
        self.answer(status, [(b"content-type", b"application/json"), *(headers or [])],
                    error_body(status, message, code))

    def answer(self, status: int, headers: list, body: bytes) -> None:
        if self.gone or self.finished:
            return
        try:
            reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
        head = [b"HTTP/1.1 %d %s\r\n" % (status, reason), *(k + b": " + v + b"\r\n" for k, v in headers),
                b"content-length: %d\r\n" % len(body)]
        keep = self.keep_client and self.request_done
        if not keep:
            head.append(b"connection: close\r\n")
        self.write(b"".join(head) + b"\r\n" + (b"" if self.request.method == b"HEAD" else body))
        self.started = True
        self.finish(client=keep)

    async def metrics(self, by_replica: bool) -> None:
        status, headers, body = await self.relay.metrics(self.request, by_replica)
        self.answer(status, headers, body)
