"""The server's engine with --max-batch > 1 (in this process, on the numpy backend): requests decode together in a
batch session and each gets its solo answer; a cancelled one frees its row and the others go on; the queue bounds
the requests waiting past the batch; /metrics counts the rows of each decode step and the running requests; and
--max-batch's bad values are one-line errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

from click.testing import CliRunner  # noqa: E402

from cullama.cli.main import main  # noqa: E402
from cullama.server.engine import Busy, Engine, Failed, Finished, Job, Piece, Refused, Stopped  # noqa: E402
from cullama.server.metrics import Metrics  # noqa: E402
# the library's batch tests' models (max_batch 4, and 1)
from tests.generation.test_batch import batched, solo  # noqa: E402,F401

PROMPTS = [[1], [1, 403], [1, 403, 407], [1, 29, 4], [1, 500, 2, 17], [1, 77]]
OPTIONS = [dict(max_new_tokens=n, temperature=t, seed=s) for n, t, s in
           ((12, 0.0, 0), (7, 0.8, 1), (15, 1.0, 2), (4, 0.0, 0), (10, 0.6, 3), (9, 0.0, 0))]


@pytest.fixture(scope="module")
def llm(batched):
    return batched


def started(llm, max_queue=8, max_batch=4) -> Engine:
    engine = Engine(lambda: llm, max_queue, Metrics(), max_batch)
    engine.start()
    deadline = time.monotonic() + 30
    while engine.state == "loading":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return engine


async def events_of(job: Job) -> list:
    out = [await job.next_event()]
    while isinstance(out[-1], Piece):
        out.append(await job.next_event())
    return out


def test_batched_requests_each_get_their_solo_answer(llm, solo):
    engine = started(llm)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, o, loop) for p, o in zip(PROMPTS, OPTIONS)]
        for job in jobs:
            engine.submit(job)
        return await asyncio.gather(*(events_of(job) for job in jobs))

    results = asyncio.run(main())
    engine.stop()
    for prompt, options, events in zip(PROMPTS, OPTIONS, results):
        expected = solo.generate(prompt, **options)
        assert "".join(e.text for e in events[:-1]) == expected.text
        assert events[-1] == Finished(expected.finish_reason, len(prompt), len(expected.token_ids))
    metrics = engine.metrics
    assert metrics.requests["completed"] == 6 and metrics.running_requests == 0
    assert metrics.batch_size.count > 0 and metrics.batch_size.counts[0] < metrics.batch_size.count  # > 1 row
    text = metrics.render()
    assert "cullama_running_requests 0" in text and 'cullama_decode_batch_size_bucket{le="4.0"}' in text


def test_a_cancelled_request_leaves_and_the_others_finish(llm, solo):
    engine = started(llm)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, dict(max_new_tokens=40, temperature=0.0), loop) for p in PROMPTS[:3]]
        for job in jobs:
            engine.submit(job)
        first = await jobs[1].next_event()  # it runs: cancel it between two tokens
        engine.cancel(jobs[1])
        rest = await asyncio.gather(*(events_of(job) for job in jobs))
        return first, rest

    _, results = asyncio.run(main())
    engine.stop()
    assert results[1][-1] == Stopped("cancelled")
    for i in (0, 2):
        expected = solo.generate(PROMPTS[i], max_new_tokens=40)
        assert "".join(e.text for e in results[i][:-1]) == expected.text


def test_the_queue_bounds_the_requests_past_the_batch(llm):
    """max_queue 1 and max_batch 2: an idle engine takes two into its batch, one waits, the fourth is a 429."""
    engine = Engine(lambda: llm, 1, Metrics(), 2)
    engine.state = "ready"  # its thread not started: every job stays queued

    async def main():
        loop = asyncio.get_running_loop()
        for prompt in PROMPTS[:3]:
            engine.submit(Job(prompt, {}, loop))
        with pytest.raises(Busy, match="--max-queue 1"):
            engine.submit(Job(PROMPTS[3], {}, loop))

    asyncio.run(main())


def test_a_request_of_several_rows_queues_all_of_them_or_none(llm):
    """n x prompts rows (server/choices.py) count as that many requests: max_queue 2 and max_batch 2 hold 4 rows; a
    request of 3 rows goes in beside one of 1, the next of 1 is a 429 and leaves nothing queued."""
    engine = Engine(lambda: llm, 2, Metrics(), 2)
    engine.state = "ready"  # its thread not started: every job stays queued

    async def main():
        loop = asyncio.get_running_loop()
        engine.submit_all([Job(p, {}, loop) for p in PROMPTS[:3]])
        engine.submit(Job(PROMPTS[3], {}, loop))
        with pytest.raises(Busy, match="this one's 2 choices do not fit"):
            engine.submit_all([Job(p, {}, loop) for p in PROMPTS[4:6]])
        assert len(engine._waiting) == 4
        with pytest.raises(Busy):
            engine.submit(Job(PROMPTS[4], {}, loop))

    asyncio.run(main())


@pytest.mark.parametrize("bad", ["0", "65", "x"])
def test_max_batch_bad_values_are_one_line_errors(bad, tmp_path):
    out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--max-batch", bad])
    assert out.exit_code == 2
    error = [line for line in out.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and "--max-batch" in error[0], out.output


def test_max_batch_defaults_to_8_and_takes_1_to_64(tmp_path, monkeypatch):
    """`cullama serve` hands launch.serve --max-batch (8 when not given) and its bounds, 1 and 64."""
    import signal

    from cullama.server import launch

    given = []
    monkeypatch.setattr(launch, "serve", lambda model_dir, **options: given.append(options["max_batch"]) or 0)
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # serve's SIGTERM handler: not in this process
    for args in ([], ["--max-batch", "1"], ["--max-batch", "64"]):
        out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), *args])
        assert out.exit_code == 0, out.output
    assert given == [8, 1, 64]


def test_serve_checks_prefill_chunk_before_anything_loads(tmp_path):
    """launch.serve (`cullama serve`'s library side): a bad prefill_chunk or max_batch is refused before the
    directory is read."""
    from cullama.common.errors import OptionError
    from cullama.server.launch import serve

    for bad in (0, 4097, "x"):
        with pytest.raises(OptionError, match="^prefill_chunk must be an integer from 1 to 4096"):
            serve(str(tmp_path / "nothing here"), prefill_chunk=bad)
    for bad in (0, 65, "x", 2.0):
        with pytest.raises(OptionError, match="^max_batch must be an integer from 1 to 64"):
            serve(str(tmp_path / "nothing here"), max_batch=bad)


def test_stopping_ends_the_batch_and_the_queue(llm):
    """stop(): the waiting requests end at once and the running ones at their next step, all "shutdown"."""
    engine = started(llm, max_batch=2)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, dict(max_new_tokens=200, temperature=0.0, ignore_eos=True), loop) for p in PROMPTS[:4]]
        for job in jobs:
            engine.submit(job)
        await jobs[0].next_event()  # the batch runs
        engine.stop()
        return await asyncio.gather(*(events_of(job) for job in jobs))

    results = asyncio.run(main())
    assert [events[-1] for events in results] == [Stopped("shutdown")] * 4
    engine.join(30)
    assert engine.state == "stopped" and engine.metrics.running_requests == 0


def queued(llm, jobs_of, max_queue=8, max_batch=4, metrics=None) -> tuple[Engine, list]:
    """An engine whose jobs (jobs_of(loop)) are all queued before its thread starts, so that they join its batch
    in a known order (job i in slot i while slots are free); (engine, the events of each job)."""
    engine = Engine(lambda: llm, max_queue, metrics or Metrics(), max_batch)
    engine.state = "ready"

    async def main():
        jobs = jobs_of(asyncio.get_running_loop())
        for job in jobs:
            engine.submit(job)
        engine.start()
        return await asyncio.wait_for(asyncio.gather(*(events_of(job) for job in jobs)), 30)

    try:
        return engine, asyncio.run(main())
    finally:
        engine.stop()
        engine.join(30)


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, Piece))


def test_the_metrics_count_every_decode_steps_rows(llm, solo):
    """After a batched run, cullama_decode_batch_size holds one observation per batched step, of its rows: the
    histogram the same schedule gives in the library (BatchSession.last_batch per step), its sum every token but
    each request's first (that one comes from its prefill); cullama_running_requests is back to 0."""
    engine, results = queued(llm, lambda loop: [Job(p, o, loop) for p, o in zip(PROMPTS, OPTIONS)])
    session, rows = llm.batch(), []
    for prompt, options in zip(PROMPTS, OPTIONS):
        session.submit(prompt, **options)
    while not session.idle:
        session.step()
        rows.append(session.last_batch)
    expected = Metrics().batch_size
    for n in filter(None, rows):
        expected.observe(n)
    histogram = engine.metrics.batch_size
    assert (histogram.counts, histogram.count, histogram.sum) == (expected.counts, expected.count, expected.sum)
    assert histogram.sum == sum(events[-1].completion_tokens - 1 for events in results)
    assert max(rows) == 4 and histogram.counts[0] > 0  # four rows at once, and one alone at the end
    text = engine.metrics.render()
    assert "cullama_running_requests 0" in text and f"cullama_decode_batch_size_count {expected.count}" in text
    assert 'cullama_decode_batch_size_bucket{le="+Inf"} %d' % expected.count in text
    for prompt, options, events in zip(PROMPTS, OPTIONS, results):
        assert text_of(events) == solo.generate(prompt, **options).text


def test_a_full_batch_queues_then_refuses_past_max_queue(llm):
    """max_batch 2, max_queue 1, two requests running: a third waits (cullama_running_requests 2, queue depth 1), a
    fourth is a 429; once they are stopped the gauge is 0 again."""
    engine = started(llm, max_queue=1, max_batch=2)
    long = dict(max_new_tokens=300, temperature=0.0, ignore_eos=True)

    async def main():
        loop = asyncio.get_running_loop()
        running = [Job(p, long, loop) for p in PROMPTS[:2]]
        for job in running:
            engine.submit(job)
        for job in running:
            assert isinstance(await job.next_event(), Piece)  # both decode now: the batch is full
        waiting = Job(PROMPTS[2], long, loop)
        engine.submit(waiting)
        for _ in range(3):  # steps go on; it stays queued
            assert isinstance(await running[0].next_event(), Piece)
        assert waiting.state == "waiting" and all(job.state == "running" for job in running)
        text = engine.metrics.render()
        with pytest.raises(Busy, match="--max-queue 1"):
            engine.submit(Job(PROMPTS[3], long, loop))
        engine.stop()
        await asyncio.gather(*(events_of(job) for job in [*running, waiting]))
        return text

    text = asyncio.run(main())
    engine.join(30)
    assert "cullama_running_requests 2" in text and "cullama_queue_depth 1" in text
    assert engine.metrics.running_requests == 0


def test_a_client_that_goes_away_frees_its_row_at_the_next_step(llm, solo, monkeypatch):
    """A running request cancelled (its client left): every batched step that starts after the cancel decodes one
    row fewer, the request ends "cancelled", and the others get their solo answers."""
    from cullama.generation.batch import BatchSession

    cancelled, steps = threading.Event(), []
    real_step = BatchSession.step

    def step(session):
        after = cancelled.is_set()
        updates = real_step(session)
        steps.append((after, session.last_batch))
        return updates

    monkeypatch.setattr(BatchSession, "step", step)
    engine = started(llm)
    options = dict(max_new_tokens=60, temperature=0.0)

    async def main():
        loop = asyncio.get_running_loop()
        jobs = [Job(p, options, loop) for p in PROMPTS[:3]]
        for job in jobs:
            engine.submit(job)
        firsts = [await job.next_event() for job in jobs]
        while steps[-1][1] < 3:  # all three decode together
            await asyncio.sleep(0.001)
        engine.cancel(jobs[1])
        cancelled.set()
        return [[first, *rest] for first, rest in zip(firsts, await asyncio.gather(*map(events_of, jobs)))]

    results = asyncio.run(main())
    engine.stop()
    assert results[1][-1] == Stopped("cancelled")
    later = [rows for after, rows in steps if after and rows]
    assert later[0] == 2 and max(later) <= 2, steps  # from the next step on, without it (then one ends too)
    for i in (0, 2):
        assert text_of(results[i]) == solo.generate(PROMPTS[i], **options).text


def test_a_request_with_bad_options_is_refused_before_it_joins(llm, solo):
    """Options the library refuses end their job with Refused (a 400) and no text, before it takes a slot; an
    option the library does not know at all (a TypeError, not a CullamaError) fails that job alone (a 500); the
    engine goes on and the good requests get their solo answers."""
    good = [(PROMPTS[0], OPTIONS[0]), (PROMPTS[1], OPTIONS[1])]
    bad = [(PROMPTS[2], dict(temperature=-1)), ([1] * 600, {}), ([1, 10 ** 6], {}), (PROMPTS[3], dict(colour=1))]
    engine, results = queued(llm, lambda loop: [Job(p, o, loop) for p, o in [good[0], *bad, good[1]]])
    refused = [events for events in results[1:4]]
    assert [type(e[0]) for e in refused] == [Refused] * 3 and all(len(e) == 1 for e in refused)
    assert "temperature" in refused[0][0].message and "context" in refused[1][0].message
    assert "outside the vocabulary" in refused[2][0].message
    assert len(results[4]) == 1 and isinstance(results[4][0], Failed)
    for (prompt, options), events in zip(good, (results[0], results[5])):
        assert text_of(events) == solo.generate(prompt, **options).text and isinstance(events[-1], Finished)
    assert engine.metrics.requests["invalid"] == 3 and engine.metrics.requests["failed"] == 1
    assert engine.metrics.requests["completed"] == 2


def test_a_row_with_nothing_to_draw_fails_its_request_alone(llm, solo, monkeypatch):
    """A NaN logit row for one request after its third token (test_batch.poison_row): that request ends with the
    library's error (a Failed, a 500: the model's numbers, not the request, are at fault) after the text of its three
    tokens; the others decode on and get their solo answers."""
    from tests.generation.test_batch import PROMPTS as LIBRARY_PROMPTS, poison_row

    backend = llm.runner.backend
    monkeypatch.setattr(backend, "_twin", backend._twin)  # restored afterwards
    poison_row(backend, slot=1, position=9)
    prompts = LIBRARY_PROMPTS[:3]
    options = dict(max_new_tokens=10, temperature=0.0)
    engine, results = queued(llm, lambda loop: [Job(p, options, loop) for p in prompts])
    assert isinstance(results[1][-1], Failed) and "no token can be drawn" in results[1][-1].message
    assert text_of(results[1]) == solo.generate(prompts[1], max_new_tokens=3).text
    for i in (0, 2):
        assert text_of(results[i]) == solo.generate(prompts[i], **options).text
        assert results[i][-1] == Finished("length", len(prompts[i]), 10)
    assert engine.metrics.requests["failed"] == 1 and engine.metrics.requests["invalid"] == 0


def test_a_generation_with_nothing_to_draw_fails_as_a_500_one_at_a_time_too(stories_dir, solo):
    """--max-batch 1 (the engine's solo path): the same NaN row ends its request as a Failed after its three tokens,
    and the engine serves the next request. (A model of its own: one whose decode plans ran already replays them
    with the twins they were made with.)"""
    import cullama
    from tests.generation.test_batch import PROMPTS as LIBRARY_PROMPTS, poison_row

    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu")
    poison_row(llm.runner.backend, slot=0, position=9)
    prompts = [LIBRARY_PROMPTS[1], LIBRARY_PROMPTS[0]]
    options = dict(max_new_tokens=10, temperature=0.0)
    engine, results = queued(llm, lambda loop: [Job(p, options, loop) for p in prompts], max_batch=1)
    assert isinstance(results[0][-1], Failed) and "no token can be drawn" in results[0][-1].message
    assert text_of(results[0]) == solo.generate(prompts[0], max_new_tokens=3).text
    assert text_of(results[1]) == solo.generate(prompts[1], **options).text
    assert results[1][-1] == Finished("length", len(prompts[1]), 10)
    assert engine.metrics.requests["failed"] == 1 and engine.metrics.requests["invalid"] == 0


def test_a_step_that_decodes_nothing_is_no_observation(llm):
    """A request that ends after one decode step, then one that only scores its prompt (echo with logprobs: a
    prefill, no decode): cullama_decode_batch_size has the one decode step, not a second, stale one."""
    jobs = lambda loop: [Job(PROMPTS[1], dict(max_new_tokens=2, temperature=0.0), loop),  # noqa: E731
                         Job(PROMPTS[2], dict(max_new_tokens=0, prompt_logprobs=1), loop)]
    engine, results = queued(llm, jobs, max_batch=2)
    assert [type(events[-1]) for events in results] == [Finished, Finished]
    histogram = engine.metrics.batch_size
    assert (histogram.count, histogram.sum, histogram.counts[0]) == (1, 1, 1)
