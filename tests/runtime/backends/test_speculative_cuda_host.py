"""Speculative decoding through the CUDA backend's host code, on the CPU against tests/fake_cupy.py (its kernels
are the NumPy twins): the generation loop, the draft model on its own GPU runner, and `bench --speculative`."""

import json

from click.testing import CliRunner

from cullama.bench import speculative as sb
from cullama.cli.main import main
from cullama.llama import Llama
from tests.runtime.backends.test_cuda_host import fake as fake  # noqa: F401 - the fixture, as test_cuda_host.py has it


def test_greedy_ids_with_ngram_and_a_draft_model(fake, stories_dir, stories_expected):
    llm = Llama.from_pretrained(stories_dir, device="cuda", draft_model=stories_dir, max_seq_len=128)
    assert llm.device == llm.draft.device == "cuda"
    for method, k in (("ngram", 4), ("draft", 8)):
        result = llm.generate("", max_new_tokens=100, speculative=method, draft_tokens=k)
        assert result.token_ids == stories_expected["ids"][:100], method
        stats = result.speculative
        assert stats["steps"] + stats["accepted"] == 99 and stats["steps"] < 99
    assert result.speculative["accepted"] == result.speculative["drafted"]  # stories260K drafting for itself


def test_bench_speculative_on_the_cuda_backend(fake, stories_dir, tmp_path):
    path = tmp_path / "spec.json"
    result = CliRunner().invoke(main, ["bench", "--device", "cuda", "--model", str(stories_dir), "--speculative",
                                       "replay", "--lengths", "12", "--samples", "12", "--warmup", "0",
                                       "--verify-context", "20", "--verify-reps", "1", "--max-seq-len", "64",
                                       "--json", str(path)])
    assert result.exit_code == 0, result.output
    record = json.loads(path.read_text())
    assert record["schema"] == sb.SCHEMA and record["device"] == "cuda" and record["options"]["verify"] == "batched"
    (row,) = record["results"]
    assert row["accepted"] == row["drafted"] == 9 and row["steps"] == 3  # 5 + 5 + 2 tokens: the last step shrank
    assert all(r["all_accepted"] == 1 for r in record["verify"]["rows"])
