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
from cullama.runtime import plan as plans, sampling
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.model.config import preset
from cullama.runtime.engine import PlanRunner
from cullama.runtime.load import load_checkpoint, random_weights
from cullama.common.errors import GenerationError, KernelError, PromptError
from cullama.runtime.ops import attention as attention_twin, gemv_mma as gemv_twin, sampling as sample_twin
from cullama.runtime.ops.rows import logits_stride
from cullama.model.reference import rope_tables
from cullama.runtime.registry import KernelSpec
from cullama.runtime.sampling import SamplingParams

from tests.conftest import FAKE_GPU
from tests.runtime.ops.test_sampling_kernel import assert_prepared, next_input
from tests.runtime.test_sampling import LOGITS, assert_distribution, softmax

GREEDY = SamplingParams(seed=0)
EPS = 1e-5


def rand(rng, *shape, scale=1.0, dtype=np.float16):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def verify_rows(rows: int, slot: int = 0) -> np.ndarray:
    """A verify step's rows table [rows, 2]: the rows of one slot at offsets 0..rows - 1 (plan.slot_rows_table)."""
    return plans.slot_rows_table(slot + 1)[slot, :rows].copy()


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
    LD = logits_stride(V)  # 40: logits rows at a stride of V rounded up to 4
    max_seq = pos + rows + 3
    x, g = rand(rng, rows, d, dtype=np.float32), rand(rng, d)
    wqkv, wo = rand(rng, (heads + 2 * kv_heads) * hd, d, scale=0.2), rand(rng, d, heads * hd, scale=0.2)
    w_gu, w_down, w_lm = rand(rng, 2 * ff, d, scale=0.2), rand(rng, d, ff, scale=0.2), rand(rng, V, d)
    bias = rand(rng, (heads + 2 * kv_heads) * hd)  # Qwen2's q|k|v bias
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
    shape = (heads, kv_heads, hd, max_seq, EPS)

    q, caches = np.full((rows, heads * hd), np.nan, np.float32), [np.zeros((kv_heads, max_seq, hd), np.float16)
                                                                  for _ in range(2)]
    xn, ssp = gemv_twin.prepare(x, g, d)  # the RMSNorm kernels' input as gemv_residual prepares it
    gemv_twin.gemv_qkv_rope(xn, ssp, wqkv, wqkv, bias, q, *caches, rope, state_at(pos), verify_rows(rows), d, *shape, 0)
    inp, x_res = rand(rng, rows, heads * hd, dtype=np.float16), x.copy()
    xn_res, ssp_res = np.zeros((rows, d), np.float16), np.zeros((rows, plans.ss_parts(d)), np.float32)
    gemv_twin.gemv_residual(inp, wo, wo, x_res, g, xn_res, ssp_res, d, heads * hd, 0)
    h, logits = np.full((rows, ff), np.nan, np.float16), np.full((rows, LD), np.nan, np.float32)
    gemv_twin.gemv_gate_up_silu(xn, ssp, w_gu, w_gu, h, ff, d, EPS, 0)
    gemv_twin.gemv_logits(xn, ssp, w_lm, logits, V, d, EPS)
    for t in range(rows):
        q1, caches1 = np.full(heads * hd, np.nan, np.float32), [np.zeros_like(caches[0]) for _ in range(2)]
        gemv_twin.gemv_qkv_rope(xn[t].copy(), ssp[t].copy(), wqkv, wqkv, bias, q1, *caches1, rope, state_at(pos + t),
                                verify_rows(1), d, *shape, 0)
        np.testing.assert_array_equal(q[t], q1)
        for cache, one in zip(caches, caches1):
            np.testing.assert_array_equal(cache[:, pos + t], one[:, pos + t])
        x1, xn1, ssp1 = x[t].copy(), np.zeros(d, np.float16), np.zeros(plans.ss_parts(d), np.float32)
        gemv_twin.gemv_residual(inp[t].copy(), wo, wo, x1, g, xn1, ssp1, d, heads * hd, 0)
        np.testing.assert_array_equal(x_res[t], x1)
        np.testing.assert_array_equal(xn_res[t], xn1)
        np.testing.assert_array_equal(ssp_res[t], ssp1)
        h1, l1 = np.full(ff, np.nan, np.float16), np.full(V, np.nan, np.float32)
        gemv_twin.gemv_gate_up_silu(xn[t].copy(), ssp[t].copy(), w_gu, w_gu, h1, ff, d, EPS, 0)
        gemv_twin.gemv_logits(xn[t].copy(), ssp[t].copy(), w_lm, l1, V, d, EPS)
        np.testing.assert_array_equal(h[t], h1)
        np.testing.assert_array_equal(logits[t, :V], l1)
    assert np.isnan(logits[:, V:]).all()  # the rows' padding is never written
    for cache in caches:  # the rows' positions, nothing else
        assert cache[:, pos:pos + rows].any(axis=(0, 2)).all()
        assert not cache[:, :pos].any() and not cache[:, pos + rows:].any()


