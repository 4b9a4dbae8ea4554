"""Speculative decoding end to end on the CPU: greedy output token for token the same as plain decoding
(stories260K's documented ids, the golden checkpoints), bursts cut by EOS, stop strings and max_new_tokens,
the context limit, the verify step's contract, statistics, timings and option errors."""

import dataclasses

import numpy as np
import pytest

import cullama
from cullama.generation import speculative
from cullama.generation.drafters import PromptLookup, Replay
from cullama.common.errors import PromptError
from cullama.runtime.sampling import SamplingParams
from cullama.generation.speculative import DraftLength, SpeculativeDecoder, verify_step
from tests.conftest import load_golden

GREEDY = SamplingParams(temperature=0.0, seed=0)


@pytest.fixture(scope="module")
def stories(stories_dir):
    """stories260K with itself as its draft model."""
    return cullama.Llama.from_pretrained(stories_dir, device="cpu", draft_model=stories_dir)


def with_eos(llm, eos):
    """The same model, ending generations at token `eos`."""
    other = cullama.Llama(dataclasses.replace(llm.config, eos_token_ids=(eos,)), llm.runner, llm.tokenizer,
                          llm.device, draft=llm.draft)
    return other


# -- the verify step's contract (the runner's own verify where it has one, else the stand-in) ------
@pytest.mark.parametrize("k,wrong_at", [(0, None), (1, None), (4, None), (8, None), (4, 0), (4, 2), (8, 7)])
def test_verify_returns_what_plain_steps_return(stories, stories_expected, k, wrong_at):
    expected = stories_expected["ids"]
    runner = stories.runner
    verify, max_draft = verify_step(runner)
    assert runner.start([1, *expected[:9]], GREEDY) == expected[9]
    drafts = expected[10:10 + k]
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % stories.config.vocab_size
    assert max_draft() == speculative.MAX_DRAFT
    accepted = verify(drafts)
    n = k + 1 if wrong_at is None else wrong_at + 1
    assert accepted == expected[10:10 + n]  # the accepted drafts, then the target's own token
    assert runner.cached == [1, *expected[:9 + n]] and runner.last == accepted[-1]
    assert runner.next() == expected[10 + n]  # the state is as if plain steps had produced them


@pytest.mark.parametrize("drafts_from", ["greedy", "wrong at 3", "ngram"])
def test_the_batched_verify_equals_the_sequential_reference(stories_dir, stories_expected, drafts_from):
    """PlanRunner.verify (one pass) against speculative.sequential_verify (plain steps), step after step:
    the same tokens, the same cached ids, the same next input."""
    expected = stories_expected["ids"]
    batched, reference = (cullama.Llama.from_pretrained(stories_dir, device="cpu").runner for _ in range(2))
    assert hasattr(batched, "verify")
    prompt = [1, *expected[:20]]
    assert batched.start(prompt, GREEDY) == reference.start(prompt, GREEDY)
    lookup = PromptLookup()
    lookup.reset(prompt + [batched.last])
    for step in range(12):
        k = min(1 + step % 8, batched.max_draft())
        done = len(batched.cached) - 20
        if drafts_from == "ngram":
            drafts = lookup.propose(k)
        else:
            drafts = expected[done + 1:done + 1 + k]
            if drafts_from == "wrong at 3" and len(drafts) > 3:
                drafts[3] = (drafts[3] + 7) % 512
        accepted = batched.verify(drafts)
        assert accepted == speculative.sequential_verify(reference, drafts), step
        assert batched.cached == reference.cached and batched.last == reference.last
        lookup.extend(accepted)
    assert batched.cached == [1, *expected[:len(batched.cached) - 1]]


def test_max_draft_shrinks_at_the_end_of_the_context(stories_dir, stories_expected):
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=16)
    verify, max_draft = verify_step(llm.runner)
    llm.runner.start([1, *stories_expected["ids"][:11]], GREEDY)  # 12 ids cached, 4 rows left
    assert max_draft() == 3  # rows [last, d1, d2, d3] at positions 12..15
    assert verify(stories_expected["ids"][12:15]) == stories_expected["ids"][12:16]
    assert max_draft() == 0  # a full context but for `last`'s own row
    llm.runner.start([1, *stories_expected["ids"][:14]], GREEDY)
    assert max_draft() == 0


