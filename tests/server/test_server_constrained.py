"""Structured outputs and tool calls through `cullama serve` (server/structured.py): response_format (the openai client's
own structured-output helper, and the request bodies langchain-openai's with_structured_output sends, replayed),
tools with tool_choice auto / required / a named function in each family's format (stories260K: no template, plain
JSON; tiny models with Qwen2.5's and LLaMA-3.1's tool calling: tests/tool_models.py), streamed as OpenAI streams them,
a history of tool calls and results; every refusal a 400 naming the field.

langchain-openai itself is not installed for these tests: it brings a dozen packages (langchain-core, langsmith,
tiktoken and their compiled wheels), so the bodies it sends (langchain-openai 1.8.1, captured with a mock transport
for issue 27's research) are replayed here instead, and its reading of the answer (the message's content through
the pydantic model, or the first tool call's arguments) is done as it does it."""

from __future__ import annotations

import json
from typing import Optional

import pydantic
import pytest

from tests.conftest import shared_path
from tests.serving import openai_client, running, stories_client, stories_oracle, stories_server  # noqa: F401
from tests.tool_models import TOOLS, hermes_model, llama31_model

# validates the constrained outputs; a test dependency (.[test]): absent on a lent GPU machine, where these skip
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency (pip install -e '.[test]')")
openai = pytest.importorskip("openai", reason="the openai client is a test dependency (pip install -e '.[test]')")

MODEL = "stories260K"
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Weather(pydantic.BaseModel):
    """Weather in a city."""
    city: str = pydantic.Field(max_length=12)
    unit: Optional[str] = pydantic.Field(default=None, max_length=10)
    days: list[pydantic.conint(ge=0, le=9)] = pydantic.Field(max_length=3)


WEATHER = openai.lib._pydantic.to_strict_json_schema(Weather)


def chat(server, **body) -> dict:
    status, _, raw = server.request("POST", "/v1/chat/completions", {"model": MODEL, "messages": ASK,
                                                                    "max_tokens": 300, "temperature": 0, **body})
    assert status == 200, raw
    return json.loads(raw)


def refusal(server, path="/v1/chat/completions", **body) -> dict:
    base = {"messages": ASK} if path.endswith("chat/completions") else {"prompt": "x"}
    status, _, raw = server.request("POST", path, {**base, **body})
    assert status == 400, raw
    return json.loads(raw)["error"]


# -- response_format ----------------------------------------------------------------------------------------------
def test_the_openai_clients_structured_output_helper(client):
    """client.chat.completions.parse(response_format=Model): the body it sends (json_schema, strict) comes back as
    JSON the client validates into the model; greedy and seeded."""
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for options in (dict(temperature=0), dict(temperature=0.9, seed=3)):
        out = parse(model=MODEL, messages=ASK, response_format=Weather, max_tokens=300, **options)
        choice = out.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather), choice
        jsonschema.validate(json.loads(choice.message.content), WEATHER)


