"""Tool calls (OpenAI's `tools`): how a model family's replies spell them, the grammar that makes a reply one, and
reading them back out of the text, whole or as it streams.

The formats, from the chat template that renders the tools (tool_format):
  hermes       Qwen2.5 (a template that spells <tool_call>): each call is `<tool_call>\\n{"name": NAME, "arguments":
               ARGS}\\n</tool_call>`, several may follow each other (one per line), the text before the first one is
               the reply's content.
  llama3_json  LLaMA-3.1 / 3.2 / 3.3 (a template with an "ipython" role and "parameters"): the reply is one
               `{"name": NAME, "parameters": ARGS}`, optionally after <|python_tag|>.
  json         any other template: it defines no tool calls, so the model has no format of its own; a call is
               forced as plain JSON: the arguments object itself for a named tool, else `[{"name": NAME,
               "parameters": ARGS}, ...]` (vLLM's choice), and tool_choice "auto" is not served.

A forced call (tool_choice "required", or a named function) is generated under `grammar`: the wrapper's bytes are
literal, so the name is known once it is written, and only the arguments are free, under the function's own
parameter schema (llguidance's %json; json.dumps' spacing, as grammar.JSON_STYLE). Under "auto" the model writes
what it likes and the calls it wrote are read back, whole (`parse`) or as it streams (ToolStreamer), the one through
the other: a reply reads the same either way (a block that is no call stays text).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from typing import Sequence

from .grammar import JSON_STYLE

NAME = r'"((?:[^"\\]|\\.)*)"'
# a call's head: {"name": "NAME", "arguments": (or "parameters": ), the arguments' JSON right after it
HEAD = re.compile(r'\{\s*"name"\s*:\s*' + NAME + r'\s*,\s*"(arguments|parameters)"\s*:\s*')


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments' JSON text, as the model wrote it
    id: str = dataclasses.field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ToolFormat:
    name: str  # "hermes", "llama3_json" or "json"
    args_key: str  # the key of the arguments in a call: "arguments" or "parameters"

    @property
    def native(self) -> bool:
        """The chat template defines the calls' spelling (tool_choice "auto" can be read back)."""
        return self.name != "json"

    def grammar(self, tools: Sequence[dict], named: str | None, parallel: bool, special: set[str]) -> str:
        """The Lark grammar of a reply that calls tools: one or more calls of any of `tools` (OpenAI tool dicts,
        checked), or one of the function `named`; `parallel` False: one call; `special`: the special tokens the
        tokenizer has among <tool_call>, </tool_call>, <|python_tag|> (a marker without its token is text)."""
        pool = [t for t in tools if named is None or t["function"]["name"] == named]
        if self.name == "json" and named is not None:
            return "start: %json " + parameters_schema(pool[0])
        calls = [f"call_{i}: {json.dumps(self.head(t['function']['name']))} %json {parameters_schema(t)} \"}}\""
                 for i, t in enumerate(pool)]
        call = f"call: {' | '.join(f'call_{i}' for i in range(len(pool)))}"
        many = parallel and named is None
        if self.name == "hermes":
            opening, closing = (marker if marker in special else json.dumps(marker)
                                for marker in ("<tool_call>", "</tool_call>"))
            start = ['start: block ("\\n" block)*' if many else "start: block",
                     f'block: {opening} "\\n" call "\\n" {closing}']
        elif self.name == "llama3_json":  # its template takes one call a turn
            start = ["start: <|python_tag|>? call" if "<|python_tag|>" in special else "start: call"]
        else:
            start = ['start: "[" call (", " call)* "]"' if many else 'start: "[" call "]"']
        return "\n".join([*start, call, *calls])

    def head(self, name: str) -> str:
        """A call's text up to its arguments."""
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.args_key}": '

    def parse(self, text: str, named: str | None = None, most: int | None = None,
              content: bool = True) -> tuple[str | None, list[ToolCall]]:
        """(the reply's content, its tool calls) read from its whole text: what its stream gives (ToolStreamer, with
        these arguments), gathered, so that a reply reads the same whole and streamed. `named`: the forced function
        (the json format's text is its arguments). A call cut at max_tokens is still that call, its arguments cut
        too, as OpenAI's; a text with no call is all content; with calls, content that is only whitespace is None."""
        streamer = self.streamer(named, most, content)
        events = streamer.push(text) + streamer.finish()
        shown = "".join(e.text for e in events if isinstance(e, Content))
        names, arguments = {}, {}
        for event in events:
            if isinstance(event, CallStart):
                names[event.index] = (event.name, event.call_id)
            elif isinstance(event, Arguments):
                arguments[event.index] = arguments.get(event.index, "") + event.text
        calls = [ToolCall(name, arguments.get(i, ""), call_id) for i, (name, call_id) in sorted(names.items())]
        if not calls:
            return shown if content else None, []
        return (shown if shown.strip() else None), calls

    def streamer(self, named: str | None = None, most: int | None = None, content: bool = True) -> "ToolStreamer":
        return ToolStreamer(self, named, most, content)


