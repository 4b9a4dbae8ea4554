"""One generation at a time per model, and work cut short: on the CPU with stories260K.

A newer generation ends an unfinished stream (its next read raises SupersededError), threads calling
generate are serialised, an abandoned stream leaves the model as fresh, and a KeyboardInterrupt at any point of
a prefill or a decode step never leaves the runner's record of the KV cache naming rows it did not write."""

import gc
import itertools
import threading

import numpy as np
import pytest

import cullama
from cullama.model import checkpoint
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.runtime.engine import PlanRunner
from cullama.runtime.load import load_checkpoint
from cullama.common.errors import SupersededError
from cullama.runtime.plan import Plan
from cullama.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def llm(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


@pytest.fixture(scope="module")
def fresh(stories_dir):
    """What each request gives on a model that did nothing before it (a model of its own per call)."""
    cache = {}

    def generate(prompt, **options):
        key = (tuple(prompt), tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = cullama.Llama.from_pretrained(stories_dir, device="cpu").generate(prompt, **options)
        return cache[key]

    return generate


def test_a_new_generation_ends_an_unfinished_stream(llm, fresh):
    stream = llm.stream([1], max_new_tokens=60)
    first = list(itertools.islice(stream, 10))
    other = llm.generate([1, 403], max_new_tokens=20)
    assert other.token_ids == fresh([1, 403], max_new_tokens=20).token_ids
    with pytest.raises(SupersededError, match="newer generation"):
        next(stream)
    result = stream.result
    assert result.finish_reason == "cancelled" and result.text == "".join(first)
    assert result.text == fresh([1], max_new_tokens=60).text[:len(result.text)]  # never spliced from the other run
    assert list(stream) == []  # ended for good


def test_two_streams_consumed_in_turn(llm, fresh):
    one, two = llm.stream([1], max_new_tokens=40), llm.stream([1, 403], max_new_tokens=40)
    assert next(one)
    second = [next(two)]  # two's first read starts it, and ends one
    with pytest.raises(SupersededError):
        next(one)
    second += list(two)
    assert "".join(second) == two.result.text == fresh([1, 403], max_new_tokens=40).text
    assert one.result.finish_reason == "cancelled"


def test_threads_calling_generate_are_serialised(llm, fresh):
    requests = [([1], {"max_new_tokens": 40}), ([1, 403], {"max_new_tokens": 40}),
                ([1, 320, 103], {"max_new_tokens": 40, "temperature": 0.8, "seed": 3}),
                ([1, 403], {"max_new_tokens": 40, "temperature": 1.0, "top_p": 0.9, "seed": 5})]
    expected = [fresh(p, **o).token_ids for p, o in requests]
    results, errors = {}, []
    start = threading.Barrier(len(requests) * 2)

    def work(i, prompt, options):
        try:
            start.wait()
            results[i] = llm.generate(prompt, **options).token_ids
        except BaseException as exc:  # noqa: BLE001 - the test reports any
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, *requests[i % len(requests)]))
               for i in range(len(requests) * 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[i] for i in range(len(threads))] == expected * 2


def test_a_stream_in_another_thread_waits_for_a_generate(llm, fresh):
    """A stream's step waits while another thread's generate holds the model, then finds itself superseded:
    a stream never reads a token of another generation."""
    stream = llm.stream([1], max_new_tokens=60)
    head = [next(stream)]
    outcome = []
    generating = threading.Event()
    real = llm.runner.next

    def slow_next(ahead=False):
        generating.set()
        return real(ahead)

    llm.runner.next = slow_next
    try:
        worker = threading.Thread(target=lambda: outcome.append(llm.generate([1, 403], max_new_tokens=30)))
        worker.start()
        generating.wait(10)
        with pytest.raises(SupersededError):
            head += list(stream)
        worker.join()
    finally:
        del llm.runner.next
    assert outcome[0].token_ids == fresh([1, 403], max_new_tokens=30).token_ids
    assert "".join(head) == stream.result.text


def test_an_abandoned_stream_leaves_the_model_as_fresh(llm, fresh):
    closed = llm.stream([1, 403], max_new_tokens=60)
    list(itertools.islice(closed, 5))
    closed.close()
    assert closed.result.finish_reason == "cancelled" and len(closed.result.token_ids) >= 5
    dropped = llm.stream([1], max_new_tokens=60, temperature=0.9, seed=1)
    list(itertools.islice(dropped, 7))
    del dropped
    gc.collect()
    assert llm.generate([1], max_new_tokens=50).token_ids == fresh([1], max_new_tokens=50).token_ids
    # and prefix reuse sees only what this model really holds
    again = llm.generate([1], max_new_tokens=50, reuse_cache=True)
    assert again.token_ids == fresh([1], max_new_tokens=50).token_ids


def test_a_stream_is_iterated_once(llm):
    stream = llm.stream([1], max_new_tokens=8)
    assert len(list(stream)) > 0 and list(stream) == [] and len(stream.result.token_ids) == 8


# -- work cut short --------------------------------------------------------------------------------
CHUNK = 4
A = [1, 320, 103, 403, 407, 261, 378, 263, 101, 278, 122]  # 11 ids: prefill chunks of 4, 4 and 3
B = [5, 17, 99, 140, 211, 263, 300, 321, 350, 400, 460, 501, 33]  # shares no prefix with A (not even BOS)


