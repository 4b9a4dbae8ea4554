"""The prefix cache (PlanRunner.prefix_rows): a prompt skips the whole prefill chunks a fresh prefill of it would
write alike, and only those, so its answer is the fresh one bit for bit whatever ran on the model before.

Each case runs a history on one model, then a prompt sharing part of it, and compares with a second model (the same
random weights) that runs only the prompt: the first token's logits, the K and V rows the prompt holds, and 12
sampled tokens with their log-probabilities, all bit for bit. Chunks of 8 rows, so that a prompt of a few dozen ids
spans several; the NumPy backend here, the real kernels through the fake GPU and the CPU executor in
tests/api/test_gpu_model.py's test_prefix_cache_is_a_fresh_prefill_bit_for_bit."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cullama
from cullama.model.config import preset
from cullama.runtime.sampling import SamplingParams

CHUNK = 8
CFG = dataclasses.replace(preset("tiny"), num_layers=2, max_seq_len=128, name="tiny-prefix-cache")
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=5)  # random weights: every draw depends on every bit
HISTORY = list(np.random.default_rng(7).integers(3, CFG.vocab_size, size=29))  # 3 whole chunks and 5 rows


def model(**options):
    return cullama.Llama.synthetic(CFG, device="cpu", seed=3, prefill_chunk=CHUNK, **options).runner


@pytest.fixture(scope="module")
def fresh_answers():
    """prompt (as a tuple) -> what a model that ran nothing before answers to it."""
    runner, answers = model(), {}
    runner.prefix_cache = False  # every prompt from row 0

    def answer(prompt):
        if tuple(prompt) not in answers:
            answers[tuple(prompt)] = run(runner, prompt)
        return answers[tuple(prompt)]
    return answer


def run(runner, prompt, **options) -> dict:
    """The prompt's first-token logits, its K and V rows, 12 tokens and their log-probabilities, and the rows the
    prefix cache gave."""
    tokens = [runner.start(prompt, SAMPLED, logprobs=3, **options)]
    reused = runner.reused
    logits = runner.backend.read("logits").copy()
    kv = [runner.backend.read(name)[:, 0, :, :len(prompt)].copy() for name in ("k_cache", "v_cache")]
    tokens += [runner.next() for _ in range(11)]
    records = runner.take_logprobs()
    return {"logits": logits, "kv": kv, "tokens": tokens, "reused": reused,
            "logprobs": [(r.token, r.logprob, tuple(r.top)) for r in records]}


def assert_fresh(got: dict, fresh: dict) -> None:
    assert got["tokens"] == fresh["tokens"]
    assert got["logits"].tobytes() == fresh["logits"].tobytes()
    for ours, theirs in zip(got["kv"], fresh["kv"]):
        assert ours.tobytes() == theirs.tobytes()
    assert got["logprobs"] == fresh["logprobs"]


def extend(prompt, n, seed):
    return list(prompt) + list(np.random.default_rng(seed).integers(3, CFG.vocab_size, size=n))


# (what ran before, the prompt, the rows the cache gives): `history` runs HISTORY and 11 tokens after it
CASES = {
    "a longer prompt after the history: its 3 whole chunks": (HISTORY, extend(HISTORY, 10, 1), 24),
    "a shorter prompt that diverges at 21: 2 chunks": (HISTORY, extend(HISTORY[:21], 20, 2), 16),
    "the same prompt again: all but its last, partial chunk": (HISTORY, HISTORY, 24),
    "a prompt of whole chunks again: its last chunk runs": (HISTORY[:24], HISTORY[:24], 16),
    "a prompt one row past whole chunks: they all come from the cache": (HISTORY, HISTORY[:25], 24),
    "a prompt inside the first chunk: nothing": (HISTORY, HISTORY[:7], 0),
    "another first id: nothing": (HISTORY, [2] + HISTORY[1:], 0),
    # the history's decoded tokens were written by decode steps, never by a prefill: the cache stops before them
    "the history and its answer: only the history's whole chunks": (HISTORY, None, 24),
}


@pytest.mark.parametrize("case", CASES)
def test_a_prompt_after_a_history_gets_the_fresh_answer_bit_for_bit(case, fresh_answers):
    history, prompt, reused = CASES[case]
    runner = model()
    answer = run(runner, history)
    if prompt is None:
        prompt = history + answer["tokens"] + [5, 6, 7]
    got = run(runner, prompt)
    assert got["reused"] == reused
    assert_fresh(got, fresh_answers(prompt))


def test_a_prompt_after_many_others_and_every_way_in(fresh_answers):
    """A history of every way rows get written (a reused chat turn, logits, score, a verify step, a constrained-free
    decode with a step queued ahead), each followed by the prompt: fresh each time."""
    runner, prompt = model(), extend(HISTORY, 14, 3)
    fresh = fresh_answers(prompt)
    run(runner, HISTORY)
    # reuse_cache (a chat turn) from an unaligned row: the rows it writes are not a fresh prefill's
    runner.start(extend(HISTORY[:27], 9, 4), SAMPLED, reuse=True)
    assert runner.reused == 27
    got = run(runner, prompt)
    assert got["reused"] == 24
    assert_fresh(got, fresh)
    runner.logits(HISTORY[:20])
    assert_fresh(run(runner, prompt), fresh)
    runner.score(HISTORY, top=2)
    got = run(runner, prompt)
    assert got["reused"] == 24
    assert_fresh(got, fresh)
    runner.start(HISTORY[:17], SAMPLED)
    runner.verify([9, 10, 11])
    runner.next(ahead=True)
    runner.drain()
    assert_fresh(run(runner, prompt), fresh)


def test_a_reused_turn_that_rewrites_cached_chunks_takes_them_out(fresh_answers):
    """A reuse_cache turn that leaves the history inside its whole chunks (row 10) rewrites rows 10 on in chunks
    that start there, which are no fresh prefill's: the cache then holds row 0's chunk only, whatever it held."""
    runner = model()
    run(runner, HISTORY)
    turn = extend(HISTORY[:10], 30, 6)
    runner.start(turn, SAMPLED, reuse=True)
    assert runner.reused == 10
    got = run(runner, turn + [7])
    assert got["reused"] == 8
    assert_fresh(got, fresh_answers(turn + [7]))


def test_reuse_cache_still_takes_every_row_it_holds():
    runner = model()
    run(runner, HISTORY)
    runner.start(HISTORY + [5], SAMPLED, reuse=True)
    assert runner.reused == 29


def test_prompt_logprobs_and_a_cache_turned_off_prefill_everything():
    runner = model()
    run(runner, HISTORY)
    runner.start(HISTORY, SAMPLED, prompt_logprobs=1)
    assert runner.reused == 0
    assert len(runner.prompt_logprobs) == len(HISTORY) - 1
    runner.start(HISTORY, SAMPLED)
    assert runner.reused == 24
    runner.prefix_cache = False
    runner.start(HISTORY, SAMPLED)
    assert runner.reused == 0


def test_other_prefill_kernels_forget_what_the_cache_holds():
    """Another GEMM sums in another order: rows the old kernels wrote are no fresh prefill's any more."""
    runner = model()
    run(runner, HISTORY)
    runner.start(HISTORY, SAMPLED)
    assert runner.reused == 24
    other = dataclasses.replace(runner.prefill_kernels,
                                attention="mma" if runner.prefill_kernels.attention != "mma" else "scalar")
    runner.set_prefill_kernels(other)
    runner.start(HISTORY, SAMPLED)
    assert runner.reused == 0
    runner.start(HISTORY, SAMPLED)
    assert runner.reused == 24
    runner.set_prefill_kernels(other)  # the same kernels: the cache stays
    runner.start(HISTORY, SAMPLED)
    assert runner.reused == 24


