"""The server's engine and app in this process, where the tests can hold the weights back or make a generation
fail: one generation at a time in arrival order, the bounded queue, cancelling, stopping, /health while
loading, and a generation's exception answered with a 500 while the server goes on."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
httpx = pytest.importorskip("httpx", reason="httpx comes with the test extra (pip install -e '.[test]')")
uvicorn = pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install -e '.[test]')")

from cullama.server.app import Settings, create_app  # noqa: E402
from cullama.server.engine import Busy, Engine, Failed, Finished, Job, Piece, Stopped, Unavailable  # noqa: E402
from cullama.server.launch import is_loopback, listen  # noqa: E402
from cullama.server.metrics import Metrics  # noqa: E402


@pytest.fixture(scope="module")
def llm(stories_dir):
    import cullama

    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def started(llm, max_queue=8, load=None) -> Engine:
    engine = Engine(load or (lambda: llm), max_queue, Metrics())
    engine.start()
    deadline = time.monotonic() + 30
    while engine.state == "loading" and load is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return engine


def options(n: int) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0}


async def events_of(job: Job) -> list:
    """Every event of a job, up to its last."""
    out = [await job.next_event()]
    while isinstance(out[-1], Piece):
        out.append(await job.next_event())
    return out


def test_jobs_run_one_at_a_time_in_arrival_order_each_with_its_own_answer(llm):
    engine = started(llm)

    async def main():
        loop = asyncio.get_running_loop()
        prompts = [[1], [1, 403], [1, 403, 407], [1, 403, 407, 261]]
        jobs = [Job(p, options(6), loop) for p in prompts]
        for job in jobs:
            engine.submit(job)
        finished_order = []

        async def watch(i, job):
            events = await events_of(job)
            finished_order.append(i)
            return events

        results = await asyncio.gather(*(watch(i, job) for i, job in enumerate(jobs)))
        return prompts, finished_order, results

    prompts, order, results = asyncio.run(main())
    assert order == [0, 1, 2, 3]
    for prompt, events in zip(prompts, results):
        expected = llm.generate(prompt, **options(6))
        assert "".join(e.text for e in events[:-1]) == expected.text
        assert events[-1] == Finished(expected.finish_reason, len(prompt), len(expected.token_ids))
    assert engine.metrics.requests["completed"] == 4 and engine.metrics.prompt_tokens == 10
    engine.stop()
    engine.join(10)


def test_the_queue_is_bounded_and_cancelling_frees_a_place_or_the_engine(llm, monkeypatch):
    inside, release = threading.Event(), threading.Event()
    real_next = llm.runner.next

    def held_next(*args, **kwargs):  # the engine waits inside a decode step until the test lets it go
        inside.set()
        release.wait(30)
        return real_next(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "next", held_next)
    engine = started(llm, max_queue=1)

    async def main():
        loop = asyncio.get_running_loop()
        long, waiting, third = Job([1], options(400), loop), Job([1], options(3), loop), Job([1], options(3), loop)
        engine.submit(long)
        await asyncio.to_thread(inside.wait, 30)  # it runs: its second token is being computed
        engine.submit(waiting)  # the one place in the queue
        with pytest.raises(Busy, match="--max-queue 1"):
            engine.submit(third)
        engine.cancel(waiting)  # leaves the queue at once
        assert await waiting.next_event() == Stopped("cancelled")
        engine.submit(third)
        engine.cancel(long)  # stops once the token being computed is done
        release.set()
        events = await events_of(long)
        assert events[-1] == Stopped("cancelled") and [e.text for e in events[:-1]] == ["Once"]
        assert isinstance((await events_of(third))[-1], Finished)  # and the next job runs
        engine.cancel(third)  # a finished job: nothing happens

    asyncio.run(main())
    assert engine.metrics.requests["cancelled"] == 2 and engine.metrics.requests["completed"] == 1
    assert engine.metrics.generated_tokens == 2 + 3  # `long`: the token before the cancel and the one under way
    engine.stop()
    engine.join(10)


class LeavingJob(Job):
    """A job whose client leaves as its `after`-th piece is posted: on the engine thread, before the engine
    reads on, so that the test knows exactly where the cancel came."""

    def __init__(self, engine: Engine, after: int, *args):
        super().__init__(*args)
        self.engine, self.after, self.pieces = engine, after, 0

    def post(self, event) -> None:
        super().post(event)
        self.pieces += isinstance(event, Piece)
        if self.pieces == self.after and isinstance(event, Piece):
            self.engine.cancel(self)


@pytest.fixture(scope="module")
def drafting_llm(stories_dir):
    """stories260K with itself as its draft model: every draft accepted, bursts of k + 1 tokens."""
    import cullama

    return cullama.Llama.from_pretrained(stories_dir, device="cpu", draft_model=stories_dir)


# Token 0 is the prefill's; with k = 4 each verify step makes a burst of 5: tokens 1-5 (pieces 2-6), 6-10, ...
# A cancel as piece `after` is posted ends the stream before its next token: the rest of the burst is dropped,
# and no further verify step runs, whether the burst was spent or not.
@pytest.mark.parametrize("after", [1, 2, 6, 7])
def test_a_cancel_stops_before_the_next_token_and_drops_the_rest_of_the_burst(drafting_llm, after):
    engine = started(drafting_llm)

    async def main():
        job = LeavingJob(engine, after, [1], {**options(400), "speculative": "draft", "draft_tokens": 4},
                         asyncio.get_running_loop())
        engine.submit(job)
        return await events_of(job)

    events = asyncio.run(main())
    assert events[-1] == Stopped("cancelled") and len(events) == after + 1
    assert engine.metrics.generated_tokens == after
    steps = -(-(after - 1) // 5)  # the steps that made tokens 0..after-1, and not one more
    assert engine.metrics.speculative["draft"] == {"steps": steps, "drafted": 4 * steps, "accepted": 4 * steps}
    engine.stop()
    engine.join(10)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "verify steps"])
def test_a_cancel_lands_at_the_next_token_while_the_text_is_held_back(llm, drafting_llm, stories_expected,
                                                                       monkeypatch, speculative):
    # A stop string that the whole output begins: every token's text is held back, no piece is ever posted.
    # The client leaves while the runner computes its 3rd step (a decode step, or a verify step of up to 5
    # tokens); that step finishes, and no other runs.
    model = drafting_llm if speculative else llm
    name = "verify" if speculative else "next"
    real, calls, jobs = getattr(model.runner, name), [], []
    engine = started(model)

    def step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            engine.cancel(jobs[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(model.runner, name, step)
    extra = {"speculative": "draft", "draft_tokens": 4} if speculative else {}

    async def main():
        jobs.append(Job([1], {**options(400), "stop": [stories_expected["text"] + "!"], **extra},
                        asyncio.get_running_loop()))
        engine.submit(jobs[0])
        return await events_of(jobs[0])

    events = asyncio.run(main())
    assert events == [Stopped("cancelled")]
    assert len(calls) == 3  # of 399 decode steps, or 80 verify steps
    engine.stop()
    engine.join(10)


def test_stopping_ends_the_running_and_the_waiting_jobs_and_refuses_new_ones(llm):
    engine = started(llm)

    async def main():
        loop = asyncio.get_running_loop()
        running, waiting = Job([1], options(400), loop), Job([1], options(3), loop)
        engine.submit(running)
        assert isinstance(await running.next_event(), Piece)
        engine.submit(waiting)
        engine.stop()
        assert await waiting.next_event() == Stopped("shutdown")
        assert (await events_of(running))[-1] == Stopped("shutdown")
        with pytest.raises(Unavailable, match="shutting down"):
            engine.submit(Job([1], options(3), loop))

    asyncio.run(main())
    engine.join(10)
    assert engine.state == "stopped"


def test_an_exception_inside_a_generation_fails_that_job_and_the_engine_goes_on(llm, monkeypatch, capsys):
    engine = started(llm)
    real_next, calls = llm.runner.next, []

    def next_token(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the device fell over")
        return real_next(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "next", next_token)

    async def main():
        loop = asyncio.get_running_loop()
        failing, after = Job([1], options(8), loop), Job([1, 403], options(5), loop)
        engine.submit(failing)
        engine.submit(after)
        return await events_of(failing), await events_of(after)

    failed, after = asyncio.run(main())
    assert failed[-1] == Failed("the generation failed (RuntimeError); the server logged the details")
    assert "".join(e.text for e in after[:-1]) == llm.generate([1, 403], **options(5)).text
    assert "the device fell over" in capsys.readouterr().err  # the details are in the server's log
    assert engine.metrics.requests["failed"] == 1
    engine.stop()
    engine.join(10)


def test_a_model_that_fails_to_load_is_reported_and_nothing_queues():
    failures = []

    def load():
        raise OSError("disk on fire")

    engine = Engine(load, 4, Metrics())
    engine.start(failures.append)
    engine.join(10)
    assert engine.state == "failed" and isinstance(failures[0], OSError)
    with pytest.raises(Unavailable, match="failed to load"):
        engine.submit(Job([1], options(3), asyncio.new_event_loop()))


@contextlib.contextmanager
def serving(engine: Engine, metrics: Metrics | None = None, **settings):
    """The app on a real socket, with uvicorn on a thread of this process; `settings`: Settings' fields."""
    sock = listen("127.0.0.1", 0)
    app = create_app(engine, Settings(model_name="m", context=512, **settings), metrics or engine.metrics)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        with httpx.Client(base_url="http://%s:%d" % sock.getsockname()[:2], timeout=60) as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        engine.stop()


