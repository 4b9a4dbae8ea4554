"""`cullama` end to end on the CPU: stories260K, the goldens, and every failure mode as one line."""

import json

import pytest
from click.testing import CliRunner

from cullama.model.checkpoint import write_random
from cullama.cli.main import main
from cullama.model.config import preset
from tests.conftest import load_golden


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
    assert doc["finish_reason"] == "stop" and doc["stop_string"] == "Lily"
    assert doc["text"] == "Once upon a time, there was a little girl named "


def test_the_completion_reads_after_the_prompt(stories_dir):
    # "...there was" goes on " a little girl": the first piece keeps its space, as transformers reads it
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 5, "--prompt-ids",
                 "1,403,407,261,378,432,383,286")
    assert result.exit_code == 0 and result.stdout == " a little girl\n", result.output


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


@pytest.mark.parametrize("args,fragment", [
    (["--top-p", 0], "--top-p must be in (0, 1]"), (["--top-p", 1.5], "--top-p"),
    (["--temperature", "nan"], "--temperature"),
    (["--top-k", 3_000_000_000], "--top-k must be an integer from 0 (off) to 2147483647"),
    (["--top-k", -1], "--top-k"), (["--max-new-tokens", -1], "--max-new-tokens"), (["--seed", -1], "--seed"),
    (["--max-seq-len", 1], "--max-seq-len must be an integer from 2"),
    (["--prompt-ids", "1,2", "--chat"], "--chat"), (["--system", "x"], "--system needs --chat"),
])
def test_bad_options_are_refused_before_the_weights_load(tmp_path, args, fragment):
    """A model directory with no weights at all: the option is what the error is about."""
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    args = args if "--prompt-ids" in args else [*args, "--prompt-ids", "1"]
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", *args), fragment)


@pytest.mark.parametrize("args", [
    ["generate", "--model", ""], ["generate", "--model", "STORIES", "--draft-model", ""],
    ["generate", "--model", "STORIES", "--tokenizer", ""], ["chat", "--model", ""], ["serve", "--model", ""],
    ["serve", "--model", "STORIES", "--draft-model", ""], ["bench", "--model", ""],
    ["bench", "--synthetic", "tiny", "--speculative", "draft", "--draft-model", ""],
    ["bench", "--synthetic", "tiny", "--speculative", "ngram", "--acceptance-model", ""],
], ids=lambda args: " ".join(a or '""' for a in args))
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(tmp_path, stories_dir, monkeypatch, args):
    for name in ("config.json", "model.safetensors", "tokenizer.model"):  # a checkpoint right here
        (tmp_path / name).symlink_to(stories_dir / name)
    monkeypatch.chdir(tmp_path)
    args = [str(stories_dir) if a == "STORIES" else a for a in args]
    flag = args[args.index("") - 1]
    one_line_error(run(*args, "--device", "cpu", *(["x"] if args[0] == "generate" else [])),
                   f'{flag} is empty: name a path ("." for the current directory)')


@pytest.mark.parametrize("changes,fragment", [
    ({"head_dim": 96, "num_heads": 4, "num_kv_heads": 2, "hidden_size": 384},
     "head_dim 96 is not supported by cullama's kernels"),
    ({"num_heads": 16, "num_kv_heads": 1, "head_dim": 16}, "not supported by cullama's kernels"),
    ({"hidden_size": 8320, "num_heads": 65, "num_kv_heads": 13, "head_dim": 128},
     "hidden_size 8320 is not supported by cullama's kernels (at most 8192)"),
    ({"vocab_size": 8}, "token id 9 is outside the vocabulary [0, 8)"),
])
def test_shapes_and_prompts_are_checked_before_the_weights_load(tmp_path, changes, fragment):
    import dataclasses

    cfg = dataclasses.replace(preset("tiny"), **changes)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", "--prompt-ids", "1,9"), fragment)


def test_a_text_prompt_needs_a_tokenizer_before_the_weights_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", "hello"), "--prompt-ids", "--tokenizer")


