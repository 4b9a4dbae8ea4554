"""Constrained decoding through the library (Llama.generate / stream / batch with json_schema=, regex=, grammar=,
constraint=) on tiny models whose random weights never write JSON by themselves: every output parses and validates
against its schema; seeded generations repeat exactly; speculative decoding (drafts checked against the grammar)
gives plain constrained greedy's tokens bit for bit; a constrained request in a batch gets its solo tokens; bad
schemas, regexes and grammars are one-line OptionErrors naming the option."""

from __future__ import annotations

import json
import re

import pytest

import cullama
from cullama import Constraint
from cullama.common.errors import OptionError
from cullama.generation.drafters import Replay

from tests.conftest import shared_path

# validates the constrained outputs; a test dependency (.[test]): absent on a lent GPU machine, where these skip
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency (pip install -e '.[test]')")

PROMPT = "Once upon a time"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 1, "maximum": 99},
                         "mood": {"enum": ["happy", "sad", "angry"]},
                         "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
                         "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
                             "kind": {"enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0,
                                                                         "maximum": 8}},
                             "required": ["kind", "legs"], "additionalProperties": False}]}},
          "required": ["name", "age", "mood", "friends", "pet"], "additionalProperties": False}
MODELS = {"stories260K": ("models", "stories260K"), "tiny-llama3": ("golden", "tiny-llama3"),
          "tiny-qwen2": ("golden", "tiny-qwen2"), "tiny-mistral": ("golden", "tiny-mistral")}
SAMPLED = [dict(temperature=0.0), dict(temperature=0.9, seed=1), dict(temperature=1.0, top_p=0.9, seed=2),
           dict(temperature=0.8, top_k=20, repetition_penalty=1.2, seed=3)]


@pytest.fixture(scope="module", params=list(MODELS))
def llm(request):
    return cullama.Llama.from_pretrained(shared_path(*MODELS[request.param]), device="cpu")


@pytest.fixture(scope="module")
def stories(stories_dir):
    return cullama.Llama.from_pretrained(stories_dir, device="cpu")


def valid(text: str, schema: dict = SCHEMA) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


@pytest.mark.parametrize("options", SAMPLED, ids=["greedy", "T0.9", "top-p", "top-k-penalty"])
def test_every_output_parses_and_validates(llm, options):
    out = llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA, **options)
    assert out.finish_reason == "eos", out.text  # the grammar completed: EOS was the only id left
    valid(out.text)


def test_the_models_write_no_json_by_themselves(llm):
    for options in SAMPLED:
        text = llm.generate(PROMPT, max_new_tokens=60, **options).text
        with pytest.raises(ValueError):
            valid(text)


def test_json_object_regex_and_lark(stories):
    assert isinstance(json.loads(stories.generate(PROMPT, max_new_tokens=120, temperature=0.7, seed=4,
                                                  constraint=Constraint.json_schema({"type": "object", "properties": {
                                                      "a": {"type": "string", "maxLength": 6}}, "required": ["a"],
                                                      "additionalProperties": False})).text), dict)
    pattern = r"[0-9]{3}-[a-z]{2,5} (yes|no)\."
    for seed in range(4):
        out = stories.generate(PROMPT, max_new_tokens=40, temperature=1.0, seed=seed, regex=pattern)
        assert re.fullmatch(pattern, out.text.lstrip()) and out.finish_reason == "eos", out.text
    lark = 'start: "The " animal " has " NUM " legs."\nanimal: "cat" | "dog" | "bird"\nNUM: /[0-9]/'
    out = stories.generate(PROMPT, max_new_tokens=40, grammar=lark)
    assert re.fullmatch(r"The (cat|dog|bird) has [0-9] legs\.", out.text.lstrip()), out.text


def test_a_cut_text_ends_with_length(stories):
    out = stories.generate(PROMPT, max_new_tokens=5, json_schema=SCHEMA)
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("options", SAMPLED[1:], ids=["T0.9", "top-p", "top-k-penalty"])
def test_seeded_constrained_generations_repeat_exactly(llm, options):
    a, b = (llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA, **options) for _ in range(2))
    assert a.token_ids == b.token_ids and a.text == b.text and a.seed == b.seed
    other = llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA, **{**options, "seed": options["seed"] + 100})
    assert other.token_ids != a.token_ids


