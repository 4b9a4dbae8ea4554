"""Batched decoding end to end (cullama/generation/batch.py, the runner's slots): every request gets exactly the tokens
it gets alone, greedy and seeded sampling alike, with requests joining and leaving mid-run; on the numpy backend here,
on the CUDA backend (a GPU, or the fake one: CULLAMA_FAKE_GPU=emu runs the real kernels) in test_batch_cuda_host."""

from __future__ import annotations

import numpy as np
import pytest

import cullama
from cullama.runtime import plan as plans
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.generation.batch import BatchedStream, BatchSession
from cullama.model.checkpoint import open_checkpoint
from cullama.runtime.engine import PlanRunner
from cullama.common.errors import OptionError, PromptError
from cullama.generation.generate import GenerationOptions, RunnerGuard
from cullama.runtime.sampling import NO_TOKEN, SamplingParams
from cullama.runtime.load import load_checkpoint

# Prompts of several lengths, and options that make the requests end at different steps (max_new_tokens), so
# requests join and leave while others run; more prompts than slots, so some wait for a slot and reuse one.
PROMPTS = [[1, 403, 407], [1, 29, 4, 13, 99, 250, 7], [1], [1, 500, 2, 17], [1, 77, 78], [1, 300, 301, 302, 3]]
OPTIONS = [dict(max_new_tokens=n, **o) for n, o in zip(
    (24, 9, 31, 5, 17, 12),
    (dict(), dict(temperature=0.8, top_p=0.9, seed=3), dict(temperature=1.1, top_k=20, seed=4),
     dict(repetition_penalty=1.3), dict(temperature=0.7, repetition_penalty=1.2, seed=5), dict()))]


@pytest.fixture(scope="module")
def batched(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=4)


@pytest.fixture(scope="module")
def solo(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def same(a, b) -> None:
    """The same answer (greedy requests draw a seed of their own, unused)."""
    assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)


def test_a_batch_gives_every_request_its_solo_tokens(batched, solo):
    """Six requests over four slots, mixed options: each equals its own generate() on a one-slot model."""
    session = batched.batch()
    streams = [session.submit(p, **o) for p, o in zip(PROMPTS, OPTIONS)]
    sizes = []
    while not session.idle:
        session.step()
        sizes.append(session.last_batch)
    assert max(sizes) == 4 and 1 in sizes[1:]  # four decoded together; the last ones on their own
    for stream, prompt, options in zip(streams, PROMPTS, OPTIONS):
        same(stream.result, solo.generate(prompt, **options))


def test_generate_takes_a_list_of_prompts(batched, solo):
    results = batched.generate(PROMPTS[:3], max_new_tokens=14, temperature=0.9, seed=11)
    assert [r.token_ids for r in results] == \
        [solo.generate(p, max_new_tokens=14, temperature=0.9, seed=11).token_ids for p in PROMPTS[:3]]
    assert batched.generate([1, 403], max_new_tokens=3).token_ids == solo.generate([1, 403], max_new_tokens=3).token_ids


def test_token_and_prompt_logprobs_in_a_batch(batched, solo):
    options = [dict(max_new_tokens=10, logprobs=2), dict(max_new_tokens=12, temperature=0.8, seed=2, logprobs=0,
                                                         prompt_logprobs=1)]
    session = batched.batch()
    streams = [session.submit(p, **o) for p, o in zip(PROMPTS[:2], options)]
    session.run()
    for stream, prompt, o in zip(streams, PROMPTS, options):
        alone = solo.generate(prompt, **o)
        same(stream.result, alone)
        assert stream.result.logprobs == alone.logprobs and stream.result.prompt_logprobs == alone.prompt_logprobs


