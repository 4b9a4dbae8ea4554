"""The speculative verify step (PlanRunner.verify): the k + 1-row twins against k + 1 one-row launches bit for bit,
the draft-first sampling rule, the numpy backend's verify against plain steps (stories260K's 256 documented ids,
the goldens, the context limit, the repetition penalty, sampling at temperature > 0), and (GPU) the kernels' rows
against one-row launches bit for bit and the model's verify against its plain steps."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import cullama
from cullama import plan as plans, sampling
from cullama.backends.numpy_backend import NumpyBackend
from cullama.checkpoint import open_checkpoint
from cullama.config import preset
from cullama.engine import PlanRunner, load_checkpoint, random_weights
from cullama.errors import KernelError, PromptError
from cullama.ops import attention as attention_twin, gemv as gemv_twin, sampling as sample_twin
from cullama.reference import rope_tables
from cullama.sampling import SamplingParams

from conftest import FAKE_GPU, load_golden, poisoned
from test_sampling import LOGITS, assert_distribution, softmax

GREEDY = SamplingParams(seed=0)
EPS = 1e-5


def rand(rng, *shape, scale=1.0, dtype=np.float16):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def state_at(pos: int, step: int = 0, seed: int = 0, top_k: int = 0) -> np.ndarray:
    state = np.zeros(8, np.int32)
    state[[sample_twin.STATE_POS, sample_twin.STATE_STEP, sample_twin.STATE_TOP_K]] = pos, step, top_k
    state[[sample_twin.STATE_SEED_LO, sample_twin.STATE_SEED_HI]] = np.array(
        [seed & 0xFFFFFFFF, seed >> 32], np.uint32).view(np.int32)
    return state


# -- twins: row t of a k + 1-row launch is a one-row launch at position pos + t ------------------------------
@pytest.mark.parametrize("rows", [2, 5, 9])
def test_gemv_twin_rows_are_one_row_launches(rows):
    rng = np.random.default_rng(rows)
    d, ff, V, heads, kv_heads, hd, pos = 72, 56, 37, 3, 1, 8, 6
    max_seq = pos + rows + 3
    x, g = rand(rng, rows, d, dtype=np.float32), rand(rng, d)
    wqkv, wo = rand(rng, (heads + 2 * kv_heads) * hd, d, scale=0.2), rand(rng, d, heads * hd, scale=0.2)
    w_gu, w_down, w_lm = rand(rng, 2 * ff, d, scale=0.2), rand(rng, d, ff, scale=0.2), rand(rng, V, d)
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
    shape = (heads, kv_heads, hd, max_seq, EPS)

    q, caches = np.full((rows, heads * hd), np.nan, np.float32), [np.zeros((kv_heads, max_seq, hd), np.float16)
                                                                  for _ in range(2)]
    gemv_twin.gemv_qkv_rope(x, g, wqkv, q, *caches, rope, state_at(pos), d, *shape)
    inp, x_res = rand(rng, rows, heads * hd, dtype=np.float32), x.copy()
    gemv_twin.gemv_residual(inp, wo, x_res, d, heads * hd)
    h, logits = np.full((rows, ff), np.nan, np.float32), np.full((rows, V), np.nan, np.float32)
    gemv_twin.gemv_gate_up_silu(x, g, w_gu, h, ff, d, EPS)
    gemv_twin.gemv_logits(x, g, w_lm, logits, V, d, EPS)
    for t in range(rows):
        q1, caches1 = np.full(heads * hd, np.nan, np.float32), [np.zeros_like(caches[0]) for _ in range(2)]
        gemv_twin.gemv_qkv_rope(x[t].copy(), g, wqkv, q1, *caches1, rope, state_at(pos + t), d, *shape)
        np.testing.assert_array_equal(q[t], q1)
        for cache, one in zip(caches, caches1):
            np.testing.assert_array_equal(cache[:, pos + t], one[:, pos + t])
        x1 = x[t].copy()
        gemv_twin.gemv_residual(inp[t].copy(), wo, x1, d, heads * hd)
        np.testing.assert_array_equal(x_res[t], x1)
        h1, l1 = np.full(ff, np.nan, np.float32), np.full(V, np.nan, np.float32)
        gemv_twin.gemv_gate_up_silu(x[t].copy(), g, w_gu, h1, ff, d, EPS)
        gemv_twin.gemv_logits(x[t].copy(), g, w_lm, l1, V, d, EPS)
        np.testing.assert_array_equal(h[t], h1)
        np.testing.assert_array_equal(logits[t], l1)
    for cache in caches:  # the rows' positions, nothing else
        assert cache[:, pos:pos + rows].any(axis=(0, 2)).all()
        assert not cache[:, :pos].any() and not cache[:, pos + rows:].any()


# (head_dim, group, kv_heads, pos, rows, splits): rows whose keys fill fewer splits than there are, and long ones
ATTENTION_CASES = [(8, 2, 4, 0, 3, 8), (32, 4, 2, 5, 9, 8), (128, 1, 3, 40, 5, 4), (16, 8, 1, 100, 2, 3),
                   (64, 1, 2, 517, 9, 32)]


def attention_rows(hd, group, kv_heads, pos, rows, splits, seed=0):
    """q [rows, heads*hd] f32 and caches [kv_heads, max_seq, hd] f16 (random past the rows' keys too)."""
    rng = np.random.default_rng(seed)
    max_seq = pos + rows + 4
    q = (2 * rng.standard_normal((rows, kv_heads * group * hd))).astype(np.float32)
    k, v = (rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16) for _ in range(2))
    return q, k, v, max_seq, np.float32(1 / np.sqrt(hd))


