"""The checkpoint's row reader at its edges: a row longer than a chunk (read one row at a time, converted rows
included), and a chunk holding several non-finite values (the first one is named)."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.model import checkpoint
from cullama.model.checkpoint import write_random
from cullama.common.errors import CheckpointError
from cullama.model.weights import load_weights

from tests.model.test_checkpoint import DOWN1, Q0, SMALL, assert_fused, poison, read_all


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_rows_longer_than_a_chunk_are_read_one_at_a_time(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(checkpoint, "CHUNK", 16)  # SMALL's rows hold 32 and 48 elements
    directory = write_random(tmp_path / dtype, SMALL, dtype=dtype)
    reference = read_all(write_random(tmp_path / "f32", SMALL, dtype="float32"))
    assert_fused(load_weights(directory), reference, rtol=2.0 ** -8 if dtype == "bfloat16" else 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_first_non_finite_value_of_a_chunk_is_named(tmp_path, dtype):
    directory = write_random(tmp_path, SMALL, dtype=dtype)
    poison(directory, Q0, np.inf, (5, 7), dtype)  # later in the same chunk
    poison(directory, Q0, np.nan, (2, 3), dtype)
    with pytest.raises(CheckpointError, match=r"holds (nan|inf) at \[2, 3\]"):
        load_weights(directory)
    directory = write_random(tmp_path / "overflow", SMALL, dtype=dtype)
    if dtype != "float16":  # a finite value past FP16's range, then a NaN after it
        poison(directory, DOWN1, 1e6, (1, 1), dtype)
        poison(directory, DOWN1, np.nan, (3, 0), dtype)
        with pytest.raises(CheckpointError, match=f"{checkpoint.SOURCE_NAME[checkpoint.WRITE_DTYPES[dtype]]} value "
                                                  r"\S+ overflows float16"):
            load_weights(directory)