# (head_dim, group, kv_heads, pos, rows, splits): rows whose keys fill fewer splits than there are, and long ones
ATTENTION_CASES = [(8, 2, 4, 0, 3, 8), (32, 4, 2, 5, 9, 8), (128, 1, 3, 40, 5, 4), (16, 8, 1, 100, 2, 3),
                   (64, 1, 2, 517, 9, 32)]
# (head_dim, group, kv_heads, pos, rows, splits, window): each row its own sliding window (Mistral), of 1, shorter
# than the rows, across the splits, as long as the first rows' context
WINDOW_CASES = [(32, 4, 2, 5, 9, 8, 1), (64, 4, 2, 40, 9, 8, 7), (128, 7, 1, 300, 5, 32, 100), (8, 2, 2, 3, 6, 4, 5)]


def attention_rows(hd, group, kv_heads, pos, rows, splits, seed=0):
    """q [rows, heads*hd] f32 and caches [kv_heads, max_seq, hd] f16 (random past the rows' keys too)."""
    rng = np.random.default_rng(seed)
    max_seq = pos + rows + 4
    q = (2 * rng.standard_normal((rows, kv_heads * group * hd))).astype(np.float32)
    k, v = (rng.standard_normal((kv_heads, max_seq, hd)).astype(np.float16) for _ in range(2))
    return q, k, v, max_seq, np.float32(1 / np.sqrt(hd))


@pytest.mark.parametrize("hd,group,kv_heads,pos,rows,splits,window", [c + (None,) for c in ATTENTION_CASES]
                         + WINDOW_CASES)
def test_attention_twin_rows_are_one_row_launches(hd, group, kv_heads, pos, rows, splits, window):
    q, k, v, max_seq, scale = attention_rows(hd, group, kv_heads, pos, rows, splits)
    heads, window = kv_heads * group, window or max_seq
    part = np.full((rows, heads, splits, hd + 2), np.nan, np.float32)
    count, out = np.ones((rows, kv_heads), np.uint32), np.full((rows, heads * hd), np.nan, np.float16)
    attention_twin.attention_decode(q, k, v, part, count, out, state_at(pos), verify_rows(rows), max_seq, scale, window,
                                    grid=(kv_heads, splits, rows))
    assert not count.any()
    for t in range(rows):
        part1, count1 = np.full((heads, splits, hd + 2), np.nan, np.float32), np.ones(kv_heads, np.uint32)
        out1 = np.full(heads * hd, np.nan, np.float16)
        attention_twin.attention_decode(q[t].copy(), k, v, part1, count1, out1, state_at(pos + t), verify_rows(1),
                                        max_seq, scale, window, grid=(kv_heads, splits, 1))
        np.testing.assert_array_equal(out[t], out1)
        np.testing.assert_array_equal(part[t], part1)


def sample_case(V=517, rows=5, seed=0, spike=0.0):
    """logits [rows, V] (each row's id 7 r raised by `spike`: a likely pick), seen [V] uint8, embed [V, 40]."""
    rng = np.random.default_rng(seed)
    logits = (3 * rng.standard_normal((rows, V))).astype(np.float32)
    logits[np.arange(rows), 7 * np.arange(rows)] += spike
    seen = (rng.random(V) < 0.1).astype(np.uint8)
    return logits, seen, rng.standard_normal((V, 40)).astype(np.float16)


def at_row_stride(logits):
    """logits [rows, V] as the kernels take them: a contiguous copy with rows at logits_stride(V) (V
    rounded up to 4, 16-byte aligned rows), the padding NaN."""
    rows, V = logits.shape
    out = np.full((rows, logits_stride(V)), np.nan, np.float32)
    out[:, :V] = logits
    return out


def run_sample_twin(logits, seen, state, fp, embed, ids):
    """The sample twin over len(ids) rows of logits [rows, V]; returns (out, picks, x). seen and state advance in
    place."""
    rows = len(ids)
    x, out = np.full(embed.shape[1], np.nan, np.float32), np.full(rows + 1, -7, np.int32)
    picks, arrivals = np.full(rows, -7, np.int32), np.zeros(1, np.uint32)
    V = logits.shape[1]
    nxt = next_input(x)
    sample_twin.sample(at_row_stride(logits[:rows]), seen, state, fp, embed, *nxt, verify_rows(rows),
                       np.asarray(ids, np.int32), picks, out, arrivals, *verify_sizes(V, embed.shape[1]),
                       grid=(rows, 1, 1))
    assert_prepared(nxt)
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


def test_a_row_with_nothing_to_draw_ends_the_verdict():
    """Every logit of a row NaN: its pick is NO_TOKEN, which equals no draft, so the run ends there; the drafts
    before it are accepted and seen, x = 0, and the backend raises (cullama.runtime.sampling.drawn) on that verdict."""
    logits, seen, embed = sample_case(rows=3, seed=2)
    fp = np.array([0.0, 1.0, 1.0, 0.0], np.float32)
    first = int(np.argmax(logits[0]))
    logits[1] = np.nan
    state, before = state_at(20, step=4), seen.copy()
    out, picks, x = run_sample_twin(logits, seen, state, fp, embed, [3, first, 5])
    assert out[:3].tolist() == [2, first, sampling.NO_TOKEN] and picks[1] == sampling.NO_TOKEN
    assert state.tolist()[:3] == [22, sampling.NO_TOKEN, 6] and not x.any()
    np.testing.assert_array_equal(seen, np.where(np.arange(517) == first, 1, before))
    backend = NumpyBackend()
    backend.allocate([plans.Buffer("verify_ids", (3,), "int32", "state"),
                      plans.Buffer("verify_out", (4,), "int32", "activation")])
    backend.set("verify_out", out)
    with pytest.raises(GenerationError, match="no token can be drawn"):
        backend.verify(plans.Plan("verify[2]", []), [3, first, 5])


