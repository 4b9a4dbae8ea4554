"""The relay of `cullama serve --replicas` (cullama/replicas/relay.py) in front of fake replicas (sockets that answer
as a script says, die half way, or refuse), and the replicas' metrics summed and labelled (prometheus.py): no Ray."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time

import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[test]')")
pytest.importorskip("httptools", reason="the ray extra is not installed (pip install -e '.[test]')")

from cullama.replicas.front import LOOPS, Front  # noqa: E402
from cullama.replicas.prometheus import labelled, summed  # noqa: E402
from cullama.replicas.relay import Relay, Target  # noqa: E402
from cullama.server.metrics import Metrics  # noqa: E402
from tests.serving import parse_prometheus  # noqa: E402

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Replica:
    """A fake replica on a port of its own: each connection's request is read (its head, and Content-Length's
    worth of body) and recorded, then `script(conn)` answers it; where the script returns True, the connection's
    next request is read and answered the same way (keep-alive). `connections`: how many it accepted; `ended`: set
    when a connection's other end closed while it waited for a request."""

    def __init__(self, script):
        self.script, self.requests, self.connections, self.ended = script, [], 0, threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        with conn:
            data = b""
            while True:
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        self.ended.set()
                        return
                    data += more
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    body += conn.recv(65536)
                body, data = body[:length], body[length:]
                self.requests.append((head.decode(), body))
                self.rest = data  # what came after (a chunked body, which the script reads)
                if not self.script(conn):
                    return

    def target(self, name: str) -> Target:
        return Target(name, "127.0.0.1", self.port)

    def close(self):
        self.sock.close()


@pytest.fixture(autouse=True, params=LOOPS)
def loop_kind(request, monkeypatch):
    """Every test on each event loop the front may run on (uvloop's where installed, asyncio's)."""
    monkeypatch.setattr(Front.__init__, "__defaults__", (request.param,))
    return request.param


@contextlib.contextmanager
def relaying(*targets: Target, prefix: str = "/app"):
    relay = Relay(prefix)
    relay.set_targets(list(targets))
    sock = socket.create_server(("127.0.0.1", 0))
    front = Front(relay, 1.0)
    thread = threading.Thread(target=front.run, args=(sock,), daemon=True)
    thread.start()
    assert front.started.wait(10) and type(front.loop).__module__.startswith(front.loop_kind)
    try:
        yield relay, sock.getsockname()[1]
    finally:
        front.stop()
        thread.join(10)
        assert not thread.is_alive()


def post(port: int, path: str = "/v1/completions", body: bytes = b'{"prompt": "x"}', headers: dict | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body, {"Content-Type": "application/json", "Host": "localhost", **(headers or {})})
    return conn.getresponse()


def events(response) -> list[bytes]:
    return [e for e in response.read().split(b"\n\n") if e]


def test_a_stream_whose_replica_dies_ends_with_an_error_event_after_its_last_whole_event():
    def dies(conn):
        conn.sendall(SSE_HEAD + chunk(b'data: {"n": 1}\n\ndata: {"n": 2}\n\n') + chunk(b'data: {"n": 3'))
        time.sleep(0.1)  # the half event arrives, then the replica is gone (no terminating chunk)

    replica = Replica(dies)
    with relaying(replica.target("a")) as (_, port):
        answer = post(port)
        got = events(answer)
    assert answer.status == 200 and got[:2] == [b'data: {"n": 1}', b'data: {"n": 2}'] and got[-1] == b"data: [DONE]"
    error = json.loads(got[2].removeprefix(b"data: "))["error"]
    assert len(got) == 4 and error["code"] == "replica_failed" and error["type"] == "server_error"
    assert "incomplete" in error["message"]


def test_a_whole_answer_cut_short_is_never_presented_complete():
    def cut(conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"choices\"")

    replica = Replica(cut)
    with relaying(replica.target("a")) as (_, port):
        answer = post(port)
        with pytest.raises(http.client.IncompleteRead):
            answer.read()