def test_a_stop_string_needs_a_tokenizer_before_the_weights_load(tmp_path):
    """The fourth sweep: --stop on a model without a tokenizer was taken and could never match (exit 0, run to the
    budget), while --regex was refused. A stop string is matched in the text: without a tokenizer, a 2."""
    (tmp_path / "config.json").write_text(json.dumps(preset("tiny").to_hf_dict()))  # no weights: refused first
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", "--prompt-ids", "1,2,3", "--stop", "283"),
                   "--stop needs the model's tokenizer")


def test_a_prompt_from_standard_input_loses_its_line_ending_crlf_too(stories_dir):
    """The fourth sweep: a prompt saved with Windows line endings kept its carriage return (one more token)."""
    docs = [json.loads(run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 2, "--json",
                           input=text).stdout) for text in ("Once upon a time\n", "Once upon a time\r\n")]
    assert docs[0]["prompt_ids"] == docs[1]["prompt_ids"] and docs[0]["token_ids"] == docs[1]["token_ids"]


def test_an_empty_prompt_where_the_tokenizer_adds_no_bos():
    """The fourth sweep: on Qwen2 (no BOS) an empty prompt was refused saying that an empty prompt starts from
    BOS."""
    directory, _, _ = load_golden("tiny-qwen2")
    one_line_error(run("generate", "--model", directory, "--device", "cpu", ""), "adds no BOS")


def test_a_tokenizer_larger_than_the_vocabulary(tmp_path):
    from tests.conftest import shared_path

    directory, _, _ = load_golden("tiny-mha")
    llama2 = shared_path("tokenizers", "llama2", "tokenizer.model")
    one_line_error(run("generate", "--model", directory, "--tokenizer", llama2, "--device", "cpu", "hello"),
                   "32000 pieces", "vocabulary of 512")


def test_a_context_larger_than_memory_exits_1(stories_dir):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-seq-len", 1_000_000_000, "")
    assert result.exit_code == 1, result.output
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: needs ") and "KV cache" in line and "--max-seq-len" in line


def test_truncated_weights(tmp_path):
    write_random(tmp_path, preset("tiny"), seed=1)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    one_line_error(run("generate", "--model", tmp_path, "--device", "cpu", "--prompt-ids", "1"), "model.safetensors")


@pytest.fixture
def chat_model(tmp_path):
    """A random model with LLaMA-2's vocabulary, and the real LLaMA-2 tokenizer."""
    from cullama.model.config import LlamaConfig
    from tests.conftest import shared_path

    tokenizer = shared_path("tokenizers", "llama2", "tokenizer.model")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_seq_len=256, name="chat-test")
    write_random(tmp_path, cfg, seed=3)
    return tmp_path, tokenizer


def test_chat_template_with_the_llama2_tokenizer(chat_model):
    from cullama.text.tokenizer import Tokenizer

    tmp_path, tokenizer = chat_model
    result = run("generate", "--model", tmp_path, "--tokenizer", tokenizer, "--device", "cpu", "--chat",
                 "--system", "Be brief.", "--max-new-tokens", 3, "--json", "Hi there")
    assert result.exit_code == 0, result.output
    expected = Tokenizer(tokenizer).chat_ids([{"role": "user", "content": "Hi there"}], system="Be brief.")
    assert json.loads(result.stdout)["prompt_ids"] == expected and expected[0] == 1


def said(result) -> str:
    """stderr without the notes."""
    return "".join(line for line in result.stderr.splitlines(keepends=True) if not line.startswith("note: "))


def interrupt_decoding_at(monkeypatch, step):
    """KeyboardInterrupt in the `step`-th decode step of the CLI's model, as a Ctrl-C would raise it."""
    from cullama.runtime.engine import PlanRunner

    real, calls = PlanRunner.next, []

    def next_token(self, ahead=False):
        calls.append(1)
        if len(calls) == step:
            raise KeyboardInterrupt
        return real(self, ahead)

    monkeypatch.setattr(PlanRunner, "next", next_token)


def test_ctrl_c_keeps_what_was_printed(stories_dir, monkeypatch):
    interrupt_decoding_at(monkeypatch, 12)
    result = run("generate", "--model", stories_dir, "--device", "cpu", "")
    assert result.exit_code == 130
    assert result.stdout == "Once upon a time, there was a little girl\n"
    assert said(result) == "interrupted\n"