def test_a_draft_outside_the_vocabulary_is_the_no_token_answer():
    """The twin's rule for a draft id outside [0, V), which the host never writes (the kernel's, on the executor
    in test_verify_emu)."""
    check_drafts_outside_the_vocabulary(twin_launcher)


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
    """k drafts from the expected continuation: all right on even calls; on odd ones draft number
    (call // 2) % k is wrong, so that successive calls reject at every row. Returns them and how many lead
    right."""
    drafts, wrong = list(continuation[:k]), (call // 2) % k if k and call % 2 else k
    if wrong < k:
        drafts[wrong] = (drafts[wrong] + 1 + call) % vocab
    return drafts, wrong


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
    state = runner.backend.read("state")[0]
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
            np.testing.assert_array_equal(spec.backend.read(name)[:, :, :, :cached],
                                          plain.backend.read(name)[:, :, :, :cached])
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
    assert runner.start(prompt, GREEDY) == tokens[0] and runner.max_draft() == 10  # 5 cached: rows 5..15 fit
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
    with pytest.raises(PromptError, match="16 drafts"):
        runner.verify([3] * 16)
    with pytest.raises(KernelError, match="1 to 15 drafts"):
        plans.verify_plan(runner.cfg, 64, 16)
    plain = numpy_runner(stories_dir)
    plain.start([1], GREEDY)
    assert runner.verify([]) == [plain.next()]  # k = 0 is a plain step
    np.testing.assert_array_equal(runner.backend.read("state"), plain.backend.read("state"))


def test_an_interrupted_verify_leaves_the_record_exact(stories_dir, monkeypatch):
    """A verify cut short inside its plan (Ctrl-C on the CPU) leaves `cached` as it was (its rows may be half
    written) and nothing to decode from; a start() that reuses the cache then equals a fresh run."""
    runner, fresh = numpy_runner(stories_dir), numpy_runner(stories_dir)
    prompt = [1, 403, 407]
    tokens = [fresh.start(prompt, GREEDY)] + [fresh.next() for _ in range(12)]
    runner.start(prompt, GREEDY)
    assert runner.verify(tokens[1:4]) == tokens[1:5]
    cached, real = list(runner.cached), runner.backend.run

    def run(plan):
        if plan.name.startswith("verify"):
            for launch in plan.launches[:7]:
                real(plans.Plan(plan.name, [launch]))
            raise KeyboardInterrupt
        real(plan)

    monkeypatch.setattr(runner.backend, "run", run)
    with pytest.raises(KeyboardInterrupt):
        runner.verify(tokens[5:9])
    monkeypatch.undo()
    assert runner.cached == cached and runner.last is None
    with pytest.raises(PromptError, match="start"):
        runner.verify([3])
    follow = prompt + tokens[:8]
    assert runner.start(follow, GREEDY, reuse=True) == fresh.start(follow, GREEDY) == tokens[8]


# -- sampling at temperature > 0: the tokens are distributed as plain sampling's -------------------------------
CHI_CONFIG = cullama.model.config.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                                        num_heads=2, num_kv_heads=1, head_dim=16, max_seq_len=16, name="chi")
CHI_PROMPT = [1, 17, 5]
CHI_SEEDS = 700  # generations per distribution


def chi_runner() -> PlanRunner:
    """A tiny random model with peaked distributions (weights of std 0.3), cheap on the numpy backend."""
    backend = NumpyBackend()
    random_weights(backend, CHI_CONFIG, seed=3, std=0.3)
    return PlanRunner(CHI_CONFIG, backend, CHI_CONFIG.max_seq_len)


def three_tokens(runner: PlanRunner, params: SamplingParams, drafts=None) -> tuple[int, int, int]:
    """start()'s token and the two after it: plain steps, or a verify of drafts(t0) (then steps for what it
    lacks)."""
    t0 = runner.start(CHI_PROMPT, params)
    got = [] if drafts is None else runner.verify(drafts(t0))
    while len(got) < 2:
        got.append(runner.next())
    return t0, got[0], got[1]


def greedy_drafts(runner: PlanRunner):
    """drafts(t0): the target's own two greedy tokens after t0 (good drafts: often, not always, accepted)."""
    table = {}

    def drafts(t0: int) -> list[int]:
        if t0 not in table:
            first = runner.start(CHI_PROMPT + [t0], GREEDY)
            table[t0] = [first, runner.start(CHI_PROMPT + [t0, first], GREEDY)]
        return table[t0]

    return drafts


