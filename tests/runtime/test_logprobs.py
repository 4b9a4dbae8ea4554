"""Log-probabilities in the library (cullama/runtime/logprobs.py, PlanRunner.score / start(logprobs=...),
Llama.logprobs, Llama.perplexity, stream(logprobs=, prompt_logprobs=)): against a NumPy log-softmax of HuggingFace's
FP32 logits (the goldens) and of cullama's own logits, through decode steps, verify steps (speculative decoding),
prefill chunks and the CUDA backend's queued-ahead steps (on the fake GPU), and the sliding-window perplexity."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import cullama
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.runtime.engine import PlanRunner
from cullama.common.errors import OptionError, PromptError
from cullama.runtime.logprobs import MAX_TOP, Perplexity, TokenLogprob, perplexity, windows
from cullama.runtime.sampling import SamplingParams
from cullama.runtime.load import load_checkpoint

from tests.conftest import GOLDEN_NAMES, load_golden


def log_softmax(logits) -> np.ndarray:
    l = np.asarray(logits, np.float64)
    m = l.max(axis=-1, keepdims=True)
    return l - m - np.log(np.exp(l - m).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def stories(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


@pytest.fixture(scope="module")
def story(stories_expected) -> list[int]:
    """A fixed id sequence: BOS and the model's documented greedy story (257 ids)."""
    return [1, *stories_expected["ids"]]


# -- the prompt's log-probabilities ------------------------------------------------------------------------

@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_prompt_logprobs_match_huggingface(name):
    """Within FP16 tolerance of a log-softmax of HF's FP32 logits; the top ids are HF's but at near-ties. Over
    the ids the tokenizer has: a vocabulary padded past it (tiny-qwen2's, as Qwen2's) is left out of cullama's
    softmax, where HF's takes the padded rows in too."""
    directory, cases, logits = load_golden(name)
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    vocab = llm.runner.sample_vocab
    for case in cases:
        ids, theirs = case["prompt_ids"], log_softmax(logits[case["logits_key"]][..., :vocab])
        ours = llm.logprobs(ids, top=5)
        assert ours[0] is None and [r.token for r in ours[1:]] == ids[1:]
        got = np.array([r.logprob for r in ours[1:]])
        want = theirs[np.arange(len(ids) - 1), ids[1:]]
        tolerance = 4e-2 * max(1.0, np.abs(logits[case["logits_key"]]).max())  # twice the logits' (test_api)
        assert np.abs(got - want).max(initial=0) <= tolerance
        for position, record in enumerate(ours[1:]):
            row = theirs[position]
            order = np.argsort(-row, kind="stable")[:5]
            assert np.abs(np.array([lp for _, lp in record.top]) - row[order]).max() <= tolerance
            margin = row[order[0]] - row[order[1]]
            assert record.top[0][0] == order[0] or margin < tolerance


def test_prompt_logprobs_are_a_log_softmax_of_the_same_logits(stories, story):
    """The device reduction against NumPy on cullama's own logits (the prefill's logits output): float32 sums."""
    records = stories.logprobs(story, top=MAX_TOP)
    theirs = log_softmax(stories.logits(story))
    got = np.array([r.logprob for r in records[1:]])
    np.testing.assert_allclose(got, theirs[np.arange(len(story) - 1), story[1:]], rtol=1e-6, atol=1e-6)
    for row, record in zip(theirs, records[1:]):
        ids = [i for i, _ in record.top]
        assert len(ids) == MAX_TOP and ids == np.argsort(-row, kind="stable")[:MAX_TOP].tolist()


def test_chunk_boundaries_change_nothing(stories_dir, stories, story):
    ckpt = open_checkpoint(stories_dir)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt)
    chunked = PlanRunner(ckpt.config, backend, 512, prefill_chunk=16)
    small = chunked.score(story, top=2)
    assert len(small) == len(story) - 1
    whole = stories.logprobs(story, top=2)[1:]
    np.testing.assert_allclose([r.logprob for r in small], [r.logprob for r in whole], atol=1e-5)


