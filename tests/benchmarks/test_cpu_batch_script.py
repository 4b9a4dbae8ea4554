"""benchmarks/cpu_batch.py end to end on stories260K (a few tokens): the figures and the profile are written, and a
batched request whose tokens differ from its solo ones (a row that depends on the others) fails the run."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cullama.runtime.ops import attention

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as when it runs as a script
import cpu_batch  # noqa: E402

QUICK = ["--requests", "3", "--max-new-tokens", "6", "--trials", "1"]


def test_cpu_batch_times_both_ways_and_writes_the_figures(stories_dir, tmp_path, capsys):
    out, profile = tmp_path / "batch.json", tmp_path / "profile.txt"
    code = cpu_batch.main([*QUICK, "--model", str(stories_dir), "--json", str(out), "--profile", str(profile)])
    assert code == 0 and "ratio" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["requests"] == 3 and len(record["batched_s"]) == len(record["in_a_row_s"]) == 1
    assert record["ratio"] == pytest.approx(min(record["batched_s"]) / min(record["in_a_row_s"]))
    assert "attention_decode" in profile.read_text()


def test_cpu_batch_fails_when_a_row_depends_on_the_batch(stories_dir, monkeypatch, capsys):
    """attention_decode made batch-dependent (rows after the first of a multi-row launch lose their attention):
    the batched requests' tokens then differ from their solo ones, and the run says so and exits 1."""
    real = attention.attention_decode

    def leaky(q, k_cache, v_cache, part, count, out, *args, grid):
        real(q, k_cache, v_cache, part, count, out, *args, grid=grid)
        if grid[2] > 1:
            out.reshape(grid[2], -1)[1:] = np.float32(0)

    monkeypatch.setattr(attention, "attention_decode", leaky)
    assert cpu_batch.main([*QUICK, "--temperature", "0", "--model", str(stories_dir)]) == 1
    assert "differ from its solo tokens" in capsys.readouterr().err


def test_cpu_batch_bad_arguments_are_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        cpu_batch.main(["--requests", "0"])
    assert exit_.value.code == 2 and "--requests" in capsys.readouterr().err
    assert cpu_batch.main(["--model", str(tmp_path / "nothing")]) == 1  # one line, no traceback
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