# -- greedy output equals plain decoding --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stories260k_greedy_ids_from_bos(stories, stories_expected, method, k):
    result = stories.generate("", max_new_tokens=256, speculative=method, draft_tokens=k)
    assert result.token_ids == stories_expected["ids"] and result.text == stories_expected["text"]
    stats = result.speculative
    assert stats["method"] == method and stats["k"] == k
    assert stats["accepted"] + stats["steps"] == 255  # every token after the prefill's came from a verify step
    if method == "draft":  # stories260K drafting for itself: every draft is accepted
        assert stats["accepted"] == stats["drafted"] and stats["tokens_per_step"] > k
    else:
        assert 0 < stats["accepted"] < stats["drafted"]


def repeated(prompt):
    """The prompt with its text (after BOS) twice more: lookups find it."""
    return prompt + prompt[1:] * 2


@pytest.mark.parametrize("repeat", [False, True], ids=["once", "repeated"])
def test_golden_greedy_ids_equal_plain_greedy(golden, repeat):
    directory, cases, _ = golden
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    for case in cases:
        prompt = repeated(case["prompt_ids"]) if repeat else case["prompt_ids"]
        plain = llm.generate(prompt, max_new_tokens=40, ignore_eos=True)
        for k in (1, 3, 8):
            spec = llm.generate(prompt, max_new_tokens=40, ignore_eos=True, speculative="ngram", draft_tokens=k)
            assert spec.token_ids == plain.token_ids, (case["prompt_ids"][:4], k)
            if repeat:
                assert spec.speculative["accepted"] > 0  # the repeated text was found and some drafts hit


def test_golden_drafts_that_always_miss(golden):
    directory, cases, _ = golden
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    case = cases[0]
    plain = llm.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True)
    wrong = Replay([(t + 1) % llm.config.vocab_size for t in plain.token_ids])
    spec = llm.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True, speculative=wrong, draft_tokens=4)
    assert spec.token_ids == plain.token_ids
    assert spec.speculative["accepted"] == 0 and spec.speculative["drafted"] > 0 and spec.speculative["steps"] == 23


def test_reused_cache_and_sampling(stories):
    first = stories.generate([1, 403, 407], max_new_tokens=30, speculative="draft", reuse_cache=True)
    again = stories.generate([1, 403, 407, *first.token_ids[:5]], max_new_tokens=20, speculative="draft",
                             reuse_cache=True)
    assert again.token_ids == first.token_ids[5:25]
    options = dict(max_new_tokens=40, temperature=0.9, top_p=0.9, seed=3)
    a, b = (stories.generate([1], speculative="ngram", **options) for _ in range(2))
    assert a.token_ids == b.token_ids  # seeded and replayable
    assert stories.generate([1], speculative="ngram", **{**options, "seed": 4}).token_ids != a.token_ids


# -- bursts cut short ---------------------------------------------------------------------------------
def burst_positions(k, n):
    """Token i's place in its burst when every one of k drafts is accepted: token 0 is the prefill's."""
    return [None] + [(i - 1) % (k + 1) for i in range(1, n)]


def test_eos_inside_a_burst_ends_the_text_there(stories, stories_expected):
    expected = stories_expected["ids"]
    places = burst_positions(8, len(expected))
    at = next(i for i in range(12, len(expected)) if expected[i] not in expected[:i] and 3 <= places[i] <= 6)
    llm = with_eos(stories, expected[at])
    stream = llm.stream("", max_new_tokens=100, speculative=Replay(expected), draft_tokens=8)
    text = "".join(stream)
    result = stream.result
    plain = llm.generate("", max_new_tokens=100)
    assert result.finish_reason == plain.finish_reason == "eos"
    assert result.token_ids == plain.token_ids == expected[:at] and text == result.text == plain.text
    assert stream.decoder.produced > at + 1  # the burst held tokens after the EOS: dropped
    assert len(result.timings.token_s) == at  # the EOS's arrival counts, as in plain decoding
    # the statistics count what the generation used (the fourth sweep: the dropped tokens counted, 9.0 a step)
    stats = result.speculative
    assert stats["unused"] == stream.decoder.produced - (at + 1) > 0
    assert stats["tokens_per_step"] == at / stats["steps"]  # the EOS and the tokens before it, past the first