def test_speculative_requests_run_alone_and_keep_their_tokens(batched, solo):
    """A speculative request (sampled: its draws differ from plain decoding's) runs alone with its verify steps."""
    spec = dict(max_new_tokens=20, temperature=0.8, seed=9, speculative="ngram", draft_tokens=3)
    session = batched.batch()
    streams = [session.submit(PROMPTS[0], max_new_tokens=8), session.submit(PROMPTS[1], **spec),
               session.submit(PROMPTS[2], max_new_tokens=6)]
    session.run()
    same(streams[1].result, solo.generate(PROMPTS[1], **spec))
    assert streams[1].result.speculative == solo.generate(PROMPTS[1], **spec).speculative
    for stream, prompt in ((streams[0], PROMPTS[0]), (streams[2], PROMPTS[2])):
        same(stream.result, solo.generate(prompt, max_new_tokens=stream.options.max_new_tokens))


def test_a_cancelled_request_frees_its_slot_and_the_others_go_on(batched, solo):
    session = batched.batch()
    streams = [session.submit(p, max_new_tokens=15) for p in PROMPTS[:5]]
    for _ in range(4):
        session.step()
    streams[1].cancel()
    session.run()
    assert streams[1].result.finish_reason == "cancelled"
    for i in (0, 2, 3, 4):
        same(streams[i].result, solo.generate(PROMPTS[i], max_new_tokens=15))


def test_a_row_with_nothing_to_draw_fails_its_request_alone(stories_dir, solo):
    """A NaN logit row for one sequence at one position (the sample twin is fed NaNs in that row only): that request
    ends with "error" after the tokens it had, the others get their solo tokens."""
    session = poisoned_session(stories_dir, solo, slots=3, position=9)
    streams = [session.submit(p, max_new_tokens=10) for p in PROMPTS[:3]]
    session.run()
    failed = streams[1].result
    assert failed.finish_reason == "error" and failed.token_ids == solo.generate(PROMPTS[1], max_new_tokens=3).token_ids
    assert "no token can be drawn" in str(streams[1].error)
    for i in (0, 2):
        assert streams[i].result.token_ids == solo.generate(PROMPTS[i], max_new_tokens=10).token_ids


def test_a_first_token_with_nothing_to_draw_fails_its_request_alone(stories_dir, solo):
    """The NaN row at a joining request's first token (its prefill's sample): it ends with "error" and no token, its
    slot goes to the next request, and every other request gets its solo tokens."""
    session = poisoned_session(stories_dir, solo, slots=2, position=6)
    streams = [session.submit(p, max_new_tokens=10) for p in PROMPTS[:3]]
    session.run()
    assert streams[1].result.finish_reason == "error" and streams[1].result.token_ids == []
    assert "no token can be drawn" in str(streams[1].error)
    for i in (0, 2):
        assert streams[i].result.token_ids == solo.generate(PROMPTS[i], max_new_tokens=10).token_ids


def poison_row(backend: NumpyBackend, slot: int, position: int) -> None:
    """The sample twin gets NaN logits in the row of `slot` the first time the slot is at `position` (its state's
    first field), and only there: that sequence has nothing to draw there (PROMPTS[1], 7 ids, in slot 1: at
    position 6 its first token, at 9 its fourth). Once only: a later request in that slot is not hit."""
    real, hit = backend._twin, []

    def twin(launch):
        fn, wants_grid = real(launch)
        if launch.spec != plans.SAMPLE:
            return fn, wants_grid

        def poisoned(logits, seen, state, fparams, embed, norm_w, x, xn, ssp, step_rows, *rest, grid):
            rows = np.asarray(step_rows).reshape(-1, 2)[:grid[0]]
            stride = logits.size // max(grid[0], 1) if logits.ndim == 1 else logits.shape[-1]
            for r, (s, _) in enumerate(rows):
                if s == slot and int(np.asarray(state).reshape(-1, 8)[s, 0]) == position and not hit:
                    logits.reshape(-1)[r * stride:(r + 1) * stride] = np.nan
                    hit.append(r)
            return fn(logits, seen, state, fparams, embed, norm_w, x, xn, ssp, step_rows, *rest, grid=grid)
        return poisoned, True

    backend._twin = twin


