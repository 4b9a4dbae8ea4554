"""`cullama bench --json-schema FILE` (cullama/bench/constrained.py): plain and constrained trials alternate, every step
of a constrained trial under the grammar (a document starting over where one ends), the ratios and the host's mask
time per L, the record; option errors before any weight loads."""

import json

import pytest
from click.testing import CliRunner

from cullama import Constraint, Llama
from cullama.bench import constrained
from cullama.cli.main import main
from cullama.runtime.ops.sampling import mask_bits

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_the_looping_mask_starts_a_new_document_after_the_forced_eos(stories_dir):
    """Greedy steps past the schema's end: each document is {"n": d} then EOS, and the next tokens start another;
    every token is one its mask allowed."""
    llm = Llama.from_pretrained(stories_dir, device="cpu")
    mask = constrained.LoopingMask(llm.grammars.matcher(Constraint.json_schema(SCHEMA)))
    recorded = []
    fill = mask.fill
    mask.fill = lambda out: (fill(out), recorded.append(out.copy()))
    tokens = [llm.runner.start([1, 403], constrained.protocol.GREEDY, mask=mask)]
    tokens += [llm.runner.next() for _ in range(40)]
    for token, row in zip(tokens, recorded):
        assert mask_bits(row, llm.config.vocab_size)[token]
    text = llm.tokenizer.decode([t for t in tokens if t != 2])
    assert mask.documents >= 3 and text.count('{"n": ') >= 3, text
    assert len(mask.fill_ns) == len(tokens)


def test_the_run_and_its_table(stories_dir):
    llm = Llama.from_pretrained(stories_dir, device="cpu")
    records = constrained.run(llm.runner, llm.grammars, Constraint.json_schema(SCHEMA), [5, 20], 20, 1, 4,
                              llm.config.vocab_size)
    for record, length in zip(records, (5, 20)):
        assert record["length"] == length and len(record["plain_ns"]) == len(record["constrained_ns"]) >= 20
        assert record["ratio_p50"] == record["constrained"]["p50_ms"] / record["plain"]["p50_ms"]
        assert record["mask_us"]["count"] >= len(record["constrained_ns"]) and record["mask_us"]["p50"] > 0
    assert records[1]["documents"] > 0
    table = constrained.format_table(records, "title")
    assert table.splitlines()[0] == "title" and len(table.splitlines()) == 4


def test_the_command_end_to_end(stories_dir, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMA))
    record = tmp_path / "out.json"
    result = run("bench", "--model", stories_dir, "--device", "cpu", "--json-schema", schema, "--lengths", "8",
                 "--samples", 16, "--warmup", 0, "--json", record)
    assert result.exit_code == 0, result.output
    assert "the GPU target, <= 1.05 at p50 and p99, is for a GPU run" in result.stdout
    saved = json.loads(record.read_text())
    assert saved["schema"] == constrained.SCHEMA and saved["results"][0]["length"] == 8


@pytest.mark.parametrize("args, message", [
    (("--synthetic", "tiny", "--json-schema", "{schema}"), "--json-schema needs a tokenizer"),
    (("--synthetic", "tiny", "--tokenizer", "x"), "--tokenizer goes with --json-schema"),
    (("--model", "{stories}", "--json-schema", "{schema}", "--batch", "1,2"), "--json-schema goes with neither"),
    (("--model", "{stories}", "--json-schema", "{missing}"), "cannot read --json-schema"),
    (("--model", "{stories}", "--json-schema", "{bad}"), "--json-schema cannot be enforced: Invalid type: strng"),
])
def test_option_errors_are_one_line_before_anything_loads(stories_dir, tmp_path, args, message):
    files = {"schema": tmp_path / "s.json", "missing": tmp_path / "m.json", "bad": tmp_path / "b.json",
             "stories": stories_dir}
    files["schema"].write_text(json.dumps(SCHEMA))
    files["bad"].write_text('{"type": "strng"}')
    result = run("bench", "--device", "cpu", *(str(a).format(**files) for a in args))
    assert result.exit_code == 2 and message in result.stderr and "loading" not in result.stderr, result.output
