"""OpenAI's response shapes: a whole answer, a streamed chunk, and the Server-Sent Events framing.

One `Answer` per request knows its kind ("text_completion" or "chat.completion"), id, creation time
and model name, and builds every body of that request; the chunks are plain dicts dumped compactly,
since they are built once per token.
"""

from __future__ import annotations

import json
import time
import uuid

# The library's finish reasons in OpenAI's words: an EOS token and a stop string both end with "stop"; a reply
# that calls tools ends with "tool_calls" (server/structured.py).
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "tool_calls": "tool_calls"}

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict) -> bytes:
    """One Server-Sent Event carrying a JSON object."""
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: the prompt tokens the prefix cache gave (runtime/engine.py), as
    OpenAI's prompt caching reports them."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Answer:
    """The bodies of one request's answer, whole or streamed."""

    def __init__(self, chat: bool, model: str, include_usage: bool = False):
        self.chat, self.model = chat, model
        # stream_options.include_usage: every chunk carries "usage": null, the extra last one the usage (OpenAI's)
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str | None, finish_reason: str, prompt_tokens: int, completion_tokens: int,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None, cached_tokens: int = 0) -> dict:
        """The whole answer; `logprobs`: the choice's (server/logprobs.py), None where none was asked for;
        `tool_calls`: the chat message's (OpenAI's shape), its content then the text before them or None."""
        finish = FINISH_REASONS[finish_reason]
        if self.chat:
            message = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None, first: bool = False,
              logprobs: dict | None = None, tool_calls: list[dict] | None = None) -> dict:
        """A streamed choice: `text` (None in the last chunk, which carries the finish reason), and the
        log-probabilities of its tokens where they were asked for. The first chat chunk also names the role,
        as OpenAI's does. `tool_calls`: a chat delta's (OpenAI's streamed shape: a call's first delta has its index,
        id, type and name, the next ones its index and a fragment of its arguments)."""
        finish = FINISH_REASONS[finish_reason] if finish_reason else None
        if self.chat:
            delta = {} if text is None else {"content": text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            if first:
                delta = {"role": "assistant", **({"content": None} if tool_calls and text is None else {}), **delta}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
            chunk = {**self._head("text_completion"), "choices": [choice]}
        return {**chunk, "usage": None} if self.include_usage else chunk

    def text_chunks(self, scores) -> "TextChunks":
        """One choice's streamed text chunks (no tools); `scores`: its server/logprobs.py Logprobs."""
        return TextChunks(self, scores)

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
        """The extra last chunk of `stream_options.include_usage`: no choices, the usage."""
        head = self._head("chat.completion.chunk" if self.chat else "text_completion")
        return {**head, "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class TextChunks:
    """One choice's streamed chunks when it calls no tools, one request's or one of its n (server/choices.py): each
    chunk's log-probability entries spell its text (Logprobs.spelled: text that ends inside a token waits for the
    rest of it), an echo's prompt text and entries go with its first chunk, and a piece that makes no chunk yet makes
    none (its text and tokens wait)."""

    def __init__(self, answer: Answer, scores):
        self.answer, self.scores = answer, scores
        self.first = True  # no chunk sent yet: the next names the role (chat) and carries the echo
        self.prompt = None  # the prompt's log-probabilities, until a chunk carries them

    def piece(self, text: str, logprobs, prompt_logprobs) -> list[dict]:
        """The chunks of a piece of text that became final and the tokens that came with it (0 or 1)."""
        self.prompt = self.prompt or prompt_logprobs
        if self.scores.top is not None:
            text, logprobs = self.scores.spelled(text, logprobs)
        if not (text or logprobs):
            return []
        return [self._chunk(text, logprobs)]

    def finished(self, finish_reason: str, logprobs, prompt_logprobs) -> list[dict]:
        """The last chunks: the text and tokens still held (with `logprobs`, those no piece carried: an EOS, the
        tokens a stop string cut), then the finish reason."""
        self.prompt = self.prompt or prompt_logprobs
        text, records = self.scores.rest(logprobs) if self.scores.top is not None else ("", ())
        out = []
        if text:  # held back to the end: its own chunk, with every token not sent yet
            out.append(self._chunk(text, records))
            records = ()
        rest = self.scores.value(records, self.prompt) if records or self.prompt else None
        prefix = self.scores.prefix if self.first and self.scores.prefix else None
        out.append(self.answer.chunk(prefix, finish_reason, first=self.first, logprobs=rest))
        self.first = False
        return out

    def _chunk(self, text: str, records) -> dict:
        chunk = self.answer.chunk(self.scores.prefix + text if self.first else text, first=self.first,
                                  logprobs=self.scores.value(records, self.prompt))
        self.first, self.prompt = False, None
        return chunk

