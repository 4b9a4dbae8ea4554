"""benchmarks/sample_step.py end to end on the CPU: against the fake CuPy (the kernel's rows timed by its events,
the twin's measured), and without a GPU (the twin's rows alone, one line saying why)."""

import json
import sys

import pytest

from tests import fake_cupy
from cullama.runtime import device
from tests.benchmarks.test_benchmark_scripts import fake  # noqa: F401  (the fixture; it puts benchmarks/ on sys.path)

import sample_step  # noqa: E402


def test_sample_step_times_the_kernel_and_its_twin(fake, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "sample.json"
    code = sample_step.main(["--vocabs", "517,33001", "--reps", "2", "--cpu-reps", "2", "--json", str(out)])
    assert code == 0 and "GPU us" in capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["complete"] and len(record["rows"]) == 2 * len(sample_step.OPTIONS)
    assert all(row["gpu_us"] > 0 and row["cpu_ms"] > 0 for row in record["rows"])
    assert {launch.spec.name for launch in fake.launches} == {"sample"}


@pytest.mark.parametrize("argv", [["--cpu-only"], []], ids=["cpu-only", "no-gpu"])
def test_sample_step_without_a_gpu_measures_the_twin(argv, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(device, "cuda_status", lambda: (False, "no NVIDIA GPU found"))
    assert sample_step.main([*argv, "--vocabs", "1000", "--cpu-reps", "1"]) == 0
    captured = capsys.readouterr()
    rows = [line for line in captured.out.splitlines() if line.strip().startswith("1000")]
    assert len(rows) == len(sample_step.OPTIONS) and all(" - " in row for row in rows)
    assert len(captured.err.strip().splitlines()) == 1 and "left out" in captured.err


def test_sample_step_bad_arguments_are_usage_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        sample_step.main(["--vocabs", "0"])
    assert exit_.value.code == 2 and "positive integers" in capsys.readouterr().err
