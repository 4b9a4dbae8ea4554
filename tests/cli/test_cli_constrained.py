"""`cullama generate --json-schema FILE | --regex RE | --grammar FILE` (and `chat`): the text is JSON valid against
the schema, matches the expression, follows the grammar; a file that cannot be read, a schema, regex or grammar that
cannot be enforced, two constraints, --ignore-eos beside one: one line and exit 2, before any weight loads."""

import json
import re

import pytest
from click.testing import CliRunner

from cullama.cli.main import main

# validates the constrained outputs; a test dependency (.[test]): absent on a lent GPU machine, where these skip
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency (pip install -e '.[test]')")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "age"], "additionalProperties": False}


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "person.json"
    path.write_text(json.dumps(SCHEMA))
    return path


@pytest.mark.parametrize("sampling", [(), ("--temperature", 0.9, "--seed", 5)], ids=["greedy", "sampled"])
def test_json_schema_gives_json_of_the_schema(stories_dir, schema_file, sampling):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--json-schema", schema_file, *sampling,
                 "Once upon a time")
    assert result.exit_code == 0, result.output
    jsonschema.validate(json.loads(result.stdout), SCHEMA)
    plain = run("generate", "--model", stories_dir, "--device", "cpu", "--max-new-tokens", 40, *sampling,
                "Once upon a time")
    with pytest.raises(ValueError):
        json.loads(plain.stdout)


def test_regex_and_grammar(stories_dir, tmp_path):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--regex", r"[0-9]{2} (cats|dogs)\.",
                 "--json", "Once upon a time")
    record = json.loads(result.stdout)
    assert re.fullmatch(r"[0-9]{2} (cats|dogs)\.", record["text"]) and record["finish_reason"] == "eos"
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "The " NAME " is " NUM " years old."\nNAME: /[A-Z][a-z]{1,8}/\nNUM: /[1-9]/\n')
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--grammar", grammar, "Once")
    assert re.fullmatch(r"The [A-Z][a-z]{1,8} is [1-9] years old\.\n", result.stdout.lstrip()), result.output


def test_chat_replies_under_the_schema(stories_dir, schema_file):
    result = run("chat", "--model", stories_dir, "--device", "cpu", "--json-schema", schema_file,
                 input="Who are you?\nAnd now?\n")
    assert result.exit_code == 0, result.output
    for line in result.stdout.splitlines():
        jsonschema.validate(json.loads(line), SCHEMA)


@pytest.mark.parametrize("args, message", [
    (("--json-schema", "{missing}"), "error: cannot read --json-schema {missing}: No such file or directory"),
    (("--json-schema", "{not_json}"), "error: --json-schema {not_json} is not JSON: "),
    (("--json-schema", "{bad_type}"), "error: --json-schema cannot be enforced: Invalid type: strng"),
    (("--regex", "(ab"), "error: --regex cannot be enforced: "),
    (("--grammar", "{bad_grammar}"), "error: --grammar cannot be enforced: "),
    (("--regex", "a", "--json-schema", "{schema}"), "error: --regex cannot go with --json-schema"),
    (("--regex", "a", "--ignore-eos"), "error: --ignore-eos cannot go with --regex: a constrained text ends with EOS"),
])
def test_what_cannot_be_enforced_is_one_line_and_exit_2(stories_dir, schema_file, tmp_path, args, message):
    files = {"missing": tmp_path / "missing.json", "not_json": tmp_path / "n.json", "bad_type": tmp_path / "b.json",
             "bad_grammar": tmp_path / "g.lark", "schema": schema_file}
    files["not_json"].write_text("{oops")
    files["bad_type"].write_text('{"type": "strng"}')
    files["bad_grammar"].write_text("start: nowhere")
    args = [a.format(**files) for a in args]
    result = run("generate", "--model", stories_dir, "--device", "cpu", *args, "x")
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(message.format(**files)) and "Traceback" not in result.output, result.stderr
    assert "loading weights" not in result.stderr and "converting" not in result.stderr  # before any weight loads