def test_batch_steps_equal_each_slots_solo_steps_on_the_runner(stories_dir):
    """The runner's own contract: batch_step() over set_batch(slots) gives each slot what next() gives it."""
    runner, alone = runner_on(stories_dir, slots=3), runner_on(stories_dir)
    params = [SamplingParams(seed=1), SamplingParams(temperature=0.9, seed=2), SamplingParams(temperature=1.2,
                                                                                               top_k=9, seed=3)]
    expected = []
    for prompt, p in zip(PROMPTS, params):
        expected.append([alone.start(prompt, p)] + [alone.next() for _ in range(12)])
    got = []
    for slot, (prompt, p) in enumerate(zip(PROMPTS, params)):
        runner.slot = slot
        got.append([runner.start(prompt, p)])
    runner.set_batch([2, 0, 1])  # any row order
    for _ in range(12):
        for slot, token in zip([2, 0, 1], runner.batch_step()):
            got[slot].append(token)
    assert got == expected
    assert NO_TOKEN not in sum(got, [])


LONG = [1] + [3 + (7 * i) % 500 for i in range(150)]  # 151 ids: three prefill chunks of stories260K's 64 rows


def test_a_model_loaded_for_batching_cuts_prompts_by_the_rule(batched, solo):
    """max_batch > 1: the chunk of plan.batch_prefill_chunk (64 rows for stories260K), on every path of the model;
    max_batch 1 keeps plan.PREFILL_CHUNK; prefill_chunk overrides both."""
    assert batched.runner.prefill_chunk == plans.batch_prefill_chunk(batched.layout) == 64
    assert solo.runner.prefill_chunk == plans.PREFILL_CHUNK == 256


def test_a_prompt_longer_than_the_chunk_joining_mid_run_gets_its_solo_tokens(batched, stories_dir):
    """A three-chunk prompt joins two running requests: each of the three gets its solo tokens, those of the same
    model alone and those of a one-slot model loaded with the same prefill chunk."""
    options = [dict(max_new_tokens=30, temperature=0.9, seed=4), dict(max_new_tokens=25),
               dict(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7, logprobs=1)]
    prompts = [PROMPTS[0], PROMPTS[1], LONG]
    session = batched.batch()
    streams = [session.submit(p, **o) for p, o in zip(prompts[:2], options)]
    for _ in range(3):
        session.step()
    streams.append(session.submit(LONG, **options[2]))
    session.run()
    same_chunk = cullama.Llama.from_pretrained(stories_dir, device="cpu", prefill_chunk=64)
    for stream, prompt, o in zip(streams, prompts, options):
        alone = batched.generate(prompt, **o)
        same(stream.result, alone)
        same(stream.result, same_chunk.generate(prompt, **o))
    assert streams[2].result.logprobs == batched.generate(LONG, **options[2]).logprobs


def test_a_joining_prompt_runs_one_chunk_between_two_tokens_of_the_running(batched, monkeypatch):
    """The schedule, recorded at the backend: while prompts of three chunks join (one to generate, one only
    scored), at most one prefill chunk runs between two batched steps, and the chunks are the model's own (every
    one of them: the prefix cache, which would skip those an earlier test left in the slots, is off)."""
    backend, events = batched.runner.backend, []
    monkeypatch.setattr(batched.runner, "prefix_cache", False)
    for name in ("run", "replay"):
        real = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda plan, real=real: (events.append(plan.name), real(plan))[1])
    session = batched.batch()
    running = [session.submit(p, max_new_tokens=40) for p in PROMPTS[:2]]
    session.step()
    session.step()
    joining = [session.submit(LONG, max_new_tokens=5), session.submit(LONG[:140], max_new_tokens=0,
                                                                      prompt_logprobs=1)]
    events.clear()
    while not all(s.ended for s in joining):
        session.step()
    chunks = [e for e in events if e.startswith("prefill[")]
    assert [c.split("+")[0] for c in chunks] == ["prefill[0:64]@2", "prefill[64:128]@2", "prefill[128:151]@2",
                                                 "prefill[0:64]@3", "prefill[64:128]@3", "prefill[128:140]@3"]
    between = 0
    for event in events:
        if event.startswith("batch["):
            between = 0
        elif event.startswith("prefill["):
            between += 1
            assert between == 1, events
    assert not any(s.ended for s in running)  # they ran throughout
    assert joining[1].result.prompt_logprobs == batched.logprobs(LONG[:140], 1)


