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

from cullama.replicas.front import Front  # noqa: E402
from cullama.replicas.prometheus import labelled, summed  # noqa: E402
from cullama.replicas.relay import Relay, Target  # noqa: E402
from cullama.server.metrics import Metrics  # noqa: E402
from tests.serving import parse_prometheus  # noqa: E402

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Replica:
    """A fake replica on a port of its own: each connection's request is read (its head, and Content-Length's
    worth of body) and recorded, then `script(conn)` answers it."""

    def __init__(self, script):
        self.script, self.requests = script, []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.answer, args=(conn,), daemon=True).start()

    def answer(self, conn):
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.requests.append((head.decode(), body))
            self.script(conn)

    def target(self, name: str) -> Target:
        return Target(name, "127.0.0.1", self.port)

    def close(self):
        self.sock.close()


@contextlib.contextmanager
def relaying(*targets: Target, prefix: str = "/app"):
    relay = Relay(prefix)
    relay.set_targets(list(targets))
    sock = socket.create_server(("127.0.0.1", 0))
    front = Front(relay, 1.0)
    thread = threading.Thread(target=front.run, args=(sock,), daemon=True)
    thread.start()
    assert front.started.wait(10)
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