def test_health_is_503_while_the_weights_load_then_200(llm):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return llm

    engine = started(llm, load=slow_load)
    with serving(engine) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["error"]["message"] == "the model is loading"
        busy = client.post("/v1/completions", json={"prompt": [1]})
        assert busy.status_code == 503 and "still loading" in busy.json()["error"]["message"]
        assert client.get("/v1/models").json()["data"][0]["id"] == "m"  # known before the weights are in
        release.set()
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        out = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 4, "temperature": 0})
        assert out.status_code == 200 and out.json()["choices"][0]["text"] == "Once upon a time"


def test_a_generation_that_raises_answers_500_whole_or_streamed_and_the_server_goes_on(llm, monkeypatch):
    real_next, calls = llm.runner.next, []

    def next_token(*args, **kwargs):
        calls.append(1)
        if len(calls) in (2, 9):  # the 1st request's 2nd decode step, the 2nd's 7th
            raise RuntimeError("the device fell over")
        return real_next(*args, **kwargs)

    monkeypatch.setattr(llm.runner, "next", next_token)
    engine = started(llm)
    with serving(engine) as client:
        body = {"prompt": [1], "max_tokens": 8, "temperature": 0}
        whole = client.post("/v1/completions", json=body)
        assert whole.status_code == 500
        assert whole.json()["error"] == {"message": "the generation failed (RuntimeError); the server logged the "
                                                    "details", "type": "server_error", "param": None, "code": None}
        # Streamed: the status was sent with the first piece, so the error is the stream's last event.
        streamed = client.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200
        events = [e for e in streamed.text.split("\n\n") if e]
        assert '"type":"server_error"' in events[-2] and events[-1] == "data: [DONE]"
        fine = client.post("/v1/completions", json=body)
        assert fine.status_code == 200 and fine.json()["choices"][0]["text"] == llm.generate([1], **options(8)).text