def test_speculative_constrained_greedy_is_plain_constrained_greedy(llm):
    """ngram drafts, a replay of plain *unconstrained* greedy's text (mostly refused by the grammar) and a replay of
    the constrained text itself (every draft accepted), k = 1, 4, 8: the tokens are plain constrained greedy's."""
    plain = llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA)
    free = llm.generate(PROMPT, max_new_tokens=200)
    runs = [dict(speculative="ngram", draft_tokens=k) for k in (1, 4, 8)]
    runs += [dict(speculative=Replay(free.token_ids), draft_tokens=4),
             dict(speculative=Replay(plain.token_ids), draft_tokens=8)]
    for options in runs:
        out = llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA, **options)
        assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason, options
    assert out.speculative["accepted"] == out.speculative["drafted"] > 0  # the constrained replay: all accepted


def test_speculative_with_a_draft_model_checks_its_drafts(stories_dir):
    """The draft model writes unconstrained text: its drafts are checked against the grammar, the refused ones
    dropped, and the tokens are plain constrained greedy's."""
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", draft_model=stories_dir)
    plain = llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA)
    out = llm.generate(PROMPT, max_new_tokens=200, json_schema=SCHEMA, speculative="draft", draft_tokens=4)
    assert out.token_ids == plain.token_ids
    valid(out.text)


def test_a_constrained_request_in_a_batch_is_its_solo_self(stories_dir):
    """A batch of four: constrained greedy, unconstrained sampled, constrained sampled, a regex; each request's
    tokens are its solo generation's, whoever runs beside it."""
    llm = cullama.Llama.from_pretrained(stories_dir, device="cpu", max_batch=3)
    requests = [dict(json_schema=SCHEMA), dict(temperature=0.9, seed=5),
                dict(json_schema=SCHEMA, temperature=0.9, top_p=0.95, seed=6), dict(regex=r"[a-z ]{3,30}\.")]
    solo = [llm.generate(PROMPT, max_new_tokens=120, **r) for r in requests]
    session = llm.batch()
    streams = [session.submit(PROMPT, max_new_tokens=120, **r) for r in requests]
    session.run()
    for stream, alone in zip(streams, solo):
        assert stream.result.token_ids == alone.token_ids and stream.result.text == alone.text
    valid(solo[0].text)
    valid(solo[2].text)
    assert llm.generate([PROMPT, "The cat"], max_new_tokens=120, json_schema=SCHEMA)[0].token_ids == \
        solo[0].token_ids


def test_stream_pieces_and_logprobs_of_a_constrained_generation(stories):
    """The stream hands out the text as ever; log-probabilities are the raw softmax's (the mask changes the pick,
    not them)."""
    stream = stories.stream(PROMPT, max_new_tokens=200, json_schema=SCHEMA, logprobs=2)
    text = "".join(stream)
    assert text == stream.result.text and valid(text)
    records = stream.result.logprobs
    assert len(records) == len(stream.result.token_ids) + 1  # and the EOS
    plain = stories.generate(PROMPT, max_new_tokens=1, logprobs=2)
    assert plain.logprobs[0].top == records[0].top  # the first position's alternatives: the model's own


@pytest.mark.parametrize("options, option, words", [
    (dict(json_schema={"type": "strng"}), "json_schema", "json_schema cannot be enforced: Invalid type: strng"),
    (dict(json_schema="{oops"), "json_schema", "json_schema is not JSON"),
    (dict(regex="(ab"), "regex", "regex cannot be enforced: "),
    (dict(grammar="start: nothing_here"), "grammar", "grammar cannot be enforced: "),
    (dict(regex="a", json_schema={}), "regex", "regex cannot go with the json_schema argument"),
    (dict(json_schema={}, ignore_eos=True), "ignore_eos", "a constrained text ends with EOS"),
    (dict(constraint=Constraint.json_schema({"type": "array", "uniqueItems": True})), "json_schema",
     "Unimplemented keys"),
])
def test_what_cannot_be_enforced_is_an_option_error(stories, options, option, words):
    with pytest.raises(OptionError) as refused:
        stories.generate(PROMPT, **options)
    assert refused.value.option == option and words in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_without_a_tokenizer_takes_no_constraint():
    llm = cullama.Llama.synthetic("tiny", device="cpu")
    with pytest.raises(OptionError, match="needs the model's tokenizer"):
        llm.generate([1, 2, 3], max_new_tokens=4, json_schema={"type": "object"})
