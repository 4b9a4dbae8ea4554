"""`cullama serve --replicas 2` end to end: one local Ray cluster for the module (started by the command itself, in a
temp dir of its own), stories260K on the CPU, driven with the official `openai` client and raw HTTP beside a single
`cullama serve` of the same model and options: the replicas must answer what one server answers, spread the load over
both, show every replica's metrics, end a stream whose replica is killed with an error event and go on, fail with the
loader's line on a model that cannot load, refuse a GPU the cluster lacks, deploy through `serve run` of the builder,
and stop on SIGTERM leaving no Ray process. Every wait is bounded."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.ray_cluster import ray_env, ray_pids, ray_root, reap
from tests.serving import CLI, ServerProcess, openai_client, parse_prometheus

pytest.importorskip("ray.serve", reason="the ray extra is not installed (pip install -e '.[test]')")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

KEY = "sk-replicas-test"
MODEL = "stories260K"
OPTIONS = ("--max-batch", "4", "--max-queue", "8")
START_S = 240  # a cluster's start on a loaded 2-core machine, with both replicas' loads


@pytest.fixture(scope="module")
def root():
    path = ray_root()
    yield path
    reap(path)  # whatever a failed test left (test_sigterm_... checks that nothing is left in the normal course)


@pytest.fixture(scope="module")
def replicas(stories_dir, tmp_path_factory, root):
    proc = ServerProcess(stories_dir, tmp_path_factory.mktemp("replicas") / "server.log", "--replicas", "2",
                         *OPTIONS, env=ray_env(root, CULLAMA_API_KEY=KEY))
    try:
        proc.wait_ready(START_S)
        wait_for(lambda: replica_metrics(proc) and len(replica_metrics(proc)) == 2, START_S, proc,
                 "both replicas ready")
        yield proc
    finally:
        if proc.process.poll() is None:
            proc.stop(signal.SIGTERM, timeout=60)


@pytest.fixture(scope="module")
def single(stories_dir, tmp_path_factory):
    """One `cullama serve` of the same model and options: what every answer must be."""
    proc = ServerProcess(stories_dir, tmp_path_factory.mktemp("single") / "server.log", *OPTIONS,
                         env={**os.environ, "CULLAMA_API_KEY": KEY})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def wait_for(condition, timeout: float, proc: ServerProcess, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{proc.log()}"
        time.sleep(0.1)
    return value


def replica_metrics(proc: ServerProcess) -> dict[str, dict[str, float]]:
    """/metrics/replicas as {replica id: its samples, without the replica label} (each replica's checked as one
    server's /metrics is)."""
    status, _, body = proc.request("GET", "/metrics/replicas")
    assert status == 200, body
    text = body.decode()
    heads = [line for line in text.splitlines() if line.startswith("#") and "cullama_replicas" not in line]
    out = {}
    for replica in sorted(set(re.findall(r'replica="([^"]+)"', text))):
        rows = [re.sub(rf'replica="{replica}",?', "", line).replace("{}", "")
                for line in text.splitlines() if f'replica="{replica}"' in line]
        out[replica] = parse_prometheus("\n".join(heads + rows) + "\n")
    return out


def cluster_address(proc: ServerProcess) -> str:
    return re.search(r"Ray cluster (\S+), started here", proc.log()).group(1)


def completed(samples: dict[str, float]) -> float:
    return samples['cullama_requests_total{outcome="completed"}']


REQUESTS = [  # (API, body): greedy and seeded, completions and chat
    ("completions", dict(prompt="Once upon a time", max_tokens=24, temperature=0)),
    ("completions", dict(prompt="The little dog", max_tokens=24, temperature=0.9, top_p=0.9, seed=7)),
    ("chat", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0)),
    ("chat", dict(messages=[{"role": "user", "content": "Tell a story"}], max_tokens=20, temperature=1.0, seed=3)),
]


def ask(client, api: str, body: dict, stream: bool = False):
    """(the answer's text, finish reason, replica id or None) of one request."""
    create = (client.completions if api == "completions" else client.chat.completions).with_raw_response.create
    raw = create(model=MODEL, stream=stream, **body)
    answer = raw.parse()
    if stream:
        pieces, finish = [], None
        for chunk in answer:
            if chunk.choices:
                choice = chunk.choices[0]
                pieces.append(choice.text if api == "completions" else (choice.delta.content or ""))
                finish = choice.finish_reason or finish
        text = "".join(pieces)
    else:
        choice = answer.choices[0]
        text, finish = (choice.text if api == "completions" else choice.message.content), choice.finish_reason
    return text, finish, raw.headers.get("x-cullama-replica")


