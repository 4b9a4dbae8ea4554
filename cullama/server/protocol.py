"""The OpenAI request bodies cullama serves (pydantic models) and its OpenAI-shaped errors.

Types are checked strictly (a string is not a number, 1.0 is not an integer); the ranges of the sampling
options are the library's own (GenerationOptions.checked), checked when the prompt is prepared. Unknown
fields are ignored, as OpenAI's peers do, but a known field that asks for something cullama cannot do
(`echo` on a chat, `tools` on /v1/completions, ...) is refused by `check()` with a 400 naming it, rather than ignored.
`n` > 1 and a list of prompts are served as rows of the engine's batch (server/choices.py); `response_format`, `tools`
and `tool_choice` become a constraint in server/structured.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationInfo,
                      field_validator)
from pydantic_core import PydanticCustomError

from . import logprobs as logprob_fields

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]  # a JSON number; true/"1" are not
MaxTokens = Annotated[StrictInt, Field(ge=1)]
# Stop strings a request may give: OpenAI takes 4; code-completion clients send a dozen or so. The matcher's
# work per token grows with the longest (cullama/text/stop_strings.py), and text that may begin one is held back.
MAX_STOPS, MAX_STOP_CHARS = 16, 256
TOP_P_ZERO = 1.1754943508222875e-38  # OpenAI's top_p 0: float32's smallest normal number, the top token alone

# The error `type` OpenAI's API gives each status (clients key on the status; people read the type).
ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """An answer other than 200: `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


# Fields of OpenAI's API that cullama cannot honour, with the values that ask for nothing (some clients
# send them as defaults). Any other value is a 400 naming the field: silently ignoring it would answer a
# different question than the one asked. A request model that declares one of them as a field serves it
# (logprobs, top_logprobs, echo: server/logprobs.py): it is then no extra field, and not checked here.
UNHONOURED: dict[str, tuple] = {
    "top_logprobs": (None,), "echo": (None, False), "best_of": (None, 1),
    "suffix": (None, ""), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


def _asks_nothing(value: Any, inert: tuple) -> bool:
    # By type as well as value: `best_of: true` is no 1, `echo: 0` no false.
    return any(value is None if v is None else (type(value) is type(v) and value == v) for v in inert)


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)  # `description`: ignored

    name: StrictStr | None = None  # OpenAI requires it; cullama does not need it
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None  # null or absent: false, as OpenAI's


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text", "json_object", or "json_schema" with json_schema (server/structured.py)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class Function(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; absent: none
    strict: StrictBool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: Function

    def openai(self) -> dict:
        """The tool as the chat template gets it (transformers passes the request's dicts)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(BaseModel):
    name: StrictStr


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class GenerationRequest(BaseModel):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="allow")  # unknown fields are kept aside (model_extra) and ignored

    model: StrictStr | None = None  # None: the served model (OpenAI requires it; its peers do not)
    max_tokens: MaxTokens | None = None
    temperature: Number = 1.0  # OpenAI's default; 0 = greedy
    top_p: Number = 1.0
    top_k: StrictInt = 0  # cullama's own, as in vLLM: 0 = off
    repetition_penalty: Number = 1.0  # cullama's own: 1 = off
    seed: StrictInt | None = None
    # A union's description is what a value of the wrong type is told it must be (app.validation_error).
    stop: StrictStr | list[StrictStr] | None = Field(None, description="a string or a list of strings")
    ignore_eos: StrictBool = False  # cullama's own, as in vLLM: for fixed-length benchmark runs
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    user: StrictStr | None = None  # accepted and ignored
    # cullama's own: speculative decoding for this request ("off": plain decoding); unset or null, the server's
    # default (`cullama serve --speculative ...`). Ranges and combinations: SpeculativeOptions.checked.
    speculative: Literal["ngram", "draft", "off"] | None = None
    draft_tokens: StrictInt | None = None
    adaptive_draft: StrictBool | None = None
    # structured outputs (server/structured.py); /v1/completions takes it too, as vLLM's does
    response_format: ResponseFormat | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def bounded_stops(cls, value):
        # Before the items' types are checked: a list of a million is refused at once, not item by item.
        stops = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        if len(stops) > MAX_STOPS:
            raise PydanticCustomError("too_many_stops", "at most {most} stop strings are allowed, got {got}",
                                      {"most": MAX_STOPS, "got": len(stops)})
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > MAX_STOP_CHARS:
                which = "this one" if isinstance(value, str) else f"stop string {i}"
                raise PydanticCustomError("stop_too_long", "a stop string may have at most {most} characters; "
                                          "{which} has {got}",
                                          {"most": MAX_STOP_CHARS, "which": which, "got": len(stop)})
        return value

    @field_validator("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "ignore_eos", "stream",
                     "n", mode="before")
    @classmethod
    def null_is_the_default(cls, value, info: ValidationInfo):
        # OpenAI's API takes null for "not given", and clients send it so.
        return cls.model_fields[info.field_name].default if value is None else value

    def check(self) -> None:
        """Raise ApiError (400, naming the field) for what the types allow but cullama does not serve."""
        if self.n < 1:  # its top: what the server can hold at once (app.prepare_choices)
            raise ApiError(400, f"n must be at least 1, got {self.n}", param="n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
        for name, value in (self.model_extra or {}).items():
            if name in UNHONOURED and not _asks_nothing(value, UNHONOURED[name]):
                raise ApiError(400, f"{name} is not supported by cullama (got {value!r}); leave it out",
                               param=name)

    def speculation(self, default: dict) -> tuple[str | None, int | None, bool]:
        """(method, draft_tokens, adaptive_draft) for SpeculativeOptions.checked: the request's fields over the
        server's `default` (Llama.stream's speculative keywords, {} for plain decoding). The default's
        draft_tokens and adaptive_draft go with a method only: a request that turns speculation on takes
        them, one that turns it off leaves them (and may not give its own)."""
        method = default.get("speculative") if self.speculative is None else \
            None if self.speculative == "off" else self.speculative
        if method is None:
            return None, self.draft_tokens, self.adaptive_draft is True
        k = default.get("draft_tokens") if self.draft_tokens is None else self.draft_tokens
        adaptive = default.get("adaptive_draft", False) if self.adaptive_draft is None else self.adaptive_draft
        return method, k, adaptive

    def token_limit(self) -> tuple[str, int] | None:
        """(field, tokens): the cap on the completion that the request gives; None where it gives none."""
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)

    def max_new_tokens(self, context: int) -> int:
        """Llama.stream's max_new_tokens: the request's cap, else up to the end of the context."""
        limit = self.token_limit()
        return context if limit is None else limit[1]

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_top_p(self):
        """The library's top_p for OpenAI's: its range is [0, 1], and 0 (only the most likely token) is the
        library's smallest, which keeps that token alone (a top_p the library refuses stays as it is)."""
        return TOP_P_ZERO if self.top_p == 0 else self.top_p

    def sampling_seed(self) -> int | None:
        """The library's seed for OpenAI's: an int64 (front-ends send -1, and other negative seeds), so a negative
        one is taken modulo 2**64, as the same 64 bits (the library's range is [0, 2**64))."""
        if self.seed is not None and -2**63 <= self.seed < 0:
            return self.seed % 2**64
        return self.seed


class CompletionRequest(GenerationRequest):
    """POST /v1/completions: `prompt` is a text or a list of token ids (BOS is added to a text only), or a list of
    either (a batch: each prompt its own choices, server/choices.py); a batch of one is taken as that one
    (lm-evaluation-harness sends its token ids so)."""

    prompt: StrictStr | list[Any] = Field(description="a string, a list of token ids, or a list of either")
    # unset or null: 16, OpenAI's default for completions; 0 with echo: the prompt's log-probabilities only
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    logprobs: StrictInt | None = None  # the sampled token's log-probability and this many more (0..5)
    echo: StrictBool = False  # the prompt's text (and with logprobs, its tokens') before the completion's

    @field_validator("echo", mode="before")
    @classmethod
    def echo_null_is_false(cls, value):
        return False if value is None else value

    @field_validator("prompt", mode="before")
    @classmethod
    def batch_of_one(cls, value):
        return value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)) \
            else value

    def max_new_tokens(self, context: int) -> int:
        limit = self.token_limit()
        return 16 if limit is None else limit[1]

    def logprob_options(self) -> dict:
        """Llama.stream's logprobs and prompt_logprobs (server/logprobs.py)."""
        return logprob_fields.library_options(False, self.logprobs, None, self.echo)

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and not 0 <= self.logprobs <= logprob_fields.MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be an integer from 0 to {logprob_fields.MAX_COMPLETION_LOGPROBS}, got "
                                f"{self.logprobs} (top_logprobs on /v1/chat/completions goes to "
                                f"{logprob_fields.MAX_TOP_LOGPROBS})", param="logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens 0 asks for nothing without echo: true (which scores the prompt)",
                           param="max_tokens")
        if self.is_batch():
            self.check_batch()
        elif isinstance(self.prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in self.prompt):
                raise ApiError(400, "prompt must be a text or a list of integer token ids", param="prompt")
            if not self.prompt:
                raise ApiError(400, "prompt is an empty list of token ids: give at least one (an empty text "
                                    "starts from BOS alone, where the tokenizer adds one)", param="prompt")

    def is_batch(self) -> bool:
        """Whether `prompt` is a list of prompts (texts, or token-id lists) rather than one."""
        return isinstance(self.prompt, list) and any(isinstance(p, (str, list)) for p in self.prompt)

    def prompts(self) -> list:
        """The prompts, each a text or a list of token ids: one, or a batch's in order."""
        return list(self.prompt) if self.is_batch() else [self.prompt]

    def check_batch(self) -> None:
        """A batch is all texts or all token-id lists (OpenAI's two kinds), each id list non-empty, of integers."""
        texts = all(isinstance(p, str) for p in self.prompt)
        if not texts and not all(isinstance(p, list) for p in self.prompt):
            raise ApiError(400, "prompt must be a list of texts or a list of token-id lists, not a mix of them and "
                                "other values", param="prompt")
        for i, ids in enumerate([] if texts else self.prompt):
            if not ids:
                raise ApiError(400, f"prompt.{i} is an empty list of token ids: give at least one", param=f"prompt.{i}")
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError(400, f"prompt.{i} must be a list of integer token ids", param=f"prompt.{i}")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class CalledFunction(BaseModel):
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = Field(description="a JSON object's text (or the object)")


class ToolCallIn(BaseModel):
    """A call an assistant turn of the history made (OpenAI's `tool_calls` item)."""

    model_config = ConfigDict(extra="allow")

    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. `refusal`: ignored

    role: StrictStr
    content: StrictStr | Annotated[list[TextPart], Field(fail_fast=True)] | None = Field(
        None, description='a string or a list of {"type": "text", "text": ...} parts')
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn that called tools
    tool_call_id: StrictStr | None = None  # a `tool` message: the call it answers
    name: StrictStr | None = None

    def as_dict(self) -> dict:
        """{"role", "content": str, and a tool call's or result's fields} for Llama.chat_ids; `developer` is OpenAI's
        new name for `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": c.function.model_dump()}
                                 for c in self.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(self, key) is not None and self.role == "tool":
                out[key] = getattr(self, key)
        return out


