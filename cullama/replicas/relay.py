"""The public address of `cullama serve --replicas N`: an ASGI app (served by uvicorn in launch.py's process) that
passes each request to one replica's own port and its answer back, byte for byte as it comes.

Why a relay of our own: Ray Serve's direct ingress gives each replica a port of its own (the replica's app served by
uvicorn in the replica's process); in front of them, Ray's Python proxy added 8 to 9 ms to the first token and made
the gaps between streamed tokens 1.4 to 1.6 times as long on the CPU here, and its HAProxy mode cuts a stream whose
replica dies (a truncated chunked body) and binds fixed ports on every interface. This relay costs about a
millisecond of TTFT (docs/replicas.md has the figures), and it is what turns a replica's death into an answer.

- Targets: the replicas Serve runs now and their ports (launch.py reads them from Serve's controller every
  REFRESH_S and calls set_targets); a replica whose port refuses a connection is left out for DOWN_S, or until the
  controller drops it.
- Routing: to the replica holding the fewest of this relay's requests, ties in turn. A connection that is refused,
  or not made within CONNECT_S, is tried on another replica (nothing reached the first).
- The request line, headers and body go through as they come (hop-by-hop headers left out, the body framed as the
  client framed it), with the application's route prefix before the path. The answer's status, headers and body come
  back as they come; an SSE body (text/event-stream) at event boundaries, a whole event at a time, so that an error
  event never lands inside half of one.
- A replica that stops before its answer is complete: a stream ends with an OpenAI-shaped error event
  (code replica_failed) and `data: [DONE]`; an answer not yet started is a 502 of the same shape; a whole answer cut
  short closes the connection (its Content-Length or chunked framing tells the client it is incomplete). Never a hang,
  never a truncated answer presented as complete.
- A client that leaves closes the connection to the replica, whose server sees the disconnect and cancels the
  generation, as with one `cullama serve`.
- /metrics and /metrics/replicas: every replica's /metrics, summed or labelled by replica (prometheus.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import NamedTuple

import httptools

from .prometheus import labelled, summed

DOWN_S = 2.0  # seconds a replica whose port refused a connection is left out
CONNECT_S = 5.0  # seconds to make a connection to a replica (one on another machine that does not answer)
METRICS_S = 2.0  # seconds a replica has to answer for /metrics (past them it is counted silent)
READ_BYTES = 65536
# Hop-by-hop headers (RFC 9110 7.6.1), and Expect (the relay reads the body, so the client's 100-continue is
# uvicorn's to answer): not passed on.
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade", b"proxy-connection",
       b"proxy-authenticate", b"proxy-authorization", b"expect"}
STOPPED = "the replica serving this request stopped before finishing it"


class Target(NamedTuple):
    replica: str  # Serve's replica id
    host: str  # where its port is reached from here
    port: int


def error_body(status: int, message: str, code: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}},
                      separators=(",", ":")).encode()


class Answer:
    """One replica's answer being read: httptools' callbacks collect its events, handed on after each read."""

    def __init__(self):
        self.events: list[tuple] = []
        self.headers: list[tuple[bytes, bytes]] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes):
        self.headers.append((name.lower(), value))

    def on_headers_complete(self):
        self.events.append(("start", self.parser.get_status_code(), self.headers))

    def on_body(self, body: bytes):
        self.events.append(("body", bytes(body)))

    def on_message_complete(self):
        self.events.append(("end",))

    def take(self) -> list[tuple]:
        events, self.events = self.events, []
        return events


class Relay:
    def __init__(self, route_prefix: str = "/"):
        self.prefix = route_prefix.rstrip("/").encode()  # "" for "/"
        self.targets: list[Target] = []
        self.held: dict[Target, int] = {}  # requests in flight per replica (this relay's)
        self.down: dict[Target, float] = {}  # replica -> until when it is left out
        self.turn = itertools.count()

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

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":  # nothing to start or stop
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            return await send({"type": "lifespan.shutdown.complete"})
        if scope["type"] != "http":
            return
        if scope["path"] in ("/metrics", "/metrics/replicas") and scope["method"] in ("GET", "HEAD"):
            return await self.metrics(scope, send, by_replica=scope["path"] == "/metrics/replicas")
        tried: set[Target] = set()
        while True:
            target = self.pick(tried)
            if target is None:
                return await answer(send, 503, "no replica is ready to serve (the replicas are starting, or all of "
                                               "them are down); retry later", "no_replica", {b"retry-after": b"1"})
            tried.add(target)
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(target.host, target.port), CONNECT_S)
                break
            except (OSError, asyncio.TimeoutError):  # nothing reached it: another may serve
                self.down[target] = time.monotonic() + DOWN_S
        self.held[target] = self.held.get(target, 0) + 1
        try:
            await self.forward(scope, receive, send, reader, writer)
        finally:
            self.held[target] -= 1
            writer.close()

    async def forward(self, scope, receive, send, reader, writer) -> None:
        """One request to the replica at the other end of (reader, writer), and its answer back."""
        chunked = any(k == b"transfer-encoding" for k, _ in scope["headers"])
        path = self.prefix + (scope.get("raw_path") or scope["path"].encode())
        if scope.get("query_string"):
            path += b"?" + scope["query_string"]
        head = [b"%s %s HTTP/1.1\r\n" % (scope["method"].encode(), path)]
        head += [k + b": " + v + b"\r\n" for k, v in scope["headers"] if k not in HOP]
        head += [b"transfer-encoding: chunked\r\n" if chunked else b"", b"connection: close\r\n\r\n"]
        writer.write(b"".join(head))
        this = asyncio.current_task()

        async def pass_body():  # the body as it comes; then wait for the client to leave
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
                body, more = message.get("body", b""), message.get("more_body", False)
                if chunked:
                    writer.write((b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else
                                                                                            b"0\r\n\r\n"))
                elif body:
                    writer.write(body)
                await writer.drain()
            else:
                while (await receive())["type"] != "http.disconnect":
                    pass
            this.cancel()  # the client left: closing the connection (the caller's finally) tells the replica

        body_task = asyncio.ensure_future(pass_body())
        upstream = Answer()
        started, sse, pending = False, False, b""
        try:
            while True:
                data = await reader.read(READ_BYTES)
                try:
                    if data:
                        upstream.parser.feed_data(data)
                except httptools.HttpParserError:
                    data = b""
                if not data:  # the end (or garbage) before the answer's end: the replica died, or its connection
                    if not started:
                        return await answer(send, 502, f"{STOPPED}; retry the request", "replica_failed")
                    if sse:  # after the last whole event (a half one is dropped)
                        error = b"data: " + error_body(500, f"{STOPPED}; the answer is incomplete", "replica_failed")
                        await send({"type": "http.response.body", "more_body": False,
                                    "body": error + b"\n\ndata: [DONE]\n\n"})
                        return
                    raise ConnectionError(STOPPED)  # uvicorn drops the connection: the body is seen incomplete
                for event in upstream.take():
                    if event[0] == "start":
                        _, status, headers = event
                        sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
                        await send({"type": "http.response.start", "status": status,
                                    "headers": [(k, v) for k, v in headers if k not in HOP]})
                        started = True
                    elif event[0] == "body":
                        if not sse:
                            await send({"type": "http.response.body", "body": event[1], "more_body": True})
                            continue
                        pending += event[1]
                        cut = pending.rfind(b"\n\n") + 2
                        if cut > 1:
                            await send({"type": "http.response.body", "body": pending[:cut], "more_body": True})
                            pending = pending[cut:]
                    else:
                        return await send({"type": "http.response.body", "body": pending, "more_body": False})
        except asyncio.CancelledError:
            if body_task.done():  # our own cancel: the client left
                return
            raise
        finally:
            body_task.cancel()

    async def metrics(self, scope, send, by_replica: bool) -> None:
        """Every replica's /metrics at once (its Host and Authorization headers passed on; a replica that refuses
        the request, for its Host or Origin, has its refusal passed on), summed or labelled by replica."""
        targets = list(self.targets)
        headers = [(k, v) for k, v in scope["headers"] if k in (b"host", b"authorization", b"origin")]
        answers = await asyncio.gather(*(self.fetch_metrics(t, headers) for t in targets))
        refusal = next((a for a in answers if isinstance(a, tuple)), None)
        if refusal is not None:
            status, headers, body = refusal
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k, v) for k, v in headers if k not in HOP]})
            return await send({"type": "http.response.body", "body": body})
        if by_replica:
            text = labelled({t.replica: a for t, a in zip(targets, answers)})
        else:
            text = summed(answers)
        body = text.encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
                                (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})

    async def fetch_metrics(self, target: Target, headers) -> str | tuple | None:
        """The replica's /metrics text; (status, headers, body) where it refused; None where it did not answer."""
        upstream = Answer()

        async def read():
            reader, writer = await asyncio.open_connection(target.host, target.port)
            try:
                writer.write(b"GET " + self.prefix + b"/metrics HTTP/1.1\r\n"
                             + b"".join(k + b": " + v + b"\r\n" for k, v in headers) + b"connection: close\r\n\r\n")
                while data := await reader.read(READ_BYTES):
                    upstream.parser.feed_data(data)
            finally:
                writer.close()

        try:
            await asyncio.wait_for(read(), METRICS_S)
        except (OSError, asyncio.TimeoutError, httptools.HttpParserError):
            return None
        events = upstream.take()
        start = next((e for e in events if e[0] == "start"), None)
        if start is None or not any(e[0] == "end" for e in events):
            return None
        body = b"".join(e[1] for e in events if e[0] == "body")
        if start[1] != 200:
            return start[1], start[2], body
        return body.decode()


async def answer(send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    body = error_body(status, message, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                            *(headers or {}).items()]})
    await send({"type": "http.response.body", "body": body})