@pytest.mark.parametrize("hd,group,kv_heads,pos,rows,splits", ATTENTION_CASES)
def test_attention_twin_rows_are_one_row_launches(hd, group, kv_heads, pos, rows, splits):
    q, k, v, max_seq, scale = attention_rows(hd, group, kv_heads, pos, rows, splits)
    heads = kv_heads * group
    part = np.full((rows, heads, splits, hd + 2), np.nan, np.float32)
    count, out = np.ones((rows, kv_heads), np.uint32), np.full((rows, heads * hd), np.nan, np.float32)
    attention_twin.attention_decode(q, k, v, part, count, out, state_at(pos), max_seq, scale,
                                    grid=(kv_heads, splits, rows))
    assert not count.any()
    for t in range(rows):
        part1, count1 = np.full((heads, splits, hd + 2), np.nan, np.float32), np.ones(kv_heads, np.uint32)
        out1 = np.full(heads * hd, np.nan, np.float32)
        attention_twin.attention_decode(q[t].copy(), k, v, part1, count1, out1, state_at(pos + t), max_seq, scale,
                                        grid=(kv_heads, splits, 1))
        np.testing.assert_array_equal(out[t], out1)
        np.testing.assert_array_equal(part[t], part1)


def sample_case(V=517, rows=5, seed=0, spike=0.0):
    """logits [rows, V] (each row's id 7 r raised by `spike`: a likely pick), seen [V] uint8, embed [V, 40]."""
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((rows, V))).astype(np.float32)
    logits[np.arange(rows), 7 * np.arange(rows)] += spike
    seen = (rng.random(V) < 0.1).astype(np.uint8)
    return logits, seen, rng.standard_normal((V, 40)).astype(np.float16)


def run_sample_twin(logits, seen, state, fp, embed, ids):
    """The sample twin over len(ids) rows; returns (out, picks, x). seen and state advance in place."""
    rows = len(ids)
    x, out = np.full(embed.shape[1], np.nan, np.float32), np.full(rows + 1, -7, np.int32)
    picks, arrivals = np.full(rows, -7, np.int32), np.zeros(1, np.uint32)
    sample_twin.sample(logits[:rows], seen, state, fp, embed, x, np.asarray(ids, np.int32), picks, out, arrivals,
                       logits.shape[1], embed.shape[1], grid=(rows, 1, 1))
    return out, picks, x