def test_stop_string_inside_a_burst_ends_the_text_there(stories, stories_expected):
    stop = "red ball"
    plain = stories.generate("", max_new_tokens=100, stop=[stop])
    stream = stories.stream("", max_new_tokens=100, stop=[stop], speculative=Replay(stories_expected["ids"]),
                            draft_tokens=8)
    pieces = list(stream)
    result = stream.result
    assert result.finish_reason == plain.finish_reason == "stop"
    assert result.text == plain.text == "".join(pieces) and result.text.endswith("a big, ")
    assert result.token_ids == plain.token_ids
    assert burst_positions(8, 100)[len(result.token_ids) - 1] not in (None, 8)  # not a burst's first or last
    assert stream.decoder.produced > len(result.token_ids)
    stats = result.speculative
    assert stats["unused"] == stream.decoder.produced - len(result.token_ids) > 0
    assert stats["tokens_per_step"] == (len(result.token_ids) - 1) / stats["steps"]


@pytest.mark.parametrize("budget", [1, 2, 9, 10, 13, 17])
def test_max_new_tokens_is_never_exceeded(stories, stories_expected, budget):
    expected = stories_expected["ids"]
    stream = stories.stream("", max_new_tokens=budget, speculative=Replay(expected), draft_tokens=8)
    text = "".join(stream)
    assert stream.result.token_ids == expected[:budget] and stream.result.finish_reason == "length"
    assert stream.decoder.produced == budget  # nothing computed past the budget: k shrank in the last step
    assert stories.runner.cached == [1, *expected[:budget - 1]]
    assert text == stories.tokenizer.decode(expected[:budget])
    stats = stream.result.speculative
    assert stats["steps"] == (budget - 1 + 8) // 9 and stats["accepted"] == stats["drafted"] == budget - 1 - stats["steps"]


@pytest.mark.parametrize("method", ["ngram", "draft", "replay"])
def test_prompts_near_the_context_limit(stories_dir, stories_expected, method):
    expected = stories_expected["ids"]
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=24, draft_model=stories_dir)
    verify, max_draft = verify_step(llm.runner)
    calls = []

    def recording_verify(drafts):  # k + 1 rows must fit: shrink k, never overflow
        calls.append((len(drafts), llm.runner.max_seq_len - len(llm.runner.cached) - 1))
        return verify(drafts)

    llm.runner.verify, llm.runner.max_draft = recording_verify, max_draft
    try:
        for prompt_len in (15, 19, 22, 23):
            prompt = [1, *expected[:prompt_len - 1]]
            drafter = Replay(expected[prompt_len - 1:]) if method == "replay" else method
            spec = llm.generate(prompt, max_new_tokens=50, speculative=drafter, draft_tokens=8)
            assert spec.token_ids == expected[prompt_len - 1:23] and spec.finish_reason == "length"
            assert len(llm.runner.cached) <= 24
    finally:
        del llm.runner.verify, llm.runner.max_draft
    assert calls and all(0 <= k <= room for k, room in calls)
    # the generation's budget ends at the context: its last token needs no cache row, so k stops one short
    assert any(k == room - 1 < 7 for k, room in calls) or method == "ngram"


# -- statistics, timings, adaptive k --------------------------------------------------------------------
def test_statistics_and_timings(stories, stories_expected):
    result = stories.generate("", max_new_tokens=40, speculative=Replay(stories_expected["ids"]), draft_tokens=4)
    assert result.speculative == {"method": "replay", "k": 4, "adaptive": False, "steps": 8, "drafted": 31,
                                  "accepted": 31, "acceptance": 1.0, "unused": 0, "tokens_per_step": 39 / 8}
    assert result.to_dict()["speculative"] == result.speculative
    token_s = result.timings.token_s
    assert len(token_s) == 39 and result.timings.prefill_s > 0
    step_gaps, burst_gaps = token_s[0::5], [t for i, t in enumerate(token_s) if i % 5]
    assert min(step_gaps) > max(burst_gaps)  # a burst's first token waits for the step, the rest arrive with it
    assert "speculative" not in stories.generate("", max_new_tokens=3).to_dict()


def test_adaptive_draft_length():
    length = DraftLength(4, adaptive=True)
    top = speculative.MAX_DRAFT
    grows = [(k, k, k + 1) for k in range(4, top)]  # every draft accepted: one more, up to MAX_DRAFT
    for drafted, accepted, k in grows + [(top, top, top), (top, 3, top), (top, 0, top - 1), (0, 0, top - 1),
                                         (top - 1, 0, top - 2)]:
        length.update(drafted, accepted)
        assert length.k == k
    for _ in range(2 * top):
        length.update(length.k, 0)
    assert length.k == 1
    fixed = DraftLength(3)
    fixed.update(3, 3)
    fixed.update(3, 0)
    assert fixed.k == 3


