"""Twins of kernels_cu/sampling.cu: the decode step's last kernel (pick the token, set up the next step)."""

from __future__ import annotations

import numpy as np

from .. import sampling
from .prepare import write_prepared
from .rows import logit_rows

SOURCE = "sampling.cu"
VARIANTS = [()]

from .rows import (FP_REP_PENALTY, FP_TEMPERATURE, FP_TOP_P, FPARAMS_LEN, ROW_OFFSET, ROW_SLOT,  # noqa: F401
                   STATE_LEN, STATE_MASKED, STATE_POS, STATE_SEED_HI, STATE_SEED_LO, STATE_STEP, STATE_TOKEN,
                   STATE_TOP_K)

MASK_ROWS = 16  # a slot's rows of the masks buffer (sampling.cu MASK_ROWS = plan.VERIFY_ROWS)


def mask_bits(words: np.ndarray, V: int) -> np.ndarray:
    """bool [V] of one mask row (uint32 words): id i is allowed where bit i & 31 of word i >> 5 is set."""
    return np.unpackbits(np.ascontiguousarray(words, dtype=np.uint32).view(np.uint8), bitorder="little")[:V] != 0


def params_from(state: np.ndarray, fparams: np.ndarray) -> sampling.SamplingParams:
    """The SamplingParams that state [8] int32 and fparams [4] float32 hold (the seed as two uint32 words)."""
    words = np.asarray(state[:8], dtype=np.int32).view(np.uint32)
    return sampling.SamplingParams(
        temperature=float(fparams[FP_TEMPERATURE]), top_k=int(state[STATE_TOP_K]), top_p=float(fparams[FP_TOP_P]),
        repetition_penalty=float(fparams[FP_REP_PENALTY]),
        seed=int(words[STATE_SEED_LO]) | int(words[STATE_SEED_HI]) << 32)


def sample(logits, seen, state, fparams, embed, norm_w, x, xn, ssp, step_rows, ids, picks, out, arrivals, masks, V, d,
           seen_stride, mask_words, verify, *, grid):
    """logits [n, V] f32 at row stride ops.rows.logits_stride(V) (a decode step's: [V]), seen [slots, seen_stride]
    uint8, state [slots, 8] int32, fparams [slots, 4] f32, embed [V, d] f16, norm_w [d] f16, x [n, d] f32, xn [n, d]
    f16, ssp [n, ceil(d / SS_SPAN)] f32, step_rows [>= n, 2] int32 (slot, offset), ids [n] int32, picks [n] int32, out
    [1 + n] int32, arrivals [1], masks [slots, MASK_ROWS, mask_words] uint32; n = grid[0] rows. Wherever x row r is
    written below, xn and ssp row r get its prepared RMSNorm input with norm_w (ops/prepare.py: layer 0's, for the
    next step's first gemv_qkv_rope). A row's params, seen and state are its slot's (rows[r, 0]); where that
    slot's state[MASKED] is set, its sample() also takes allowed = mask_bits(masks[slot, offset]) (rows[r, 1]), and
    otherwise no mask is read.

    verify 0 (a batched decode step, one row per slot): picks[r] = cullama.runtime.sampling.sample(logits[r], params,
    seen, state[STEP]) of row r's slot, and as one decode step of that slot would: state[TOKEN] = picks[r],
    state[STEP] += 1, state[POS] += 1, seen[picks[r]] = 1, x[r] = embed[picks[r]] as float32 (0 and not seen
    where the pick is NO_TOKEN). ids, out and arrivals are not used.

    verify 1 (n rows of one slot, rows[0]'s: a decode step, n = 1, or a verify step): row r: picks[r] =
    cullama.runtime.sampling.sample(logits[r], params, seen | ids[1..r], state[STEP] + r, draft=ids[r + 1] if r + 1 <
    n). Then n' - 1 = how many leading drafts ids[1..] equal the pick of the row before them, out = [n', ids[1..n'-1],
    picks[n'-1]], and as n' decode steps would: state[TOKEN] = picks[n'-1], state[STEP] += n', state[POS] += n',
    seen[those n' tokens] = 1, x[0] = embed[picks[n'-1]] as float32, all in place; arrivals is left at 0. Where the
    last pick is NO_TOKEN (every logit of its row NaN or -inf), it is not marked seen and x = 0. A draft outside
    [0, V) (which the host never writes) makes every pick NO_TOKEN: n' = 1, nothing indexed by it.
    """
    n_rows = int(grid[0])
    states, fps = state.reshape(-1, STATE_LEN), fparams.reshape(-1, FPARAMS_LEN)
    seens, xs = seen.reshape(-1, int(seen_stride)), x.reshape(-1, int(d))
    table = np.asarray(step_rows).reshape(-1, 2)
    rows_logits = logit_rows(logits, V, n_rows)

    def allowed(r: int, slot: int):  # token row r's mask, if its slot is constrained (else masks is not read)
        if not states[slot, STATE_MASKED]:
            return None
        mask_rows = np.asarray(masks).reshape(-1, MASK_ROWS, int(mask_words))
        return mask_bits(mask_rows[slot, int(table[r, ROW_OFFSET])], V)

    if not verify:
        for r in range(n_rows):
            slot = int(table[r, ROW_SLOT])
            _sample_rows(rows_logits[r:r + 1], seens[slot], states[slot], fps[slot], embed, xs[r], ids[:1], picks[r:],
                         None, V, d, [allowed(r, slot)])
        write_prepared(xs[:n_rows], norm_w, xn.reshape(-1, int(d))[:n_rows], ssp.reshape(len(xs), -1)[:n_rows],
                       int(d))
        return
    slot = int(table[0, ROW_SLOT])
    _sample_rows(rows_logits, seens[slot], states[slot], fps[slot], embed, xs[0], ids, picks, out, V, d,
                 [allowed(r, slot) for r in range(n_rows)])
    write_prepared(xs[:1], norm_w, xn.reshape(-1, int(d))[:1], ssp.reshape(len(xs), -1)[:1], int(d))
    arrivals[0] = 0


