"""`--model org/name` and `--revision` on every command that takes a model, on a hub cache laid out in a temporary
folder (tests/hub_cache.py), offline: in process (huggingface_hub's settings patched), and `cullama serve` as a
process configured as a user configures it (HF_HUB_CACHE, HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from cullama.cli.main import main
from tests.hub_cache import REPO, stories_cache

huggingface_hub = pytest.importorskip("huggingface_hub", reason="the hub extra is not installed (pip install -e "
                                                                "'.[test]')")
from huggingface_hub import constants  # noqa: E402


@pytest.fixture
def cache(tmp_path, stories_dir, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return stories_cache(tmp_path / "hub", stories_dir)


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_generate_from_a_hub_id_and_a_revision(cache, stories_expected):
    out = run("generate", "--model", REPO, "--device", "cpu", "--max-new-tokens", 12, "--json", "")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)["token_ids"] == stories_expected["ids"][:12]
    # the tag v0's config.json: a context of 64 tokens, so 70 new tokens stop at its end
    out = run("generate", "--model", REPO, "--revision", "v0", "--device", "cpu", "--max-new-tokens", 70, "--json", "")
    assert out.exit_code == 0, out.output
    assert len(json.loads(out.stdout)["token_ids"]) == 63


def test_info_chat_perplexity_and_bench_take_a_hub_id(cache, tmp_path):
    out = run("info", "--model", REPO, "--revision", "main")
    assert out.exit_code == 0 and "model: karpathy/stories260K" in out.stdout, out.output
    out = CliRunner().invoke(main, ["chat", "--model", REPO, "--device", "cpu", "--max-new-tokens", "3"], input="hi\n")
    assert out.exit_code == 0, out.output
    (tmp_path / "ids.txt").write_text("1 403 407 261 378 432")
    out = run("perplexity", "--model", REPO, "--revision", "v0", "--device", "cpu", "--ids", tmp_path / "ids.txt")
    assert out.exit_code == 0 and "window of 64 tokens" in out.stdout, out.output
    out = run("bench", "--model", REPO, "--device", "cpu", "--lengths", "4", "--samples", 4, "--warmup", 0,
              "--prompt-len", 2, "--json", tmp_path / "bench.json")
    assert out.exit_code == 0, out.output
    assert json.loads((tmp_path / "bench.json").read_text())["model"] == REPO


@pytest.mark.parametrize("args,needle", [
    (("--model", "karpathy/missing"), "error: karpathy/missing is not a local directory, nor in the hub cache "),
    (("--model", REPO, "--revision", "v9"), 'error: karpathy/stories260K (revision "v9") is not a local directory'),
    (("--model", "STORIES", "--revision", "main"), "error: --revision is for a HuggingFace hub id, and "),
    (("--model", "karpathy/stories260K", "--draft-model", "karpathy/nodraft"),
     "error: karpathy/nodraft is not a local directory, nor in the hub cache"),
    (("--model", "karpathy/stories260K", "--tokenizer", "karpathy/notok"),
     "error: karpathy/notok is not a local directory, nor in the hub cache"),
])
def test_what_cannot_be_had_is_one_line_and_exit_2(cache, stories_dir, args, needle):
    args = [str(stories_dir) if a == "STORIES" else a for a in args]
    out = run("generate", *args, "--device", "cpu", "--max-new-tokens", 2, "")
    assert out.exit_code == 2 and out.stderr.startswith(needle) and out.stderr.count("\n") == 1, out.output


def test_serve_a_hub_id_from_the_cache_named_by_the_environment(tmp_path, stories_dir, stories_expected):
    from tests.serving import ServerProcess, openai_client, run_serve

    stories_cache(tmp_path / "hub", stories_dir)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    server = ServerProcess(REPO, tmp_path / "server.log", "--revision", "main", env=env)
    try:
        server.wait_ready()
        client = openai_client(server)
        assert [m.id for m in client.models.list().data] == [REPO]  # a hub id is served under its id, as vLLM does
        out = client.completions.create(model=REPO, prompt=[1], max_tokens=8, temperature=0)
        assert out.choices[0].text == stories_expected["text"][:len(out.choices[0].text)] != ""
    finally:
        assert server.stop() == 0, server.log()
    done = run_serve("--model", "karpathy/missing", "--port", "0", env=env)
    assert done.returncode == 2 and done.stderr.startswith("error: karpathy/missing is not a local directory, nor in "
                                                           "the hub cache") and done.stderr.count("\n") == 1
