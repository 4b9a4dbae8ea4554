"""OpenAI's log-probability fields: what a request asks of the library, what the engine thread hands on, and
the response shapes.

- /v1/chat/completions: `logprobs: true` and `top_logprobs` (0 to 20): `choices[].logprobs.content[]`, one
  {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]} per generated token.
- /v1/completions (OpenAI's legacy API): `logprobs` (an int, 0 to 5: the sampled token's and that many more) and
  `echo` (the prompt's text before the completion's; with `logprobs`, every prompt token's log-probability, the
  first None): `choices[].logprobs` = {tokens, token_logprobs, top_logprobs (dicts of token text -> logprob,
  the sampled token's included, as OpenAI's), text_offset (characters into the choice's text)}.
  lm-evaluation-harness's log-likelihood request (`echo: true, logprobs: 1, max_tokens: 1`, or 0) is this.

The numbers are the library's (cullama/runtime/logprobs.py: the model's raw softmax, before temperature and the other
sampling options), computed on the device; the engine thread only slices lists (Cursor), and the text of each
token and the offsets are made here, on the HTTP side. Every token the model produced has its entry, the EOS that
ended a generation too (as vLLM's), so `token_logprobs` holds the prompt's tokens and then the completion's.
-inf (a token the model gives no probability) is sent as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import math
import re
from typing import Sequence

from ..runtime.logprobs import MAX_TOP, TokenLogprob

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions API: logprobs <= 5
MAX_TOP_LOGPROBS = MAX_TOP  # chat's top_logprobs <= 20, as OpenAI's
NO_PROBABILITY = -9999.0
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def library_options(chat: bool, logprobs, top_logprobs: int | None, echo: bool) -> dict:
    """Llama.stream's logprobs and prompt_logprobs for a request's fields (checked by the protocol)."""
    if chat:
        return {"logprobs": (top_logprobs or 0) if logprobs else None, "prompt_logprobs": None}
    return {"logprobs": logprobs, "prompt_logprobs": logprobs if echo else None}


class Cursor:
    """What of a stream's log-probabilities the engine thread has handed on: each event takes what came since."""

    def __init__(self, stream):
        self.stream, self.sent, self.prompt_sent = stream, 0, False

    def take(self) -> dict:
        """An event's `logprobs` (the new tokens') and `prompt_logprobs` (the first time only, once known)."""
        records = self.stream.token_logprobs or ()
        new, self.sent = tuple(records[self.sent:]), len(records)
        prompt = None
        if not self.prompt_sent and self.stream.prompt_logprobs is not None:
            prompt, self.prompt_sent = tuple(self.stream.prompt_logprobs), True
        return {"logprobs": new, "prompt_logprobs": prompt}


def cursor(stream, options: dict) -> Cursor | None:
    """A Cursor when the request asked for log-probabilities, else None (nothing is done per token)."""
    if options.get("logprobs") is None and options.get("prompt_logprobs") is None:
        return None
    return Cursor(stream)