def test_an_interrupted_prefill_keeps_only_the_chunks_it_wrote(monkeypatch, fresh_answers):
    """A prefill cut short (Ctrl-C) between two chunks: the cache names the chunks written before, no more."""
    runner = model()
    run(runner, HISTORY)
    calls, real_run = [], runner.backend.run

    def interrupted(plan):
        calls.append(plan.name)
        if plan.name.startswith("prefill[8:"):
            raise KeyboardInterrupt
        real_run(plan)

    monkeypatch.setattr(runner.backend, "run", interrupted)
    other = [9] + HISTORY[1:]
    with pytest.raises(KeyboardInterrupt):
        runner.start(other, SAMPLED)
    monkeypatch.setattr(runner.backend, "run", real_run)
    assert runner.cached == other[:8]
    got = run(runner, other)
    assert got["reused"] == 8
    assert_fresh(got, fresh_answers(other))
    assert run(runner, HISTORY)["reused"] == 0  # row 0 holds another id now


def test_the_slots_of_a_batch_each_keep_their_own(fresh_answers):
    runner = cullama.Llama.synthetic(CFG, device="cpu", seed=3, prefill_chunk=CHUNK, max_batch=2).runner
    other = extend([4], 20, 5)
    runner.slot = 0
    run(runner, HISTORY)
    runner.slot = 1
    run(runner, other)
    runner.slot = 0
    got = run(runner, HISTORY + [5])
    assert got["reused"] == 24
    assert_fresh(got, fresh_answers(HISTORY + [5]))
    runner.slot = 1
    assert run(runner, HISTORY + [5])["reused"] == 0


def test_the_chunk_rule_is_what_the_cache_assumes():
    """The cache rests on a prompt running in the same chunks from a chunk boundary as from row 0, the same (start,
    rows) each: a GPU GEMM's split-K depends on the rows (prefill_kernels.split_rule), which the NumPy twins here do
    not show in their bits. A prompt that leaves the cached one at row 29 starts at 24, not 29."""
    runner = model()
    chunks = []
    real = runner._prefill_plan
    runner._prefill_plan = lambda start, n, output: chunks.append((start, n)) or real(start, n, output)
    prompt = extend(HISTORY, 12, 9)
    runner.prefix_cache = False
    runner.start(prompt, SAMPLED)
    fresh, chunks[:] = list(chunks), []
    assert fresh == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 1)]
    runner.prefix_cache = True
    runner.start(extend(HISTORY, 10, 1), SAMPLED)
    chunks[:] = []
    runner.start(prompt, SAMPLED)
    assert runner.reused == 24 and chunks == fresh[3:]
