"""`cullama serve` as a real process for the server tests: start it on 127.0.0.1 with a free port (--port 0;
the server prints the port it got), wait for /health, talk raw HTTP (a streamed answer's SSE chunks too), read
/metrics, stop it with a signal; the official `openai` client of one; and the module fixtures a test module of
stories260K's server imports (`server`, `client`, `oracle`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator
from urllib.parse import urlsplit

import pytest

CLI = "from cullama.cli.main import main; main()"


@pytest.fixture(scope="module", name="server")
def stories_server(stories_dir, tmp_path_factory):
    """The fixture `server`: stories260K served on the CPU with the default options, one per test module."""
    with running(stories_dir, tmp_path_factory.mktemp("serve")) as proc:
        yield proc


@pytest.fixture(scope="module", name="client")
def stories_client(server):
    """The fixture `client`: the openai client of `server`."""
    return openai_client(server)


@pytest.fixture(scope="module", name="oracle")
def stories_oracle(stories_dir):
    """The fixture `oracle`: the library, in this process: what each request must give when it runs alone."""
    import cullama

    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def openai_client(server: "ServerProcess", api_key: str = "unused"):
    """The official client (the `openai` test dependency) of a running server: no retries, a generous timeout."""
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=120)


@contextlib.contextmanager
def running(model_dir: Path, log_dir: Path, *args: str) -> Iterator["ServerProcess"]:
    """A server ready to serve (/health answers 200), stopped by SIGTERM afterwards; its log is printed
    when it does not exit 0."""
    proc = ServerProcess(model_dir, log_dir / "server.log", *args)
    try:
        proc.wait_ready()
        yield proc
    finally:
        if proc.stop(signal.SIGTERM) != 0:
            print(proc.log())


class ServerProcess:
    def __init__(self, model_dir: Path, log_path: Path, *args: str, env: dict | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")  # a file, not a pipe: nobody has to drain it while tests run
        command = [sys.executable, "-c", CLI, "serve", "--model", str(model_dir), "--host", "127.0.0.1",
                   "--port", "0", "--device", "cpu", *args]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_for(r"listening on (http://\S+)", timeout=60).group(1)
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log())
            if found:
                return found
            if self.process.poll() is not None:
                raise AssertionError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} from the server in {timeout} s:\n{self.log()}")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.request("GET", "/health")[0] != 200:
            assert time.monotonic() < deadline, f"/health never answered 200:\n{self.log()}"
            time.sleep(0.05)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None,
                headers: dict | None = None) -> tuple[int, dict, bytes]:
        """(status, headers, body) of one request on a new connection."""
        if isinstance(body, dict):
            body = json.dumps(body)
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            return response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()

    def sse(self, path: str, body: dict) -> list[dict]:
        """The chunks of a streamed answer to `body` (`stream: true` added), checked as OpenAI's server-sent events:
        a 200 of text/event-stream, each event one `data: ` line, the last `data: [DONE]`."""
        status, headers, raw = self.request("POST", path, {**body, "stream": True})
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), raw
        events = [e for e in raw.decode().split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]", events
        return [json.loads(e[len("data: "):]) for e in events[:-1]]

    def metrics(self) -> dict[str, float]:
        """/metrics as {sample name with labels: value} (parse_prometheus checks the format)."""
        status, _, body = self.request("GET", "/metrics")
        assert status == 200
        return parse_prometheus(body.decode())

    def wait_metric(self, name: str, want, timeout: float = 30) -> dict[str, float]:
        """Poll /metrics until `want(value of name)`; the last sample set."""
        deadline = time.monotonic() + timeout
        while True:
            samples = self.metrics()
            if want(samples[name]):
                return samples
            assert time.monotonic() < deadline, f"{name} = {samples[name]} after {timeout} s"
            time.sleep(0.02)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        finally:
            self._log.close()

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()


def run_serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`cullama serve` expected to exit by itself (a bad option or model, a port in use)."""
    return subprocess.run([sys.executable, "-c", CLI, "serve", *args], capture_output=True, text=True, timeout=60,
                          env=env)


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                    r'(NaN|[+-]?Inf|[+-]?[0-9.eE+-]+)$')


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format 0.0.4, checked as it is read: every sample line well formed and announced
    by a TYPE line, histogram buckets cumulative and ending with +Inf == _count."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    types: dict[str, str] = {}
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            assert name not in types, f"two TYPE lines for {name}"
            types[name] = kind
        elif line.startswith("# HELP ") or not line.strip():
            continue
        else:
            match = SAMPLE.match(line)
            assert match, f"not a Prometheus sample line: {line!r}"
            name, labels, value = match.group(1), match.group(2) or "", match.group(3)
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in types or types.get(base) in ("histogram", "summary"), f"{name} has no TYPE line"
            key = name + labels
            assert key not in samples, f"{key} appears twice"
            samples[key] = float(value)
    for name, kind in types.items():
        if kind == "histogram":
            buckets = [(k, v) for k, v in samples.items() if k.startswith(name + "_bucket{")]
            bounds = [float(re.search(r'le="([^"]+)"', k).group(1)) for k, _ in buckets]
            counts = [v for _, v in buckets]
            assert bounds == sorted(bounds) and bounds[-1] == float("inf"), f"{name}: buckets out of order"
            assert counts == sorted(counts), f"{name}: buckets are not cumulative"
            assert counts[-1] == samples[name + "_count"], f"{name}: +Inf bucket != _count"
    return samples
