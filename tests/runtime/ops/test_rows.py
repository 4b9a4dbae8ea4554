"""cullama/runtime/ops/rows.py: the decode state's layout is kernels_cu/common.cuh's (the host's one copy of it), and
row_positions reads a step's rows table as the kernels' row_slot and row_pos do."""

from __future__ import annotations

import re

import numpy as np

from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.ops import rows

DEFINE = re.compile(r"^#define (\w+) (\d+)\b", re.M)
LAYOUT_PREFIXES = ("STATE_", "FP_", "FPARAMS_", "ROW_")


def test_the_layout_is_common_cuhs():
    defines = {name: int(value) for name, value in DEFINE.findall((SOURCE_DIR / "common.cuh").read_text())}
    names = [name for name in vars(rows) if name.startswith(LAYOUT_PREFIXES)]
    assert len(names) == 14  # seven state fields and STATE_LEN, three fparams and FPARAMS_LEN, two row fields
    assert {name: getattr(rows, name) for name in names} == {name: defines[name] for name in names}
    assert defines["ROW_FIELDS"] == 2  # row_positions reads the table as [R, 2]


def test_row_positions_are_each_rows_slot_position_plus_its_offset():
    rng = np.random.default_rng(0)
    state = rng.integers(1000, 2000, (3, rows.STATE_LEN)).astype(np.int32)  # every other field far from a position
    state[:, rows.STATE_POS] = [40, 7, 19]
    table = np.array([[2, 0], [0, 3], [2, 1], [1, 0], [0, 9]], np.int32)  # the fifth row is past `rows`: not read
    for step_rows, state_buffer in ((table, state), (table.ravel(), state.ravel())):  # as the plans' buffers are
        slots, positions = rows.row_positions(step_rows, state_buffer, 4)
        assert (slots, positions) == ([2, 0, 2, 1], [19, 43, 20, 7])
        assert all(type(value) is int for value in slots + positions)
    assert rows.row_positions(table, state, 0) == ([], [])