def test_a_returning_conversation_finds_its_prefix_in_the_slot_it_left(stories_dir):
    """The prefix cache in a batch: a request goes to the free slot whose cache holds the most of its prompt (here
    not the lowest), skips those rows (cached_tokens), and gets its solo answer; a new prompt takes the slot idle the
    longest, leaving the others' caches alone."""
    model = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=3)
    fresh = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=3)
    fresh.runner.prefix_cache = False
    session = model.batch()
    taken, slot_for = [], session._slot_for
    session._slot_for = lambda stream: taken.append(slot_for(stream)) or taken[-1]
    first = [session.submit(p, max_new_tokens=4) for p in (PROMPTS[0], LONG, PROMPTS[1])]
    session.run()
    assert taken == [0, 1, 2]  # (the first one's slot is free again when the third comes: slots never taken first)
    assert [s.slot for s in first] == [None] * 3 and [s.result.cached_tokens for s in first] == [0, 0, 0]
    slots = [model.runner.prefix_rows(LONG + [9], s) for s in range(3)]
    assert slots == [0, 128, 0]  # LONG's two whole chunks of 64, in the second slot
    options = dict(max_new_tokens=20, temperature=0.9, seed=11)
    back = session.submit(LONG + [9, 10], **options)
    other = session.submit([1, 250, 251], max_new_tokens=3)
    session.run()
    assert taken[3:] == [1, 0]  # `other`: the slot idle the longest (the first request's), not the third's
    assert back.result.cached_tokens == 128 and other.result.cached_tokens == 0
    same(back.result, fresh.generate(LONG + [9, 10], **options))
    session.submit([1, 300, 301], max_new_tokens=2)
    session.run()
    assert taken[5] == 2  # idle the longest now: the third's (slot 0 was just taken by `other`, 1 by `back`)


def test_max_batch_is_checked_before_anything_loads(stories_dir):
    for bad in (0, 65, "x", 2.0, True):
        with pytest.raises(OptionError, match="^max_batch must be an integer from 1 to 64"):
            cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=bad)
    for bad in (0, 4097, "64", 64.0, True):
        with pytest.raises(OptionError, match="^prefill_chunk must be an integer from 1 to 4096"):
            cullama.Llama.from_pretrained(stories_dir, device="cpu", prefill_chunk=bad)
        with pytest.raises(OptionError, match="^prefill_chunk must be an integer from 1 to 4096"):
            cullama.Llama.synthetic("tiny", device="cpu", max_batch=2, prefill_chunk=bad)


