"""Constrained decoding's grammars (cullama/text/grammar.py): constraints checked for their form, compiled by llguidance
against each kind of tokenizer (a SentencePiece model through its byte table, a tokenizer.json through llguidance's
loader), masks in the sample kernel's bit order that never allow an id past the tokenizer's pieces, EOS forced once
the grammar is complete, the optional first space of a tokenizer whose decoder drops it, one-line errors naming the
option, and a speculative step's draft masks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cullama.common.errors import OptionError
from cullama.runtime.ops.sampling import mask_bits
from cullama.text.grammar import Constraint, Grammars, checked_constraint
from cullama.text.tokenizer import load_tokenizer

from tests.conftest import shared_path

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}
MODELS = {  # name: (directory under ../shared, the model's vocab_size, its EOS ids)
    "stories260K": (("models", "stories260K"), 512, (2,)),
    "tiny-llama3": (("golden", "tiny-llama3"), 506, (501, 504)),
    "tiny-qwen2": (("golden", "tiny-qwen2"), 512, (452, 450)),
    "tiny-mistral": (("golden", "tiny-mistral"), 525, (522,)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    parts, vocab, eos = MODELS[request.param]
    tokenizer = load_tokenizer(shared_path(*parts))
    return request.param, tokenizer, Grammars(tokenizer, vocab, eos)


def allowed(grammars: Grammars, matcher) -> np.ndarray:
    out = np.zeros(grammars.words, np.uint32)
    matcher.fill(out)
    return np.flatnonzero(mask_bits(out, grammars.n_vocab))


def walk(grammars: Grammars, matcher, text: str) -> list[int]:
    """Feed the ids of `text` (as the tokenizer writes it mid-text) one by one, each one allowed by the mask before
    it: the ids."""
    tok = grammars.tokenizer
    ids = tok.encode_inside(text) if hasattr(tok, "encode_inside") else tok.encode(text, bos=False)
    for token in ids:
        assert token in allowed(grammars, matcher), (text, token)
        matcher.accept(token)
    return ids


def test_a_document_of_the_schema_is_accepted_and_then_only_eos(model):
    name, tok, grammars = model
    matcher = grammars.matcher(Constraint.json_schema(SCHEMA))
    walk(grammars, matcher, '{"a": 42, "b": "y"}')
    assert matcher.stopped
    assert set(allowed(grammars, matcher)) == set(grammars.eos_ids)  # EOS forced: the text is complete
    matcher.accept(grammars.eos_ids[0])


def test_no_id_past_the_tokenizer_is_ever_allowed(model):
    """tiny-qwen2: 453 pieces under 512 logit rows (a padded vocabulary); every mask along a document and under the
    freest grammar leaves 453..511 clear."""
    name, tok, grammars = model
    for constraint in (Constraint.json_schema(SCHEMA), Constraint.regex(r"(?s:.*)"), Constraint.json_object()):
        matcher = grammars.matcher(constraint)
        assert allowed(grammars, matcher).max() < tok.vocab_size
    matcher = grammars.matcher(Constraint.regex(r"(?s:.{0,40})"))
    text = "free text: Once upon a time"
    for token in walk(grammars, matcher, text):
        assert allowed(grammars, matcher).max() < tok.vocab_size


def test_the_mask_is_in_the_kernels_bit_order(model):
    """A regex of one character allows exactly that character's ids: bit i & 31 of word i >> 5."""
    name, tok, grammars = model
    ids = allowed(grammars, grammars.matcher(Constraint.regex("Z")))
    texts = {tok.decode([int(i)]) for i in ids}
    assert texts == {"Z"}, (name, texts)


def test_json_comes_in_json_dumps_spacing(model):
    """Only ", " and ": " between items: a ' ' before ':' or after '{' is refused (no whitespace to run away in), unless
    the schema's own x-guidance says otherwise."""
    name, tok, grammars = model
    free = {"type": "object", "additionalProperties": {"type": "integer"}}  # no key forced: any tokenization
    matcher = grammars.matcher(Constraint.json_schema(free))
    walk(grammars, matcher, '{"k"')
    assert matcher.valid_prefix(ids_of(tok, ": 4")) == len(ids_of(tok, ": 4"))
    assert matcher.valid_prefix(ids_of(tok, " :")) == 0
    loose = grammars.matcher(Constraint.json_schema({**free, "x-guidance": {"whitespace_flexible": True}}))
    walk(grammars, loose, '{"k"')
    assert loose.valid_prefix(ids_of(tok, " :")) == len(ids_of(tok, " :"))