def test_perplexity_of_stories260k_on_its_story(stories, story):
    """docs/logprobs.md's figure: the whole story in one window (the context is 512)."""
    result = stories.perplexity(story)
    by_hand = math.exp(-np.mean(log_softmax(stories.logits(story))[np.arange(len(story) - 1), story[1:]]))
    assert (result.tokens, result.windows, result.context, result.stride) == (256, 1, 512, 256)
    assert abs(result.perplexity - by_hand) <= 1e-5 * by_hand
    # the README's 1.580, within what BLAS's order of float32 sums moves it between machines (1.5799 here, 1.5800
    # elsewhere: tests/test_cli_perplexity.py); round() would flip wherever the figure sits near 1.5795
    assert result.perplexity == pytest.approx(1.580, abs=1e-3)


def test_sliding_window_perplexity_is_huggingfaces_loop(stories_dir, story):
    """A context of 64 ids, windows 24 apart: HF's perplexity guide's loop written out here, on cullama's
    logits of each window, gives the same figure."""
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_seq_len=64)
    result = llm.perplexity(story, stride=24)
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(story), 24):
        end = min(begin + 64, len(story))
        window = story[begin:end]
        lp = log_softmax(llm.logits(window))[np.arange(len(window) - 1), window[1:]]
        trg = end - max(prev_end, 1) if begin == 0 else end - prev_end  # the new ids; never the text's first
        nll -= lp[len(lp) - trg:].sum()
        count += trg
        prev_end = end
        if end == len(story):
            break
    assert result.tokens == count == len(story) - 1 and result.windows == 10
    assert abs(result.nll - nll / count) <= 1e-5


def test_windows_score_every_id_once():
    for n, context, stride in [(257, 64, 24), (257, 64, 64), (10, 64, 32), (65, 64, 1), (2, 2, 1), (100, 7, 3)]:
        spans = windows(n, context, stride)
        scored = [i for _, end, first in spans for i in range(first, end)]
        assert all(end - begin <= context and begin < first for begin, end, first in spans)
        if stride < context:
            assert scored == list(range(1, n))
        else:  # each window's first id has no context in it: not scored
            assert scored == [i for i in range(1, n) if i % context]
    # a last window that would score nothing (its one id has no context) is no window
    assert windows(9, 4, 4) == [(0, 4, 1), (4, 8, 5)]
    # two ids are the fewest a perplexity scores: the second given the first
    two = perplexity(lambda window: [-1.0] * (len(window) - 1), [1, 2], 8, 4)
    assert (two.nll, two.tokens, two.windows) == (1.0, 1, 1)
    # a perplexity past what a float holds is inf, never an OverflowError; up to the largest float it is e^nll
    assert [perplexity(lambda w: [-nll] * (len(w) - 1), [1, 2], 8, 4).perplexity
            for nll in (708.5, 709.0, 709.78, 709.79, 1e6)] == [math.exp(708.5), math.exp(709.0), math.exp(709.78),
                                                                math.inf, math.inf]


def test_perplexity_refuses_what_it_cannot_score(stories):
    with pytest.raises(OptionError, match="stride"):
        stories.perplexity([1, 403, 407], stride=0)
    with pytest.raises(OptionError, match="stride"):
        stories.perplexity([1, 403, 407], stride=513)
    with pytest.raises(OptionError, match="at least 2"):
        perplexity(lambda w: [], [1], 8, 4)
    for stride in (0, 9):  # windows() checks its own stride too
        with pytest.raises(OptionError, match="stride"):
            windows(10, 8, stride)


