"""Twins of kernels_cu/sampling.cu: the decode step's last kernel (pick the token, set up the next step)."""

from __future__ import annotations

import numpy as np

from .. import sampling

SOURCE = "sampling.cu"
VARIANTS = [()]

# kernels_cu/common.cuh
STATE_POS, STATE_TOKEN, STATE_STEP, STATE_TOP_K, STATE_SEED_LO, STATE_SEED_HI = range(6)
FP_TEMPERATURE, FP_TOP_P, FP_REP_PENALTY = range(3)


def params_from(state: np.ndarray, fparams: np.ndarray) -> sampling.SamplingParams:
    """The SamplingParams that state [8] int32 and fparams [4] float32 hold (the seed as two uint32 words)."""
    words = np.asarray(state[:8], dtype=np.int32).view(np.uint32)
    return sampling.SamplingParams(
        temperature=float(fparams[FP_TEMPERATURE]), top_k=int(state[STATE_TOP_K]), top_p=float(fparams[FP_TOP_P]),
        repetition_penalty=float(fparams[FP_REP_PENALTY]),
        seed=int(words[STATE_SEED_LO]) | int(words[STATE_SEED_HI]) << 32)


def sample(logits, seen, state, fparams, embed, x, V, d):
    """logits [V] f32, seen [V] uint8, state [8] int32, fparams [4] f32, embed [V, d] f16, x [d] f32.

    token = cullama.sampling.sample(logits, params, seen != 0, state[STEP]); then state[TOKEN] = token,
    state[STEP] += 1, state[POS] += 1, seen[token] = 1 and x = embed[token] as float32, all in place. Where
    the token is NO_TOKEN (every logit NaN or -inf), seen is left alone and x = 0.
    """
    step = int(state[STATE_STEP])
    token = sampling.sample(logits[:V], params_from(state, fparams), seen[:V] != 0, step)
    state[STATE_TOKEN] = token
    state[STATE_STEP] = step + 1
    state[STATE_POS] += 1
    if token == sampling.NO_TOKEN:
        x[:d] = 0
        return
    seen[token] = 1
    x[:d] = embed[token, :d].astype(np.float32)


def uniform_probe(seed, step, out):
    """out[0] = uniform(seed, step)."""
    out[0] = np.float32(sampling.uniform(int(seed), int(step)))