def _call(text: str) -> ToolCall | None:
    """The one call a text holds (surrounding whitespace aside), or None."""
    call, end = _call_at(text.strip())
    return call if call is not None and not text.strip()[end:].strip() else None


def _call_at(text: str) -> tuple[ToolCall | None, int]:
    """(the call at the start of `text`, where it ends): {"name": ..., "arguments" | "parameters": {...}} in that
    order keeps its arguments' text as written; any other order is read through json."""
    head = HEAD.match(text)
    if head is not None:
        try:
            name = json.loads(f'"{head.group(1)}"')
            args, end = json.JSONDecoder().raw_decode(text, head.end())
        except ValueError:
            return None, 0
        rest = text[end:]
        close = len(rest) - len(rest.lstrip())
        if isinstance(args, dict) and rest[close:close + 1] == "}":
            return ToolCall(name, text[head.end():end]), end + close + 1
    try:  # not in the format's own shape (another order, arguments as a string): read through json
        value, end = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None, 0
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None, 0
    args = value.get("arguments", value.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None, 0
    if not isinstance(args, dict):
        return None, 0
    return ToolCall(value["name"], json.dumps(args, ensure_ascii=False)), end


def parameters_schema(tool: dict) -> str:
    """A tool's parameters as the JSON schema its arguments are generated under: json.dumps' spacing unless the
    schema says otherwise; a function without parameters takes an empty object; `strict` false (or absent):
    keywords llguidance cannot enforce are ignored, as OpenAI's non-strict tools."""
    function = tool["function"]
    schema = function.get("parameters")
    if schema is None:
        schema = {"type": "object", "properties": {}, "additionalProperties": False}
    own = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    style = {**JSON_STYLE, **own, **({} if function.get("strict") else {"lenient": True})}
    return json.dumps({**schema, "x-guidance": style})


def tool_format(template_text: str | None) -> ToolFormat:
    """The tool-call format of a chat template (its source), "json" where it defines none."""
    text = template_text or ""
    if "<tool_call>" in text:
        return ToolFormat("hermes", "arguments")
    if "ipython" in text and '"parameters"' in text:
        return ToolFormat("llama3_json", "parameters")
    return ToolFormat("json", "parameters")


# -- streaming ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Content:
    text: str


@dataclasses.dataclass(frozen=True)
class CallStart:
    index: int
    call_id: str
    name: str


@dataclasses.dataclass(frozen=True)
class Arguments:
    index: int
    text: str


class ToolStreamer:
    """A reply's text, piece by piece, as OpenAI streams a message with tool calls: content, then for each call its
    start (index, id, name) and its arguments in fragments as they are written. A call whose head is the format's
    own (always, under a grammar) streams its arguments as they come; any other is sent whole once it has ended;
    what cannot be a call is content. `finish()` ends the reply. The fragments of a call add up to its arguments'
    text, as `parse` reads them. `most`: the calls read at most (parallel_tool_calls false: 1), the others dropped;
    `content` False: no content (a forced call, whose grammar allows none: a reply cut before its first call's name
    has no content, rather than the markup it began with)."""

    def __init__(self, fmt: ToolFormat, named: str | None = None, most: int | None = None, content: bool = True):
        self.fmt, self.named, self.most, self.content = fmt, named, most, content
        self.buffer, self.calls, self.index = "", [], -1
        self.mode = "args" if fmt.name == "json" and named is not None else "start"
        self.depth, self.in_string, self.escaped = 0, False, False
        self.block = ""  # hermes: a block whose head is not the format's own, held whole until it ends
        self.opening = ""  # the text that opened the block being read (given back as content if it is none)

    def push(self, text: str) -> list:
        self.buffer += text
        events: list = []
        while self.buffer:
            step = getattr(self, f"_{self.mode}")(events)
            if not step:
                break
        return self._kept(events)

    @property
    def read(self) -> int:
        """The calls read so far (those `most` keeps)."""
        return len(self.calls) if self.most is None else min(len(self.calls), self.most)

    def _kept(self, events: list) -> list:
        """The events the reply shows: no call past `most`, no content where there is none to show."""
        def shown(event) -> bool:  # (a Content, a CallStart or an Arguments)
            if isinstance(event, Content):
                return self.content
            return self.most is None or event.index < self.most

        return [e for e in events if shown(e)]

    def finish(self) -> list:
        """The rest: text held back (a possible start of a call that never came) as content."""
        events = []
        if self.mode == "args" and self.named is not None and self.index < 0:
            self._begin(events, self.named)
        if self.mode == "args" and self.buffer:
            events.append(Arguments(self.index, self.buffer))
        elif self.mode == "held" and self.block:  # a call that never ended: what it is, as parse reads it
            events += self._whole(self.block, final=True)
        elif self.buffer and self.mode in ("start", "content", "block") and self.index < 0:
            events.append(Content(self.opening + self.buffer if self.mode == "block" else self.buffer))
        self.buffer, self.block = "", ""
        return self._kept([e for e in events if not isinstance(e, (Content, Arguments)) or e.text])

    def _begin(self, events: list, name: str) -> None:
        self.index += 1
        call_id = "call_" + uuid.uuid4().hex[:24]
        self.calls.append(call_id)
        events.append(CallStart(self.index, call_id, name))
        self.depth, self.in_string, self.escaped = 0, False, False

    # each mode: consume what it can of the buffer, append events; False: wait for more text
    def _start(self, events: list) -> bool:
        if self.fmt.name == "hermes":
            self.mode = "content"
            return True
        stripped = self.buffer.lstrip()
        if not stripped:
            return False
        body = stripped.removeprefix("<|python_tag|>").lstrip()
        if "<|python_tag|>".startswith(stripped):
            return False
        opening = "{" if self.fmt.name == "llama3_json" else "["
        if not body:
            return False
        if body[0] != opening:
            self.mode = "content"
            return True
        if self.fmt.name == "json":
            self.buffer, self.mode, self.opening = body[1:], "block", "["
        else:
            self.buffer, self.mode = body, "block"
        return True

    def _content(self, events: list) -> bool:
        if self.fmt.name != "hermes":
            events.append(Content(self.buffer))
            self.buffer = ""
            return False
        # after a call, the text between and after the blocks is not content (parse reads the text before the first)
        shown = (lambda text: None) if self.index >= 0 else (lambda text: events.append(Content(text)))
        at = self.buffer.find("<tool_call>")
        if at < 0:  # hold back what may be the start of <tool_call>
            keep = next((k for k in range(min(len(self.buffer), 10), 0, -1)
                         if "<tool_call>".startswith(self.buffer[-k:])), 0)
            shown(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            return False
        shown(self.buffer[:at])
        self.buffer, self.mode, self.opening = self.buffer[at + len("<tool_call>"):], "block", "<tool_call>"
        return True

    def _block(self, events: list) -> bool:
        """A call's head: its name once whole, then its arguments."""
        text = self.buffer.lstrip()
        head = HEAD.match(text)
        if head is not None and head.end() == len(text):  # the spaces after its colon may go on
            return False
        if head is None or text[head.end()] != "{":  # (arguments that are no object: a string of JSON, ...)
            if head is None and len(text) < 64 and _may_become_head(text):
                return False
            self.mode, self.block = "held", ""  # not the format's own shape: the call is read once it ends
            return True
        name = json.loads(f'"{head.group(1)}"')
        self._begin(events, name)
        self.buffer, self.mode = text[head.end():], "args"
        return True

    def _args(self, events: list) -> bool:
        if self.named is not None and self.index < 0:
            self._begin(events, self.named)
        end = None
        for i, ch in enumerate(self.buffer):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    end = i + 1
                    break
        if end is None:
            events.append(Arguments(self.index, self.buffer))
            self.buffer = ""
            return False
        events.append(Arguments(self.index, self.buffer[:end]))
        self.buffer, self.mode = self.buffer[end:], "close" if self.named is None or self.fmt.name != "json" else "done"
        return True

    def _close(self, events: list) -> bool:
        """After a call's arguments: its closing '}', then (hermes) '</tool_call>' and another block or text, (json)
        ', ' and another call or ']'."""
        if self.fmt.name == "hermes":
            match = re.match(r"\s*\}\s*</tool_call>", self.buffer)
            if match is None:
                return False if len(self.buffer) < 32 else self._stray(events)
            self.buffer, self.mode = self.buffer[match.end():], "content"
            return True
        if self.fmt.name == "llama3_json":  # its one call: what follows the '}' is content (_done), spaces and all
            match = re.match(r"\s*\}", self.buffer)
            if match is None:
                return False
            self.buffer, self.mode = self.buffer[match.end():], "done"
            return True
        match = re.match(r"\s*\}\s*(?=\S)", self.buffer)  # json: what follows decides (', ' or ']')
        if match is None:
            return False
        self.buffer = self.buffer[match.end():]
        if self.buffer.startswith(","):
            self.buffer, self.mode = self.buffer[1:], "block"
        elif self.buffer.startswith("]"):
            self.buffer, self.mode = self.buffer[1:], "done"
        else:
            return self._stray(events)
        return True

    def _done(self, events: list) -> bool:
        """After the last call: text is content, but whitespace alone waits (what follows it keeps its spaces; at
        the end it is dropped)."""
        if self.buffer.strip():
            events.append(Content(self.buffer))
            self.buffer = ""
        return False

    def _stray(self, events: list) -> bool:
        events.append(Content(self.buffer))
        self.buffer, self.mode = "", "content"
        return False

    def _held(self, events: list) -> bool:
        """A hermes block not in the format's own order: held to its end, then read as parse reads it."""
        self.block += self.buffer
        self.buffer = ""
        end = self.block.find("</tool_call>")
        if end < 0 or self.fmt.name != "hermes":
            return False
        block, self.buffer = self.block[:end], self.block[end + len("</tool_call>"):]
        self.block, self.mode = "", "content"
        events += self._whole(block)
        return True

    def _whole(self, block: str, final: bool = False) -> list:
        call = _call(block)
        if call is None:
            return [Content(("<tool_call>" if self.fmt.name == "hermes" else "") + block +
                            ("" if final else "</tool_call>"))]
        events: list = []
        self._begin(events, call.name)
        return events + [Arguments(self.index, call.arguments)]


def _may_become_head(text: str) -> bool:
    """Whether more text could make `text` a call's head (it is a prefix of one)."""
    probe = '{"name": "x", "arguments": '
    partial = re.match(r'\{\s*("(n(a(m(e)?)?)?)?)?$', text) or re.match(r'\{\s*"name"\s*:?\s*("[^"]*)?$', text) \
        or re.match(r'\{\s*"name"\s*:\s*' + NAME + r'\s*(,\s*("[a-z]*"?\s*:?\s*)?)?$', text)
    return bool(partial) or probe.startswith(text)