def test_bad_options_are_refused(stories):
    with pytest.raises(OptionError, match="top"):
        stories.logprobs([1, 2], top=21)
    with pytest.raises(OptionError, match="top"):
        stories.logprobs([1, 2], top=None)
    with pytest.raises(PromptError, match="context"):
        stories.logprobs([1] * 513)
    for bad in (-1, 21, True, 2.0, "3"):
        with pytest.raises(OptionError, match="logprobs"):
            stories.stream([1], logprobs=bad)
        with pytest.raises(OptionError, match="prompt_logprobs"):
            stories.stream([1], prompt_logprobs=bad)


# -- generated tokens ------------------------------------------------------------------------------------

def test_each_generated_token_gets_the_log_softmax_of_its_step(stories_dir, story):
    """Read the logits buffer after every step (the numpy backend is synchronous): each record is that row's."""
    ckpt = open_checkpoint(stories_dir)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt)
    runner = PlanRunner(ckpt.config, backend, 512)
    params = SamplingParams(temperature=0.9, top_k=20, repetition_penalty=1.3, seed=5)
    tokens, rows = [runner.start(story[:9], params, logprobs=4)], [backend.read("logits")]
    for _ in range(12):
        tokens.append(runner.next())
        rows.append(backend.read("logits"))
    records = runner.take_logprobs()
    assert [r.token for r in records] == tokens and runner.take_logprobs() == []
    for token, row, record in zip(tokens, rows, records):
        want = log_softmax(row)  # the raw softmax: no penalty, no temperature, no top-k
        assert abs(record.logprob - want[token]) <= 1e-6
        assert [i for i, _ in record.top] == np.argsort(-want, kind="stable")[:4].tolist()


def test_greedy_generation_with_logprobs_is_unchanged(stories, story):
    plain = stories.generate(story[:5], max_new_tokens=30)
    scored = stories.generate(story[:5], max_new_tokens=30, logprobs=2, prompt_logprobs=1)
    assert scored.token_ids == plain.token_ids and plain.logprobs is None and plain.prompt_logprobs is None
    assert [r.token for r in scored.logprobs] == scored.token_ids
    assert all(r.top[0] == (r.token, r.logprob) for r in scored.logprobs)  # greedy: the token is the top one
    assert scored.prompt_logprobs[0] is None
    assert scored.prompt_logprobs[1:] == stories.logprobs(story[:5], top=1)[1:]
    # the decode path's numbers against the prompt path's (a GEMM instead of the GEMV): FP16 tolerance
    again = stories.logprobs(story[:5] + scored.token_ids, top=0)[5:]
    np.testing.assert_allclose([r.logprob for r in again], [r.logprob for r in scored.logprobs], atol=2e-2)


def test_prompt_logprobs_prefill_the_whole_prompt_whatever_reuse_says(stories, story):
    stories.generate(story[:30], max_new_tokens=4)
    again = stories.generate(story[:40], max_new_tokens=4, reuse_cache=True, prompt_logprobs=0)
    assert len(again.prompt_logprobs) == 40 and again.prompt_logprobs[1:] == stories.logprobs(story[:40])[1:]


def test_scoring_only(stories, story):
    result = stories.generate(story[:40], max_new_tokens=0, prompt_logprobs=3)
    assert result.token_ids == [] and result.finish_reason == "length" and result.logprobs is None
    assert result.prompt_logprobs == stories.logprobs(story[:40], top=3)
    whole = stories.generate(story[:512] if len(story) >= 512 else story, max_new_tokens=0, prompt_logprobs=0)
    assert len(whole.prompt_logprobs) == len(story)


def test_the_eos_that_ends_a_generation_has_its_logprob(stories, story):
    plain = stories.generate(story[:5], max_new_tokens=30)
    eos = plain.token_ids[6]
    llm = cullama.Llama(dataclasses.replace(stories.config, eos_token_ids=(eos,)), stories.runner, stories.tokenizer,
                        "cpu")
    result = llm.generate(story[:5], max_new_tokens=30, logprobs=0)
    assert result.finish_reason == "eos" and result.token_ids == plain.token_ids[:6]
    assert [r.token for r in result.logprobs] == plain.token_ids[:7] and result.logprobs[-1].token == eos


