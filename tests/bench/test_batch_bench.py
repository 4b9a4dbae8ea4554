"""`cullama bench --batch` (cullama/bench/batch.py): its table and record, and its option errors before anything
loads. The figures are measurements, never asserted (benchmarks/PREDICTIONS.md holds the predictions)."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from cullama.cli.main import main


def bench(*args):
    return CliRunner().invoke(main, ["bench", "--device", "cpu", *[str(a) for a in args]])


def test_bench_batch_reports_every_size(tmp_path, stories_dir):
    record = tmp_path / "batch.json"
    out = bench("--model", stories_dir, "--batch", "1,3", "--samples", 3, "--warmup", 1, "--prompt-len", 5,
                "--json", record)
    assert out.exit_code == 0, out.output
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"] and rows[0][-3:] == ["1.00x", "-", "-"]
    assert rows[1][-1].endswith("x") and float(rows[1][-2]) > 0  # the gap while a prompt joins two running rows
    assert "prefill chunk 64" in out.stdout  # stories260K loaded for batching (plan.batch_prefill_chunk)
    data = json.loads(record.read_text())
    assert data["kind"] == "batch" and [s["batch"] for s in data["sizes"]] == [1, 3]
    assert all(len(s["step_ms"]) == 3 and s["tokens_per_s"] > 0 for s in data["sizes"])
    assert data["sizes"][0]["join_ms"] == [] and data["sizes"][0]["join_vs_step"] is None
    assert len(data["sizes"][1]["join_ms"]) == 5 and data["sizes"][1]["join_max_ms"] >= data["sizes"][1]["join_p50_ms"]
    assert data["options"]["prefill_chunk"] == 64
    for size, row in zip(data["sizes"], rows):  # each size's figures are its timed steps', as the table shows them
        ms = size["step_ms"]
        assert [size["p50_ms"], size["p99_ms"]] == pytest.approx(list(np.percentile(ms, [50, 99])))
        assert size["tokens_per_s"] == pytest.approx(size["batch"] * 1e3 / np.mean(ms))
        assert size["sequence_tokens_per_s"] == pytest.approx(size["tokens_per_s"] / size["batch"])
        assert row[1:5] == [f"{size['p50_ms']:.3f}", f"{size['p99_ms']:.3f}", f"{size['tokens_per_s']:.1f}",
                            f"{size['sequence_tokens_per_s']:.1f}"]
    assert data["sizes"][1]["vs_batch_1"] == data["sizes"][1]["p50_ms"] / data["sizes"][0]["p50_ms"]


def test_bench_batch_option_errors(stories_dir):
    for args, words in ((("--batch", "0"), "--batch '0'"), (("--batch", "65"), "each from 1 to 64"),
                        (("--batch", "x"), "not a comma-separated list"),
                        (("--batch", "2", "--speculative", "ngram"), "either --batch or --speculative"),
                        (("--batch", "2", "--samples", "600"), "do not fit in the context")):
        out = bench("--model", stories_dir, *args)
        assert out.exit_code != 0 and words in out.output, (args, out.output)
        assert len([line for line in out.output.splitlines() if line.startswith("error")]) == 1, out.output
