"""Tokenizers: which file a checkpoint's tokenizer is, and the SentencePiece `tokenizer.model`.

A checkpoint's tokenizer is its `tokenizer.json` (HuggingFace's `tokenizers` library: tokenizer_json.py), else
its `tokenizer.model` (SentencePiece, below), as transformers' AutoTokenizer prefers the first; `--tokenizer`
names either file, or a directory holding one. The tokenizer's directory may hold a `tokenizer_config.json`
(its special tokens, add_bos_token, a chat template) and the chat template files (chat_template.py). A chat
goes through the template when there is one, else through LLaMA-2's format as Meta's code builds it
(tokenizer_base.py, which both tokenizers share).

The SentencePiece tokenizer decodes as sentencepiece itself does (`decode` is `SentencePieceProcessor.decode`),
so the text is exactly what HF / Meta code would print. Streaming has to agree with it to the character:
for any ids, `"".join(push(i) for i in ids) + flush() == decode(ids)`. Two things make that
non-trivial, and both come from how sentencepiece builds the text out of one surface per piece:

- byte-fallback pieces (`<0xE2>` `<0x82>` `<0xAC>`) are grouped into runs and each run is read
  as UTF-8; a character split over several pieces only exists once its last byte arrived, and a
  byte that cannot start or continue a character becomes U+FFFD;
- the leading "▁" of the first piece is dropped (the dummy prefix added by encode), and whether
  a piece is "first" depends on everything decoded before it.

The stream decoder keeps the ids that are not final yet (at most the last three bytes of an
unfinished character, plus the new id) and re-decodes only those, behind a short stand-in for
the history that puts sentencepiece in the same state the full history would: one ordinary piece
once any text was produced (nothing is "first" any more), else the few pieces that decoded to ''.

A completion is decoded in its prompt's context (`prime(prompt_ids)` first), as transformers' `decode(prompt +
completion)[len(decode(prompt)):]`, vLLM's detokenizer and OpenAI's API give it: after "Once upon a time" the piece
"▁there" reads " there", where decoded alone its space would be dropped as the text's first. After a prompt that
decodes to nothing (BOS alone) the first piece is the text's first, and drops it.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import sentencepiece as spm

from ..common.errors import TokenizerError, option
from ..common.untrusted import read_json
from .chat_template import ChatTemplate, find as find_chat_template
from .tokenizer_base import SPECIAL_TOKEN_KEYS, TokenizerBase, special_tokens

MAX_MODEL_BYTES = 64 * 1024 * 1024  # LLaMA-2's tokenizer.model is 0.5 MB, the largest known ~5 MB
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # a checkpoint's tokenizer: the first that is there


def find_tokenizer(model_dir: str | os.PathLike[str]) -> Path | None:
    """The checkpoint's tokenizer file (the first of TOKENIZER_FILES in `model_dir`), or None."""
    return next((p for p in (Path(model_dir) / name for name in TOKENIZER_FILES) if p.is_file()), None)


def load_tokenizer(model_dir: str | os.PathLike[str],
                   override: str | os.PathLike[str] | None = None) -> TokenizerBase:
    """The tokenizer named by `override` (--tokenizer: a tokenizer.json, a tokenizer.model, or a directory
    holding one), else the checkpoint's own, with the tokenizer_config.json and chat template beside it."""
    path = Path(override) if override is not None else None
    if path is None or path.is_dir():
        where = path if path is not None else Path(model_dir)
        path = find_tokenizer(where)
        if path is None:
            raise TokenizerError(f"{where} has no tokenizer ({' or '.join(TOKENIZER_FILES)}); name one with "
                                 f"{option('tokenizer')}")
    config_file = path.parent / "tokenizer_config.json"
    config = _read_config(path.parent, config_file)
    template = find_chat_template(path.parent, config, config_file)
    if path.suffix == ".json":
        from .tokenizer_json import JsonTokenizer  # imports the tokenizers library only when it is needed

        return JsonTokenizer(path, config, template, config_file)
    return Tokenizer(path, config, template, config_file)


def _read_config(directory: Path, config_file: Path) -> dict:
    """tokenizer_config.json ({} when there is none), with the special tokens it leaves out taken from an older
    checkpoint's special_tokens_map.json."""
    config = read_json(config_file, TokenizerError) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise TokenizerError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    map_file = directory / "special_tokens_map.json"
    if map_file.is_file():
        tokens = read_json(map_file, TokenizerError)
        if not isinstance(tokens, dict):
            raise TokenizerError(f"{map_file}: expected a JSON object, got {type(tokens).__name__}")
        config = {**{k: v for k, v in tokens.items() if k in SPECIAL_TOKEN_KEYS}, **config}
    return config