def test_answers_are_a_single_servers_and_both_replicas_give_them(replicas, single):
    many, one = openai_client(replicas, KEY), openai_client(single, KEY)
    seen = set()
    for api, body in REQUESTS:
        for stream in (False, True):
            want = ask(one, api, body, stream)[:2]
            for _ in range(3):
                text, finish, replica = ask(many, api, body, stream)
                assert (text, finish) == want, (api, body, stream)
                seen.add(replica)
    assert len(seen) == 2, seen
    assert many.models.list().data[0].id == MODEL


def test_sixteen_concurrent_requests_spread_over_both_replicas(replicas, single):
    one, many = openai_client(single, KEY), openai_client(replicas, KEY)
    prompts = [f"Once upon a time there was a {word}" for word in
               ("cat", "dog", "girl", "boy", "tree", "bird", "ball", "car")] * 2
    wants = [ask(one, "completions", dict(prompt=p, max_tokens=40, temperature=0))[:2] for p in prompts]
    before = replica_metrics(replicas)
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda p: ask(many, "completions", dict(prompt=p, max_tokens=40, temperature=0),
                                          stream=True), prompts))
    assert [g[:2] for g in got] == wants
    after = replica_metrics(replicas)
    served = {r: completed(after[r]) - completed(before[r]) for r in after}
    assert sum(served.values()) == 16 and all(n >= 3 for n in served.values()), served
    # and the summed /metrics is the sum of the replicas' (one server's names and labels: parse_prometheus checks)
    total = replicas.metrics()
    assert total['cullama_replicas{state="answered"}'] == 2
    for name in ('cullama_requests_total{outcome="completed"}', "cullama_generation_tokens_total",
                 "cullama_decode_batch_size_count", 'cullama_time_to_first_token_seconds_bucket{le="+Inf"}'):
        assert total[name] == sum(samples[name] for samples in after.values()), name
    assert all(samples["cullama_decode_batch_size_count"] > 0 for samples in after.values())


BAD = [  # (method, path, body, headers): every one refused as one `cullama serve` refuses it
    ("GET", "/v1/models", None, {}),  # no key
    ("POST", "/v1/completions", {"prompt": "x"}, {"Authorization": "Bearer wrong"}),
    ("GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}", "Host": "evil.example"}),
    ("GET", "/v1/models", None, {"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"}),
    ("GET", "/v1/nothing", None, {"Authorization": f"Bearer {KEY}"}),
    ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 100000}, {"Authorization": f"Bearer {KEY}"}),
    ("POST", "/v1/completions", {"prompt": "x", "temperature": "hot"}, {"Authorization": f"Bearer {KEY}"}),
    ("POST", "/v1/completions", {"prompt": "x", "model": "other"}, {"Authorization": f"Bearer {KEY}"}),
    ("POST", "/v1/completions", "not json", {"Authorization": f"Bearer {KEY}"}),
    ("POST", "/v1/completions", {"prompt": "x"}, {"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"}),
]


@pytest.mark.parametrize("method, path, body, headers", BAD, ids=range(len(BAD)))
def test_refusals_and_errors_are_a_single_servers(replicas, single, method, path, body, headers):
    want_status, want_headers, want_body = single.request(method, path, body, headers)
    status, got_headers, got_body = replicas.request(method, path, body, headers)
    assert want_status >= 400 and (status, json.loads(got_body)) == (want_status, json.loads(want_body))
    assert got_headers.get("content-type") == want_headers.get("content-type")