def _sample_rows(rows_logits, seen, state, fparams, embed, x, ids, picks, out, V, d, allowed) -> None:
    """One sequence's step over its rows (1: a decode step; k + 1: a verify step), as `sample` says for verify 1;
    seen [>= V], state [8], fparams [4], x [d] are that sequence's; allowed: each row's mask (None: unconstrained);
    out None: not written."""
    rows, step = len(rows_logits), int(state[STATE_STEP])
    params, seen_mask = params_from(state, fparams), seen[:V] != 0
    drafts_are_ids = all(0 <= int(t) < V for t in ids[1:rows])
    for r, row in enumerate(rows_logits):
        if not drafts_are_ids:
            picks[r] = sampling.NO_TOKEN
            continue
        before = seen_mask.copy()
        before[ids[1:r + 1]] = True  # the drafts before row r: accepted by the time its pick matters
        picks[r] = sampling.sample(row[:V], params, before, step + r, int(ids[r + 1]) if r + 1 < rows else None,
                                   allowed[r])
    n = 1
    while drafts_are_ids and n < rows and picks[n - 1] == ids[n]:
        n += 1
    accepted = [int(t) for t in ids[1:n]] + [int(picks[n - 1])]
    if out is not None:
        out[0], out[1:n + 1] = n, accepted
    state[STATE_TOKEN] = accepted[-1]
    state[STATE_STEP] = step + n
    state[STATE_POS] += n
    if accepted[-1] == sampling.NO_TOKEN:
        seen[accepted[:-1]] = 1
        x[:d] = 0
        return
    seen[accepted] = 1
    x[:d] = embed[accepted[-1], :d].astype(np.float32)


def uniform_probe(seed, step, out):
    """out[0] = uniform(seed, step)."""
    out[0] = np.float32(sampling.uniform(int(seed), int(step)))


# kernels_cu/sampling.cu: the columns of a row of the logprobs kernel's output
LP_MAX, LP_SUM, LP_TARGET, LP_TARGET_ID, LP_TOP = range(5)
LP_MAX_TOP = 20
LP_TOP_ID = LP_TOP + LP_MAX_TOP
LP_WIDTH = LP_TOP_ID + LP_MAX_TOP
NO_LOGIT = 0x7FFFFFFF  # the NaN (bits) of a target outside [0, V), and of a top entry past the V-th id


def logprobs(logits, targets, out, V, stride, target_at, top, *, grid):
    """logits: rows at a stride of `stride` floats (row r: logits.reshape(-1)[r * stride:][:V]), targets int32
    (row r's: targets[target_at + r]), out [>= rows, LP_WIDTH] float32; rows = grid[0].

    Row r of out: LP_MAX m = max l (NaN as -inf), LP_SUM s = sum expf(l - m) (an l = m = +inf term is 1),
    LP_TARGET l[target] as stored (the NaN NO_LOGIT for a target outside [0, V)), LP_TARGET_ID the target (int32
    bits), and for j < min(top, LP_MAX_TOP) LP_TOP + j / LP_TOP_ID + j: the j-th largest logit (NaN as -inf, -0
    as +0) and its id, lower ids first on ties (NO_LOGIT and -1 past the V-th). Columns past them are left as
    they were. The kernel writes these bits exactly, but for s (its sum runs in another order).
    cullama.runtime.logprobs.from_rows turns a row into log-probabilities."""
    flat, ints = np.asarray(logits).reshape(-1), out.view(np.int32)
    targets = np.asarray(targets).reshape(-1)  # state [slots, 8] too: a decode step's token, at slot * 8 + 1
    for r in range(int(grid[0])):
        row = flat[r * stride:r * stride + V].astype(np.float32)
        keyed = np.where(np.isnan(row), np.float32(-np.inf), row) + np.float32(0)  # NaN -> -inf, -0 -> +0
        m = keyed.max()
        with np.errstate(invalid="ignore"):
            e = keyed - m
            p = np.where(np.isnan(e), np.float32(1), np.exp(e, dtype=np.float32))
        t = int(targets[target_at + r])
        out[r, LP_MAX], out[r, LP_SUM] = m, np.float32(p.sum(dtype=np.float64))
        if 0 <= t < V:
            out[r, LP_TARGET] = row[t]
        else:
            ints[r, LP_TARGET] = NO_LOGIT
        ints[r, LP_TARGET_ID] = t
        n = min(top, LP_MAX_TOP)
        order = np.lexsort((np.arange(V), -keyed))[:n]  # larger first, then the lower id
        ints[r, LP_TOP:LP_TOP + n], ints[r, LP_TOP_ID:LP_TOP_ID + n] = NO_LOGIT, -1
        out[r, LP_TOP:LP_TOP + len(order)], ints[r, LP_TOP_ID:LP_TOP_ID + len(order)] = keyed[order], order