class Tokenizer(TokenizerBase):
    """A SentencePiece `tokenizer.model` with LLaMA-2 conventions (BOS/EOS added as ids).

    `config` (tokenizer_config.json's contents) and `template` come from load_tokenizer: with a template, the
    rendered chat is read with the control pieces it spells (`<s>`, `</s>`) as those ids, and every stretch of
    text between them encoded on its own (with sentencepiece's leading "▁"), as transformers' LLaMA tokenizer
    reads it (legacy mode)."""

    def __init__(self, path: str | os.PathLike[str], config: Mapping | None = None,
                 template: ChatTemplate | None = None, config_file: Path | str = "tokenizer_config.json") -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                data = fh.read(MAX_MODEL_BYTES + 1)
        except OSError as e:
            raise TokenizerError(f"cannot read tokenizer {self.path}: {e.strerror or e}") from None
        if not data or len(data) > MAX_MODEL_BYTES:
            # sentencepiece takes an empty model (0 pieces, every call then fails) and would read any size
            size = "empty" if not data else f"larger than {MAX_MODEL_BYTES >> 20} MiB"
            raise TokenizerError(f"{self.path} is not a SentencePiece tokenizer model (the file is {size})")
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=data)
        except RuntimeError:
            # sentencepiece's own message is a multi-line C++ location; ours names the file.
            raise TokenizerError(f"{self.path} is not a SentencePiece tokenizer model") from None
        if self._sp.vocab_size() == 0:
            raise TokenizerError(f"{self.path} is not a SentencePiece tokenizer model (it has no pieces)")
        self.vocab_size: int = self._sp.vocab_size()  # pieces: ids 0 .. vocab_size - 1
        self.bos_id: int = self._sp.bos_id()
        self.eos_id: int = self._sp.eos_id()
        self._filler = self._find_filler()
        self.template = template
        # the template's bos_token etc.: tokenizer_config.json's, else the model's own pieces (as transformers)
        own = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self._sp.unk_id()}
        self.special_tokens = {**{k: self._sp.id_to_piece(i) for k, i in own.items() if 0 <= i < self.vocab_size},
                               **special_tokens(config or {}, config_file)}

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.eos_id,) if self.eos_id >= 0 else ()

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    # -- ids <-> text --------------------------------------------------------------------------

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        """LLaMA-2 ids for `text`: control pieces are never matched in text, only added as ids."""
        ids = self._sp.encode(text)
        if bos:
            ids = [self._special("BOS", self.bos_id), *ids]
        if eos:
            ids.append(self._special("EOS", self.eos_id))
        return ids

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat template: the control pieces it spells as their ids, the text between encoded."""
        specials, split = self._rendered_specials
        ids: list[int] = []
        for part in split(text):
            if part in specials:
                ids.append(specials[part])
            elif part:
                ids += self._sp.encode(part)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode(self._checked(ids))

    def piece(self, token_id: int) -> str:
        """The vocabulary entry itself (e.g. '▁Hello', '<0xE2>', '<s>'), for debugging output."""
        return self._sp.id_to_piece(self._checked([token_id])[0])

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    # -- for grammars (text/grammar.py) ----------------------------------------------------------

    @functools.cached_property
    def token_table(self) -> tuple[tuple[bytes, ...], frozenset[int]]:
        """(each id's bytes inside a text, the ids no text spells): '▁' is a space ('▁the' is b' the'), a byte piece
        ('<0x0A>') its byte; control, unknown and unused pieces keep their own text but are in the second set."""
        sp, tokens, special = self._sp, [], set()
        for i in range(self.vocab_size):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):
                tokens.append(bytes([int(piece[3:5], 16)]))
            elif sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
                tokens.append(piece.encode())
                special.add(i)
            else:
                tokens.append(piece.replace("\u2581", " ").encode())
        return tuple(tokens), frozenset(special)

    def encode_inside(self, text: str) -> list[int]:
        """`text`'s ids as sentencepiece reads it inside a longer text: without the '▁' it puts at a text's start
        (encoded behind a newline, a byte piece no merge crosses, whose ids are then dropped)."""
        if not text:
            return []
        behind, ids = self._sp.encode("\n"), self._sp.encode("\n" + text)
        if ids[:len(behind)] == behind:
            return ids[len(behind):]
        ids = self._sp.encode(text)  # a model whose newline merges: drop the start's lone '▁' piece instead
        return ids[1:] if ids and self._sp.id_to_piece(ids[0]) == "\u2581" else ids

    # -- internals -----------------------------------------------------------------------------

    @functools.cached_property
    def _rendered_specials(self):
        """({piece: id} of the pieces a rendered template may spell: control pieces and <unk>, never matched in
        text otherwise; a function that splits a text around them)."""
        specials = {self._sp.id_to_piece(i): i for i in range(self.vocab_size)
                    if self._sp.is_control(i) or self._sp.is_unknown(i)}
        specials = {piece: i for piece, i in specials.items() if piece}
        if not specials:
            return specials, lambda text: [text]
        pattern = re.compile("(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")")
        return specials, pattern.split

    def _special(self, name: str, token_id: int) -> int:
        if token_id < 0:
            raise TokenizerError(f"{self.path} defines no {name} token")
        return token_id

    def _byte(self, token_id: int) -> int | None:
        """The byte a byte-fallback piece stands for (its piece is '<0xAB>'), else None."""
        if not self._sp.is_byte(token_id):
            return None
        return int(self._sp.id_to_piece(token_id)[3:5], 16)

    def _find_filler(self) -> int | None:
        """An ordinary piece that decodes to some text: the stream decoder's stand-in history."""
        sp = self._sp
        for i in range(self.vocab_size):
            special = sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i) or sp.is_unused(i)
            if not special and sp.decode([i]):
                return i
        return None  # a vocabulary of only special pieces: StreamDecoder keeps the full history


