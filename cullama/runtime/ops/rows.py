"""The decode state's layout, a step's rows table and its token rows (kernels_cu/common.cuh): their one home on the
host (the twins, engine.py and the backends read them from here).

state [slots, STATE_LEN] int32 and fparams [slots, FPARAMS_LEN] float32 hold each sequence slot's position, last
token, step counter and sampling parameters; a step's rows table [R, 2] int32 gives each token row's slot and its
offset from that slot's position (a decode step: one row (s, 0); a verify step: (s, 0..k); a batched step: (s_r, 0)).
A kernel compiled for T token rows takes its activations as [T, width] rows (token_rows) and writes logits at the row
stride logits_stride(V) (logit_rows).
"""

from __future__ import annotations

import numpy as np

STATE_POS, STATE_TOKEN, STATE_STEP, STATE_TOP_K, STATE_SEED_LO, STATE_SEED_HI, STATE_MASKED = range(7)
STATE_LEN = 8
FP_TEMPERATURE, FP_TOP_P, FP_REP_PENALTY = range(3)
FPARAMS_LEN = 4
ROW_SLOT, ROW_OFFSET = range(2)


def row_positions(step_rows, state, rows: int) -> tuple[list[int], list[int]]:
    """([slot], [position]) of token rows 0..rows-1: step_rows [>= rows, 2] (slot, offset) and state [slots, 8] as
    the kernels take them (common.cuh row_pos)."""
    table = np.asarray(step_rows).reshape(-1, 2)[:rows]
    slots = table[:, ROW_SLOT]
    positions = np.asarray(state).reshape(-1, STATE_LEN)[slots, STATE_POS] + table[:, ROW_OFFSET]
    return slots.tolist(), positions.tolist()


def logits_stride(V: int) -> int:
    """The row stride of a verify step's logits [rows, V]: V rounded up to 4, so every row is 16-byte aligned
    for the sample kernel's float4 loads (kernels_cu/common.cuh logits_stride, the same rule)."""
    return -(-V // 4) * 4


def logit_rows(logits: np.ndarray, V: int, rows: int) -> np.ndarray:
    """[rows, >= V] views of a logits argument at the kernels' row stride logits_stride(V), whatever the
    array's own shape (a buffer's width is logits_stride(vocab) >= logits_stride(V)); written through."""
    if not logits.flags.c_contiguous:  # reshape would copy, and the rows written would be lost
        raise ValueError("logits must be a contiguous array (its rows are written in place)")
    flat = logits.reshape(-1)
    if rows == 1:
        return flat[None, :V]
    return flat[: rows * logits_stride(V)].reshape(rows, logits_stride(V))


def token_rows(a: np.ndarray) -> np.ndarray:
    """[T, width] rows of a twin argument: a decode step's 1-D array is one row (a view, written through)."""
    return a[None] if a.ndim == 1 else a