def ids_of(tok, text):
    return tok.encode_inside(text) if hasattr(tok, "encode_inside") else tok.encode(text, bos=False)


def test_the_constrained_text_is_the_text_a_user_sees(model):
    """No optional space before the constrained text: a completion is read after its prompt, a SentencePiece piece's
    '▁' included, so an id whose text starts with a space cannot start a JSON value, whatever the tokenizer."""
    name, tok, grammars = model
    first = allowed(grammars, grammars.matcher(Constraint.json_schema(SCHEMA)))
    spelled = [tok.token_table[0][int(i)] if hasattr(tok, "token_table") else tok.token_bytes(int(i)) for i in first]
    assert spelled and not [b for b in spelled if b[:1].isspace()], (name, spelled)


def test_llama2_tokenizer_first_piece(tmp_path):
    tok = load_tokenizer(shared_path("tokenizers", "llama2"))
    grammars = Grammars(tok, 32000, (2,))
    first = allowed(grammars, grammars.matcher(Constraint.json_schema(SCHEMA)))
    pieces = {tok.piece(int(i)) for i in first}
    assert "▁{" not in pieces and '{"' in pieces, pieces  # the text shown keeps a '▁': none may lead
    matcher = grammars.matcher(Constraint.json_schema(SCHEMA))
    ids = tok.encode_inside('{"a": 12, "b": "x"}')  # '{' where a text's start would be '▁{'
    assert not tok.piece(ids[0]).startswith("▁") and matcher.valid_prefix(ids) == len(ids)


@pytest.mark.parametrize("constraint, problem", [
    (Constraint.json_schema({"type": "strng"}), "json_schema cannot be enforced: Invalid type: strng"),
    (Constraint.json_schema({"type": "array", "uniqueItems": True}), 'Unimplemented keys: ["uniqueItems"]'),
    (Constraint.json_schema({"$ref": "#/$defs/nope"}), "Pointer '/$defs/nope' does not exist"),
    (Constraint.regex("(ab"), "regex cannot be enforced: "),
    (Constraint.grammar("start: foo"), 'grammar cannot be enforced: '),
    (Constraint.json_schema({"type": "string", "format": "colour"}, option="response_format"),
     "response_format cannot be enforced: Unknown format: colour"),
])
def test_what_cannot_be_enforced_is_one_line_naming_the_option(model, constraint, problem):
    name, tok, grammars = model
    with pytest.raises(OptionError) as refused:
        grammars.matcher(constraint)
    message = str(refused.value)
    assert problem in message and "\n" not in message and len(message) < 400, message
    assert refused.value.option == constraint.option


def test_strict_false_ignores_what_cannot_be_enforced(model):
    name, tok, grammars = model
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "uniqueItems": True}
    grammars.matcher(Constraint.json_schema(schema, strict=False))  # compiles: uniqueItems ignored


@pytest.mark.parametrize("kwargs, option, words", [
    (dict(json_schema="{not json"), "json_schema", "is not JSON"),
    (dict(json_schema="[1, 2]"), "json_schema", "must be a JSON schema (a JSON object), got list"),
    (dict(json_schema=5), "json_schema", "must be a JSON schema"),
    (dict(regex=5), "regex", "must be a string"),
    (dict(grammar=b"start"), "grammar", "must be a string"),
    (dict(regex="a", grammar="start: \"a\""), "grammar", "cannot go with the regex argument"),
    (dict(json_schema={}, constraint=Constraint.regex("a")), "constraint", "cannot go with the json_schema argument"),
    (dict(constraint={"type": "object"}), "constraint", "must be a cullama.Constraint"),
    (dict(regex="a" * (1 << 20 + 1)), "regex", "is longer than"),
])
def test_options_are_checked_for_their_form(kwargs, option, words):
    with pytest.raises(OptionError) as refused:
        checked_constraint(**kwargs)
    assert refused.value.option == option and words in str(refused.value), str(refused.value)


def test_constraints_compare_by_content_and_show_it():
    assert Constraint.json_schema('{"type": "object"}') == Constraint.json_object(option="json_schema")
    assert Constraint.json_schema(SCHEMA) != Constraint.json_schema(SCHEMA, strict=False)
    assert repr(Constraint.regex("[0-9]+")) == "Constraint.regex('[0-9]+')"
    assert checked_constraint(json_schema=json.dumps(SCHEMA)) == Constraint.json_schema(SCHEMA)


