"""benchmarks/serve_latency.py end to end on the CPU with stories260K, the smallest run that takes every step:
a GPU session's minutes should not go to a typo in it. Its figures are not checked (a test is no benchmark)."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as when it runs as a script

import serve_latency  # noqa: E402


def test_serve_latency_prints_its_table_and_writes_every_sample(stories_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    assert serve_latency.main(["--model", str(stories_dir), "--device", "cpu", "--lengths", "3,5", "--requests", "2",
                               "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["L", "tokens", "chunks"])
    assert [line.split()[:3] for line in lines[header + 1:header + 3]] == [["3", "3", "3"], ["5", "5", "5"]]
    record = json.loads(out.read_text())
    assert record["complete"] and record["device"] == "cpu" and record["model"] == "stories260K"
    first = record["rows"][0]
    assert first["tokens"] == [3, 3]
    assert len(first["client_gap_ms"]) == len(first["stream_token_ms"]) == 2 * 2  # 2 requests, 2 gaps each
    assert set(first["summary"]) >= {"added_ms_per_token", "engine_token_ms_mean", "client_gap_ms_p99"}


def test_the_synthetic_server_process_loads_random_weights_with_the_named_tokenizer(stories_dir, monkeypatch):
    # Random LLaMA-2-7B weights are too big for the CPU; the `tiny` preset takes the same path up to the check
    # that its vocabulary (1024) matches the tokenizer's (stories260K: 512).
    from cullama.common.errors import CullamaError
    from cullama.server import launch

    served = {}
    monkeypatch.setattr(launch, "run", lambda load, settings, host, port, max_queue: served.update(
        load=load, settings=settings, host=host, port=port) or 0)
    tokenizer = str(stories_dir / "tokenizer.model")
    assert serve_latency.main(["--serve-synthetic", "tiny", "--tokenizer", tokenizer, "--device", "cpu"]) == 0
    assert (served["settings"].model_name, served["settings"].context, served["host"], served["port"]) == \
        ("tiny", 1024, "127.0.0.1", 0)
    with pytest.raises(CullamaError, match="has 512 pieces, the tiny preset 1024"):
        served["load"]()