@pytest.mark.parametrize("penalty", [1.0, 1.3, 0.7])
@pytest.mark.parametrize("wrong", [0, 2, 4])  # the draft that misses; 4 = none of the four
def test_greedy_sample_twin_rows_are_one_row_launches(penalty, wrong):
    """A verify's sample over k + 1 rows leaves state, seen and x as n one-row launches would, n = the drafts the
    rows' argmaxes confirm + 1; each row's seen includes the drafts before it (which the one-row launches mark)."""
    logits, seen, embed = sample_case()
    fp = np.array([0.0, 1.0, penalty, 0.0], np.float32)
    one_seen, one_state, picks = seen.copy(), state_at(11, step=3), []
    for r in range(5):  # one-row launches: each row's argmax with the tokens before it seen
        one_out, _, one_x = run_sample_twin(logits[r:], one_seen, one_state, fp, embed, [0])
        picks.append(int(one_out[1]))
    drafts = [p if i != wrong else (p + 1) % 517 for i, p in enumerate(picks[:4])]
    state = state_at(11, step=3)
    out, got_picks, x = run_sample_twin(logits, seen, state, fp, embed, [9, *drafts])
    n = min(wrong, 4) + 1
    assert out[:n + 1].tolist() == [n, *picks[:n]] and got_picks[:n].tolist() == picks[:n]
    one_seen, one_state = sample_case()[1], state_at(11, step=3)
    for r in range(n):
        _, _, one_x = run_sample_twin(logits[r:], one_seen, one_state, fp, embed, [0])
    np.testing.assert_array_equal(state, one_state)
    np.testing.assert_array_equal(seen, one_seen)
    np.testing.assert_array_equal(x, one_x)


@pytest.mark.parametrize("options", [(1.0, 0, 1.0, 1.0), (0.8, 20, 0.9, 1.2), (1.3, 0, 0.8, 0.9)])
def test_sampled_sample_twin_rows_draw_each_row_with_its_draft_first(options):
    temperature, top_k, top_p, penalty = options
    logits, seen, embed = sample_case(seed=5, spike=12.0)
    fp = np.array([temperature, top_p, penalty, 0.0], np.float32)
    params = SamplingParams(temperature, top_k, top_p, penalty, seed=77)
    argmax = dataclasses.replace(params, temperature=0.0)
    counts = set()
    for trial in range(16):
        ids = [3, *(int(t) for t in np.random.default_rng(trial).integers(0, 517, 4))]
        for r in range(4):  # most drafts the rows' argmax: likely accepted, so that runs of them occur
            if trial % 4:
                before = seen.astype(bool) | np.isin(np.arange(517), ids[1:r + 1])
                ids[r + 1] = sampling.sample(logits[r], argmax, before, 0)
        state, seen_after = state_at(11, step=40 + trial, seed=77, top_k=top_k), seen.copy()
        out, picks, x = run_sample_twin(logits, seen_after, state, fp, embed, ids)
        expected = []
        for r in range(5):
            before = seen.astype(bool) | np.isin(np.arange(517), ids[1:r + 1])
            expected.append(sampling.sample(logits[r], params, before, 40 + trial + r, ids[r + 1] if r < 4 else None))
        n = next((r + 1 for r in range(4) if expected[r] != ids[r + 1]), 5)
        accepted = [*ids[1:n], expected[n - 1]]
        assert picks.tolist() == expected and out[:n + 1].tolist() == [n, *accepted]
        assert state.tolist()[:3] == [11 + n, accepted[-1], 40 + trial + n]
        np.testing.assert_array_equal(seen_after, np.where(np.isin(np.arange(517), accepted), 1, seen))
        np.testing.assert_array_equal(x, embed[accepted[-1]].astype(np.float32))
        counts.add(n)
    assert len(counts) >= 3, counts  # rejections at several rows, and accepted runs


# -- the sampling rule: the draft's bucket first ----------------------------------------------------------------
N = 20000


