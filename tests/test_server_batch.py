"""The server's engine with --max-batch > 1 (in this process, on the numpy backend): requests decode together in a
batch session and each gets its solo answer; a cancelled one frees its row and the others go on; the queue bounds
the requests waiting past the batch; /metrics counts the rows of each decode step and the running requests; and
--max-batch's bad values are one-line errors."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

from click.testing import CliRunner  # noqa: E402

from cullama.cli.main import main  # noqa: E402
from cullama.server.engine import Busy, Engine, Finished, Job, Piece, Stopped  # noqa: E402
from cullama.server.metrics import Metrics  # noqa: E402

PROMPTS = [[1], [1, 403], [1, 403, 407], [1, 29, 4], [1, 500, 2, 17], [1, 77]]
OPTIONS = [dict(max_new_tokens=n, temperature=t, seed=s) for n, t, s in
           ((12, 0.0, 0), (7, 0.8, 1), (15, 1.0, 2), (4, 0.0, 0), (10, 0.6, 3), (9, 0.0, 0))]


@pytest.fixture(scope="module")
def llm(stories_dir):
    import cullama

    return cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=4)


@pytest.fixture(scope="module")
def solo(stories_dir):
    import cullama

    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


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


@pytest.mark.parametrize("bad", ["0", "65", "x"])
def test_max_batch_bad_values_are_one_line_errors(bad, tmp_path):
    out = CliRunner().invoke(main, ["serve", "--model", str(tmp_path), "--max-batch", bad])
    assert out.exit_code == 2
    error = [line for line in out.output.splitlines() if line.startswith("Error")]
    assert len(error) == 1 and "--max-batch" in error[0], out.output


def test_serve_checks_prefill_chunk_before_anything_loads(tmp_path):
    """launch.serve (`cullama serve`'s library side): a bad prefill_chunk is refused before the directory is read."""
    from cullama.errors import OptionError
    from cullama.server.launch import serve

    for bad in (0, 4097, "x"):
        with pytest.raises(OptionError, match="^prefill_chunk must be an integer from 1 to 4096"):
            serve(str(tmp_path / "nothing here"), prefill_chunk=bad)


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