def test_the_memory_check_counts_every_slot_and_says_how_many_fit(stories_dir, monkeypatch):
    from cullama.runtime import memory
    from cullama.common.errors import ResourceError

    cfg = open_checkpoint(stories_dir).config
    buffers = plans.runtime_buffers(cfg, cfg.max_seq_len, slots=3)
    kv = sum(b.nbytes for b in buffers if b.kind == "cache") // 3  # one sequence's K and V
    rest = sum(b.nbytes for b in buffers) - 3 * kv
    monkeypatch.setattr(memory, "free_bytes", lambda device: (rest + kv * 5 // 2, "the CPU has"))  # 2 fit, not 3
    assert runner_on(stories_dir, slots=2).slots == 2
    with pytest.raises(ResourceError) as refused:
        runner_on(stories_dir, slots=3)
    message = str(refused.value)
    assert f"KV cache {memory.gib(3 * kv)}" in message and "--max-batch" in message
    assert f"{memory.gib(kv)} each; 2 fit beside the weights" in message, message


def test_set_batch_refuses_a_slot_with_nothing_to_decode(stories_dir):
    runner = runner_on(stories_dir, slots=2)
    with pytest.raises(PromptError, match="slot 1 has nothing to decode from"):
        runner.set_batch([1])


def runner_on(directory, slots=1) -> PlanRunner:
    ckpt = open_checkpoint(directory)
    backend = NumpyBackend()
    runner = PlanRunner(ckpt.config, backend, ckpt.config.max_seq_len, slots=slots)
    load_checkpoint(backend, ckpt)
    return runner


def poisoned_session(directory, solo, slots: int, position: int) -> BatchSession:
    """A session on a bare runner of `slots` slots whose slot 1 has nothing to draw at `position` (poison_row)."""
    runner = runner_on(directory, slots=slots)
    poison_row(runner.backend, slot=1, position=position)
    guard = RunnerGuard()
    return BatchSession(runner, guard, stream_maker(runner, guard, solo.eos_ids))


def stream_maker(runner, guard, eos_ids):
    """BatchSession's make_stream for a bare runner: id prompts, no tokenizer."""
    def make(prompt, **options):
        return BatchedStream(runner, None, list(prompt), GenerationOptions.checked(**options), eos_ids, guard)
    return make


def test_each_row_stops_at_its_own_stop_strings(batched, solo):
    """Stop strings are each request's own: three requests stop on different strings at different steps (they
    leave the batch then), one runs to its limit; each equals its solo generation, the matched string too."""
    options = [dict(max_new_tokens=30, stop=["park"]), dict(max_new_tokens=30, temperature=0.8, seed=3, stop=["boy"]),
               dict(max_new_tokens=30, stop=["Lily", "girl"]), dict(max_new_tokens=20)]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3]]
    session = batched.batch()
    streams = [session.submit(p, **o) for p, o in zip(prompts, options)]
    session.run()
    reasons = []
    for stream, prompt, o in zip(streams, prompts, options):
        alone = solo.generate(prompt, **o)
        same(stream.result, alone)
        assert stream.result.stop_string == alone.stop_string
        reasons.append(stream.result.finish_reason)
    assert reasons[:3] == ["stop"] * 3 and [s.result.stop_string for s in streams[:3]] == ["park", "boy", "girl"]


def test_a_request_with_bad_options_is_refused_before_it_joins(batched, solo):
    """submit() checks a request's options and prompt before it queues: a bad one raises there, nothing of it
    enters the session, and the running requests go on with their solo tokens."""
    session = batched.batch()
    good = [session.submit(p, max_new_tokens=12) for p in PROMPTS[:2]]
    session.step()
    held = (list(session.pending), session.joining, list(session.running))
    bad = [([1, 10 ** 6], {}, PromptError, "outside the vocabulary"), ([], {}, PromptError, "empty"),
           ([1] * 512, {}, PromptError, "does not fit in the context"),
           (PROMPTS[2], dict(temperature=-1), OptionError, "^temperature"),
           (PROMPTS[2], dict(top_k="3"), OptionError, "^top_k"), (PROMPTS[2], dict(logprobs=99), OptionError,
                                                                   "^logprobs"),
           (PROMPTS[2], dict(speculative="nope"), OptionError, "^speculative")]
    for prompt, options, error, words in bad:
        with pytest.raises(error, match=words):
            session.submit(prompt, **options)
        assert (list(session.pending), session.joining, list(session.running)) == held
    session.run()
    for stream, prompt in zip(good, PROMPTS):
        same(stream.result, solo.generate(prompt, max_new_tokens=12))


def test_generate_checks_every_prompt_before_any_runs(batched, monkeypatch):
    """Llama.generate(list): one bad prompt (the last) is refused before the model computes anything."""
    def no_prefill(*args, **kwargs):
        raise AssertionError("a prompt was prefilled before every prompt was checked")
    monkeypatch.setattr(batched.runner, "begin", no_prefill)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        batched.generate([PROMPTS[0], PROMPTS[1], [1, 512]], max_new_tokens=5)