@pytest.mark.parametrize("draft", [4, 2, 7, 5])  # the argmax, a middling one, a small one, a -inf one
def test_a_draft_first_draw_is_distributed_as_p(draft):
    params = SamplingParams(temperature=1.0, seed=99)
    seen = np.zeros(8, bool)
    tokens = np.array([sampling.sample(LOGITS, params, seen, step, draft) for step in range(N)])
    assert_distribution(np.bincount(tokens, minlength=8) / N, softmax(LOGITS), N)
    # the draft is taken exactly when its bucket, first, holds the draw
    p = softmax(LOGITS)
    accept = np.array([sampling.uniform(99, step) < p[draft] for step in range(N)])
    assert ((tokens == draft) == accept).mean() > 0.999  # float32 rounding at a bucket edge aside


def test_a_draft_outside_the_cuts_is_never_picked_and_a_lone_one_always():
    seen = np.zeros(8, bool)
    cut = SamplingParams(temperature=1.0, top_k=3, seed=5)  # keeps ids 4, 7, 0
    tokens = {sampling.sample(LOGITS, cut, seen, step, 1) for step in range(2000)}
    assert tokens == {0, 4, 7}
    lone = SamplingParams(temperature=1.0, top_k=1, seed=5)
    assert {sampling.sample(LOGITS, lone, seen, step, 4) for step in range(200)} == {4}
    assert {sampling.sample(LOGITS, lone, seen, step, 0) for step in range(200)} == {4}


def test_greedy_ignores_the_draft_and_no_draft_is_plain_id_order():
    seen = np.zeros(8, bool)
    assert sampling.sample(LOGITS, GREEDY, seen, 0, 3) == 4
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=2)
    for step in range(200):  # the inverse CDF of the spec before drafts existed
        l = np.array(LOGITS, np.float32) / np.float32(0.9)
        p = np.exp(l - l.max()).astype(np.float32)
        p = np.where(sampling._nucleus(p, np.float32(0.95) * p.sum(dtype=np.float32)), p, 0).astype(np.float32)
        target = np.float32(sampling.uniform(2, step)) * p.sum(dtype=np.float32)
        assert sampling.sample(LOGITS, params, seen, step) == int(np.nonzero(np.cumsum(p, dtype=np.float32)
                                                                              > target)[0][0])


# -- the numpy backend: verify against plain steps -------------------------------------------------------------
def numpy_runner(directory, max_seq=None) -> PlanRunner:
    ckpt = open_checkpoint(directory)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt)
    return PlanRunner(ckpt.config, backend, max_seq or ckpt.config.max_seq_len)


def drafts_from(continuation: list[int], k: int, call: int, vocab: int) -> tuple[list[int], int]:
    """k drafts from the expected continuation with draft number call % (k + 1) wrong (k: none), so that
    successive calls reject at every row and accept whole runs; and how many of them are right."""
    drafts, wrong = list(continuation[:k]), call % (k + 1)
    if wrong < k:
        drafts[wrong] = (drafts[wrong] + 1 + call) % vocab
    return drafts, min(wrong, k)


def speculative_ids(runner: PlanRunner, prompt, params, expected: list[int], k: int, total: int) -> list[int]:
    """`total` ids through verify() with drafts from `expected` (partly wrong), checking each verdict."""
    ids, call = [runner.start(prompt, params)], 0
    while len(ids) < total:
        n = min(k, runner.max_draft(), total - 1 - len(ids))
        drafts, right = drafts_from(expected[len(ids):], n, call, runner.cfg.vocab_size)
        got = runner.verify(drafts)
        assert got == expected[len(ids):len(ids) + right + 1], (len(ids), drafts, got)
        ids, call = ids + got, call + 1
    return ids


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_stories260k_256_greedy_ids_through_verify(stories_dir, stories_expected, k):
    runner, expected = numpy_runner(stories_dir), stories_expected["ids"]
    assert speculative_ids(runner, stories_expected["prompt_ids"], GREEDY, expected, k, 256) == expected
    assert runner.cached == stories_expected["prompt_ids"] + expected[:-1] and runner.last == expected[-1]
    state = runner.backend.read("state")
    assert state[0] == len(runner.cached) and state[1] == expected[-1] and state[2] == 256


