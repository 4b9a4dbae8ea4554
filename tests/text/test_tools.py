"""Tool calls (cullama/text/tools.py): each family's format found from its chat template; the grammar of a forced call
(random logits choosing among what it allows: every reply parses back into calls whose arguments validate against
their tool's parameters); `parse` and the streamer agreeing on every split of a reply into pieces; chat templates
given the tools, an assistant's tool calls and tool results (tokenizer_base)."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from cullama.common.errors import PromptError
from cullama.runtime.ops.sampling import mask_bits
from cullama.text.grammar import Constraint, Grammars
from cullama.text.tokenizer import load_tokenizer
from cullama.text.tools import Arguments, CallStart, Content, ToolFormat, tool_format

from tests.conftest import shared_path
from tests.tool_models import HERMES_TEMPLATE, LLAMA31_TEMPLATE, TOOLS, hermes_model, llama31_model

# validates the constrained outputs; a test dependency (.[test]): absent on a lent GPU machine, where these skip
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is a test dependency (pip install -e '.[test]')")

HERMES, LLAMA31, JSON = ToolFormat("hermes", "arguments"), ToolFormat("llama3_json", "parameters"), \
    ToolFormat("json", "parameters")
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def tool_models(tmp_path_factory):
    golden = shared_path("golden")
    root = tmp_path_factory.mktemp("tool-models")
    return {"hermes": hermes_model(golden, root / "hermes"), "llama3_json": llama31_model(golden, root / "llama31")}


def test_the_format_comes_from_the_template():
    assert tool_format(HERMES_TEMPLATE) == HERMES and tool_format(LLAMA31_TEMPLATE) == LLAMA31
    golden = json.loads(shared_path("golden", "tiny-llama3", "tokenizer_config.json").read_text())["chat_template"]
    assert tool_format(golden) == JSON and tool_format(None) == JSON and not JSON.native and HERMES.native


def rebuild(events) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = "", {}
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls) and event.call_id.startswith("call_")
            calls[event.index] = [event.name, ""]
        else:
            assert isinstance(event, Arguments)
            calls[event.index][1] += event.text
    return content or None, [tuple(c) for _, c in sorted(calls.items())]


def streamed(fmt: ToolFormat, text: str, rng: random.Random, named: str | None = None):
    streamer, events, at = fmt.streamer(named), [], 0
    while at < len(text):
        size = rng.randint(1, 7)
        events += streamer.push(text[at:at + size])
        at += size
    return rebuild(events + streamer.finish())


def parsed(fmt: ToolFormat, text: str, named: str | None = None):
    content, calls = fmt.parse(text, named)
    return content, [(c.name, c.arguments) for c in calls]


def arguments(rng: random.Random) -> str:
    value = {"city": rng.choice(["Paris", 'a "q" }', "x{[y", "é\\n", ""]), "n": rng.randint(0, 99),
             "l": [1, {"a": [2, "]"]}]}
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def test_streamed_pieces_add_up_to_the_parse_in_every_format():
    """2000 replies of 1-3 calls (with content before Qwen's), split at random: the streamed content and calls
    (their arguments' fragments joined) are exactly what parse reads, which are exactly what was written."""
    rng = random.Random(0)
    for _ in range(2000):
        calls = [(rng.choice(["get_weather", "get_time"]), arguments(rng)) for _ in range(rng.randint(1, 3))]
        content = rng.choice(["", "Sure. ", "I will call <tool", "text\n"])
        text = content + "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls)
        assert parsed(HERMES, text) == streamed(HERMES, text, rng) == (content or None, calls), text
        name, args = calls[0]
        text = f'{{"name": "{name}", "parameters": {args}}}'
        assert parsed(LLAMA31, text) == streamed(LLAMA31, text, rng) == (None, [(name, args)]), text
        text = "[" + ", ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls) + "]"
        assert parsed(JSON, text) == streamed(JSON, text, rng) == (None, calls), text
        assert parsed(JSON, args, "f") == streamed(JSON, args, rng, "f") == (None, [("f", args)])


@pytest.mark.parametrize("fmt, text, expected", [
    (HERMES, "Hello there", ("Hello there", [])),
    (HERMES, '<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call>', (None, [("f", '{"a": 1}')])),
    (HERMES, "a <tool_call> nonsense </tool_call> b", ("a <tool_call> nonsense </tool_call> b", [])),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', (None, [("f", '{"a": 1}')])),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}}', (None, [("f", '{"a": 1}')])),  # cut: no end
    (LLAMA31, '{"parameters": {"x": 1}, "name": "g"}', (None, [("g", '{"x": 1}')])),
    (LLAMA31, "<|python_tag|>{\"name\": \"g\", \"parameters\": {}}", (None, [("g", "{}")])),
    (LLAMA31, "It is sunny.", ("It is sunny.", [])),
    (LLAMA31, "{not json", ("{not json", [])),
])
def test_a_reply_in_another_shape_is_read_as_parse_reads_it(fmt, text, expected):
    """Under tool_choice "auto" the model writes what it likes: a call in another key order (sent whole once it
    ends), arguments as a JSON string, text that is no call (content)."""
    assert parsed(fmt, text) == expected
    assert streamed(fmt, text, random.Random(1)) == expected