def test_a_replica_that_dies_before_answering_is_a_502_and_one_that_refuses_is_skipped():
    silent = Replica(lambda conn: None)  # reads the request, closes
    refusing = socket.create_server(("127.0.0.1", 0))
    refused = Target("gone", "127.0.0.1", refusing.getsockname()[1])
    refusing.close()  # nothing listens there now
    ok = Replica(lambda conn: conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"))
    with relaying(silent.target("silent")) as (_, port):
        answer = post(port)
        assert answer.status == 502 and json.loads(answer.read())["error"]["code"] == "replica_failed"
    with relaying(refused, ok.target("ok")) as (relay, port):
        for _ in range(4):  # each time, whichever the turn: the refused one is left out, the request served
            answer = post(port)
            assert answer.status == 200 and answer.read() == b"ok"
        assert refused in relay.down and len(ok.requests) == 4


def test_no_replica_is_a_503_with_retry_after():
    with relaying() as (_, port):
        answer = post(port)
        assert answer.status == 503 and answer.getheader("retry-after") == "1"
        assert json.loads(answer.read())["error"]["code"] == "no_replica"


def test_the_request_goes_through_under_the_route_prefix_and_the_answer_back_as_it_came():
    replica = Replica(lambda conn: conn.sendall(b"HTTP/1.1 201 Created\r\nx-thing: 1\r\ncontent-length: 5\r\n\r\nhello"))
    with relaying(replica.target("a"), prefix="/app") as (_, port):
        answer = post(port, "/v1/completions?a=1", b'{"prompt": "x"}', {"Authorization": "Bearer k",
                                                                         "Connection": "keep-alive"})
        assert (answer.status, answer.getheader("x-thing"), answer.read()) == (201, "1", b"hello")
    head, body = replica.requests[0]
    lines = head.split("\r\n")
    assert lines[0] == "POST /app/v1/completions?a=1 HTTP/1.1" and body == b'{"prompt": "x"}'
    fields = [line.lower() for line in lines[1:]]
    assert "host: localhost" in fields and "authorization: bearer k" in fields
    assert not any(field.startswith("connection:") for field in fields)  # (hop by hop; the relay's own is kept alive)


def test_requests_go_to_the_replica_holding_fewest():
    release = threading.Event()

    def slow(conn):
        conn.sendall(SSE_HEAD + chunk(b"data: 1\n\n"))
        release.wait(30)
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    first, second = Replica(slow), Replica(slow)
    with relaying(first.target("a"), second.target("b")) as (relay, port):
        answers = []
        for _ in range(4):
            answers.append(post(port))
            answers[-1].readline()  # the stream started: its replica holds it
        assert len(first.requests) == len(second.requests) == 2
        release.set()
        for answer in answers:
            assert events(answer)[-1].strip() == b"data: [DONE]"  # (readline took the first event's first line)


def replica_text(completed: int, queue: int) -> str:
    metrics = Metrics()
    for _ in range(completed):
        metrics.count("completed")
    metrics.set_load(queue, 1)
    metrics.decode_steps(2, 3)
    return metrics.render() + '# HELP cullama_replica_info x\n# TYPE cullama_replica_info gauge\ncullama_replica_info{pid="7",node="n"} 1\n'


def test_the_summed_metrics_read_as_one_servers_and_the_labelled_as_each_replicas():
    a, b = replica_text(3, 2), replica_text(5, 1)
    total = parse_prometheus(summed([a, b, None]))
    assert total['cullama_requests_total{outcome="completed"}'] == 8 and total["cullama_queue_depth"] == 3
    assert total['cullama_decode_batch_size_bucket{le="2.0"}'] == 6 and total["cullama_decode_batch_size_count"] == 6
    assert (total['cullama_replicas{state="answered"}'], total['cullama_replicas{state="silent"}']) == (2, 1)
    assert not any(name.startswith("cullama_replica_info") for name in total)
    text = labelled({"r1": a, "r2": b})
    assert 'cullama_requests_total{replica="r1",outcome="completed"} 3' in text
    assert 'cullama_queue_depth{replica="r2"} 1' in text
    assert 'cullama_replica_info{replica="r2",pid="7",node="n"} 1' in text
    assert text.count("# TYPE cullama_queue_depth gauge") == 1


# -- the front (front.py) and the connections to the replicas

def ok_answer(conn, body: bytes = b"ok") -> bool:
    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    return True  # the connection serves the next request


def raw(port: int, data: bytes, timeout: float = 10) -> bytes:
    """What the relay answers `data` with, up to its closing the connection (a hang fails on the timeout)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        answer = b""
        while more := sock.recv(65536):
            answer += more
    return answer


def test_connections_to_a_replica_are_kept_alive_and_reused():
    replica = Replica(ok_answer)
    with relaying(replica.target("a")) as (relay, port):
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for i in range(5):  # one client connection, kept alive, and new ones
            conn = client if i % 2 else http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/v1/completions", b'{"prompt": "x"}', {"Host": "localhost"})
            answer = conn.getresponse()
            assert (answer.status, answer.read(), answer.getheader("connection")) == (200, b"ok", None)
        assert replica.connections == relay.opened == 1 and len(replica.requests) == 5
        assert all(head.startswith("POST /app/v1/completions HTTP/1.1") for head, _ in replica.requests)


def test_a_kept_connection_the_replica_closed_is_retried_once_on_a_new_one():
    served = []

    def once(conn):  # answers one request per connection, then closes it at the next request (unanswered)
        if served and served[-1] is conn:
            return False
        served.append(conn)
        return ok_answer(conn, b"%d" % len(served))

    replica = Replica(once)
    with relaying(replica.target("a")) as (relay, port):
        assert post(port).read() == b"1"
        answer = post(port, body=b'{"prompt": "y"}')  # on the kept connection first: closed, retried on a new one
        assert (answer.status, answer.read()) == (200, b"2")
        assert replica.connections == relay.opened == 2
        assert [body for _, body in replica.requests] == [b'{"prompt": "x"}', b'{"prompt": "y"}', b'{"prompt": "y"}']


MALFORMED = [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\n\r\n",  # HTTP/1.1 without a Host
             b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: abc\r\n\r\n",
             b"GET /he\x00alth HTTP/1.1\r\nHost: a\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
             b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
             b"GET /health HTTP/1.1\r\nHost: a\r\nX-Big: " + b"x" * 17000 + b"\r\n\r\n"]


@pytest.mark.parametrize("request_bytes", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_http_is_a_400_and_a_closed_connection_never_a_traceback(request_bytes, caplog):
    replica = Replica(ok_answer)
    with relaying(replica.target("a")) as (_, port):
        answer = raw(port, request_bytes)  # (returns once the relay closed the connection)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400 ") and b"content-type: application/json" in head, answer
        assert json.loads(body)["error"]["code"] == "malformed_http"
        assert post(port).read() == b"ok"  # and the relay goes on
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not any(head.startswith("GET /he") for head, _ in replica.requests)


def test_a_malformed_request_after_an_answer_began_only_closes_the_connection():
    release = threading.Event()

    def slow(conn):
        conn.sendall(SSE_HEAD + chunk(b"data: 1\n\n"))
        release.wait(10)

    replica = Replica(slow)
    with relaying(replica.target("a")) as (_, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n")
            got = sock.recv(65536)
            sock.sendall(b"GARBAGE\r\n\r\n")  # while the answer goes on: pipelined garbage
            while more := sock.recv(65536):
                got += more
        release.set()
        assert got.startswith(b"HTTP/1.1 200 OK") and b"HTTP/1.1 400" not in got and not got.endswith(b"0\r\n\r\n")


def test_a_chunked_answer_goes_through_chunk_by_chunk_as_each_comes():
    """The replica sends a piece only after the client got the one before: a relay that held one back would hang."""
    got = [threading.Event() for _ in range(6)]

    def lockstep(conn):
        conn.sendall(SSE_HEAD)
        for i, event in enumerate(got):
            conn.sendall(chunk(b'data: {"n": %d}\n\n' % i))
            assert event.wait(10), f"the client never got event {i}"
        conn.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    replica = Replica(lockstep)
    with relaying(replica.target("a")) as (_, port):
        answer = post(port)
        assert answer.getheader("transfer-encoding") == "chunked"
        for i, event in enumerate(got):
            assert answer.readline() == b'data: {"n": %d}\n' % i and answer.readline() == b"\n"
            event.set()
        assert answer.read() == b"data: [DONE]\n\n"  # and the answer ends: complete


def test_an_event_split_over_chunks_goes_out_whole():
    def split(conn):
        conn.sendall(SSE_HEAD + chunk(b'data: {"n"') + chunk(b': 1}\n') + chunk(b'\ndata: {"n": 2}\n\nda'))
        time.sleep(0.05)
        conn.sendall(chunk(b"ta: [DONE]\n\n") + b"0\r\n\r\n")
        return True

    replica = Replica(split)
    with relaying(replica.target("a")) as (_, port):
        assert events(post(port)) == [b'data: {"n": 1}', b'data: {"n": 2}', b"data: [DONE]"]


def test_a_replica_dying_mid_stream_on_a_kept_connection_ends_the_stream_and_the_client_connection_goes_on():
    streams = []

    def first_ok_then_dies(conn):
        streams.append(conn)
        if len(streams) == 1:
            return ok_answer(conn)
        conn.sendall(SSE_HEAD + chunk(b'data: {"n": 1}\n\n'))
        time.sleep(0.1)
        return False  # gone, mid-stream

    replica = Replica(first_ok_then_dies)
    with relaying(replica.target("a")) as (relay, port):
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        client.request("GET", "/v1/models", headers={"Host": "localhost"})
        assert client.getresponse().read() == b"ok"
        client.request("POST", "/v1/completions", b"{}", {"Host": "localhost"})  # on the kept connection
        got = events(client.getresponse())
        assert got[0] == b'data: {"n": 1}' and got[-1] == b"data: [DONE]" and len(got) == 3
        assert json.loads(got[1].removeprefix(b"data: "))["error"]["code"] == "replica_failed"
        streams.clear()
        client.request("GET", "/v1/models", headers={"Host": "localhost"})  # the client's connection goes on
        assert client.getresponse().read() == b"ok"
        assert relay.held == {replica.target("a"): 0}


def test_a_client_that_leaves_closes_its_replicas_connection():
    release = threading.Event()

    def endless(conn):
        conn.sendall(SSE_HEAD + chunk(b"data: 1\n\n"))
        try:
            while not release.wait(0.02):
                conn.sendall(chunk(b"data: 2\n\n"))
        except OSError:
            replica.ended.set()

    replica = Replica(endless)
    with relaying(replica.target("a")) as (relay, port):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert replica.ended.wait(10)
        release.set()
        deadline = time.monotonic() + 5
        while relay.held[replica.target("a")] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert relay.held[replica.target("a")] == 0 and not relay.pool.get(replica.target("a"))


def test_pipelined_requests_head_expect_continue_and_http10_answer_as_one_server():
    def answer(conn):
        return ok_answer(conn, b"hello")

    replica = Replica(answer)
    with relaying(replica.target("a")) as (_, port):
        got = raw(port, b"GET /1 HTTP/1.1\r\nHost: a\r\n\r\nHEAD /2 HTTP/1.1\r\nHost: a\r\n\r\n"
                        b"GET /3 HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert got.count(b"HTTP/1.1 200 OK") == 3 and got.count(b"hello") == 2 and got.endswith(b"hello")
        assert [head.split(" ")[:2] for head, _ in replica.requests] == [["GET", "/app/1"], ["HEAD", "/app/2"],
                                                                        ["GET", "/app/3"]]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
            sock.sendall(b"{}")
            got = sock.recv(65536)
            while not got.endswith(b"hello"):  # (the head and the body may come apart)
                got += sock.recv(65536)
            assert got.startswith(b"HTTP/1.1 200 OK")
        assert "expect" not in replica.requests[-1][0].lower() and replica.requests[-1][1] == b"{}"
    streamed = Replica(lambda conn: conn.sendall(SSE_HEAD + chunk(b"data: 1\n\n") + b"0\r\n\r\n"))
    with relaying(streamed.target("a")) as (_, port):
        got = raw(port, b"GET /s HTTP/1.0\r\n\r\n")  # no chunks for HTTP/1.0: the end of the connection ends it
        assert got.endswith(b"\r\n\r\ndata: 1\n\n") and b"transfer-encoding" not in got.lower()


def test_a_chunked_request_body_goes_through_chunked():
    bodies = []

    def read_chunked(conn):
        body = replica.rest
        while not body.endswith(b"0\r\n\r\n"):
            body += conn.recv(65536)
        bodies.append(body)
        return ok_answer(conn)

    replica = Replica(read_chunked)
    with relaying(replica.target("a")) as (_, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", iter([b'{"prompt"', b': "x"}']), {"Host": "a"}, encode_chunked=True)
        assert conn.getresponse().read() == b"ok"
        head = replica.requests[0][0].lower()
        assert "transfer-encoding: chunked" in head and "content-length" not in head
        assert bodies == [b'9\r\n{"prompt"\r\n6\r\n: "x"}\r\n0\r\n\r\n']


def test_stop_ends_within_its_grace_even_with_a_stream_that_never_ends():
    release = threading.Event()

    def endless(conn):
        conn.sendall(SSE_HEAD + chunk(b"data: 1\n\n"))
        release.wait(30)

    replica = Replica(endless)
    relay = Relay("/app")
    relay.set_targets([replica.target("a")])
    sock = socket.create_server(("127.0.0.1", 0))
    front = Front(relay, 0.5)
    thread = threading.Thread(target=front.run, args=(sock,), daemon=True)
    thread.start()
    assert front.started.wait(10)
    answer = post(sock.getsockname()[1])
    assert answer.status == 200
    stopped = time.monotonic()
    front.stop()
    thread.join(10)
    release.set()
    assert not thread.is_alive() and time.monotonic() - stopped < 3
    with pytest.raises(http.client.IncompleteRead):  # closed: never presented as complete
        answer.read()
    with pytest.raises(OSError):
        socket.create_connection(sock.getsockname()[:2], timeout=2)


def test_metrics_through_the_front_are_summed_labelled_and_a_refusal_passed_on():
    def metrics_of(completed):
        def answer(conn):
            return ok_answer(conn, replica_text(completed, 1).encode())
        return answer

    a, b = Replica(metrics_of(3)), Replica(metrics_of(5))
    refusing = Replica(lambda conn: conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
                                                 b"content-length: 11\r\n\r\n{\"no\": \"k\"}"))
    with relaying(a.target("r1"), b.target("r2")) as (_, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics", headers={"Host": "localhost", "Authorization": "Bearer k"})
        total = parse_prometheus(conn.getresponse().read().decode())
        assert total['cullama_requests_total{outcome="completed"}'] == 8
        conn.request("GET", "/metrics/replicas", headers={"Host": "localhost"})  # on the same connection
        text = conn.getresponse().read().decode()
        assert 'cullama_requests_total{replica="r2",outcome="completed"} 5' in text
    assert all(head.startswith("GET /app/metrics HTTP/1.1") and "authorization: bearer k" in head.lower()
               for head, _ in a.requests[:1] + b.requests[:1])
    with relaying(refusing.target("r3")) as (_, port):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics", headers={"Host": "evil.example"})
        answer = conn.getresponse()
        assert (answer.status, answer.read(), answer.getheader("content-type")) == (401, b'{"no": "k"}',
                                                                                    "application/json")