class StreamDecoder:
    """Turns ids into text one id at a time, emitting text as soon as it can no longer change."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._sp = tokenizer._sp
        self._reset()

    def _reset(self) -> None:
        self._context: list[int] = []  # stands in for every id already turned into text
        self._context_text = ""  # decode(self._context), cut off the front of each re-decode
        self._pending: list[int] = []  # ids whose text is not final yet
        self._emitted_any = False
        self._fresh = False  # primed, and nothing pushed since

    def prime(self, ids: Iterable[int]) -> str:
        """Take `ids` (a prompt) as the text so far, in one decode: what push() of each would do. Returns their text
        that is final (all of it, but for a character whose bytes the ids after them may complete, which goes to
        their text). A flush() with no push() since gives '': a completion of no tokens has no text. Ids the
        tokenizer has none for (a padded vocabulary's) are left out."""
        ids = [i for i in map(int, ids) if 0 <= i < self._tok.vocab_size]  # the others have no text
        self._pending.extend(ids)
        text = self._finish(len(self._pending) - self._unfinished_bytes())
        self._fresh = True
        return text

    def push(self, token_id: int) -> str:
        """Add one id; return the text that became final with it ('' if none did)."""
        (token_id,) = self._tok._checked([token_id])
        self._fresh = False
        self._pending.append(token_id)
        if self._tok._byte(token_id) is None:
            # Any other piece ends the byte run before it, and its own surface is fixed now.
            return self._finish(len(self._pending))
        return self._finish(len(self._pending) - self._unfinished_bytes())

    def flush(self) -> str:
        """The rest of the text (an unfinished character becomes U+FFFD, as in decode); resets."""
        text = "" if self._fresh else self._finish(len(self._pending))
        self._reset()
        return text

    def _unfinished_bytes(self) -> int:
        """How many trailing byte pieces sentencepiece cannot turn into text yet.

        Replays sentencepiece's UTF-8 scan of the byte run at the end of `_pending` (which starts
        where its scan starts too): a valid character consumes its bytes, anything else consumes
        one byte as U+FFFD. The scan only stalls on a character that is still a valid beginning
        but not complete, so at most three bytes are ever held back.
        """
        run = bytearray()
        for token_id in reversed(self._pending):
            byte = self._tok._byte(token_id)
            if byte is None:
                break
            run.append(byte)
        run.reverse()
        i = 0
        while i < len(run):
            chunk = bytes(run[i : i + _utf8_length(run[i])])
            if not _utf8_prefix_ok(chunk):
                i += 1  # invalid whatever follows: U+FFFD now
            elif len(chunk) == _utf8_length(run[i]):
                i += len(chunk)  # a complete character
            else:
                return len(run) - i  # a character that may still complete
        return 0

    def _finish(self, n: int) -> str:
        """Make the first `n` pending ids final and return their text."""
        if n == 0:
            return ""
        done, self._pending = self._pending[:n], self._pending[n:]
        text = self._sp.decode(self._context + done)[len(self._context_text) :]
        self._emitted_any = self._emitted_any or bool(text)
        filler = self._tok._filler
        if self._emitted_any and filler is not None:
            # Once there is text no piece is "first" any more: one ordinary piece says the same.
            self._context = [filler]
        else:
            # Nothing shown yet, so only pieces that decoded to '' are behind us (a dropped
            # leading "▁", BOS). Control pieces change nothing later on and are left out.
            self._context += [i for i in done if not self._sp.is_control(i)]
        self._context_text = self._sp.decode(self._context)
        return text


def _utf8_length(lead: int) -> int:
    """Bytes sentencepiece reads for a character starting with `lead` (1 for a stray byte)."""
    if 0xF0 <= lead < 0xF8:
        return 4
    if 0xE0 <= lead < 0xF0:
        return 3
    if 0xC0 <= lead < 0xE0:
        return 2
    return 1


def _utf8_prefix_ok(chunk: bytes) -> bool:
    """Whether `chunk` is a valid character or the start of one.

    Python's incremental decoder rejects a byte as soon as no valid character can follow, and
    rejects what sentencepiece rejects (overlong forms, surrogates, > U+10FFFF), so a rejected
    chunk is U+FFFD in sentencepiece's decode too, whatever bytes come next.
    """
    try:
        codecs.getincrementaldecoder("utf-8")().decode(chunk, final=False)
    except UnicodeDecodeError:
        return False
    return True