def test_a_web_page_allowed_by_allowed_origins_gets_its_preflight_and_can_read_the_answers(llm):
    page = "http://localhost:3000"
    with serving(started(llm), allowed_origins=(page, "https://ui.example")) as client:
        preflight = client.options("/v1/chat/completions", headers={
            "Origin": page, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == page
        assert preflight.headers["access-control-allow-headers"] == "authorization, content-type, x-stainless-os"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        answer = client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2, "temperature": 0},
                             headers={"Origin": page})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == page
        assert answer.headers["vary"] == "Origin"
        streamed = client.post("/v1/completions", headers={"Origin": "https://ui.example"},
                               json={"prompt": [1], "max_tokens": 2, "temperature": 0, "stream": True})
        assert streamed.status_code == 200 and streamed.headers["access-control-allow-origin"] == "https://ui.example"
        refused = client.options("/v1/completions", headers={"Origin": "http://localhost:3001",
                                                             "Access-Control-Request-Method": "POST"})
        assert refused.status_code == 403 and "access-control-allow-origin" not in refused.headers
        plain = client.get("/health")  # no Origin: a program, no CORS headers
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


@pytest.mark.parametrize("path, body, tokenize", [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 3}, "encode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, "chat_ids"),
], ids=["completion", "chat"])
def test_a_prompt_is_tokenized_off_the_event_loop_so_the_server_answers_meanwhile(llm, monkeypatch, path, body,
                                                                                   tokenize):
    inside, release = threading.Event(), threading.Event()
    real = getattr(llm, tokenize)

    def held(*args, **kwargs):  # a prompt of many megabytes: it takes as long as the test likes
        inside.set()
        release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(llm, tokenize, held)
    engine = started(llm)
    with serving(engine) as client, ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, path, json=body)
        assert inside.wait(30)
        try:
            health = client.get("/health", timeout=5)  # times out while the event loop tokenizes
        finally:
            release.set()
        assert health.status_code == 200
        assert answer.result().status_code == 200


def test_loopback_addresses_are_told_apart_from_the_others():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.10")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread's death is the point
def test_an_engine_thread_that_died_makes_health_503():
    """A fault outside any one request (here the batch session cannot even start) ends the engine thread while its
    state is still ready: /health says so (and a replica under Ray, whose health check asks the same, is replaced)."""
    engine = Engine(lambda: object(), 8, Metrics(), max_batch=2)  # object() has no batch(): the thread raises
    engine.start()
    engine.join(30)
    assert engine.state == "ready" and engine.problem() == "the model is not served (its engine thread ended)"
    with serving(engine) as client:
        health = client.get("/health")
        assert health.status_code == 503 and "engine thread ended" in health.json()["error"]["message"]