def test_a_named_call_cut_short_is_still_the_call_whole_and_streamed():
    """A named function's reply in the plain JSON format is its arguments, by the grammar: cut by max_tokens it is
    that call with its arguments cut (finish_reason "length"), whole as streamed, never text."""
    cut = '{"city": "Par'
    assert parsed(JSON, cut, "get_weather") == (None, [("get_weather", cut)])
    assert streamed(JSON, cut, random.Random(0), "get_weather") == parsed(JSON, cut, "get_weather")


def test_text_after_a_call_is_content_after_it_whole_as_streamed():
    """What follows a reply's calls is content (its spaces kept, whitespace alone dropped), read the same whole and
    streamed a character at a time (the fourth sweep: the stream dropped a lone space, "and more" became "andmore")."""
    for fmt, text, expected in [(JSON, '[{"name": "g", "parameters": {}}] tail', (" tail", [("g", "{}")])),
                                (LLAMA31, '{"name": "f", "parameters": {"a": 1}} and more', (" and more",
                                                                                             [("f", '{"a": 1}')])),
                                (LLAMA31, '{"name": "f", "parameters": {"a": 1}} \n ', (None, [("f", '{"a": 1}')]))]:
        one_by_one = fmt.streamer()
        events = [e for ch in text for e in one_by_one.push(ch)] + one_by_one.finish()
        assert parsed(fmt, text) == rebuild(events) == expected


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("fmt, text, expected", [
    (HERMES, HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "U',
     [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "U')]),
    (HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city', [("get_weather", '{"city')]),
    (HERMES, '<tool_call>\n{"name": "get_', []),
    (LLAMA31, '{"name": "get_time", "parameters": {"tz": "N', [("get_time", '{"tz": "N')]),
    (JSON, '[{"name": "get_time", "parameters": {"tz": "A"}}, {"name": "get_time", "parameters": {"t',
     [("get_time", '{"tz": "A"}'), ("get_time", '{"t')]),
])
def test_a_forced_call_cut_by_max_tokens_is_still_a_call_whole_as_streamed(fmt, text, expected):
    """The fourth sweep: tool_choice "required" cut by max_tokens gave its markup as the whole answer's content and
    no call, while the stream gave the calls. Now both give every call begun, the last with its arguments cut (as
    OpenAI's, finish_reason "length"), and no content: a forced reply has none (cut before a name: nothing)."""
    assert fmt.parse(text, content=False)[0] is None
    assert parsed_forced(fmt, text) == expected
    streamer = fmt.streamer(content=False)
    events = streamer.push(text[:9]) + streamer.push(text[9:]) + streamer.finish()
    assert rebuild(events) == (None, expected)


def parsed_forced(fmt: ToolFormat, text: str):
    return [(c.name, c.arguments) for c in fmt.parse(text, content=False)[1]]


def test_auto_replies_read_the_same_whole_and_streamed_keeping_every_call_that_parses():
    """The fourth sweep: under "auto", one block that is no call made the whole answer all text (its calls lost),
    while the stream kept the calls; one extra "}" likewise. Now the whole answer is the stream's."""
    bad = HERMES_CALL + "\n<tool_call>\nnot a call\n</tool_call>"
    content, calls = parsed(HERMES, bad)
    assert calls == [("get_weather", '{"city": "Paris"}')]
    assert (content, calls) == streamed(HERMES, bad, random.Random(2))
    extra = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}}\n</tool_call>'
    assert parsed(HERMES, extra) == streamed(HERMES, extra, random.Random(3)) == (None, [("f", '{"a": 1}')])


def test_parallel_tool_calls_false_reads_the_first_call_only():
    two = HERMES_CALL + "\n" + HERMES_CALL.replace("get_weather", "get_time")
    assert len(HERMES.parse(two)[1]) == 2
    assert [c.name for c in HERMES.parse(two, most=1)[1]] == ["get_weather"]
    streamer = HERMES.streamer(most=1)
    events = streamer.push(two) + streamer.finish()
    assert rebuild(events) == (None, [("get_weather", '{"city": "Paris"}')]) and streamer.read == 1


def walk(grammars: Grammars, grammar: str, seed: int, prefer: int | None = None, limit: int = 300):
    """Random logits choosing among what the grammar allows, to EOS: the ids (None if cut at `limit`)."""
    rng = np.random.default_rng(seed)
    matcher = grammars.matcher(Constraint.grammar(grammar, option="tool_choice"))
    out, mask = [], np.zeros(grammars.words, np.uint32)
    for _ in range(limit):
        matcher.fill(mask)
        logits = rng.standard_normal(grammars.n_vocab)
        if prefer is not None:
            logits[prefer] += 6
        logits[~mask_bits(mask, grammars.n_vocab)] = -np.inf
        token = int(np.argmax(logits))
        matcher.accept(token)
        if token in grammars.eos_ids:
            return out
        out.append(token)
    return None


@pytest.mark.parametrize("family", ["hermes", "llama3_json"])
@pytest.mark.parametrize("choice", ["required", "get_time", "single"])
def test_a_forced_call_parses_and_its_arguments_validate(tool_models, family, choice):
    """Every reply the grammar allows (random logits, 6 seeds) ends in EOS, parses into calls of the tools (of the named
    one; one call with parallel_tool_calls false; LLaMA-3.1's one a turn), each one's arguments valid against its
    parameters."""
    tok = load_tokenizer(tool_models[family])
    config = json.loads((tool_models[family] / "config.json").read_text())
    eos = [i for i in (tok.eos_id, *([config["eos_token_id"]] if isinstance(config["eos_token_id"], int) else
                                      config["eos_token_id"])) if i is not None]
    grammars = Grammars(tok, config["vocab_size"], eos)
    fmt = tool_format(tok.template.text)
    special = {m for m in ("<tool_call>", "</tool_call>", "<|python_tag|>") if len(tok.encode_rendered(m)) == 1}
    named = choice if choice == "get_time" else None
    grammar = fmt.grammar(TOOLS, named, choice != "single", special)
    ended = 0
    for seed in range(6):
        ids = walk(grammars, grammar, seed, prefer=tok.eos_id)
        if ids is None:
            continue
        ended += 1
        content, calls = fmt.parse(tok.decode(ids))
        assert content is None and calls, tok.decode(ids)
        assert len(calls) == 1 or choice == "required" and family == "hermes"
        for call in calls:
            assert named is None or call.name == named
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    assert ended >= 3


def test_a_generic_forced_call_is_plain_json(tool_models):
    tok = load_tokenizer(shared_path("models", "stories260K"))
    grammars = Grammars(tok, 512, (2,))
    for named, parallel in ((None, True), (None, False), ("get_weather", True)):
        grammar = JSON.grammar(TOOLS, named, parallel, set())
        ids = next(ids for seed in range(20) if (ids := walk(grammars, grammar, seed, prefer=2)) is not None)
        content, calls = JSON.parse(tok.decode(ids), named)
        assert content is None and calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])