def test_ctrl_c_with_json_prints_the_record_so_far(stories_dir, stories_expected, monkeypatch):
    interrupt_decoding_at(monkeypatch, 12)
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--json", "")
    assert result.exit_code == 130 and said(result) == "interrupted\n"
    doc = json.loads(result.stdout)
    assert doc["finish_reason"] == "interrupted" and doc["token_ids"] == stories_expected["ids"][:12]
    assert doc["text"] == "Once upon a time, there was a little girl" and doc["device"] == "cpu"


def test_ctrl_c_while_loading_exits_130(stories_dir, monkeypatch):
    from cullama import llama

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(llama, "load_checkpoint", interrupted)
    for command in ("generate", "chat"):
        result = run(command, "--model", stories_dir, "--device", "cpu", input="")
        assert result.exit_code == 130 and result.stderr == "interrupted\n" and result.stdout == ""


def test_ctrl_c_at_the_chat_prompt_exits_130(stories_dir, monkeypatch):
    from cullama.cli import main as cli

    def lines(self):
        yield "Hello"
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.TextInput, "lines", lines)
    result = run("chat", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 5, "--json")
    assert result.exit_code == 130 and said(result) == "interrupted\n"
    assert json.loads(result.stdout)["finish_reason"] == "length"  # the finished turn was printed


def test_ctrl_c_in_info_exits_130(monkeypatch):
    from cullama.runtime import device

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(device, "environment", interrupted)
    result = run("info")
    assert result.exit_code == 130 and result.stderr == "interrupted\n"  # not click's "Aborted!", exit 1


def test_the_seed_used_is_in_the_json(stories_dir):
    args = ("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 20, "--temperature", 1.0,
            "--json", "")
    drawn = json.loads(run(*args).stdout)
    assert isinstance(drawn["seed"], int)
    again = json.loads(run(*args, "--seed", drawn["seed"]).stdout)
    assert again["token_ids"] == drawn["token_ids"] and again["seed"] == drawn["seed"]


def test_auto_says_when_it_runs_on_the_cpu(stories_dir, monkeypatch):
    from cullama.runtime import device

    monkeypatch.setattr(device, "cuda_status", lambda: (False, "no NVIDIA GPU found"))
    result = run("generate", "--model", stories_dir, "--max-new-tokens", 3, "")
    assert result.exit_code == 0
    assert result.stderr.splitlines()[0] == "note: running on the CPU: no NVIDIA GPU found"


def test_stdin_that_is_not_utf8_is_decoded_with_a_note(stories_dir):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 5, "--json",
                 input=b"Once upon \xff\xfe a time")
    assert result.exit_code == 0, result.output
    assert result.stderr.count("not valid UTF-8") == 1
    from cullama.text.tokenizer import Tokenizer
    tok = Tokenizer(stories_dir / "tokenizer.model")
    assert json.loads(result.stdout)["prompt_ids"] == tok.encode("Once upon \ufffd\ufffd a time")


@pytest.mark.parametrize("command, what", [("generate", "standard input"), ("chat", "a line of standard input")])
def test_endless_standard_input_stops_at_the_cap(stories_dir, monkeypatch, command, what):
    # issue 30 item 4's sibling: `cullama generate < /dev/zero` read to the end of memory too
    from cullama.cli import main as cli

    monkeypatch.setattr(cli, "MAX_INPUT_BYTES", 1 << 20)
    result = run(command, "--model", stories_dir, "--device", "cpu", input=b"x" * (2 << 20))
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == f"error: {what} holds more than 1 MiB, the most cullama reads from one " \
                                             "input (some 16M tokens, far past any model's context)"


def test_an_undecodable_argument_is_decoded_with_a_note(stories_dir):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 3, "Once \udcff")
    assert result.exit_code == 0, result.output
    assert "note: PROMPT is not valid UTF-8" in result.stderr


def test_chat_command_keeps_the_conversation(chat_model):
    from cullama.text.tokenizer import Tokenizer

    model, tokenizer = chat_model
    result = run("chat", "--model", model, "--tokenizer", tokenizer, "--device", "cpu", "--system", "Be brief.",
                 "--max-new-tokens", 4, "--json", input="Hi there\n\nAnd then?\n")
    assert result.exit_code == 0, result.output
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    history = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "And then?"}]
    assert second["prompt_ids"] == Tokenizer(tokenizer).chat_ids(history, system="Be brief.")


