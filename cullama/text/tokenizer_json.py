"""A `tokenizer.json` through HuggingFace's `tokenizers` library: ids as AutoTokenizer gives them, and streaming.

Encoding is the library's own, so ids equal transformers' for the same text: special tokens written in a text
are read as the special tokens (as transformers does; a chat message that spells `<|eot_id|>` gets that token),
and BOS is what the post-processor adds, unless tokenizer_config.json sets `add_bos_token` / `add_eos_token`,
which then decide (transformers 5 rebuilds the post-processor from them the same way).

Decoding is the library's `decode(ids, skip_special_tokens=True)`: special tokens (BOS, EOS, the chat
markers) print nothing, unless asked for (`skip_special_tokens=False`). (transformers'
`clean_up_tokenization_spaces`, a post-edit that removes the spaces before punctuation, is not applied: the
text is what the model wrote.) Streaming agrees with it to the character: for any ids, `"".join(push(i) for i in ids) + flush() == decode(ids)`. A piece's text is final
unless it ends in U+FFFD, which may be a character whose bytes are still arriving (byte-level BPE splits
characters across tokens): that one is held back, the rest shown. A ByteFallback decoder (LLaMA-2-style
tokenizer.json) reads a run of byte pieces (`<0xE2>`) as one string, valid UTF-8 or U+FFFD for each byte,
so a run is held whole until a piece that is not a byte ends it. The decoder re-decodes only what is not final,
behind one ordinary token that stands in for the history (so that a decoder that strips the first space
strips it once); a run of bytes that never makes a character keeps only its unfinished tail.

A completion is decoded in its prompt's context (`prime(prompt_ids)` first), as transformers' `decode(prompt +
completion)[len(decode(prompt)):]` and vLLM give it: a decoder that strips the first space (Metaspace, or
LLaMA-2's Strip) strips only the text's first, so the completion's first piece keeps its space after a prompt that
has text. A byte-level BPE (LLaMA-3, Qwen2) strips nothing: there the context changes nothing.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import tokenizers
from tokenizers import processors

from .chat_template import ChatTemplate
from ..common.errors import TokenizerError
from .tokenizer_base import TokenizerBase, special_tokens
from ..common.untrusted import read_bounded, shown

BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class JsonTokenizer(TokenizerBase):
    """A tokenizer.json (byte-level BPE for LLaMA-3, Qwen2, Mistral; any model `tokenizers` reads)."""

    def __init__(self, path: str | Path, config: Mapping | None = None, template: ChatTemplate | None = None,
                 config_file: Path | str = "tokenizer_config.json") -> None:
        self.path = Path(path)
        self._tok = _read(self.path)
        vocab = self._tok.get_vocab(with_added_tokens=True)  # {piece: id}
        if not vocab:
            raise TokenizerError(f"{self.path} has no tokens")
        self.vocab_size: int = max(vocab.values()) + 1  # ids 0 .. vocab_size - 1 (a few may be unused)
        self.special_tokens = special_tokens(config or {}, config_file)
        self.template = template
        self.bos_id = self._token_id("bos_token", config_file)
        self.eos_id = self._token_id("eos_token", config_file)
        self._set_post_processor(config or {}, config_file)
        self._check_post_processor()
        self._special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        # the decoder's own JSON (its pickled state), not the whole tokenizer's: LLaMA-3's is 9 MB
        decoders = _decoder_types(json.loads(self._tok.decoder.__getstate__()) if self._tok.decoder else None)
        # ByteFallback reads a run of byte pieces as one: its text is final only once the run has ended
        self._byte_ids = frozenset(i for p, i in vocab.items() if BYTE_PIECE.fullmatch(p)) \
            if "ByteFallback" in decoders else frozenset()
        self._byte_level = "ByteLevel" in decoders  # pieces spell bytes through GPT-2's byte-to-character table
        self._added_ids = frozenset(self._tok.get_added_tokens_decoder())
        self._filler = self._find_filler()
        self._filler_text = "" if self._filler is None else self._tok.decode([self._filler])

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return () if self.eos_id is None else (self.eos_id,)

    def __repr__(self) -> str:
        return f"JsonTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    # -- ids <-> text --------------------------------------------------------------------------

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """Ids for `text`; `bos`: with what the tokenizer adds around a text (its BOS, if it has one)."""
        ids = self._tok.encode(text, add_special_tokens=bos).ids
        if eos:
            if self.eos_id is None:
                raise TokenizerError(f"{self.path} defines no EOS token (eos_token in tokenizer_config.json)")
            ids.append(self.eos_id)
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat template: its special tokens are in the text, nothing is added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(self._checked(ids), skip_special_tokens=skip_special_tokens)

    def piece(self, token_id: int) -> str | None:
        """The vocabulary entry itself (e.g. 'Ġhello', '<|eot_id|>'); None for an id no token has."""
        return self._tok.id_to_token(self._checked([token_id])[0])

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (OpenAI's `bytes` of a log-probability): a byte-level piece through
        GPT-2's byte-to-character table ('Ġhello' -> b' hello'), a SentencePiece-style piece with '▁' as a space
        and '<0xAB>' as that byte, an added token (a special one too) as its text. b'' for an id no token has."""
        piece = self.piece(token_id)
        if piece is None:
            return b""
        if token_id in self._added_ids:
            return piece.encode()
        if self._byte_level:
            return bytes(_BYTE_OF_CHAR.get(c, 0x3F) for c in piece)  # '?' for a character the table lacks
        if token_id in self._byte_ids:
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()

    def stream_decoder(self, skip_special_tokens: bool = True) -> JsonStreamDecoder:
        return JsonStreamDecoder(self, skip_special_tokens)

    def json_text(self) -> str:
        """The tokenizer as tokenizer.json text (what a grammar matcher reads: text/grammar.py)."""
        return self._tok.to_str()

    # -- internals -----------------------------------------------------------------------------

    def _token_id(self, key: str, config_file) -> int | None:
        token = self.special_tokens.get(key)
        if token is None:
            return None
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{config_file}: {key} {shown(token, quote=True)} is not a token of {self.path}")
        return token_id

    def _set_post_processor(self, config: Mapping, config_file) -> None:
        """transformers 5: add_bos_token / add_eos_token in tokenizer_config.json, when either is there, replace
        the post-processor by BOS? text EOS? (a flag without its token is off)."""
        flags = {}
        for key in ("add_bos_token", "add_eos_token"):
            value = config.get(key)
            if value is not None and not isinstance(value, bool):
                raise TokenizerError(f"{config_file}: {key} must be true or false, got {value!r}")
            flags[key] = bool(value)
        if not any(key in config for key in flags):
            return
        bos = self.special_tokens.get("bos_token") if flags["add_bos_token"] and self.bos_id is not None else None
        eos = self.special_tokens.get("eos_token") if flags["add_eos_token"] and self.eos_id is not None else None
        single = " ".join([*([f"{bos}:0"] if bos else []), "$A:0", *([f"{eos}:0"] if eos else [])])
        pair = f"{single} {' '.join([*([f'{bos}:1'] if bos else []), '$B:1', *([f'{eos}:1'] if eos else [])])}"
        specials = [(t, i) for t, i in ((bos, self.bos_id), (eos, self.eos_id)) if t]
        try:
            self._tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        except Exception as exc:  # a token the template syntax cannot hold (e.g. one with a space)
            raise TokenizerError(f"{config_file}: add_bos_token / add_eos_token: {exc}") from None

    def _check_post_processor(self) -> None:
        """TokenizerError unless the ids the post-processor adds around every text (encoding '' gives just them)
        are tokens: its special_tokens name any ids, and one past the vocabulary would only fail later, at the
        model, as a prompt id out of range with no word of where it came from."""
        added = self._tok.encode("", add_special_tokens=True).ids
        bad = [i for i in added if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenizerError(f"{self.path}: its post_processor adds token id {bad[0]}, outside its vocabulary "
                                 f"[0, {self.vocab_size})")

    def _find_filler(self) -> int | None:
        """An ordinary token whose text is plain ASCII letters or digits and that nothing merges with: the
        stream decoder's stand-in for the history."""
        for i in range(self.vocab_size):
            if i in self._special_ids or i in self._byte_ids:
                continue
            text = self._tok.decode([i])
            if text and text.isascii() and text.isalnum() and self._tok.decode([i, i]) == text * 2:
                return i
        return None  # no such token: JsonStreamDecoder keeps the history


class JsonStreamDecoder:
    """Turns ids into text one id at a time, emitting text as soon as it can no longer change (module docstring)."""

    def __init__(self, tokenizer: JsonTokenizer, skip_special_tokens: bool = True) -> None:
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._decode = functools.partial(tokenizer._tok.decode, skip_special_tokens=skip_special_tokens)
        # the ids decode leaves out: they neither end a byte run nor stand for anything in the history
        self._skipped = tokenizer._special_ids if skip_special_tokens else frozenset()
        # ids that may change the text of a byte run before them (ByteFallback): its bytes, and skipped ids
        self._held = tokenizer._byte_ids | self._skipped if tokenizer._byte_ids else frozenset()
        self._reset()

    def _reset(self) -> None:
        self._context: list[int] = []  # stands in for every id whose text is final
        self._context_text = ""  # decode(self._context), cut off the front of each re-decode
        self._pending: list[int] = []  # ids whose text is not all final
        self._shown = 0  # characters of the pending ids' text already returned
        self._emitted_any = False
        self._fresh = False  # primed, and nothing pushed since

    def prime(self, ids: Iterable[int]) -> str:
        """Take `ids` (a prompt) as the text so far: what push() of each would do, in one decode. Returns their
        text that is final (all of it, but for a character whose bytes the ids after them may complete, which goes to
        their text). A flush() with no push() since gives '': a completion of no tokens has no text. Ids the
        tokenizer has none for (a padded vocabulary's) are left out."""
        ids = [i for i in map(int, ids) if 0 <= i < self._tok.vocab_size]  # the others have no text
        cut = len(ids)  # ids[cut:]: a trailing run whose text may still change (a byte run, ByteFallback)
        while cut and ids[cut - 1] in self._held:
            cut -= 1
        text = ""
        if cut:
            self._pending.extend(ids[:cut - 1])  # their text is what push(ids[cut - 1]) makes final
            text = self.push(ids[cut - 1])
        for token in ids[cut:]:
            self.push(token)  # each is held: ''
        self._fresh = True
        return text

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became final with it ('' if none did)."""
        (token_id,) = self._tok._checked([token_id])
        self._fresh = False
        self._pending.append(token_id)
        if token_id in self._held:
            return ""  # a byte run's text can still change as a whole
        text = self._text()
        if text.endswith("\ufffd"):
            out = text[self._shown:-1]  # all but a U+FFFD that may be a character still arriving
            self._shown = len(text) - 1
            self._rebase(text)
            return out
        out = text[self._shown:]
        self._settle(text)
        return out

    def flush(self) -> str:
        """The rest of the text (an unfinished character becomes U+FFFD, as in decode); resets."""
        text = "" if self._fresh else self._text()[self._shown:]
        self._reset()
        return text

    def _text(self) -> str:
        """The pending ids' text, in the context of everything before them."""
        return self._decode(self._context + self._pending)[len(self._context_text):]

    def _settle(self, text: str) -> None:
        """Every pending id's text is final: they become history."""
        self._emitted_any = self._emitted_any or bool(text)
        if self._emitted_any and self._tok._filler is not None:
            # once there is text, one ordinary token says the same
            self._context, self._context_text = [self._tok._filler], self._tok._filler_text
        else:
            # Nothing shown yet, so only ids that decoded to '' are behind us (a stripped leading space);
            # special tokens, skipped by decode, are left out.
            self._context += [i for i in self._pending if i not in self._skipped]
            self._context_text = self._decode(self._context)
        self._pending, self._shown = [], 0

    def _rebase(self, text: str) -> None:
        """Bytes that never make a character (U+FFFD after U+FFFD) would keep every id pending: keep only the
        ids of the last, unfinished character, once the ids before them are seen to decode to the final text."""
        if len(self._pending) <= 4 or self._tok._filler is None:
            return
        filler, filler_text = [self._tok._filler], self._tok._filler_text
        for cut in range(len(self._pending) - 1, len(self._pending) - 5, -1):
            head, tail = self._pending[:cut], self._pending[cut:]
            if self._decode(self._context + head) == self._context_text + text[:-1] and \
                    self._decode(filler + tail) == filler_text + "\ufffd":
                self._context, self._context_text = filler, filler_text
                self._pending, self._shown = tail, 0
                self._emitted_any = True
                return


def _read(path: Path) -> tokenizers.Tokenizer:
    raw = read_bounded(path, TokenizerError, "a tokenizer.json")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path} is not a tokenizer.json (invalid UTF-8 at byte {exc.start})") from None
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # the library raises a bare Exception with serde's message
        message = " ".join(str(exc).split())[:200]
        # a file a newer release wrote (merges as pairs: tokenizers 0.20) reads as malformed to an older one
        raise TokenizerError(f"{path} is not a tokenizer.json that tokenizers {tokenizers.__version__} can read "
                             f"({message}; a newer release may: pip install -U tokenizers)") from None
    # A file saved after enable_truncation / enable_padding keeps them, and the library would then cut or pad
    # every prompt. transformers switches both off on each call it is not asked for them
    # (PreTrainedTokenizerFast.set_truncation_and_padding), so its ids are the whole text's: so are ours.
    tok.no_truncation()
    tok.no_padding()
    return tok


def _bytes_to_chars() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable Latin-1 bytes stand for themselves, the other bytes
    for the characters from U+0100 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


_BYTE_OF_CHAR = _bytes_to_chars()


def _decoder_types(spec) -> set[str]:
    """Every decoder type in a tokenizer.json "decoder" (a Sequence's too)."""
    if not isinstance(spec, dict):
        return set()
    inner = spec.get("decoders") or []
    return {str(spec.get("type")), *(t for d in inner for t in _decoder_types(d))}
