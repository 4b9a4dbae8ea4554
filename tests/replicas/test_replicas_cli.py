"""`cullama serve --replicas` refusing what it cannot serve before any Ray process starts: without Ray installed,
options that contradict each other, a bad model, a port in use. One line and exit 2 each (no cluster)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.ray_cluster import ray_env, ray_pids, ray_root, reap
from tests.serving import CLI

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")


@pytest.fixture
def root():
    path = ray_root()
    yield path
    assert reap(path) == []  # none of these starts a Ray process


def serve(root, *args: str, code: str = CLI) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, "serve", "--port", "0", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=120, env=ray_env(root))


def one_error(out: subprocess.CompletedProcess) -> str:
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr and "listening on" not in out.stderr
    return lines[0]


def test_replicas_without_ray_is_one_line_naming_the_extra(root, stories_dir):
    no_ray = "import sys; sys.modules['ray'] = None; " + CLI  # as if ray were not installed
    line = one_error(serve(root, "--model", str(stories_dir), "--replicas", "2", code=no_ray))
    assert line.startswith("error: cullama serve --replicas needs Ray Serve") and "pip install 'cullama[ray]'" in line
    assert ray_pids(root) == []


@pytest.mark.parametrize("args, said", [
    (("--replicas", "2", "--min-replicas", "1"), "not both"),
    (("--ray-address", "127.0.0.1:6379"), "--ray-address is an option of replicas"),
    (("--upscale-delay", "1"), "--upscale-delay is an option of replicas"),
    (("--replicas", "0"), "--replicas"),
    (("--min-replicas", "3", "--max-replicas", "2"), "--min-replicas and --max-replicas must satisfy"),
    (("--replicas", "2", "--ray-app", "no/slash"), "--ray-app must be"),
    (("--replicas", "2", "--max-batch", "0"), "--max-batch"),
])
def test_contradicting_options_are_one_line(root, stories_dir, args, said):
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[test]')")
    out = serve(root, "--model", str(stories_dir), *args)
    assert out.returncode == 2 and said in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "listening on" not in out.stderr


def test_a_bad_model_or_a_port_in_use_starts_no_cluster(root, stories_dir, tmp_path):
    pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[test]')")
    line = one_error(serve(root, "--model", str(tmp_path), "--replicas", "2"))
    assert str(tmp_path) in line
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = subprocess.run([sys.executable, "-c", CLI, "serve", "--model", str(stories_dir), "--device", "cpu",
                              "--port", port, "--replicas", "2"], capture_output=True, text=True, timeout=120,
                             env=ray_env(root))
    assert f"cannot listen on 127.0.0.1:{port}" in one_error(out)