def test_a_grammar_is_compiled_once_per_model(model):
    name, tok, grammars = model
    constraint = Constraint.json_schema(SCHEMA)
    assert grammars.compiled(constraint) is grammars.compiled(Constraint.json_schema(dict(SCHEMA)))
    a, b = grammars.matcher(constraint), grammars.matcher(constraint)
    walk(grammars, a, '{"a": 1')
    assert allowed(grammars, b).tolist() == allowed(grammars, grammars.matcher(constraint)).tolist()  # own state


def test_draft_masks_are_the_masks_after_each_draft(model):
    """fill_drafts: row r is the mask after the first r drafts (what fill gives after accepting them); the
    matcher's state is unchanged; valid_prefix stops at the first draft the grammar refuses."""
    name, tok, grammars = model
    matcher = grammars.matcher(Constraint.json_schema(SCHEMA))
    walk(grammars, matcher, '{"a')
    drafts = ids_of(tok, '": 7, "b"')[:4]
    assert matcher.valid_prefix(drafts) == len(drafts)
    refused = [t for t in range(tok.vocab_size) if matcher.valid_prefix([t]) == 0][0]
    assert matcher.valid_prefix(drafts[:2] + [refused] + drafts[2:]) == 2
    rows = np.zeros((len(drafts) + 1, grammars.words), np.uint32)
    matcher.fill_drafts(drafts, rows)
    for r in range(len(drafts) + 1):
        step = grammars.matcher(Constraint.json_schema(SCHEMA))
        walk(grammars, step, '{"a')
        for t in drafts[:r]:
            step.accept(t)
        expected = np.zeros(grammars.words, np.uint32)
        step.fill(expected)
        np.testing.assert_array_equal(rows[r], expected, err_msg=f"row {r}")
    assert matcher.valid_prefix(drafts) == len(drafts)  # unchanged
    one = np.zeros((1, grammars.words), np.uint32)
    matcher.fill_drafts([], one)
    np.testing.assert_array_equal(one[0], rows[0])


def test_a_token_the_grammar_refuses_is_a_generation_error(model):
    from cullama.common.errors import GenerationError

    name, tok, grammars = model
    matcher = grammars.matcher(Constraint.regex("Z+"))
    refused = ids_of(tok, "a")[0]
    with pytest.raises(GenerationError, match="does not follow the grammar"):
        matcher.accept(refused)


def test_the_piece_table_is_sentencepiece_s_bytes():
    """stories260K's byte table: '▁' a space, '<0x0A>' a newline, control pieces special; encode_inside drops the
    start's '▁' (llguidance tokenizes forced text with it)."""
    tok = load_tokenizer(shared_path("models", "stories260K"))
    tokens, special = tok.token_table
    assert len(tokens) == tok.vocab_size and {0, 1, 2} <= special
    newline = tok.encode_inside("\n")
    assert [tokens[i] for i in newline] == [b"\n"]
    for text in ("Once upon a time", "a b", "{\"x\": 1}", " lead"):
        ids = tok.encode_inside(text)
        assert b"".join(tokens[i] for i in ids).decode() == text, text


@pytest.mark.parametrize("installed, refused", [("1.6.1", True), ("1.6.9rc1", True), ("1.7.0", False),
                                                ("1.9.1", False), ("2.0.0.dev3", False)])
def test_an_llguidance_too_old_for_a_list_of_eos_ids_is_one_line(installed, refused, monkeypatch, request):
    """llguidance 1.6 takes one EOS id, and a list raised a TypeError from inside the tokenizer's construction; an
    installed release below the floor (setup.cfg's too) is an OptionError naming both versions and the fix."""
    from importlib import metadata

    from cullama.text import grammar

    monkeypatch.setattr(metadata, "version", lambda name: installed if name == "llguidance" else pytest.fail(name))
    grammar._llguidance.cache_clear()  # checked once a process: here, with this version installed
    request.addfinalizer(grammar._llguidance.cache_clear)  # the real one's check for the tests after
    if refused:
        with pytest.raises(OptionError, match=rf"needs llguidance 1\.7 or newer, and {installed[:5]} is installed "
                                              r"\(pip install -U 'llguidance>=1\.7'\)"):
            grammar._llguidance()
    else:
        assert grammar._llguidance() is not None


def test_the_llguidance_floor_is_setup_cfg_s():
    import configparser

    from tests.conftest import REPO
    from cullama.text.grammar import LLGUIDANCE_MIN

    setup = configparser.ConfigParser()
    setup.read(REPO / "setup.cfg")
    floor = f"llguidance>={'.'.join(map(str, LLGUIDANCE_MIN))}"
    extras = setup["options.extras_require"]
    for extra in ("constrained", "serve", "test"):
        assert floor in extras[extra].split(), extra
