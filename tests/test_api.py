"""The public API on the CPU: Llama.from_pretrained, generate, stream, logits, stop conditions."""

import numpy as np
import pytest

import cullama
from cullama.errors import PromptError
from cullama.generate import StopMatcher
from conftest import load_golden


@pytest.fixture(scope="module")
def stories(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def test_generate_reproduces_stories260k(stories, stories_expected):
    result = stories.generate("", max_new_tokens=256)
    assert result.token_ids == stories_expected["ids"]
    assert result.text == stories_expected["text"]
    assert result.finish_reason == "length" and result.prompt_ids == [1]
    assert len(result.timings.token_s) == 255 and result.timings.tokens_per_s > 0


def test_stream_pieces_concatenate_to_the_text(stories):
    stream = stories.stream([1], max_new_tokens=60)
    pieces = list(stream)
    assert len(pieces) > 10 and "".join(pieces) == stream.result.text


def test_logits_match_huggingface():
    directory, cases, logits = load_golden("tiny-gqa-sharded")
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    for case in cases:
        ours = llm.logits(case["prompt_ids"])
        theirs = logits[case["logits_key"]]
        assert ours.dtype == np.float32 and ours.shape == theirs.shape
        # FP16 weights, activations and KV cache: within FP16 tolerance of HF's FP32 logits
        assert np.max(np.abs(ours - theirs)) <= 2e-2 * max(1.0, np.abs(theirs).max())


def test_eos_ends_generation_unless_ignored():
    directory, cases, _ = load_golden("tiny-mha")
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    case = cases[0]
    greedy = case["greedy_ids"]
    llm.config = type(llm.config)(**{**llm.config.__dict__, "eos_token_ids": (greedy[4],)})
    stopped = llm.generate(case["prompt_ids"], max_new_tokens=24)
    assert stopped.finish_reason == "eos" and stopped.token_ids == greedy[:4]
    full = llm.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True)
    assert full.finish_reason == "length" and full.token_ids == greedy


def test_generation_stops_at_the_end_of_the_context(stories_dir):
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=10)
    result = llm.generate([1, 403], max_new_tokens=100)
    assert result.finish_reason == "length" and len(result.token_ids) == 8


def test_bad_requests_are_prompt_errors(stories):
    with pytest.raises(PromptError, match="vocabulary"):
        stories.generate([1, 99999])
    with pytest.raises(PromptError, match="temperature"):
        stories.generate([1], temperature=-1)
    with pytest.raises(PromptError, match="context"):
        stories.generate([1] * 600)
    with pytest.raises(PromptError, match="max_new_tokens"):
        stories.generate([1], max_new_tokens=-1)


@pytest.mark.parametrize("chunks,stops,emitted,stopped", [
    (["Hello wor", "ld!"], ["world"], "Hello ", True),
    (["ab", "c", "d"], ["cx"], "abcd", False),  # "c" is held back until "d" rules out "cx"
    (["a\n", "\nb"], ["\n\n"], "a", True),
    (["xyz"], [], "xyz", False),
])
def test_stop_matcher_holds_back_possible_stops(chunks, stops, emitted, stopped):
    matcher = StopMatcher(stops)
    out = "".join(matcher.feed(c) for c in chunks)
    if not matcher.stopped:
        out += matcher.flush()
    assert out == emitted and matcher.stopped == stopped