def test_a_cancelled_request_leaves_at_the_next_step_and_its_slot_is_reused(batched, solo):
    """Cancelled between two steps, a running request ends at the next step with the tokens it had: that step
    decodes one row fewer, its slot is free, and the next request to come takes it."""
    session = batched.batch()
    streams = [session.submit(p, max_new_tokens=30) for p in PROMPTS[:4]]
    while session.last_batch < 4:
        session.step()
    had, slot = list(streams[2].token_ids), streams[2].slot
    streams[2].cancel()
    updates = session.step()
    assert session.last_batch == 3 and slot in session.free
    assert [u.done for u in updates if u.stream is streams[2]] == [True]
    assert streams[2].result.finish_reason == "cancelled" and streams[2].result.token_ids == had
    late = session.submit(PROMPTS[4], max_new_tokens=8)
    session.step()
    assert late.slot == slot and session.last_batch == 4
    session.cancel(streams[0])  # the owner's side: at once, not at the next step
    assert streams[0].result.finish_reason == "cancelled" and streams[0].slot is None and 0 in session.free
    session.run()
    for stream, prompt in ((streams[1], PROMPTS[1]), (streams[3], PROMPTS[3]), (late, PROMPTS[4])):
        same(stream.result, solo.generate(prompt, max_new_tokens=stream.options.max_new_tokens))


NEAR_END = [1] + [3 + (5 * i) % 500 for i in range(508)]  # 509 ids of stories260K's 512 context: 3 tokens fit


def test_requests_at_the_edges_of_their_budget(batched):
    """A prompt three tokens short of the context (its budget is the context's end, not max_new_tokens), one with
    nothing to generate (max_new_tokens=0: it ends at once, no slot kept), and one of a single token that also
    scores its prompt: each equals its solo generation (on the same model: its prefill chunk), beside a request that
    runs throughout."""
    cases = [(PROMPTS[0], dict(max_new_tokens=20)), (NEAR_END, dict(max_new_tokens=10)),
             (PROMPTS[1], dict(max_new_tokens=0)), (PROMPTS[3], dict(max_new_tokens=1, prompt_logprobs=1))]
    session = batched.batch()
    streams = [session.submit(p, **o) for p, o in cases]
    session.run()
    for stream, (prompt, options) in zip(streams, cases):
        alone = batched.generate(prompt, **options)
        same(stream.result, alone)
        assert stream.result.prompt_logprobs == alone.prompt_logprobs
    assert len(streams[1].result.token_ids) == 3 and streams[2].result.token_ids == []
    assert len(streams[3].result.token_ids) == 1 and streams[3].result.prompt_logprobs[1] is not None


def test_last_batch_is_the_rows_this_step_decoded(batched):
    """session.last_batch (what the server's cullama_decode_batch_size observes after each step) is 0 after a step
    that decoded nothing: one that only scored a prompt, or only ended a cancelled request."""
    session = batched.batch()
    session.submit(PROMPTS[0], max_new_tokens=2)
    session.step()  # its prefill (the first token) and one decode step (the second): it ends
    assert session.idle and session.last_batch == 1
    scored = session.submit(PROMPTS[1], max_new_tokens=0, prompt_logprobs=1)
    session.step()
    assert scored.ended and session.last_batch == 0
    running = session.submit(PROMPTS[2], max_new_tokens=9)
    session.step()
    assert session.last_batch == 1
    running.cancel()
    session.step()
    assert running.ended and session.last_batch == 0


def test_cancelled_while_joining_or_waiting(batched, solo):
    """A request cancelled between two chunks of its prompt leaves with its slot freed and its prefill dropped (the
    next request joins into that slot at once); one cancelled while it waits for a slot never takes one; the running
    ones and the one that joined keep their solo tokens."""
    session = batched.batch()
    running = [session.submit(p, max_new_tokens=20) for p in PROMPTS[:3]]
    while session.last_batch < 3:
        session.step()
    joining = session.submit(LONG, max_new_tokens=5)
    session.step()  # its first chunk of three
    assert session.joining is joining and joining.slot == 3
    waiting = [session.submit(PROMPTS[3], max_new_tokens=6), session.submit(PROMPTS[4], max_new_tokens=7)]
    assert session.holding == 3 + 1 + 2  # running, joining, waiting: what the server counts against --max-batch
    joining.cancel()
    session.step()
    assert joining.result.finish_reason == "cancelled" and joining.result.token_ids == [] and joining.slot is None
    assert session.joining is None and waiting[0].slot == 3 and session.last_batch == 4  # it joined in one chunk
    waiting[1].cancel()
    session.step()
    assert waiting[1].result.finish_reason == "cancelled" and waiting[1].slot is None and not session.pending
    session.run()
    for stream, prompt in zip(running + waiting[:1], PROMPTS[:4]):
        same(stream.result, solo.generate(prompt, max_new_tokens=stream.options.max_new_tokens))


