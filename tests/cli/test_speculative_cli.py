"""`cullama generate` and `cullama chat` with --speculative, --draft-model, --draft-tokens, --adaptive-draft:
the same greedy output, the `speculative` JSON record, and every wrong combination as one line."""

import json

import pytest
from click.testing import CliRunner

from cullama.cli.main import main
from tests.conftest import load_golden


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_line_error(result, *fragments):
    assert result.exit_code == 2, result.output
    errors = [line for line in result.stderr.splitlines() if not line.startswith("note: ")]
    assert len(errors) == 1 and errors[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


@pytest.mark.parametrize("options", [
    ("--speculative", "ngram"),
    ("--speculative", "ngram", "--draft-tokens", 8, "--adaptive-draft"),
    ("--draft-model", "STORIES", "--draft-tokens", 2),
    ("--speculative", "draft", "--draft-model", "STORIES"),
])
def test_generate_json_has_the_speculative_record(stories_dir, stories_expected, options):
    options = [stories_dir if o == "STORIES" else o for o in options]
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 64, "--json", *options, "")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["token_ids"] == stories_expected["ids"][:64] and doc["text"] == stories_expected["text"][:len(doc["text"])]
    record = doc["speculative"]
    method = "ngram" if "ngram" in options else "draft"
    k = options[options.index("--draft-tokens") + 1] if "--draft-tokens" in options else 4
    assert record["method"] == method and record["k"] == k and record["adaptive"] == ("--adaptive-draft" in options)
    assert record["steps"] + record["accepted"] == 63 and record["tokens_per_step"] >= 1
    assert len(doc["timings"]["token_s"]) == 63


def test_generate_text_is_the_plain_text(stories_dir, stories_expected):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 256, "--speculative",
                 "ngram", "")
    assert result.exit_code == 0, result.output
    assert result.stdout == stories_expected["text"] + "\n"


def test_golden_ids_with_a_draft_model(stories_dir):
    directory, cases, _ = load_golden("tiny-mha")
    ids = ",".join(map(str, cases[1]["prompt_ids"]))
    plain, spec = (run("generate", "--model", directory, "--device", "cpu", "--prompt-ids", ids, "--max-new-tokens", 24,
                       "--ignore-eos", *extra) for extra in ((), ("--draft-model", stories_dir)))
    assert plain.exit_code == spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and len(spec.stdout.split()) == 24


def test_chat_takes_the_same_options(stories_dir):
    turns = "Hello there\nTell me more\n"
    plain = run("chat", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 20, "--json", input=turns)
    spec = run("chat", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 20, "--json", "--draft-model",
               stories_dir, "--draft-tokens", 3, input=turns)
    assert plain.exit_code == spec.exit_code == 0, spec.output
    plain_docs, spec_docs = ([json.loads(line) for line in r.stdout.splitlines()] for r in (plain, spec))
    assert [d["token_ids"] for d in spec_docs] == [d["token_ids"] for d in plain_docs] and len(spec_docs) == 2
    assert all(d["speculative"]["method"] == "draft" and d["speculative"]["k"] == 3 for d in spec_docs)
    assert all("speculative" not in d for d in plain_docs)


@pytest.mark.parametrize("args,fragments", [
    (("--speculative", "draft"), ["--speculative draft needs --draft-model"]),
    (("--draft-tokens", 3), ["--draft-tokens and --adaptive-draft need --speculative or --draft-model"]),
    (("--adaptive-draft",), ["need --speculative or --draft-model"]),
    (("--speculative", "ngram", "--draft-tokens", 0), ["--draft-tokens must be an integer from 1 to 15, got 0"]),
    (("--speculative", "ngram", "--draft-tokens", 16), ["--draft-tokens must be an integer from 1 to 15, got 16"]),
    (("--speculative", "ngram", "--draft-model", "STORIES"), ["--draft-model", "--speculative ngram"]),
])
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_wrong_combinations_are_one_line(stories_dir, command, args, fragments):
    args = [stories_dir if a == "STORIES" else a for a in args]
    one_line_error(run(command, "--model", stories_dir, "--device", "cpu", *args, input="hi\n"), *fragments)


def test_a_draft_with_another_vocabulary_is_one_line():
    target, _, _ = load_golden("tiny-mha")
    draft, _, _ = load_golden("tiny-gqa-sharded")
    one_line_error(run("generate", "--model", target, "--device", "cpu", "--draft-model", draft, "--prompt-ids", "1,2"),
                   "draft model", "1024 tokens", "512")


def test_bad_speculative_choice_is_a_usage_error(stories_dir):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--speculative", "eagle", "x")
    assert result.exit_code == 2 and "'eagle' is not one of 'ngram', 'draft'" in result.stderr