def test_health_and_malformed_http_as_one_server(replicas):
    assert replicas.request("GET", "/health")[0] == 200  # open without the key, as one server's
    with socket.create_connection((replicas.host, replicas.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n\r\n")  # HTTP/1.1 without a Host: the relay's h11 refuses it
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and json.loads(body)["error"]["code"] == "malformed_http"


def test_every_replicas_metrics_are_reachable(replicas):
    per = replica_metrics(replicas)
    assert len(per) == 2
    status, _, body = replicas.request("GET", "/metrics/replicas")
    infos = re.findall(r'cullama_replica_info\{replica="([^"]+)",pid="(\d+)",node="([^"]+)"\} 1', body.decode())
    assert sorted(r for r, _, _ in infos) == sorted(per) and len({pid for _, pid, _ in infos}) == 2
    for samples in per.values():  # each replica's batch sizes, queue and latencies
        for name in ("cullama_decode_batch_size_count", "cullama_queue_depth", "cullama_running_requests",
                     "cullama_time_to_first_token_seconds_count", "cullama_time_between_tokens_seconds_count"):
            assert name in samples, name


def replica_pid(replicas: ServerProcess, replica: str) -> int:
    _, _, body = replicas.request("GET", "/metrics/replicas")
    return int(re.search(rf'cullama_replica_info\{{replica="{replica}",pid="(\d+)"', body.decode()).group(1))


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_and_the_others_serve(replicas):
    client = openai_client(replicas, KEY)
    before = set(replica_metrics(replicas))
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Once", max_tokens=400, stream=True,
                                                      temperature=0, extra_body={"ignore_eos": True})
    victim = raw.headers["x-cullama-replica"]
    pid, chunks = replica_pid(replicas, victim), 0
    with pytest.raises(openai.APIError) as failure:
        for chunk in raw.parse():
            chunks += 1
            assert chunk.choices[0].finish_reason is None  # never an answer presented as complete
            if chunks == 20:
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
    assert time.monotonic() - killed < 10  # never a hang
    assert failure.value.code == "replica_failed" and "incomplete" in failure.value.message
    # new requests go to the healthy replica at once
    for _ in range(6):
        start = time.monotonic()
        text, finish, replica = ask(client, "completions", dict(prompt="Once", max_tokens=4, temperature=0))
        assert replica != victim and finish == "length" and time.monotonic() - start < 10
    # and Serve replaces the dead one
    now = wait_for(lambda: (m := replica_metrics(replicas)) and len(m) == 2 and victim not in m and m, START_S,
                   replicas, "replacement replica")
    assert len(set(now) - before) == 1


def test_a_gpu_the_cluster_lacks_is_one_line(replicas, stories_dir, root):
    out = subprocess.run([sys.executable, "-c", CLI, "serve", "--model", str(stories_dir), "--port", "0",
                          "--replicas", "1", "--device", "cuda", "--ray-address", cluster_address(replicas),
                          "--ray-app", "gpu"], capture_output=True, text=True, timeout=120, env=ray_env(root))
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr
    assert "has 0 GPUs" in errors[0] and "--device cpu" in errors[0]


def test_a_model_that_fails_to_load_fails_the_deployment_with_the_loaders_line(replicas, stories_dir, root,
                                                                               tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(stories_dir, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])  # the header promises more than the file holds
    import cullama
    from cullama.common.errors import CullamaError

    with pytest.raises(CullamaError) as loader:
        cullama.Llama.from_pretrained(bad, device="cpu")
    out = subprocess.run([sys.executable, "-c", CLI, "serve", "--model", str(bad), "--port", "0", "--device", "cpu",
                          "--replicas", "1", "--ray-address", cluster_address(replicas), "--ray-app", "bad",
                          "--replica-cpus", "0"],  # the module's replicas hold the cluster's CPUs
                         capture_output=True, text=True, timeout=START_S, env=ray_env(root))
    assert out.returncode == loader.value.exit_code == 2, out.stderr
    assert f"error: {loader.value.for_cli()}" in out.stderr.splitlines(), out.stderr


def test_serve_run_of_the_builder_deploys_the_same_server(replicas, single, stories_dir, root, tmp_path):
    """`serve run cullama.replicas.app:build_app model=DIR ...` into the module's cluster, reached through Ray's own
    proxy (its route prefix taken off before the app: the key is checked on the path as one server checks it)."""
    out = subprocess.run([shutil.which("serve", path=os.path.dirname(sys.executable)), "run", "--non-blocking",
                          "--address", cluster_address(replicas), "--name", "built", "--route-prefix", "/built",
                          "cullama.replicas.app:build_app", f"model={stories_dir}", "device=cpu", "max_batch=4",
                          "max_queue=8", f"api_key={KEY}", "num_cpus=0"], capture_output=True, text=True, timeout=START_S,
                         env=ray_env(root), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    url = re.search(r"Application 'built' is ready at (http://\S+?)/built", out.stdout + out.stderr).group(1)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    proxy = http.client.HTTPConnection(host, int(port), timeout=60)
    proxy.request("GET", "/built/v1/models")
    refused = proxy.getresponse()
    assert refused.status == 401 and json.loads(refused.read())["error"]["code"] == "invalid_api_key"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    proxy.request("POST", "/built/v1/completions", json.dumps(body),
                  {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    answer = proxy.getresponse()
    want = json.loads(single.request("POST", "/v1/completions", body, {"Authorization": f"Bearer {KEY}"})[2])
    assert answer.status == 200 and json.loads(answer.read())["choices"] == want["choices"]


def test_sigterm_mid_stream_ends_the_streams_and_leaves_no_ray_process(replicas, root):
    """Last of the module: it stops the module's server."""
    conn = http.client.HTTPConnection(replicas.host, replicas.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 400,
                                                        "stream": True, "ignore_eos": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    events = []
    for line in response:
        if line.startswith(b"data: "):
            events.append(line[6:].strip())
            if len(events) == 10:
                replicas.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
    assert time.monotonic() - signalled < 10 and events[-1] == b"[DONE]"
    assert json.loads(events[-2])["error"]["message"] == "the server is shutting down"
    assert replicas.process.wait(60) == 0, replicas.log()
    stopped = time.monotonic() - signalled
    left = wait_until_gone(root, 15)
    assert left == [], f"Ray processes left {stopped:.1f} s after SIGTERM: {left}"


def wait_until_gone(root, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := ray_pids(root)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left



