"""Structured outputs and tool calls: a request's `response_format`, `tools` and `tool_choice` as the constraint its
generation runs under (cullama/text/grammar.py), and for tools how its reply is read back (cullama/text/tools.py).

- response_format {"type": "text"}: nothing; {"type": "json_object"}: any JSON object; {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}: JSON valid against the schema (strict true: a keyword llguidance
  cannot enforce is a 400; false or absent, as OpenAI's default: it is ignored).
- tools, with tool_choice (OpenAI's default: "auto" where tools are given):
  "none"      the tools are not shown to the model and no call is read: a plain reply.
  "auto"      the tools go to the chat template, the model answers as it likes, and the calls its family's format
              spells (Qwen2.5's <tool_call> blocks, LLaMA-3.1's JSON) come back as `tool_calls`, finish_reason
              "tool_calls"; a model whose template defines no tool calls gets a 400.
  "required"  at least one call (one with parallel_tool_calls false; LLaMA-3.1's template takes one a turn) of any
              tool, generated under a grammar in the family's format, each call's arguments under its function's
              parameter schema (strict per function, as response_format's); finish_reason "tool_calls".
  a function  {"type": "function", "function": {"name"}}: one call of it, finish_reason "stop" (as OpenAI's).
  A model whose template has no tool format still takes "required" and a named function, through plain JSON
  (tools.py's "json" format); its prompt then holds the tools only if its template renders them.
Every refusal is a 400 naming the field at fault.
"""

from __future__ import annotations

import dataclasses
import re

from ..common.errors import CullamaError, OptionError
from ..text.grammar import Constraint
from ..text.tools import Arguments, CallStart, Content, ToolCall, ToolFormat

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>")  # the tool formats' markers that may be special tokens


def _refused(status: int, message: str, param: str):
    from .protocol import ApiError

    return ApiError(status, message, param=param)


@dataclasses.dataclass(frozen=True)
class ToolReply:
    """How a reply to a request with tools is read: its model's format, and the forced function (if named)."""

    fmt: ToolFormat
    choice: str  # "auto", "required" or "named"
    named: str | None = None
    parallel: bool = True  # parallel_tool_calls (false: a reply's first call only)

    def _reading(self) -> dict:
        """How its text is read (ToolStreamer's options): a forced call has no content (its grammar allows none)."""
        return {"named": self.named, "most": None if self.parallel else 1, "content": self.choice == "auto"}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self.fmt.parse(text, **self._reading())

    def streamer(self):
        return self.fmt.streamer(**self._reading())

    def finish_reason(self, finish: str, calls: int) -> str:
        """The finish_reason (responses.FINISH_REASONS') of a reply with `calls` tool calls that the library ended
        with `finish`: "tool_calls" where it called tools, but for a named function ("stop", as OpenAI's)."""
        if finish == "length" or not calls or self.choice == "named":
            return finish
        return "tool_calls"

    def whole(self, text: str) -> tuple[str | None, list[dict], int]:
        """(the message's content, its tool calls in OpenAI's shape, how many) of a whole reply."""
        content, calls = self.parse(text)
        return content, [call.openai() for call in calls], len(calls)


def deltas(events: list) -> list[tuple[str | None, list[dict] | None]]:
    """A ToolStreamer's events as chat deltas: (content, tool_calls) each, in OpenAI's streamed shape."""
    out = []
    for event in events:
        if isinstance(event, Content):
            out.append((event.text, None))
        elif isinstance(event, CallStart):
            out.append((None, [{"index": event.index, "id": event.call_id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]))
        elif isinstance(event, Arguments):
            out.append((None, [{"index": event.index, "function": {"arguments": event.text}}]))
    return out


def structured(llm, body) -> tuple[Constraint | None, ToolReply | None, list | None]:
    """(the constraint of the request's generation, how its tool calls are read, the tools its chat template gets),
    each None where the request asks for none; ApiError 400 naming the field at fault. The constraint is compiled
    here (on the request's thread), so that the engine only copies it."""
    tools = getattr(body, "tools", None) or []
    choice = getattr(body, "tool_choice", None)
    if not tools:
        if choice not in (None, "none"):
            raise _refused(400, "tool_choice needs tools", "tool_choice")
        return _compiled(llm, response_format(body)), None, None
    tools = [t.openai() for t in tools]
    check_tools(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return _compiled(llm, response_format(body)), None, None
    if response_format(body) is not None:
        raise _refused(400, "response_format cannot go with tools unless tool_choice is \"none\": a reply is a tool "
                            "call or the format's JSON, not both", "response_format")
    fmt = llm.tool_format()
    template = getattr(llm.tokenizer, "template", None)
    shown = tools if template is not None and template.supports("tools") else None  # else the prompt has none
    if choice == "auto":
        if not fmt.native:
            raise _refused(400, "tool_choice \"auto\" needs a chat template that defines tool calls (as LLaMA-3.1's "
                                "and Qwen2.5's do), and this model's has none; use \"required\" or name a function",
                           "tool_choice")
        return None, ToolReply(fmt, "auto", parallel=getattr(body, "parallel_tool_calls", None) is not False), shown
    named = None if choice == "required" else choice.function.name
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise _refused(400, f"tool_choice names the function {named!r}, which is not one of the tools",
                       "tool_choice.function.name")
    for i, tool in enumerate(tools):  # each function's parameters, on their own: a 400 naming the one at fault
        if named is None or tool["function"]["name"] == named:
            parameters = tool["function"].get("parameters")
            if parameters is not None:
                _compiled(llm, Constraint.json_schema(parameters, strict=bool(tool["function"].get("strict")),
                                                      option=f"tools.{i}.function.parameters"))
    special = {m for m in MARKERS if _single_token(llm.tokenizer, m)}
    parallel = getattr(body, "parallel_tool_calls", None) is not False
    grammar = fmt.grammar(tools, named, parallel, special)
    constraint = _compiled(llm, Constraint.grammar(grammar, option="tool_choice"))
    return constraint, ToolReply(fmt, "named" if named else "required", named, parallel), shown


def response_format(body) -> Constraint | None:
    fmt = getattr(body, "response_format", None)
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise _refused(400, "response_format.json_schema goes with type \"json_schema\"", "response_format.type")
        return None
    if fmt.type == "json_object":
        return Constraint.json_object("response_format")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise _refused(400, "response_format of type \"json_schema\" needs json_schema.schema", "response_format")
    try:
        return Constraint.json_schema(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict),
                                      option="response_format.json_schema.schema")
    except OptionError as exc:
        raise _refused(400, str(exc), exc.option) from None


def check_tools(tools: list[dict]) -> None:
    names = set()
    for i, tool in enumerate(tools):
        name = tool["function"]["name"]
        if not TOOL_NAME.fullmatch(name):
            raise _refused(400, f"tools.{i}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                           f"tools.{i}.function.name")
        if name in names:
            raise _refused(400, f"tools.{i}.function.name: two tools are named {name!r}", f"tools.{i}.function.name")
        names.add(name)


def _compiled(llm, constraint: Constraint | None) -> Constraint | None:
    """The constraint, compiled for the model (a 400 naming its option where it cannot be enforced)."""
    if constraint is None:
        return None
    try:
        llm.grammars.check(constraint)
    except CullamaError as exc:
        param = getattr(exc, "option", None) or constraint.option
        raise _refused(400, str(exc), param) from None
    return constraint


def _single_token(tokenizer, text: str) -> bool:
    try:
        return len(tokenizer.encode_rendered(text)) == 1
    except CullamaError:
        return False