def test_verify_rows_are_the_plain_steps_bit_for_bit(stories_dir):
    """Each accepted row's logits, the K and V written, the state, seen and the next input: exactly the plain
    steps' (with a repetition penalty, so that the drafts before a row count)."""
    params = SamplingParams(repetition_penalty=1.3, seed=0)
    plain, spec = numpy_runner(stories_dir), numpy_runner(stories_dir)
    prompt = [1, 403, 407, 261]
    tokens, logits, after = [plain.start(prompt, params)], [], []
    for _ in range(30):
        tokens.append(plain.next())
        logits.append(plain.backend.read("logits"))
        after.append({name: plain.backend.read(name) for name in ("state", "seen", "x")})
    assert spec.start(prompt, params) == tokens[0]
    done = 0
    for k, wrong in ((4, 4), (3, 1), (8, 8), (2, 0), (5, 3)):
        drafts = tokens[done + 1:done + 1 + k]
        if wrong < k:
            drafts[wrong] = (drafts[wrong] + 5) % 512
        got = spec.verify(drafts)
        assert got == tokens[done + 1:done + 2 + wrong]
        rows = spec.backend.read("verify_logits")
        for r in range(len(got)):
            np.testing.assert_array_equal(rows[r], logits[done + r])
        done += len(got)
        for name, value in after[done - 1].items():
            np.testing.assert_array_equal(spec.backend.read(name), value, err_msg=name)
        cached = len(spec.cached)
        for name in ("k_cache", "v_cache"):
            np.testing.assert_array_equal(spec.backend.read(name)[:, :, :cached], plain.backend.read(name)[:, :, :cached])
    assert done == 5 + 2 + 9 + 1 + 4  # every verdict above


def test_golden_checkpoints_verify_equals_plain_greedy(golden):
    directory, cases, _ = golden
    plain, spec = numpy_runner(directory), numpy_runner(directory)
    for case in cases:
        prompt = case["prompt_ids"]
        expected = [plain.start(prompt, GREEDY)] + [plain.next() for _ in range(23)]
        for k in (3, 8):
            assert speculative_ids(spec, prompt, GREEDY, expected, k, 24) == expected


def test_verify_near_the_context_limit(stories_dir):
    """k + 1 rows never write past the KV cache: max_draft shrinks to what fits, verify refuses more, and the
    last positions fill exactly (the numpy caches would raise IndexError on a write past them)."""
    prompt = [1, 403, 407, 261, 378]
    runner, plain = numpy_runner(stories_dir, max_seq=16), numpy_runner(stories_dir, max_seq=16)
    tokens = [plain.start(prompt, GREEDY)] + [plain.next() for _ in range(10)]
    assert runner.start(prompt, GREEDY) == tokens[0] and runner.max_draft() == 8  # 5 cached: rows 5..13 fit
    assert runner.verify(tokens[1:9]) == tokens[1:10]  # 9 rows: positions 5..13
    assert len(runner.cached) == 14 and runner.max_draft() == 1  # positions 14, 15 left
    with pytest.raises(PromptError, match="2 drafts at position 14 do not fit: at most 1"):
        runner.verify(tokens[10:11] + [3])
    assert runner.verify([tokens[10]]) == [tokens[10], plain.next()]  # positions 14 and 15: the cache is full
    assert len(runner.cached) == 16 and runner.max_draft() == 0
    with pytest.raises(PromptError, match="full"):
        runner.verify([])
    with pytest.raises(PromptError, match="at most 0"):
        runner.verify([1])


def test_verify_refuses_bad_drafts_and_no_prompt(stories_dir):
    runner = numpy_runner(stories_dir)
    with pytest.raises(PromptError, match="call start"):
        runner.verify([1])
    runner.start([1], GREEDY)
    with pytest.raises(PromptError, match="draft token id 512 is outside"):
        runner.verify([3, 512])
    with pytest.raises(PromptError, match="9 drafts"):
        runner.verify([3] * 9)
    with pytest.raises(KernelError, match="1 to 8 drafts"):
        plans.verify_plan(runner.cfg, 64, 9)
    plain = numpy_runner(stories_dir)
    plain.start([1], GREEDY)
    assert runner.verify([]) == [plain.next()]  # k = 0 is a plain step
    np.testing.assert_array_equal(runner.backend.read("state"), plain.backend.read("state"))