def test_templates_render_the_tools_the_calls_and_the_results(tool_models):
    """The request's tools, an assistant turn's calls (their arguments a JSON text, given to the template as a dict,
    as transformers' templates take them) and tool results, in each family's own format."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "content": "20C", "tool_call_id": "c1"}]
    hermes = load_tokenizer(tool_models["hermes"])
    text = hermes.decode(hermes.chat_ids(history, tools=TOOLS), skip_special_tokens=False)
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert "<tool_response>\n20C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    llama = load_tokenizer(tool_models["llama3_json"])
    text = llama.decode(llama.chat_ids(history, tools=TOOLS), skip_special_tokens=False)
    assert "Environment: ipython" in text and '"name": "get_time"' in text
    assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "20C"}' in text
    assert "Environment" not in llama.decode(llama.chat_ids(history[:1]), skip_special_tokens=False)


@pytest.mark.parametrize("message, words", [
    ({"role": "tool", "content": "20C"}, r"has role 'tool' \(a tool call's result\), which"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     "holds tool calls, which"),
])
def test_a_template_without_tool_calls_refuses_them(message, words):
    """tiny-llama3's own template names neither: a message of a call or a result is refused, not dropped; LLaMA-2's
    format (no template) neither."""
    for tok in (load_tokenizer(shared_path("golden", "tiny-llama3")),
                load_tokenizer(shared_path("models", "stories260K"))):
        with pytest.raises(PromptError, match=words):
            tok.chat_ids([{"role": "user", "content": "hi"}, message])
    with pytest.raises(PromptError, match="tools need the model's chat template"):
        load_tokenizer(shared_path("models", "stories260K")).chat_ids([{"role": "user", "content": "hi"}], tools=TOOLS)


@pytest.mark.parametrize("call, words", [
    ({"function": {"name": "f", "arguments": "not json"}}, "tool call 0 must be"),
    ({"function": {"name": 5, "arguments": {}}}, "tool call 0 must be"),
    ("f()", "tool call 0 must be"),
])
def test_a_malformed_call_of_the_history_is_refused(tool_models, call, words):
    tok = load_tokenizer(tool_models["hermes"])
    with pytest.raises(PromptError, match=words):
        tok.chat_ids([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}])
    with pytest.raises(PromptError, match="only an assistant message may"):
        tok.chat_ids([{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}])