def two_sample_chi2(a: list, b: list) -> tuple[float, int]:
    """Pearson's statistic that samples a and b come from one distribution (categories with fewer than 10
    observations in all pooled), and its degrees of freedom."""
    keys = sorted(set(a) | set(b))
    ca, cb = np.array([a.count(k) for k in keys], float), np.array([b.count(k) for k in keys], float)
    rare = ca + cb < 10
    ca, cb = np.append(ca[~rare], ca[rare].sum()), np.append(cb[~rare], cb[rare].sum())
    keep = ca + cb > 0
    ca, cb = ca[keep], cb[keep]
    ea, eb = (ca + cb) * len(a) / (len(a) + len(b)), (ca + cb) * len(b) / (len(a) + len(b))
    return float(((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum()), len(ca) - 1


def distributions_differ(plain: list, speculative: list, drafts) -> bool:
    """Whether the tokens after start()'s are distributed differently: the first's and the second's
    distributions, and how often they are the greedy drafts (the acceptance's own statistic). Chi-square at
    about 6 standard deviations: a correct sampler fails this about once in 10^5 runs, and the seeds are fixed."""
    def matches(t0, t1, t2):
        first, second = drafts(t0)
        return (t1 == first, t1 == first and t2 == second)

    samples = [([t[i] for t in plain], [t[i] for t in speculative]) for i in (1, 2)]
    samples.append(([matches(*t) for t in plain], [matches(*t) for t in speculative]))
    for a, b in samples:
        chi2, dof = two_sample_chi2(a, b)
        if chi2 > dof + 6 * math.sqrt(2 * dof):
            return True
    return False


@pytest.mark.slow
def test_sampled_verify_is_distributed_as_plain_sampling(monkeypatch):
    """Speculative sampling against plain sampling at temperature 1 over many seeds: the first two tokens after
    the prompt's have the same distribution, drafts accepted or not. The same statistic catches the classic
    slip (on a rejection, resampling from p with the draft still in it), so it can fail."""
    runner, spec = chi_runner(), chi_runner()
    drafts = greedy_drafts(chi_runner())
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(2 * CHI_SEEDS)]
    plain = [three_tokens(runner, p) for p in params[:CHI_SEEDS]]
    speculative = [three_tokens(spec, p, drafts) for p in params[CHI_SEEDS:]]
    accepted = sum(t1 == drafts(t0)[0] for t0, t1, _ in speculative)
    assert 0.2 * CHI_SEEDS < accepted < 0.8 * CHI_SEEDS  # drafts often accepted, often not: both paths run
    assert not distributions_differ(plain, speculative, drafts)
    # replayable: the same seed and drafts give the same tokens
    assert [three_tokens(spec, p, drafts) for p in params[CHI_SEEDS:CHI_SEEDS + 20]] == speculative[:20]

    real = sampling.sample

    def residual_keeps_the_draft(logits, params, seen, step, draft=None, allowed=None):
        token = real(logits, params, seen, step, draft, allowed)
        if draft is None or token == draft:
            return token
        return real(logits, params, seen, step + 1_000_003, None, allowed)

    monkeypatch.setattr(sampling, "sample", residual_keeps_the_draft)
    slipped = [three_tokens(spec, p, drafts) for p in params[CHI_SEEDS:]]
    assert distributions_differ(plain, slipped, drafts)


def test_every_verify_kernel_is_a_compiled_variant():
    """CI compiles (and checks for spills) every kernel a verify plan launches: ops.gemv_mma.VARIANTS."""
    from cullama.runtime.ops import gemv_mma

    for name in ("llama-2-7b", "tiny"):
        for k in range(1, plans.MAX_DRAFT + 1):
            for launch in plans.verify_plan(preset(name), 512, k).launches:
                if launch.spec.source == "gemv_mma.cu":
                    assert launch.spec.defines == gemv_mma.defines(16, k + 1)
                    assert launch.spec.defines in gemv_mma.VARIANTS
    assert plans.gemv("gemv_residual", 1).defines == gemv_mma.defines(16, 1)  # the decode step: the same kernel


# -- the kernels: their rows against one-row launches, bit for bit (on a GPU; on the CPU executor in test_verify_emu)
def gpu_launcher(kernels):
    """launch(spec, grid, block, args): the kernel on the GPU, its NumPy array arguments copied in and back."""
    import cupy as cp

    def launch(spec, grid, block, args):
        device = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
        kernels.function(spec)(grid, (block,), tuple(device))
        for host, on_device in zip(args, device):
            if isinstance(host, np.ndarray):
                host[...] = on_device.get()

    return launch


def twin_launcher(spec, grid, block, args):
    """launch(spec, grid, block, args) on the kernel's NumPy twin."""
    assert spec == plans.SAMPLE
    sample_twin.sample(*args, grid=(*grid, 1, 1)[:3])


def nan(*shape, dtype=np.float32):
    return np.full(shape, np.nan, dtype)


def check_gemv_rows(launch, rows, d=136, ff=184, V=1001, heads=5, kv_heads=1, hd=32, pos=29, seed=0):
    """Each gemv kernel the plans launch (gemv_mma.cu, FP16) with TOKENS = rows against `rows` launches of the decode
    step's instance (TOKENS 1) at the rows' positions: the same bits; odd sizes (K a multiple of 8: 16-byte rows),
    outputs poisoned; and close to the twin. (FP16 W passed twice and group 0, as the plans do: one signature.)"""
    rng = np.random.default_rng(seed)
    max_seq = pos + rows + 3
    x, g = rand(rng, rows, d, dtype=np.float32), rand(rng, d)
    wqkv, wo = rand(rng, (heads + 2 * kv_heads) * hd, d, scale=0.1), rand(rng, d, heads * hd, scale=0.1)
    w_gu, w_down, w_lm = rand(rng, 2 * ff, d, scale=0.1), rand(rng, d, ff, scale=0.1), rand(rng, V, d, scale=0.1)
    bias = rand(rng, (heads + 2 * kv_heads) * hd)  # Qwen2's q|k|v bias: every row adds it alike
    inp, hin = rand(rng, rows, heads * hd, dtype=np.float16), rand(rng, rows, ff, dtype=np.float16)  # FP16 inputs
    rope = np.stack(rope_tables(hd, np.arange(max_seq), 10000.0), -1).astype(np.float32)
    shape = (np.int32(d), np.int32(heads), np.int32(kv_heads), np.int32(hd), np.int32(max_seq), np.float32(EPS))
    zero = np.int32(0)  # the group: unread at BITS 16
    xn, ssp = gemv_twin.prepare(x, g, d)  # the prepared RMSNorm input (gemv_qkv_rope, gemv_logits)

    def run(tokens, sl, pos_now):
        """Every kernel on token rows `sl` of the inputs: {output name: array}."""
        n, per_block = len(range(rows)[sl]), plans.gemv_rows(tokens)
        spec = lambda name: plans.gemv(name, tokens)  # noqa: E731
        q, caches = nan(n, heads * hd), [nan(kv_heads, max_seq, hd, dtype=np.float16) for _ in range(2)]
        launch(spec("gemv_qkv_rope"), (-(-(heads + 2 * kv_heads) * hd // per_block),), plans.GEMV_THREADS,
               (xn[sl].copy(), ssp[sl].copy(), wqkv, wqkv, bias, q, *caches, rope, state_at(pos_now), verify_rows(n),
                *shape, zero))
        xo, xd = x[sl].copy(), x[sl].copy()
        prepared = {name: (nan(n, d, dtype=np.float16), nan(n, plans.ss_parts(d))) for name in ("o", "down")}
        launch(spec("gemv_residual"), (-(-d // per_block),), plans.GEMV_THREADS,
               (inp[sl].copy(), wo, wo, xo, g, *prepared["o"], np.int32(d), np.int32(heads * hd), zero))
        launch(spec("gemv_residual"), (-(-d // per_block),), plans.GEMV_THREADS,
               (hin[sl].copy(), w_down, w_down, xd, g, *prepared["down"], np.int32(d), np.int32(ff), zero))
        h, logits = nan(n, ff, dtype=np.float16), nan(n, logits_stride(V))
        launch(spec("gemv_gate_up_silu"), (-(-ff // (per_block // 2)),), plans.GEMV_THREADS,
               (xn[sl].copy(), ssp[sl].copy(), w_gu, w_gu, h, np.int32(ff), np.int32(d), np.float32(EPS), zero))
        launch(spec("gemv_logits"), (-(-V // per_block),), plans.GEMV_THREADS,
               (xn[sl].copy(), ssp[sl].copy(), w_lm, logits, np.int32(V), np.int32(d), np.float32(EPS)))
        return {"q": q, "k": caches[0][:, pos_now:pos_now + n], "v": caches[1][:, pos_now:pos_now + n], "o": xo,
                "down": xd, "o xn": prepared["o"][0], "o ssp": prepared["o"][1], "down xn": prepared["down"][0],
                "down ssp": prepared["down"][1], "h": h, "logits": logits}

    many = run(rows, slice(None), pos)
    for t in range(rows):
        for name, value in run(1, slice(t, t + 1), pos + t).items():
            row = many[name][:, t:t + 1] if name in ("k", "v") else many[name][t:t + 1]
            np.testing.assert_array_equal(row, value, err_msg=f"{name}, row {t} of {rows}")
    twin_q = np.empty((rows, heads * hd), np.float32)
    caches = [np.zeros((kv_heads, max_seq, hd), np.float16) for _ in range(2)]
    gemv_twin.gemv_qkv_rope(xn, ssp, wqkv, wqkv, bias, twin_q, *caches, rope, state_at(pos), verify_rows(rows), d,
                            heads, kv_heads, hd, max_seq, EPS, 0)
    np.testing.assert_allclose(many["q"], twin_q, rtol=2e-3, atol=2e-3)  # and right, not only consistent
    twin_logits = np.empty((rows, logits_stride(V)), np.float32)
    gemv_twin.gemv_logits(xn, ssp, w_lm, twin_logits, V, d, EPS)
    np.testing.assert_allclose(many["logits"][:, :V], twin_logits[:, :V], rtol=2e-3, atol=2e-3)
    assert np.isnan(many["logits"][:, V:]).all()  # the rows' padding is never written


def check_attention_rows(launch, hd, group, kv_heads, pos, rows, splits, window=None):
    """attention_decode over `rows` token rows (gridDim.z) against one-row launches at pos + t: the same bits,
    counters left at zero; and close to the twin. With a sliding window, each row its own."""
    q, k, v, max_seq, scale = attention_rows(hd, group, kv_heads, pos, rows, splits, seed=pos)
    heads, window = kv_heads * group, window or max_seq
    spec = KernelSpec("attention.cu", "attention_decode", (("HEAD_DIM", hd), ("GROUP", group)))

    def run(sl, n, pos_now):
        out, part = nan(n, heads * hd, dtype=np.float16), nan(n, heads, splits, hd + 2)  # out: FP16
        count = np.zeros((n, kv_heads), np.uint32)
        launch(spec, (kv_heads, splits, n), plans.ATTENTION_THREADS,
               (q[sl].copy(), k, v, part, count, out, state_at(pos_now), verify_rows(n), np.int32(max_seq),
                np.float32(scale),
                np.int32(window)))
        assert not count.any()
        return out, part

    out, part = run(slice(None), rows, pos)
    for t in range(rows):
        out1, part1 = run(slice(t, t + 1), 1, pos + t)
        np.testing.assert_array_equal(out[t:t + 1], out1)
        np.testing.assert_array_equal(part[t:t + 1], part1)
    twin_out = np.empty_like(out)
    attention_twin.attention_decode(q, k, v, np.empty(part.shape, np.float32), np.zeros((rows, kv_heads), np.uint32),
                                    twin_out, state_at(pos), verify_rows(rows), max_seq, scale, window,
                                    grid=(kv_heads, splits, rows))
    np.testing.assert_allclose(out, twin_out, rtol=1e-3, atol=1e-4)


def verify_sizes(V, D, xp=np):
    """The sample kernel's arguments after `arrivals` for a verify step over a seen [V] of one slot: masks (an `xp`
    array, never read: state[MASKED] is 0), V, d, seen_stride, mask_words, verify."""
    return xp.zeros(1, np.uint32), np.int32(V), np.int32(D), np.int32(V), np.int32(-(-V // 32)), np.int32(1)


def check_greedy_sample_rows(launch, V, penalty, D=40):
    """The sample kernel over 5 rows (greedy): picks, verdict, state, seen and x exactly the twin's, for drafts
    that miss at every row in turn (and a row with nothing to draw); the logits put back; arrivals at zero. One id
    not seen yet tops every row: row 0 picks it, and the rows after it only if the drafts count as seen (no penalty),
    so drafts repeat, and a penalty changes the picks."""
    logits, seen, embed = sample_case(V=V, seed=V)
    repeated = int(np.flatnonzero(seen == 0)[0])
    logits[:, repeated] = logits.max(axis=1) + 1
    fp = np.array([0.0, 1.0, penalty, 0.0], np.float32)
    argmax = SamplingParams(repetition_penalty=penalty, seed=0)
    for wrong in range(6):
        rows_logits = logits.copy()
        ids = [3]
        for r in range(4):
            before = seen.astype(bool) | np.isin(np.arange(V), ids[1:])
            pick = sampling.sample(logits[r], argmax, before, 0)
            ids.append(pick if r != wrong else (pick + 1) % V)
        if wrong == 5:  # every draft right, and the last row has nothing to draw
            rows_logits[4] = np.nan
        state, kernel_seen = state_at(11, step=3), seen.copy()
        x, picks, out = nan(D), np.full(5, -7, np.int32), np.full(6, -7, np.int32)
        arrivals = np.zeros(1, np.uint32)
        kernel_logits, nxt = at_row_stride(rows_logits), next_input(x)
        launch(plans.SAMPLE, (5,), plans.SAMPLE_THREADS, (kernel_logits, kernel_seen, state, fp, embed, *nxt,
                                                           verify_rows(5), np.array(ids, np.int32), picks, out,
                                                           arrivals, *verify_sizes(V, D)))
        assert_prepared(nxt)
        twin_seen, twin_state = seen.copy(), state_at(11, step=3)
        twin_out, twin_picks, twin_x = run_sample_twin(rows_logits, twin_seen, twin_state, fp, embed, ids)
        n = int(twin_out[0])
        assert n == min(wrong, 4) + 1
        np.testing.assert_array_equal(out[:n + 1], twin_out[:n + 1])
        np.testing.assert_array_equal(picks, twin_picks)
        np.testing.assert_array_equal(state, twin_state)
        np.testing.assert_array_equal(kernel_seen, twin_seen)
        np.testing.assert_array_equal(x, twin_x)
        np.testing.assert_array_equal(kernel_logits[:, :V], rows_logits)  # the drafts' logits, penalised, put back
        assert int(arrivals[0]) == 0


def check_drafts_outside_the_vocabulary(launch, V=517):
    """The sample kernel over 5 rows whose drafts hold an id outside [0, V) (first, in the middle, last; greedy and
    sampled, with a penalty, so the valid drafts before it are penalised in place): nothing is indexed with it
    (an index of 2^31 - 1 faults), every pick is NO_TOKEN, out = [1, NO_TOKEN], state one step on with NO_TOKEN,
    seen and the logits as they were, x = 0, arrivals at zero."""
    logits, seen, embed = sample_case(V=V, seed=1)
    for fp in (np.array([0.0, 1.0, 1.3, 0.0], np.float32), np.array([0.9, 0.95, 1.2, 0.0], np.float32)):
        for bad, where in ((V, 1), (-1, 1), (-2**31, 2), (V + 4096, 4), (2**31 - 1, 4)):
            ids = np.array([3, 10, 11, 12, 13], np.int32)
            ids[where] = bad
            kernel_logits, state, kernel_seen = at_row_stride(logits), state_at(11, step=3, seed=5), seen.copy()
            x, picks, out = nan(embed.shape[1]), np.full(5, -7, np.int32), np.full(6, -7, np.int32)
            arrivals = np.zeros(1, np.uint32)
            launch(plans.SAMPLE, (5,), plans.SAMPLE_THREADS, (kernel_logits, kernel_seen, state, fp, embed,
                                                               *next_input(x), verify_rows(5), ids, picks, out,
                                                               arrivals,
                                                               *verify_sizes(V, embed.shape[1])))
            case = f"draft {bad} at {where}, temperature {fp[0]}"
            assert out[:2].tolist() == [1, sampling.NO_TOKEN] and (picks == sampling.NO_TOKEN).all(), case
            expected = state_at(12, step=4, seed=5)
            expected[sample_twin.STATE_TOKEN] = sampling.NO_TOKEN
            np.testing.assert_array_equal(state, expected, err_msg=case)
            np.testing.assert_array_equal(kernel_seen, seen, err_msg=case)
            np.testing.assert_array_equal(kernel_logits, at_row_stride(logits), err_msg=case)
            assert not x.any() and int(arrivals[0]) == 0, case


def explained(token, logits, params, seen, step, draft, delta=1e-4) -> bool:
    """Whether the spec draws `token` for a draw moved by at most delta (the kernel's block scan and the spec's
    float32 cumsum round differently), in the draft-first order of the inverse CDF."""
    order = (lambda t: -1 if t == draft else t)  # noqa: E731 - the draft's bucket first, then id order
    u = sampling.uniform(params.seed, step)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "uniform", lambda s, t: max(u - delta, 0.0))
        lo = sampling.sample(logits, params, seen, step, draft)
        mp.setattr(sampling, "uniform", lambda s, t: u + delta)
        hi = sampling.sample(logits, params, seen, step, draft)
    return order(lo) <= order(token) <= order(hi)


def check_sampled_sample_rows(launch, V, trials, D=8):
    """The sample kernel over 5 rows at temperature > 0 (penalty, top-k, top-p): each row's pick is the twin's,
    or within rounding of a bucket edge in the draft-first order; the verdict follows from the picks."""
    logits, seen, embed = sample_case(V=V, seed=3, spike=9.0)
    fp = np.array([0.9, 0.95, 1.2, 0.0], np.float32)
    argmax = SamplingParams(repetition_penalty=1.2, seed=0)
    agree = 0
    for trial in range(trials):
        ids = [5]
        for r in range(4):  # the rows' argmax (likely accepted), one of them wrong
            before = seen.astype(bool) | np.isin(np.arange(V), ids[1:])
            pick = sampling.sample(logits[r], argmax, before, 0)
            ids.append(pick if r != trial % 5 else (pick + 3) % V)
        state, kernel_seen = state_at(11, step=7 * trial, seed=99, top_k=50), seen.copy()
        picks, out = np.full(5, -7, np.int32), np.full(6, -7, np.int32)
        launch(plans.SAMPLE, (5,), plans.SAMPLE_THREADS, (at_row_stride(logits), kernel_seen, state, fp, embed,
                                                           *next_input(nan(D)), verify_rows(5),
                                                           np.array(ids, np.int32), picks, out,
                                                           np.zeros(1, np.uint32), *verify_sizes(V, D)))
        params = sample_twin.params_from(state_at(11, step=7 * trial, seed=99, top_k=50), fp)
        for r in range(5):
            before = seen.astype(bool) | np.isin(np.arange(V), ids[1:r + 1])
            draft = ids[r + 1] if r < 4 else None
            expected = sampling.sample(logits[r], params, before, 7 * trial + r, draft)
            agree += picks[r] == expected
            assert picks[r] == expected or explained(picks[r], logits[r], params, before, 7 * trial + r, draft)
        n = next((r + 1 for r in range(4) if picks[r] != ids[r + 1]), 5)
        assert out[:n + 1].tolist() == [n, *ids[1:n], picks[n - 1]]
        assert state[sample_twin.STATE_STEP] == 7 * trial + n and state[sample_twin.STATE_TOKEN] == picks[n - 1]
    assert agree >= 0.9 * 5 * trials


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 5, 9])
def test_gpu_gemv_rows_are_one_row_launches(kernels, rows):
    check_gemv_rows(gpu_launcher(kernels), rows, seed=rows)


@pytest.mark.gpu
@pytest.mark.parametrize("hd,group,kv_heads,pos,rows,splits,window", [c + (None,) for c in ATTENTION_CASES]
                         + [(128, 1, 32, 500, 9, 8, None)] + WINDOW_CASES + [(128, 4, 8, 5000, 9, 32, 4096)])
def test_gpu_attention_rows_are_one_row_launches(kernels, hd, group, kv_heads, pos, rows, splits, window):
    check_attention_rows(gpu_launcher(kernels), hd, group, kv_heads, pos, rows, splits, window)


@pytest.mark.gpu
@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("V", [517, 32000])
def test_gpu_greedy_verify_sample_equals_its_twin(kernels, V, penalty):
    check_greedy_sample_rows(gpu_launcher(kernels), V, penalty)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [517, 32000])
def test_gpu_sampled_verify_sample_follows_its_twin(kernels, V):
    check_sampled_sample_rows(gpu_launcher(kernels), V, trials=40)


@pytest.mark.gpu
def test_gpu_verify_sample_bounds_its_drafts(kernels):
    check_drafts_outside_the_vocabulary(gpu_launcher(kernels))


@pytest.mark.gpu
@pytest.mark.parametrize("draft", [4, 2])
def test_gpu_sampled_verify_row_is_distributed_as_p(kernels, draft):
    """Two rows (one draft) at temperature 1, launched over and over (the kernel advances the step by what it
    accepts): row 0's pick, out[1] either way, follows p, and equals the draft exactly when accepted."""
    import cupy as cp

    n, V = 8000, len(LOGITS)
    fn = kernels.function(plans.SAMPLE)
    logits = cp.asarray(np.array([LOGITS, LOGITS], np.float32))
    state = cp.asarray(state_at(0, seed=2**63 + 9))
    ids, picks, out = cp.asarray(np.array([0, draft], np.int32)), cp.zeros(2, np.int32), cp.zeros(3, np.int32)
    args = (logits, cp.zeros(V, np.uint8), state, cp.asarray(np.array([1.0, 1.0, 1.0, 0.0], np.float32)),
            cp.zeros((V, 8), np.float16), *next_input(cp.zeros(8, np.float32), cp), cp.asarray(verify_rows(2)), ids,
            picks, out, cp.zeros(1, np.uint32), *verify_sizes(V, 8, cp))
    firsts, steps = [], 0
    for _ in range(n):
        fn((2,), (1024,), args)
        got = out.get()
        firsts.append(int(got[1]))
        assert got[0] == (2 if got[1] == draft else 1)
        steps += int(got[0])
    assert int(state.get()[sample_twin.STATE_STEP]) == steps
    assert_distribution(np.bincount(firsts, minlength=V) / n, softmax(LOGITS), n)


def gpu_verify_against_plain(plain: PlanRunner, spec: PlanRunner, prompt, params, calls=16):
    """Plain steps on one runner, verify calls (k cycling 1..8, drafts from the plain tokens, some wrong) on
    the other: the same tokens, every accepted row's logits bit-identical to the plain step's, and the state,
    seen and next input after each verdict the plain steps'."""
    tokens, logits, after = [plain.start(prompt, params)], [], []
    for _ in range(8 * calls):
        tokens.append(plain.next())
        logits.append(plain.backend.read("logits"))
        after.append([plain.backend.read(name) for name in ("state", "seen", "x")])
    assert spec.start(prompt, params) == tokens[0]
    done = 0
    for call in range(calls):
        drafts, right = drafts_from(tokens[done + 1:], call % plans.MAX_DRAFT + 1, call, spec.cfg.vocab_size)
        got = spec.verify(drafts)
        assert got == tokens[done + 1:done + 2 + right], call
        rows = spec.backend.read("verify_logits")
        for r in range(len(got)):
            np.testing.assert_array_equal(rows[r], logits[done + r], err_msg=f"call {call}, row {r}")
        done += len(got)
        for name, value in zip(("state", "seen", "x"), after[done - 1]):
            np.testing.assert_array_equal(spec.backend.read(name), value, err_msg=f"call {call}: {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("penalty", [1.0, 1.2], ids=["greedy", "penalty"])
def test_gpu_stories260k_verify_is_the_plain_steps_bit_for_bit(stories_dir, penalty):
    runners = [cullama.Llama.from_pretrained(stories_dir, device="cuda").runner for _ in range(2)]
    gpu_verify_against_plain(*runners, [1, 403, 407], SamplingParams(repetition_penalty=penalty, seed=0),
                             calls=6 if FAKE_GPU else 16)


@pytest.mark.gpu
def test_gpu_llama2_7b_shape_verify_is_the_plain_steps_bit_for_bit():
    """Four layers of LLaMA-2-7B's shapes (random weights): 32 heads of 128, 4096 wide, 32000 ids."""
    cfg = dataclasses.replace(preset("llama-2-7b"), num_layers=4, max_seq_len=1024, name="7b-4-layers")
    if FAKE_GPU:  # the NumPy twins at 7B shapes take minutes here: tiny's shapes
        cfg = dataclasses.replace(preset("tiny"), max_seq_len=1024, name="tiny-4-layers")
    plain, spec = (cullama.Llama.synthetic(cfg, device="cuda", seed=7).runner for _ in range(2))
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, cfg.vocab_size, size=500)]
    gpu_verify_against_plain(plain, spec, prompt, GREEDY, calls=4 if FAKE_GPU else 8)