def test_json_schema_and_json_object_on_both_endpoints_are_the_librarys(server, oracle):
    """The server's constrained text is the library's own (the same ids, options and constraint), on
    /v1/chat/completions and /v1/completions; json_object's text starts as an object (stories260K never ends one
    within 60 tokens: finish_reason "length")."""
    from cullama import Constraint

    ids = oracle.chat_ids(ASK)
    answer = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER,
                                                                                 "strict": True}})
    expected = oracle.generate(ids, max_new_tokens=300, constraint=Constraint.json_schema(WEATHER))
    assert answer["choices"][0]["message"]["content"] == expected.text
    answer = chat(server, response_format={"type": "json_object"}, max_tokens=60, seed=4, temperature=1.0)
    expected = oracle.generate(ids, max_new_tokens=60, temperature=1.0, seed=4, constraint=Constraint.json_object())
    assert answer["choices"][0]["message"]["content"] == expected.text and expected.text.startswith('{"')
    status, _, raw = server.request("POST", "/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}})
    expected = oracle.generate("Once upon a time", max_new_tokens=300,
                               constraint=Constraint.json_schema(WEATHER, strict=False))
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == expected.text
    jsonschema.validate(json.loads(expected.text), WEATHER)


def test_n_choices_each_hold_to_the_schema_and_are_the_request_alone(server, oracle):
    """response_format with n > 1 and a list of prompts: every choice valid against the schema, each the library's
    own generation with its seed (seed + j); tools with several choices are a 400 naming n."""
    from cullama import Constraint

    body = {"prompt": ["Once upon a time", "The cat"], "n": 2, "seed": 5, "temperature": 0.9, "max_tokens": 300,
            "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    status, _, raw = server.request("POST", "/v1/completions", {"model": MODEL, **body})
    assert status == 200, raw
    answer = json.loads(raw)["choices"]
    assert [c["index"] for c in answer] == [0, 1, 2, 3]
    for choice in answer:
        prompt, j = body["prompt"][choice["index"] // 2], choice["index"] % 2
        expected = oracle.generate(prompt, max_new_tokens=300, temperature=0.9, seed=5 + j,
                                   constraint=Constraint.json_schema(WEATHER, strict=False))
        assert choice["text"] == expected.text
        jsonschema.validate(json.loads(choice["text"]), WEATHER)
    error = refusal(server, n=2, tools=[{"type": "function", "function": {"name": "f", "parameters": WEATHER}}],
                    tool_choice="required")
    assert error["param"] == "n" and "one choice" in error["message"]


def test_a_streamed_structured_output_is_the_whole_one(server):
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}}
    whole = chat(server, **body)["choices"][0]["message"]["content"]
    chunks = server.sse("/v1/chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 300, "temperature": 0,
                                                 **body})
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_strict_refuses_what_cannot_be_enforced_and_non_strict_ignores_it(server):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                        "uniqueItems": True, "maxItems": 2}},
              "required": ["tags"], "additionalProperties": False}
    error = refusal(server, response_format={"type": "json_schema", "json_schema": {
        "name": "t", "schema": schema, "strict": True}})
    assert error["param"] == "response_format.json_schema.schema"
    assert error["message"] == 'response_format.json_schema.schema cannot be enforced: Unimplemented keys: ' \
                               '["uniqueItems"]'
    out = chat(server, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": schema}})
    assert isinstance(json.loads(out["choices"][0]["message"]["content"])["tags"], list)


# langchain-openai 1.8.1's request bodies (tests/server's module docstring): with_structured_output(Weather) (its
# default method, for an OpenAI model name and another alike), method="json_mode", method="function_calling"
LANGCHAIN_SCHEMA = {"description": "Weather in a city.", "properties": {
    "city": {"title": "City", "type": "string"},
    "unit": {"anyOf": [{"type": "string"}, {"type": "null"}], "description": "celsius or fahrenheit", "title": "Unit"},
    "days": {"items": {"type": "integer"}, "title": "Days", "type": "array"}},
    "required": ["city", "unit", "days"], "title": "Weather", "type": "object", "additionalProperties": False}
LANGCHAIN_TOOL_PARAMETERS = {"properties": {
    "city": {"type": "string"},
    "unit": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "description": "celsius or fahrenheit"},
    "days": {"items": {"type": "integer"}, "type": "array"}}, "required": ["city", "days"], "type": "object"}
LANGCHAIN_BODIES = {
    "json_schema": {"stream": False, "response_format": {"type": "json_schema", "json_schema": {
        "schema": LANGCHAIN_SCHEMA, "name": "Weather", "strict": True}}},
    "json_mode": {"stream": False, "response_format": {"type": "json_object"}},
    "function_calling": {"stream": False, "parallel_tool_calls": False,
                         "tool_choice": {"type": "function", "function": {"name": "Weather"}},
                         "tools": [{"type": "function", "function": {"name": "Weather", "description": "Weather in a city.",
                                                                     "parameters": LANGCHAIN_TOOL_PARAMETERS}}]},
}


# -- tools on a model without a tool format (plain JSON) -----------------------------------------------------------
def test_a_named_function_with_the_openai_client(client):
    """parse(tools=[pydantic_function_tool(Weather)], tool_choice named): one call, its arguments parsed by the
    client into the model; finish_reason "stop" (as OpenAI's for a named function)."""
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    out = parse(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Weather)], max_tokens=300,
                tool_choice={"type": "function", "function": {"name": "Weather"}}, temperature=0)
    choice = out.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None
    assert call.function.name == "Weather" and isinstance(call.function.parsed_arguments, Weather)


def test_required_gives_calls_of_the_tools(server):
    """Plain JSON calls of the tools (a list of one with parallel_tool_calls false: stories260K writes call after call
    until max_tokens otherwise; tests/text/test_tools.py walks the longer lists), each call's arguments valid against
    its function's parameters, finish_reason "tool_calls"."""
    for parallel in (False,):
        ended = 0
        for seed in range(4):
            body = {"tools": TOOLS, "tool_choice": "required", "temperature": 0.8, "seed": seed, "max_tokens": 400}
            if parallel is not None:
                body["parallel_tool_calls"] = parallel
            choice = chat(server, **body)["choices"][0]
            if choice["finish_reason"] == "length":
                continue
            ended += 1
            calls = choice["message"]["tool_calls"]
            assert choice["finish_reason"] == "tool_calls" and calls and (parallel is None or len(calls) == 1)
            for call in calls:
                tool = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
                jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])
            assert len({c["id"] for c in calls}) == len(calls) and choice["message"]["content"] is None
        assert ended >= 1, parallel


