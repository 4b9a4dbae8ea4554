"""`cullama` end to end on the CPU: stories260K, the goldens, and every failure mode as one line."""

import json

import pytest
from click.testing import CliRunner

from cullama.checkpoint import write_random
from cullama.cli.main import main
from cullama.config import preset
from conftest import load_golden


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_stories260k_greedy_text_from_an_empty_prompt(stories_dir, stories_expected):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 256, "")
    assert result.exit_code == 0, result.output
    assert result.stdout == stories_expected["text"] + "\n"


def test_json_output_and_prompt_from_stdin(stories_dir, stories_expected):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 12, "--json", input="")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["token_ids"] == stories_expected["ids"][:12]
    assert doc["prompt_ids"] == [1] and doc["finish_reason"] == "length"
    assert doc["text"] == "Once upon a time, there was a little girl named Lily."[: len(doc["text"])]
    assert len(doc["timings"]["token_s"]) == 11 and doc["timings"]["prefill_s"] > 0


def test_stop_string_ends_the_stream(stories_dir):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--stop", "Lily", "--json", "")
    doc = json.loads(result.stdout)
    assert doc["finish_reason"] == "stop"
    assert doc["text"] == "Once upon a time, there was a little girl named "


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-gqa-sharded"])
def test_golden_greedy_ids_by_prompt_ids(name):
    directory, cases, _ = load_golden(name)
    case = cases[0]
    result = run("generate", "--model", directory, "--device", "cpu", "--prompt-ids",
                 ",".join(map(str, case["prompt_ids"])), "--max-new-tokens", 24, "--ignore-eos", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == case["greedy_ids"]


def test_sampling_is_reproducible_with_a_seed(stories_dir):
    args = ("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 30, "--temperature", 0.9,
            "--top-p", 0.9, "--top-k", 40, "--json", "")
    first, second = (json.loads(run(*args, "--seed", 7).stdout) for _ in range(2))
    other = json.loads(run(*args, "--seed", 8).stdout)
    assert first["token_ids"] == second["token_ids"] != other["token_ids"]


def test_info_says_whether_there_is_a_gpu():
    result = run("info")
    assert result.exit_code == 0
    assert "numpy" in result.stdout and "gpu" in result.stdout


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


def test_missing_model_directory(tmp_path):
    one_line_error(run("generate", "--model", tmp_path / "nope", "hi"), "nope")


def test_bin_weights_are_refused_with_advice(tmp_path):
    cfg = preset("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", "--prompt-ids", "1"), "save_pretrained")


def test_prompt_longer_than_the_context(stories_dir):
    one_line_error(run("generate", "--model", stories_dir, "--device", "cpu", "--max-seq-len", 4,
                       "--prompt-ids", "1,2,3,4,5"), "context")


def test_text_prompt_without_a_tokenizer():
    directory, _, _ = load_golden("tiny-mha")
    one_line_error(run("generate", "--model", directory, "--device", "cpu", "hello"), "tokenizer")


def test_bad_sampling_option(stories_dir):
    one_line_error(run("generate", "--model", stories_dir, "--device", "cpu", "--top-p", 0, ""), "top_p")


def test_truncated_weights(tmp_path):
    write_random(tmp_path, preset("tiny"), seed=1)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", "--prompt-ids", "1"), "model.safetensors")


@pytest.fixture
def chat_model(tmp_path):
    """A random model with LLaMA-2's vocabulary, and the real LLaMA-2 tokenizer."""
    from cullama.config import LlamaConfig
    from conftest import shared_path

    tokenizer = shared_path("tokenizers", "llama2", "tokenizer.model")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_seq_len=256, name="chat-test")
    write_random(tmp_path, cfg, seed=3)
    return tmp_path, tokenizer


def test_chat_template_with_the_llama2_tokenizer(chat_model):
    from cullama.tokenizer import Tokenizer

    tmp_path, tokenizer = chat_model
    result = run("generate", "--model", tmp_path, "--tokenizer", tokenizer, "--device", "cpu", "--chat",
                 "--system", "Be brief.", "--max-new-tokens", 3, "--json", "Hi there")
    assert result.exit_code == 0, result.output
    expected = Tokenizer(tokenizer).chat_ids([{"role": "user", "content": "Hi there"}], system="Be brief.")
    assert json.loads(result.stdout)["prompt_ids"] == expected and expected[0] == 1


def test_ctrl_c_keeps_what_was_printed(stories_dir, monkeypatch):
    from cullama.generate import GenerationStream

    real_iter = GenerationStream.__iter__

    def interrupted(self):
        for i, piece in enumerate(real_iter(self)):
            if i == 5:
                raise KeyboardInterrupt
            yield piece

    monkeypatch.setattr(GenerationStream, "__iter__", interrupted)
    result = run("generate", "--model", stories_dir, "--device", "cpu", "")
    assert result.exit_code == 130
    assert result.stdout.startswith("Once upon") and "interrupted" in result.stderr


def test_chat_command_keeps_the_conversation(chat_model):
    from cullama.tokenizer import Tokenizer

    model, tokenizer = chat_model
    result = run("chat", "--model", model, "--tokenizer", tokenizer, "--device", "cpu", "--system", "Be brief.",
                 "--max-new-tokens", 4, "--json", input="Hi there\n\nAnd then?\n")
    assert result.exit_code == 0, result.output
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "And then?"}]
    assert second["prompt_ids"] == Tokenizer(tokenizer).chat_ids(history, system="Be brief.")