class TokenTexts:
    """Each id's text as OpenAI shows it and its bytes: the tokenizer's `token_bytes(id)` where it has one, else a
    SentencePiece piece's own surface ("▁" as a space; a byte-fallback piece's byte; a control piece's name); bytes
    that are part of a character read "bytes:\\xNN". Cached per id (at most the vocabulary). Without a tokenizer,
    or a piece: "token_id:N" and no bytes."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int] | None]] = {}

    def __call__(self, token: int) -> tuple[str, list[int] | None]:
        found = self._cache.get(token)
        if found is None:
            found = self._cache[token] = self._text(token)
        return found

    def _text(self, token: int) -> tuple[str, list[int] | None]:
        if self.tokenizer is None or not 0 <= token < self.tokenizer.vocab_size:
            return f"token_id:{token}", None
        own = getattr(self.tokenizer, "token_bytes", None)  # a tokenizer that knows its tokens' bytes
        if own is not None:
            data = own(token)
        else:  # a SentencePiece piece: "▁" is a space, "<0xAB>" the byte AB, a control piece its name
            piece = self.tokenizer.piece(token)
            if piece is None:
                return f"token_id:{token}", None
            byte = BYTE_PIECE.fullmatch(piece)
            data = bytes([int(byte.group(1), 16)]) if byte else piece.replace("\u2581", " ").encode()
        try:
            return data.decode("utf-8"), list(data)
        except UnicodeDecodeError:  # part of a character: OpenAI's spelling of such a token
            return "bytes:" + "".join(f"\\x{b:02x}" for b in data), list(data)


def number(logprob: float) -> float:
    """A log-probability as JSON takes it: -inf (and NaN, which the library never gives) as -9999.0."""
    return logprob if logprob > NO_PROBABILITY and not math.isnan(logprob) else NO_PROBABILITY


class Logprobs:
    """One request's `logprobs` values, chunk after chunk (a stream) or at once (a whole answer). `top`: the
    alternatives asked for, None when the request asked for no log-probabilities; `prefix`: the echoed prompt's
    text (completions with `echo`), which the choice's text starts with."""

    def __init__(self, chat: bool, top: int | None, echo: bool, prompt_ids: Sequence[int], tokenizer):
        self.chat, self.top, self.texts, self.tokenizer = chat, top, TokenTexts(tokenizer), tokenizer
        self._offset = 0  # characters of the choice's text before the next token (completions)
        # the completion's text as the library reads it: in the prompt's context (its first piece keeps its space)
        self._decoder = None
        if tokenizer is not None and top is not None and not chat:
            self._decoder = tokenizer.stream_decoder()
            self._decoder.prime(prompt_ids)
        # a stream's chunks (spelled): its text and tokens received, not yet sent, each token with its text as the
        # library's primed stream decoder reads it
        self._speller = None
        if tokenizer is not None:
            self._speller = tokenizer.stream_decoder()
            self._speller.prime(prompt_ids)
        self._text, self._tokens = "", []
        self.prompt_ids, self.prefix, self._prompt_offsets = list(prompt_ids), "", [0] * len(prompt_ids)
        if echo and tokenizer is not None:  # the prompt as the tokenizer decodes it: the offsets agree with it
            self._prompt_offsets, self.prefix = self._offsets(prompt_ids)
            self._offset = len(self.prefix)  # the completion's text follows it: prefix + text = decode(all ids)

    def spelled(self, text: str, records: Sequence[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
        """Of a stream's new text and new tokens, what a chunk may carry now: text that ends where a token's ends,
        and the tokens that spell it (OpenAI's chunks). The library streams text as it becomes final, which may
        end inside a token (a possible stop string held back) or hold a token's text back for a later one; the
        rest waits here for the next event, or for `rest`. A token is read as the library's stream decoder reads
        it (in the prompt's context, a character split over tokens given by its last), and one whose text is empty
        (a skipped special token, the first bytes of a character) goes with the next that shows text."""
        self._text += text
        self._tokens += [(r, self._speller.push(r.token) if self._speller else "") for r in records]
        if self._speller is None:  # no tokenizer, no text: every entry at once
            return self.rest(())
        count = chars = end = 0
        for k, (_, token_text) in enumerate(self._tokens, 1):
            end += len(token_text)
            if end > len(self._text):
                break
            if token_text:
                count, chars = k, end
        sent, self._text = self._text[:chars], self._text[chars:]
        records, self._tokens = [r for r, _ in self._tokens[:count]], self._tokens[count:]
        return sent, records

    def rest(self, records: Sequence[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
        """At the stream's end: the text and the tokens still held (with `records`, those no chunk carried: an
        EOS, the tokens a stop string cut), all of them."""
        text, held = self._text, [r for r, _ in self._tokens] + list(records)
        self._text, self._tokens = "", []
        return text, held

    def _offsets(self, ids: Sequence[int]) -> tuple[list[int], str]:
        """Where each id's text starts, as a stream decoder assigns it (a character split over byte pieces
        belongs to its last one), and the text that is final with them: a character the completion's first ids
        complete is the completion's (as GenerationStream's primed decoder gives it)."""
        decoder, pieces, offsets, position = self.tokenizer.stream_decoder(), [], [], 0
        for token in ids:
            offsets.append(position)
            pieces.append(decoder.push(token))
            position += len(pieces[-1])
        return offsets, "".join(pieces)

    def value(self, records: Sequence[TokenLogprob], prompt: Sequence[TokenLogprob | None] | None = None):
        """The choice's `logprobs` for these generated tokens (and, for an echo, the prompt's, first): None when
        the request asked for none."""
        if self.top is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(r) for r in records], "refusal": None}
        tokens, token_logprobs, tops, offsets = [], [], [], []
        if prompt is not None:
            for record, offset, token in zip(prompt, self._prompt_offsets, self.prompt_ids):
                tokens.append(self.texts(token)[0])
                token_logprobs.append(None if record is None else number(record.logprob))
                tops.append(None if record is None else self._top_dict(record))
                offsets.append(offset)
        for record in records:
            tokens.append(self.texts(record.token)[0])
            token_logprobs.append(number(record.logprob))
            tops.append(self._top_dict(record))
            offsets.append(self._offset)
            if self._decoder is not None:
                self._offset += len(self._decoder.push(record.token))
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def _chat_entry(self, record: TokenLogprob) -> dict:
        text, data = self.texts(record.token)
        return {"token": text, "logprob": number(record.logprob), "bytes": data,
                "top_logprobs": [self._chat_top(token, lp) for token, lp in record.top[:self.top]]}

    def _chat_top(self, token: int, logprob: float) -> dict:
        text, data = self.texts(token)
        return {"token": text, "logprob": number(logprob), "bytes": data}

    def _top_dict(self, record: TokenLogprob) -> dict:
        """The legacy API's top_logprobs entry: the `top` most likely tokens' texts and the sampled one's."""
        out = {}
        for token, lp in (*record.top[:self.top], (record.token, record.logprob)):
            out.setdefault(self.texts(token)[0], number(lp))
        return out