def test_adaptive_generation_grows_k(stories, stories_expected):
    stream = stories.stream("", max_new_tokens=60, speculative=Replay(stories_expected["ids"]), draft_tokens=2,
                            adaptive_draft=True)
    list(stream)
    assert stream.result.token_ids == stories_expected["ids"][:60]
    assert stream.decoder.length.k == 11 and stream.result.speculative["adaptive"] is True  # 2, 3, .. 11: 63 tokens
    assert stream.result.speculative["k"] == 2


# -- options ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options,needle", [
    ({"speculative": "bogus"}, "speculative must be one of 'ngram', 'draft'"),
    ({"speculative": 3}, "speculative must be one of"),
    ({"speculative": "ngram", "draft_tokens": 0}, "draft_tokens must be an integer from 1 to 15"),
    ({"speculative": "ngram", "draft_tokens": 16}, "draft_tokens must be an integer from 1 to 15"),
    ({"speculative": "ngram", "draft_tokens": 2.0}, "draft_tokens"),
    ({"speculative": "ngram", "draft_tokens": True}, "draft_tokens"),
    ({"speculative": "ngram", "adaptive_draft": "yes"}, "adaptive_draft"),
    ({"draft_tokens": 4}, "draft_tokens needs speculative decoding"),
    ({"adaptive_draft": True}, "adaptive_draft needs speculative decoding"),
])
def test_bad_options_are_prompt_errors(stories, options, needle):
    with pytest.raises(PromptError, match=needle):
        stories.generate([1], max_new_tokens=4, **options)


def test_adaptive_draft_takes_the_boolean_types_ignore_eos_takes(stories):
    plain = stories.generate([1], max_new_tokens=6, ignore_eos=np.True_)
    spec = stories.generate([1], max_new_tokens=6, ignore_eos=np.True_, speculative="ngram", adaptive_draft=np.True_)
    assert spec.token_ids == plain.token_ids and spec.speculative["adaptive"] is True
    assert stories.generate([1], max_new_tokens=2, adaptive_draft=np.False_).speculative is None
    for value in (1, "yes", None):
        for option in ("ignore_eos", "adaptive_draft"):
            with pytest.raises(PromptError, match=f"{option} must be True or False"):
                stories.generate([1], max_new_tokens=2, speculative="ngram", **{option: value})


def test_draft_needs_a_draft_model(stories_dir):
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu")
    with pytest.raises(PromptError, match="needs a draft model"):
        llm.generate([1], speculative="draft")


def test_a_draft_outside_the_vocabulary_is_refused(stories):
    with pytest.raises(PromptError, match=r"draft token id 512 is outside the vocabulary \[0, 512\)"):
        stories.generate([1], max_new_tokens=10, speculative=Replay([403, 512, 3]))


def test_decoder_on_its_own(stories, stories_expected):
    """The bench drives SpeculativeDecoder directly: start, then whole bursts."""
    expected = stories_expected["ids"]
    decoder = SpeculativeDecoder(stories.runner, PromptLookup(), DraftLength(4))
    assert decoder.start([1, *expected[:99]], GREEDY) == expected[99]
    out = []
    while decoder.produced < 60:
        burst = decoder.step(60)
        assert 1 <= len(burst) <= 5
        out += burst
    assert out == expected[100:159] and decoder.produced == 60
    assert decoder.stats.steps == decoder.stats.to_dict()["steps"] and speculative.MAX_DRAFT == 15


def test_one_generation_at_a_time(stories, stories_expected):
    """A newer generation ends a speculative stream mid-burst, as it ends a plain one; the model stays usable."""
    from cullama.common.errors import SupersededError

    expected = stories_expected["ids"]
    stream = stories.stream("", max_new_tokens=60, speculative=Replay(expected), draft_tokens=8)
    first = next(stream)
    while not stream.decoder._burst:  # until a burst is half handed out
        first += next(stream)
    assert stream.decoder.produced == 10
    other = stories.generate([1, 403], max_new_tokens=5, speculative="ngram")
    with pytest.raises(SupersededError):
        next(stream)
    assert stream.result.finish_reason == "cancelled" and stream.result.text == first
    assert stream.result.speculative["steps"] == 1
    assert other.token_ids == stories.generate([1, 403], max_new_tokens=5).token_ids
    assert stories.generate("", max_new_tokens=20, speculative="draft").token_ids == expected[:20]