def test_a_solo_generation_ends_the_session(batched, solo):
    """A solo generation on the same model meanwhile takes the model (RunnerGuard): the session's next step ends
    every request of it, "cancelled" with the tokens it had, and the solo generation gets its own tokens."""
    session = batched.batch()
    streams = [session.submit(p, max_new_tokens=20) for p in PROMPTS[:3]]
    for _ in range(4):
        session.step()
    had = [list(s.token_ids) for s in streams]
    assert batched.generate(PROMPTS[4], max_new_tokens=9).token_ids == \
        solo.generate(PROMPTS[4], max_new_tokens=9).token_ids
    updates = session.step()
    assert sorted(id(u.stream) for u in updates) == sorted(map(id, streams)) and all(u.done for u in updates)
    assert [s.result.finish_reason for s in streams] == ["cancelled"] * 3 and session.idle
    assert [s.result.token_ids for s in streams] == had


def test_a_speculative_request_near_the_context_end(batched):
    """Its verify steps draft no further than its budget (7 tokens: the context's end) allows: its tokens and its
    drafting statistics are those of its solo stream."""
    spec = dict(max_new_tokens=10, speculative="ngram", draft_tokens=3)
    prompt = ([1, 403, 407, 261, 378] * 101)[:505]  # "Once upon a time" over and over: the drafter proposes to the end
    session = batched.batch()
    stream = session.submit(prompt, **spec)
    session.run()
    alone = batched.generate(prompt, **spec)
    same(stream.result, alone)
    assert stream.result.speculative == alone.speculative and alone.speculative["drafted"] > 0


def test_a_request_with_nothing_to_generate_is_not_prefilled(batched, monkeypatch):
    """max_new_tokens=0 (no prompt_logprobs): it ends in the step that admits it, with no prefill, and its slot is
    free again at once."""
    prefills, begin = [], batched.runner.begin
    monkeypatch.setattr(batched.runner, "begin", lambda *args, **kw: (prefills.append(args), begin(*args, **kw))[1])
    session = batched.batch()
    stream = session.submit(PROMPTS[1], max_new_tokens=0)
    session.step()
    assert stream.result.finish_reason == "length" and stream.result.token_ids == [] and prefills == []
    assert session.idle and session.free == [0, 1, 2, 3]


def test_a_batch_past_one_group_of_rows(stories_dir, solo):
    """More sequences than a GEMV takes rows (plan.VERIFY_ROWS, 16): a batched step runs in groups (plan.batch_groups),
    each with its own rows table, ids and log-probability rows; every request still gets its solo tokens and
    log-probabilities."""
    wide = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=plans.VERIFY_ROWS + 2)
    prompts = [[1, 3 + (37 * i) % 500, 3 + (91 * i) % 500][:2 + i % 2] for i in range(plans.VERIFY_ROWS + 2)]
    options = dict(max_new_tokens=plans.VERIFY_ROWS + 8, temperature=0.9, seed=5, logprobs=1)  # all run at once
    session = wide.batch()
    streams = [session.submit(p, **options) for p in prompts]
    sizes = []
    while not session.idle:
        session.step()
        sizes.append(session.last_batch)
    assert max(sizes) == plans.VERIFY_ROWS + 2 and plans.batch_groups(max(sizes)) == 2
    for stream, prompt in zip(streams, prompts):
        alone = solo.generate(prompt, **options)
        same(stream.result, alone)
        assert stream.result.logprobs == alone.logprobs
