"""The decode state's layout and a step's rows table (kernels_cu/common.cuh): its one home on the host (the twins,
engine.py and the backends read it from here).

state [slots, STATE_LEN] int32 and fparams [slots, FPARAMS_LEN] float32 hold each sequence slot's position, last
token, step counter and sampling parameters; a step's rows table [R, 2] int32 gives each token row's slot and its
offset from that slot's position (a decode step: one row (s, 0); a verify step: (s, 0..k); a batched step: (s_r, 0)).
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
