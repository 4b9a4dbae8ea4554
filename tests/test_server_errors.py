"""The server's 4xx answers built in this process, without a server: pydantic's complaints as OpenAI errors
naming the request's own field, and the body limit the context sets."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

from pydantic import ValidationError  # noqa: E402

from cullama.server.app import body_limit, validation_error  # noqa: E402
from cullama.server.protocol import ChatRequest, CompletionRequest  # noqa: E402


def refusal(model, body: dict):
    with pytest.raises(ValidationError) as refused:
        model.model_validate_json(json.dumps(body))
    return validation_error(refused.value, model)


# A union's members each complain ("stop.str: Input should be a valid string", "stop.list[str]: ..."): the
# answer names the field as the request spells it and what it takes, with the member's complaint that went
# deepest where the value had the right shape but a wrong part.
UNIONS = [  # (model, body, param, message)
    (CompletionRequest, {"prompt": [1], "stop": 5}, "stop", "stop must be a string or a list of strings"),
    (CompletionRequest, {"prompt": [1], "stop": ["a", 1]}, "stop",
     "stop must be a string or a list of strings (stop.1: Input should be a valid string)"),
    (CompletionRequest, {"prompt": 1}, "prompt", "prompt must be a string or a list of token ids"),
    (ChatRequest, {"messages": [{"role": "user", "content": 5}]}, "messages.0.content",
     'messages.0.content must be a string or a list of {"type": "text", "text": ...} parts'),
    (ChatRequest, {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "image"}]}]},
     "messages.1.content", 'messages.1.content must be a string or a list of {"type": "text", "text": ...} parts '
                           "(messages.1.content.0.type: Input should be 'text')"),
]


@pytest.mark.parametrize("model, body, param, message", UNIONS, ids=[u[2] + ":" + json.dumps(u[1]) for u in UNIONS])
def test_a_union_of_the_wrong_type_names_the_field_and_what_it_takes(model, body, param, message):
    error = refusal(model, body)
    assert (error.status, error.param, error.message) == (400, param, message)


def test_a_plain_field_of_the_wrong_type_keeps_its_path_and_pydantics_words():
    error = refusal(CompletionRequest, {"prompt": [1], "stream_options": {"include_usage": 3}, "stream": True})
    assert (error.param, error.message) == ("stream_options.include_usage",
                                            "stream_options.include_usage: Input should be a valid boolean")
    error = refusal(ChatRequest, {"messages": [{"role": 5, "content": "x"}]})
    assert (error.param, error.message) == ("messages.0.role", "messages.0.role: Input should be a valid string")


def test_the_body_limit_grows_with_the_context_past_a_floor_of_2_mib():
    assert body_limit(512) == body_limit(4096) == 2 << 20
    assert body_limit(128 * 1024) == 64 * 128 * 1024  # 8 MiB


@pytest.mark.parametrize("stop, message", [
    (["a"] * 17, "stop: at most 16 stop strings are allowed, got 17"),
    (["."] * 1_000_000, "stop: at most 16 stop strings are allowed, got 1000000"),
    ("x" * 257, "stop: a stop string may have at most 256 characters; this one has 257"),
    (["a", "x" * 300], "stop: a stop string may have at most 256 characters; stop string 1 has 300"),
], ids=["17", "a million", "one too long", "the second too long"])
def test_stop_strings_are_bounded_in_number_and_length(stop, message):
    # The matcher's work per token is bounded by the longest stop string; how many there are bounds the
    # automaton it builds for the request (cullama/stop_strings.py).
    error = refusal(CompletionRequest, {"prompt": [1], "stop": stop})
    assert (error.status, error.param, error.message) == (400, "stop", message)
    body = CompletionRequest.model_validate_json(json.dumps({"prompt": [1], "stop": ["x" * 256] * 16}))
    assert len(body.stops()) == 16


def test_a_list_of_a_million_bad_messages_is_one_complaint_not_a_million():
    # Building pydantic's complaints for every bad item took seconds, holding the GIL the engine thread needs.
    raw = json.dumps({"messages": [{"role": "user", "content": 5}] * 100_000})
    with pytest.raises(ValidationError) as refused:
        ChatRequest.model_validate_json(raw)
    assert refused.value.error_count() <= 2
    raw = json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}] * 100_000}]})
    with pytest.raises(ValidationError) as refused:
        ChatRequest.model_validate_json(raw)
    assert refused.value.error_count() <= 3