class ChatRequest(GenerationRequest):
    """POST /v1/chat/completions: `messages` go through the model's chat template (LLaMA-2's without one)."""

    # fail_fast: the first bad message is the answer; a list of a million gets no million complaints
    messages: Annotated[list[Message], Field(fail_fast=True)]
    max_completion_tokens: MaxTokens | None = None  # OpenAI's newer name for max_tokens; it wins
    logprobs: StrictBool = False  # each generated token's log-probability
    top_logprobs: StrictInt | None = None  # and this many alternatives (0..20; needs logprobs)
    tools: list[Tool] | None = None  # server/structured.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    parallel_tool_calls: StrictBool | None = None  # false: one call at most (null or absent: true)

    @field_validator("logprobs", mode="before")
    @classmethod
    def logprobs_null_is_false(cls, value):
        return False if value is None else value

    def logprob_options(self) -> dict:
        """Llama.stream's logprobs and prompt_logprobs (server/logprobs.py)."""
        return logprob_fields.library_options(True, self.logprobs, self.top_logprobs, False)

    def check(self) -> None:
        """Also top_logprobs' range and its need of logprobs, and what a message asks for that the chat template
        cannot hold, named by the message's field."""
        super().check()
        most = logprob_fields.MAX_TOP_LOGPROBS
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= most:
                raise ApiError(400, f"top_logprobs must be an integer from 0 to {most}, got {self.top_logprobs}",
                               param="top_logprobs")
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        for i, message in enumerate(self.messages):
            if (message.model_extra or {}).get("function_call") not in (None, []):  # the deprecated form of tool_calls
                raise ApiError(400, f"messages.{i}.function_call: OpenAI's deprecated functions are not supported by "
                                    "cullama; send tool_calls", param=f"messages.{i}.function_call")
            if message.tool_calls and message.role != "assistant":
                raise ApiError(400, f"messages.{i}.tool_calls: only an assistant message makes tool calls",
                               param=f"messages.{i}.tool_calls")
            if message.role == "developer" and i > 0:
                raise ApiError(400, f"messages.{i}.role: a developer message (OpenAI's newer name for a system "
                                    "message) may only come first: the chat template takes one system prompt, "
                                    "before the conversation", param=f"messages.{i}.role")

    def token_limit(self) -> tuple[str, int] | None:
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return super().token_limit()
