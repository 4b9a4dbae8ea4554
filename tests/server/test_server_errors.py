"""The server's 4xx answers built in this process, without a server: pydantic's complaints as OpenAI errors
naming the request's own field, the body limit the context sets, and reading a body (its time limit, the
budget of bytes unfinished bodies hold, a client leaving mid-upload)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")

from pydantic import ValidationError  # noqa: E402

from cullama.server.app import (BodyBudget, ClientLeft, body_limit, parse, read_body,  # noqa: E402
                                validation_error)
from cullama.server.protocol import ApiError, ChatRequest, CompletionRequest  # noqa: E402


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
    (CompletionRequest, {"prompt": 1}, "prompt", "prompt must be a string, a list of token ids, or a list of either"),
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
    # automaton it builds for the request (cullama/text/stop_strings.py).
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


# -- reading a body ----------------------------------------------------------------------------------------
def upload(chunks: list, told: int | None = None):
    """A Starlette Request whose body arrives as `chunks`: bytes, an asyncio.Event to wait for, or "leave" (the
    client disconnects); its Content-Length says `told`."""
    from starlette.requests import Request

    headers = [] if told is None else [(b"content-length", str(told).encode())]
    pending = list(chunks)

    async def receive():
        while isinstance(pending[0], asyncio.Event):  # one never set: a client that sends no more
            await pending.pop(0).wait()
        chunk = pending.pop(0)
        if chunk == "leave":
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunk, "more_body": bool(pending)}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}, receive)


def test_a_body_that_does_not_come_in_time_is_a_408_and_gives_its_bytes_back():
    bodies = BodyBudget(1 << 20)

    async def main():
        with pytest.raises(ApiError) as refused:
            await read_body(upload([b"x" * 1000, asyncio.Event()], told=5000), 512, bodies, timeout=0.2)
        return refused.value

    error = asyncio.run(main())
    assert (error.status, error.code) == (408, "request_timeout") and error.headers["Connection"] == "close"
    assert error.message == "the request body did not arrive within 0.2 s (1000 bytes came); send it whole"
    assert bodies.held == 0


def test_unfinished_bodies_together_hold_at_most_the_budget():
    bodies, go_on = BodyBudget(1 << 20), asyncio.Event()

    async def main():
        stalled = asyncio.ensure_future(read_body(upload([b"x" * 700_000, go_on, b"y"], told=700_001), 512,
                                                  bodies, timeout=30))
        await asyncio.sleep(0.05)
        assert bodies.held == 700_000
        with pytest.raises(ApiError) as refused:  # 700,000 + 400,000 bytes: past the budget of 1 MiB
            await read_body(upload([b"z" * 400_000], told=400_000), 512, bodies, timeout=30)
        assert bodies.held == 700_000
        go_on.set()
        assert len(await stalled) == 700_001 and bodies.held == 0
        assert await read_body(upload([b"z" * 400_000], told=400_000), 512, bodies, timeout=30) == b"z" * 400_000
        return refused.value

    error = asyncio.run(main())
    assert (error.status, error.code, error.headers["Retry-After"]) == (503, "server_busy", "1")
    assert bodies.held == 0


def test_a_client_that_leaves_mid_upload_is_a_client_that_left():
    bodies = BodyBudget(1 << 20)

    async def main():
        with pytest.raises(ClientLeft, match="11 of 1000 bytes"):
            await read_body(upload([b'{"prompt": ', "leave"], told=1000), 512, bodies, timeout=30)

    asyncio.run(main())
    assert bodies.held == 0


# -- what a message names ----------------------------------------------------------------------------------
SURROGATES = [  # (model, raw body, param, what the message starts with)
    (CompletionRequest, rb'{"prompt": "\ud800 hi"}', "prompt", "prompt holds a lone UTF-16 surrogate (\\ud800)"),
    (ChatRequest, rb'{"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": "a\udc00"}]}',
     "messages.1.content", "messages.1.content holds a lone UTF-16 surrogate (\\udc00)"),
    (CompletionRequest, rb'{"prompt": "x", "stop": ["ok", "\ud800\u0041"]}', "stop.1",
     "stop.1 holds a lone UTF-16 surrogate (\\ud800)"),
    (CompletionRequest, rb'{"prompt": "x", "\udfffx": 1}', None, "the body has a key, '\\\\udfffx', that holds"),
]


@pytest.mark.parametrize("model, raw, param, start", SURROGATES, ids=[s[2] or "a key" for s in SURROGATES])
def test_a_lone_surrogate_is_named_by_its_field(model, raw, param, start):
    with pytest.raises(ApiError) as refused:
        parse(raw, model)
    assert refused.value.param == param and refused.value.message.startswith(start), refused.value.message
    assert refused.value.message.endswith("which is not a character: in JSON, \\ud800-\\udbff must be followed by "
                                          "\\udc00-\\udfff")
    assert parse(rb'{"prompt": "a\ud83d\ude00b"}', CompletionRequest).prompt == "a\U0001F600b"  # a pair is fine
    with pytest.raises(ApiError, match="^the body is not valid JSON: invalid escape"):  # not a surrogate
        parse(rb'{"prompt": "\u12G4"}', CompletionRequest)


@pytest.mark.parametrize("messages, param, words", [
    ([{"role": "user", "content": "hi"}, {"role": "developer", "content": "be brief"}], "messages.1.role",
     "a developer message (OpenAI's newer name for a system message) may only come first"),
    ([{"role": "user", "content": "2+2?", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}], "messages.0.tool_calls",
     "only an assistant message makes tool calls"),
    ([{"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}],
     "messages.0.function_call", "OpenAI's deprecated functions are not supported by cullama"),
], ids=["developer second", "tool_calls of a user", "function_call"])
def test_a_message_the_template_cannot_hold_is_named(messages, param, words):
    body = ChatRequest.model_validate_json(json.dumps({"messages": messages}))
    with pytest.raises(ApiError) as refused:
        body.check()
    assert refused.value.param == param and refused.value.message.startswith(f"{param}: {words}")
    ChatRequest.model_validate_json(json.dumps({"messages": [  # first, a developer message is the system prompt
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi", "tool_calls": []}]})).check()
