"""`cullama serve --min-replicas 1 --max-replicas 2` with short delays: a second replica comes under load (more
requests than one replica's batch) and takes some of it, and goes when the load has gone. One local Ray cluster for the
module, every wait bounded."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.ray_cluster import ray_env, ray_pids, ray_root, reap
from tests.replicas.test_replicas import START_S, completed, replica_metrics, wait_for
from tests.serving import ServerProcess, openai_client

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[test]')")
pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

LOAD_S = 90  # the most the load runs for before a second replica must have come


@pytest.fixture(scope="module")
def root():
    path = ray_root()
    yield path
    reap(path)


@pytest.fixture(scope="module")
def autoscaled(stories_dir, tmp_path_factory, root):
    proc = ServerProcess(stories_dir, tmp_path_factory.mktemp("autoscaled") / "server.log", "--min-replicas", "1",
                         "--max-replicas", "2", "--upscale-delay", "1", "--downscale-delay", "3",
                         "--autoscale-window", "2", "--max-batch", "1", "--max-queue", "16", env=ray_env(root))
    try:
        proc.wait_ready(START_S)
        yield proc
    finally:
        if proc.process.poll() is None:
            proc.stop(signal.SIGTERM, timeout=60)


def test_a_second_replica_comes_under_load_takes_some_and_goes_when_idle(autoscaled, root):
    assert len(replica_metrics(autoscaled)) == 1
    client = openai_client(autoscaled)
    done, errors = threading.Event(), []

    def load():  # one long stream after another: 4 clients against one replica's batch of 1
        while not done.is_set():
            try:
                for _ in client.completions.create(model="stories260K", prompt="Once", max_tokens=200, stream=True,
                                                   extra_body={"ignore_eos": True}):
                    pass
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return

    clients = [threading.Thread(target=load) for _ in range(4)]
    for thread in clients:
        thread.start()
    try:
        two = wait_for(lambda: (m := replica_metrics(autoscaled)) and len(m) == 2 and m, LOAD_S, autoscaled,
                       "second replica under load")
        newcomer = min(two, key=lambda r: completed(two[r]))
        wait_for(lambda: completed(replica_metrics(autoscaled).get(newcomer, {})) > 0 if newcomer in
                 replica_metrics(autoscaled) else False, 60, autoscaled, "request served by the second replica")
    finally:
        done.set()
        for thread in clients:
            thread.join(120)
    assert not errors, errors
    wait_for(lambda: len(replica_metrics(autoscaled)) == 1, START_S, autoscaled, "scaling back to one replica")
    assert autoscaled.stop(signal.SIGTERM, timeout=60) == 0, autoscaled.log()
    deadline = time.monotonic() + 15
    while ray_pids(root) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray_pids(root) == []