@pytest.mark.parametrize("speculative", ["ngram", "draft"])
def test_speculative_tokens_take_their_logprobs_from_the_verify_rows(stories_dir, story, speculative):
    """Greedy: the verify rows are bit for bit the plain steps' rows, and so are their log-probabilities.
    Sampled: every accepted token has its own record."""
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", draft_model=stories_dir)
    plain = llm.generate(story[:150], max_new_tokens=20, logprobs=3)
    fast = llm.generate(story[:150], max_new_tokens=20, logprobs=3, speculative=speculative)
    assert fast.speculative["accepted"] > 5 and fast.token_ids == plain.token_ids
    assert fast.logprobs == plain.logprobs
    sampled = llm.generate(story[:150], max_new_tokens=20, logprobs=1, speculative=speculative, temperature=0.8,
                           seed=3)
    assert [r.token for r in sampled.logprobs] == sampled.token_ids


def test_a_runner_without_logprobs_is_refused():
    from cullama.generation.generate import GenerationOptions, GenerationStream

    class Bare:
        max_seq_len = 32

    with pytest.raises(OptionError, match="logprobs"):
        GenerationStream(Bare(), None, [1], GenerationOptions.checked(logprobs=0), ())


# -- the CUDA backend's host code, on the fake GPU ---------------------------------------------------------

def test_queued_ahead_steps_keep_their_own_logprobs_on_the_fake_gpu(fake_gpu, stories_dir, story):
    """With the next step queued before a token is read, the logits and logprob_step buffers already hold the
    next step's: each token's record must come from its own copy. The fake GPU's kernels are the twins, so the
    records equal the numpy backend's bit for bit; the graph with the logprobs kernel is captured once, the
    plain decode graph stays as it is."""
    from cullama.runtime.backends.cuda_backend import CudaBackend

    gpu = cullama.Llama.from_pretrained(stories_dir, device="cuda")
    cpu = cullama.Llama.from_pretrained(stories_dir, device="cpu")
    assert isinstance(gpu.runner.backend, CudaBackend) and gpu.runner.backend.asynchronous
    args = dict(max_new_tokens=16, logprobs=5, prompt_logprobs=2, temperature=0.7, seed=11)
    on_gpu, on_cpu = gpu.generate(story[:7], **args), cpu.generate(story[:7], **args)
    assert on_gpu.token_ids == on_cpu.token_ids and len(on_gpu.logprobs) == 16
    assert on_gpu.logprobs == on_cpu.logprobs and on_gpu.prompt_logprobs == on_cpu.prompt_logprobs
    graphs = gpu.runner.backend.graphs
    assert set(graphs) == {"decode+logprobs[5]"} and graphs["decode+logprobs[5]"].replays == 15
    gpu.generate(story[:7], max_new_tokens=5)
    assert set(graphs) == {"decode+logprobs[5]", "decode"}
    fast = gpu.generate(story[:150], max_new_tokens=16, logprobs=1, speculative="ngram")
    assert fast.logprobs == cpu.generate(story[:150], max_new_tokens=16, logprobs=1).logprobs
    assert any(name.startswith("verify[") and name.endswith("+logprobs[1]") for name in graphs)


@pytest.fixture
def fake_gpu(monkeypatch):
    from tests import fake_cupy

    return fake_cupy.install(monkeypatch)


def test_records_are_values():
    record, ppl = TokenLogprob(3, -0.5, ((3, -0.5),)), Perplexity(2.0, math.log(2.0), 10, 1, 16, 16)
    assert hash(record) == hash(TokenLogprob(3, -0.5, ((3, -0.5),))) and hash(ppl) == hash(dataclasses.replace(ppl))
    assert ppl.to_dict() == {"perplexity": 2.0, "nll": math.log(2.0), "tokens": 10, "windows": 1, "context": 16,
                             "stride": 16}
