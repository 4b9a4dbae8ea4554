"""benchmarks/logprobs_step.py end to end on the CPU against the fake CuPy (as
tests/benchmarks/test_benchmark_scripts.py runs the other scripts): every graph it times is captured once per name, the
rows say what the kernel and the host add."""

import json

import pytest

from tests.benchmarks.test_benchmark_scripts import fake  # noqa: F401  (the fixture)

import logprobs_step  # noqa: E402  (benchmarks/ is on sys.path: test_benchmark_scripts put it there)


def test_logprobs_step_times_each_graph_and_the_host(fake, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "logprobs.json"
    code = logprobs_step.main(["--model", "tiny", "--context", "5", "--steps", "3", "--trials", "2", "--tops", "0,3",
                               "--max-seq-len", "24", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0 and "+kernel us" in stdout
    record = json.loads(out.read_text())
    assert record["complete"] and [r["top"] for r in record["rows"]] == [0, 3] and len(record["trials"]) == 2
    for row in record["rows"]:
        assert row["graph_ms"] > 0 and row["host_ms"] > 0
        assert row["kernel_us"] == pytest.approx((row["graph_ms"] - record["graph_ms"]) * 1e3)
    assert len(fake.graphs) == 3  # the plain decode graph and one per top, each captured once


def test_logprobs_step_refuses_what_does_not_fit(fake, capsys):  # noqa: F811
    with pytest.raises(SystemExit):
        logprobs_step.main(["--model", "tiny", "--context", "20", "--steps", "10", "--max-seq-len", "24"])
    with pytest.raises(SystemExit):
        logprobs_step.main(["--model", "tiny", "--tops", "21"])