def sse_tool_calls(chunks: list[dict]) -> tuple[str | None, list[tuple[str, str, str]]]:
    """(content, [(id, name, arguments)]) rebuilt from streamed chunks as a client does, checking OpenAI's shape."""
    content, calls = "", {}
    first = chunks[0]["choices"][0]["delta"]
    assert first["role"] == "assistant"
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a call's first delta: index, id, type, name, arguments ""
                assert call["type"] == "function" and call["function"]["arguments"] == "" and \
                    call["index"] == len(calls)
                calls[call["index"]] = [call["id"], call["function"]["name"], ""]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]][2] += call["function"]["arguments"]
    return content or None, [tuple(c) for _, c in sorted(calls.items())]


def whole_calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]


def test_streamed_tool_calls_are_the_whole_ones(server, client):
    """stream: true: the first delta opens the call (index, id, type, name, arguments ""), the next ones carry
    fragments of its arguments, which add up to the whole answer's arguments; the last chunk has the finish reason;
    the openai client's stream accumulator rebuilds the call and parses its arguments."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": 300,
                "temperature": 0.9, "seed": 7, "parallel_tool_calls": False}
        whole = chat(server, **body)["choices"][0]
        chunks = server.sse("/v1/chat/completions", body)
        content, calls = sse_tool_calls(chunks)
        assert content is None and [(n, a) for _, n, a in calls] == whole_calls(whole["message"])
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]
    tool = openai.pydantic_function_tool(Weather)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[tool], temperature=0, max_tokens=300,
                                        tool_choice={"type": "function", "function": {"name": "Weather"}}) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)


@pytest.mark.parametrize("body, param, words", [
    ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto" needs a chat template that defines tool calls'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name",
     "tool_choice names the function 'nope', which is not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
     "tools.0.function.name", "tools.0.function.name must be 1 to 64 letters"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools.1.function.name", "two tools are named"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "strng"}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters", "tools.0.function.parameters cannot be enforced: "),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "response_format cannot go with tools"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format.type: Input should be"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strng"}}}},
     "response_format.json_schema.schema", "cannot be enforced: Invalid type: strng"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos",
     "a constrained text ends with EOS"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
])
def test_a_request_that_cannot_be_served_is_a_400_naming_its_field(server, body, param, words):
    error = refusal(server, **body)
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"], error


def test_tools_are_refused_on_completions(server):
    assert refusal(server, "/v1/completions", tools=TOOLS)["param"] == "tools"


def test_a_history_of_tool_calls_is_refused_where_the_template_cannot_hold_it(server):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "20C", "tool_call_id": "c1"}]
    error = refusal(server, messages=messages)
    assert error["param"] == "messages" and "does not hold" in error["message"]


def test_a_constrained_request_beside_others_in_the_batch_engine_is_its_solo_self(server, oracle):
    """Four requests at once (the server batches up to 8): two constrained, two not; each answer is the library's
    solo generation."""
    import concurrent.futures

    from cullama import Constraint

    ids = oracle.chat_ids(ASK)
    schema = {"name": "w", "schema": WEATHER, "strict": True}
    bodies = [dict(response_format={"type": "json_schema", "json_schema": schema}, temperature=0.9, seed=11),
              dict(temperature=0.9, seed=12, max_tokens=40),
              dict(response_format={"type": "json_schema", "json_schema": schema}, temperature=0),
              dict(temperature=0, max_tokens=60)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda b: chat(server, **b), bodies))
    for body, answer in zip(bodies, answers):
        constraint = Constraint.json_schema(WEATHER) if "response_format" in body else None
        expected = oracle.generate(ids, max_new_tokens=body.get("max_tokens", 300), temperature=body["temperature"],
                                   seed=body.get("seed"), constraint=constraint)
        assert answer["choices"][0]["message"]["content"] == expected.text, body


# -- tools in the families' own formats ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    make = hermes_model if request.param == "hermes" else llama31_model
    model = make(shared_path("golden"), root / "model")
    with running(model, root, "--max-seq-len", "2048") as proc:  # the tools take 600 of these tokenizers' tokens
        proc.family = request.param
        yield proc


def family_chat(server, **body) -> tuple[int, dict]:
    status, _, raw = server.request("POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 200, **body})
    return status, json.loads(raw)


def test_required_and_named_in_the_familys_format(family):
    """Generated in the family's own format (Qwen2.5's <tool_call> blocks, LLaMA-3.1's JSON), read back as calls
    whose arguments validate, streamed alike."""
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        ended = 0
        for seed in range(4):
            body = {"tools": TOOLS, "tool_choice": choice, "temperature": 1.0, "seed": seed}
            status, answer = family_chat(family, **body)
            assert status == 200, answer
            out = answer["choices"][0]
            if out["finish_reason"] == "length":
                continue
            ended += 1
            calls = out["message"]["tool_calls"]
            assert out["finish_reason"] == ("tool_calls" if choice == "required" else "stop")
            assert calls and (len(calls) == 1 or family.family == "hermes" and choice == "required")
            for call in calls:
                assert isinstance(choice, str) or call["function"]["name"] == "get_time"
                parameters = next(t for t in TOOLS if t["function"]["name"] == call["function"]["name"])
                jsonschema.validate(json.loads(call["function"]["arguments"]), parameters["function"]["parameters"])
            chunks = family.sse("/v1/chat/completions", {"messages": ASK, "max_tokens": 200, **body})
            content, streamed = sse_tool_calls(chunks)
            assert [(n, a) for _, n, a in streamed] == whole_calls(out["message"]) and content is None
        assert ended >= 2, choice


def test_a_forced_call_cut_by_max_tokens_is_a_call_whole_and_streamed(family):
    """The fourth sweep: "required" cut by max_tokens answered its markup as content, no call, unless streamed. Now
    whole and streamed alike: the calls begun (the last one's arguments cut), no content, finish_reason "length"."""
    cut = 0
    for max_tokens in (20, 28, 40, 60):
        body = {"tools": TOOLS, "tool_choice": "required", "temperature": 0, "max_tokens": max_tokens}
        status, answer = family_chat(family, **body)
        assert status == 200, answer
        out = answer["choices"][0]
        if out["finish_reason"] != "length":
            continue
        cut += 1
        assert out["message"]["content"] is None
        chunks = family.sse("/v1/chat/completions", {"messages": ASK, **body})
        content, streamed = sse_tool_calls(chunks)
        assert [(n, a) for _, n, a in streamed] == whole_calls(out["message"]) and content is None
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        if max_tokens >= 28:  # the name is written by then: the call is there, its arguments cut
            assert whole_calls(out["message"])
    assert cut >= 2


def test_auto_reads_whatever_calls_the_model_wrote(family):
    """tool_choice "auto" (the default with tools): the model writes as it likes (here: random text, no call); its
    reply is content, finish_reason "stop", and streaming gives the same text."""
    status, answer = family_chat(family, tools=TOOLS, temperature=0, max_tokens=30)
    assert status == 200, answer
    out = answer["choices"][0]
    content, calls = out["message"]["content"], whole_calls(out["message"])
    assert (content or calls) and out["finish_reason"] in (("tool_calls",) if calls else ("stop", "length"))
    chunks = family.sse("/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 30})
    assert sse_tool_calls(chunks)[0] == content


def test_a_history_of_tool_calls_and_results_is_accepted(family):
    """An assistant turn that called a tool (its arguments a JSON string, as OpenAI sends them) and the tool's
    result: accepted, rendered by the family's template, and the conversation goes on."""
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "20 degrees"}]
    status, answer = family_chat(family, messages=messages, tools=TOOLS, tool_choice="required", temperature=0.5,
                                 seed=1)
    assert status == 200, answer
    status, answer = family_chat(family, messages=messages, temperature=0, max_tokens=10)
    assert status == 200 and answer["usage"]["prompt_tokens"] > 40, answer
    client = openai_client(family)
    out = client.chat.completions.create(model=family.url and client.models.list().data[0].id, messages=messages,
                                         tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0.5, seed=2)
    assert out.choices[0].finish_reason in ("tool_calls", "length")