@pytest.fixture
def chunked(stories_dir):
    """stories260K with a prefill chunk of 4 rows, so that a prompt takes several passes."""
    def make():
        ckpt = checkpoint.open_checkpoint(stories_dir)
        backend = NumpyBackend()
        runner = PlanRunner(ckpt.config, backend, ckpt.config.max_seq_len, prefill_chunk=CHUNK)
        load_checkpoint(backend, ckpt)
        return cullama.Llama(ckpt.config, runner, Tokenizer(stories_dir / "tokenizer.model"), "cpu")
    return make


def interrupt_at(monkeypatch, backend, plan_prefix: str, occurrence: int, launches_done: int):
    """A KeyboardInterrupt in the `occurrence`-th run of a plan named plan_prefix..., after `launches_done` of
    its launches ran (0: before any): the way Ctrl-C cuts a plan short on the CPU."""
    real, seen = backend.run, []

    def run(plan):
        if plan.name.startswith(plan_prefix):
            seen.append(plan.name)
            if len(seen) == occurrence:
                for launch in plan.launches[:launches_done]:
                    real(Plan(plan.name, [launch]))
                raise KeyboardInterrupt
        real(plan)

    monkeypatch.setattr(backend, "run", run)
    return lambda: monkeypatch.setattr(backend, "run", real)


@pytest.mark.parametrize("occurrence,launches_done", [(1, 0), (1, 9), (2, 5), (3, 0), (3, 40)])
def test_an_interrupted_prefill_leaves_no_stale_cache_record(chunked, monkeypatch, occurrence, launches_done):
    """generate(A), then generate(B) cut short in its prefill (chunk 1, 2 or 3 of 4 rows, before or inside
    it), then generate(A, reuse_cache=True) equals a fresh run of A: the runner never still believes that
    the cache holds A."""
    llm, reference = chunked(), chunked()
    expected = reference.generate(A, max_new_tokens=20).token_ids
    llm.generate(A, max_new_tokens=20)
    restore = interrupt_at(monkeypatch, llm.runner.backend, "prefill", occurrence, launches_done)
    stream = llm.stream(B, max_new_tokens=20)
    with pytest.raises(KeyboardInterrupt):
        list(stream)
    restore()
    assert stream.result.finish_reason == "interrupted" and stream.result.token_ids == []
    assert llm.runner.cached == B[:CHUNK * (occurrence - 1)]  # only the chunks that were completely written
    assert llm.generate(A, max_new_tokens=20, reuse_cache=True).token_ids == expected


def test_an_interrupt_before_the_first_token_is_read(chunked, monkeypatch):
    llm, reference = chunked(), chunked()
    expected = reference.generate(A, max_new_tokens=20).token_ids
    llm.generate(A, max_new_tokens=20)
    monkeypatch.setattr(llm.runner.backend, "read_token", lambda *slot: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        llm.generate(B, max_new_tokens=20)
    monkeypatch.undo()
    assert llm.runner.cached == B and llm.runner.last is None  # written, but nothing to decode from
    assert llm.generate(A, max_new_tokens=20, reuse_cache=True).token_ids == expected


@pytest.mark.parametrize("step,launches_done", [(1, 0), (3, 12), (5, 27)])
def test_an_interrupted_decode_step_keeps_the_record_exact(chunked, monkeypatch, step, launches_done):
    """A decode step cut short (before or inside its plan) leaves `cached` naming exactly the rows written
    before it: B, then the tokens of the steps that finished. Continuing from there with reuse equals a run
    that stopped there on its own."""
    llm, reference = chunked(), chunked()
    full = reference.generate(B, max_new_tokens=20, ignore_eos=True).token_ids
    restore = interrupt_at(monkeypatch, llm.runner.backend, "decode", step, launches_done)
    stream = llm.stream(B, max_new_tokens=20, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        list(stream)
    restore()
    assert stream.result.finish_reason == "interrupted" and stream.result.token_ids == full[:step]
    assert llm.runner.cached == B + full[:step - 1] and llm.runner.last is None
    with pytest.raises(cullama.common.errors.PromptError, match="start"):
        llm.runner.next()  # the device state is half a step on: decoding needs a start()
    follow = B + full[:step + 2]
    reference.generate(B, max_new_tokens=step, ignore_eos=True)  # the same cache, written the same way
    assert llm.generate(follow, max_new_tokens=10, reuse_cache=True).token_ids == \
        reference.generate(follow, max_new_tokens=10, reuse_cache=True).token_ids


def test_an_interrupt_while_reading_a_decoded_token(chunked, monkeypatch):
    llm = chunked()
    full = chunked().generate(B, max_new_tokens=6, ignore_eos=True).token_ids
    calls = []
    real = llm.runner.backend.token

    def token(slot):
        calls.append(slot)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(slot)

    monkeypatch.setattr(llm.runner.backend, "token", token)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(B, max_new_tokens=6, ignore_eos=True)
    assert llm.runner.cached == B + full[:3] and llm.runner.last is None  # the third step's row is written


def test_an_interrupted_logits_call(chunked, monkeypatch):
    llm, reference = chunked(), chunked()
    expected = reference.generate(A, max_new_tokens=20).token_ids
    llm.generate(A, max_new_tokens=20)
    restore = interrupt_at(monkeypatch, llm.runner.backend, "prefill", 2, 3)
    with pytest.raises(KeyboardInterrupt):
        llm.logits(B)
    restore()
    assert llm.runner.cached == B[:CHUNK]
    np.testing.assert_array_equal(llm.logits(A), reference.logits(A))
    assert llm.generate(A, max_new_tokens=20, reuse_cache=True).token_ids == expected