def test_chat_drops_the_oldest_exchanges_and_refuses_a_message_too_long(stories_dir):
    turns = [f"Tell me about dog {i}." for i in range(4)] + ["dog " * 200, "And then?"]
    result = run("chat", "--model", stories_dir, "--device", "cpu", "--max-seq-len", 128, "--max-new-tokens", 8,
                 "--system", "Be brief.", "--json", input="\n".join(turns) + "\n")
    assert result.exit_code == 0, result.output
    replies = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(replies) == 5  # the message too long was not sent; the chat went on
    assert all(len(r["prompt_ids"]) + len(r["token_ids"]) <= 128 for r in replies)
    notes = [line for line in result.stderr.splitlines() if "outgrew" in line]
    assert notes and all(line.startswith("note: the conversation outgrew the context of 128 tokens") for line in notes)
    (refused,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert "leaves no room in the context of 128 tokens" in refused and refused.endswith("the message was not sent")
    from cullama.text.tokenizer import Tokenizer
    tok = Tokenizer(stories_dir / "tokenizer.model")
    text = tok.decode(replies[-1]["prompt_ids"])  # the system prompt and the last message are kept
    assert text.startswith("[INST] <<SYS>>\nBe brief.\n<</SYS>>") and text.endswith("[INST] And then? [/INST]")
    assert "dog 0" not in text


def test_chat_without_a_tokenizer_speaks_of_chat():
    directory, _, _ = load_golden("tiny-mha")
    result = run("chat", "--model", directory, "--device", "cpu", input="Hi\n")
    one_line_error(result, "cullama chat needs a tokenizer", "--tokenizer")
    assert "--chat" not in result.stderr


def test_a_system_prompt_that_leaves_no_room(stories_dir):
    one_line_error(run("chat", "--model", stories_dir, "--device", "cpu", "--max-seq-len", 16, "--system",
                       "Be brief. " * 20, input="Hi\n"), "--system takes", "context of 16 tokens")


def test_a_text_prompt_that_is_not_utf8_on_chat_input(stories_dir):
    result = run("chat", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 3, "--json",
                 input=b"Hi \xff\nAnd \xfe\n")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) == 2 and result.stderr.count("not valid UTF-8") == 1


def test_standard_input_that_cannot_be_read(stories_dir, monkeypatch):
    import errno

    from cullama.cli import main as cli

    class Failing:
        def read(self, size=-1):  # as a file's: item 4 reads at most MAX_INPUT_BYTES + 1
            raise OSError(errno.EIO, "Input/output error")

        readline = read

    monkeypatch.setattr(cli.TextInput, "__init__", lambda self: setattr(self, "binary", Failing()))
    for command in ("generate", "chat"):
        one_line_error(run(command, "--model", stories_dir, "--device", "cpu", input="x"),
                       "cannot read standard input: Input/output error")


def test_prefill_chunk_reaches_the_model(stories_dir, monkeypatch):
    """--prefill-chunk: the model's prompt rows per prefill pass (generate here; chat, serve and bench the same)."""
    from cullama.llama import Llama

    chunks, real = [], Llama.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        llm = real(cls, *args, **kwargs)
        chunks.append(llm.runner.prefill_chunk)
        return llm
    monkeypatch.setattr(Llama, "from_pretrained", classmethod(spy))
    ids = "1,403,407,261,378,263,101,278"
    args = ("generate", "--model", stories_dir, "--device", "cpu", "--prompt-ids", ids, "--max-new-tokens", 8, "--json")
    default, cut = run(*args), run(*args, "--prefill-chunk", 3)
    assert default.exit_code == 0 and cut.exit_code == 0, cut.output
    assert chunks == [256, 3]
    assert json.loads(cut.stdout)["token_ids"] == json.loads(default.stdout)["token_ids"]  # the NumPy twins: any chunk


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "bench"])
@pytest.mark.parametrize("bad", ["0", "4097", "x"])
def test_prefill_chunk_bad_values_are_one_line_errors(command, bad, tmp_path):
    result = run(command, "--model", tmp_path, "--prefill-chunk", bad)
    assert result.exit_code == 2
    errors = [line for line in result.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "--prefill-chunk" in errors[0], result.output