@pytest.mark.parametrize("method", list(LANGCHAIN_BODIES))
def test_langchain_with_structured_output_bodies(family, method):
    """Each body langchain sends, as it sends it (its strings and integers unbounded, which stories260K never ends:
    the golden tiny models' replies end more often); what langchain reads back validates: the content against the
    schema (json_schema; json_mode: a JSON object), the one tool call's arguments against the tool's parameters."""
    ended = 0
    for seed in range(16):  # until 3 replies end (8 seeds ended 2+ before the decode GEMVs moved to tensor cores)
        if ended == 3:
            break
        status, answer = family_chat(family, max_tokens=400, temperature=1.0, seed=seed, **LANGCHAIN_BODIES[method])
        assert status == 200, answer
        choice = answer["choices"][0]
        if choice["finish_reason"] == "length":
            continue
        ended += 1
        message = choice["message"]
        if method == "function_calling":
            assert choice["finish_reason"] == "stop" and message["content"] is None  # a named function: "stop"
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "Weather" and call["type"] == "function" and call["id"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), LANGCHAIN_TOOL_PARAMETERS)
        elif method == "json_schema":
            jsonschema.validate(json.loads(message["content"]), LANGCHAIN_SCHEMA)
        else:
            assert isinstance(json.loads(message["content"]), dict)
    assert ended >= 2, method
