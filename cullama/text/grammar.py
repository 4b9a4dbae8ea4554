"""Constrained decoding's grammars: what a generation must match (a JSON schema, a regular expression, a Lark
grammar), compiled by llguidance against the model's tokenizer into a matcher that says before every token which
ids may come next, as a bitmask the sample kernel reads (kernels_cu/sampling.cu: bit i & 31 of word i >> 5).

    c = Constraint.json_schema({"type": "object", ...})        # or .regex(r"..."), .grammar(lark), .json_object()
    grammars = Grammars(tokenizer, n_vocab=config.vocab_size, eos_ids=llm.eos_ids)   # one per model
    matcher = grammars.matcher(c)       # OptionError (one line, naming c.option) for what cannot be enforced
    matcher.fill(mask)                  # mask: uint32 [ceil(n_vocab / 32)], the ids allowed now
    matcher.accept(token)               # the token sampled: the next fill() allows what may follow it

llguidance (`pip install 'cullama[constrained]'`, no PyTorch) reads each token's bytes: a tokenizer.json through its
own Rust loader, a SentencePiece model through the byte table tokenizer.py builds (token_table). Every EOS id the
model stops at is its EOS: where the grammar may end they are allowed, and once it must end they are the only ids
allowed, so a constrained generation ends with an EOS by the ordinary path (a `max_new_tokens` cut first leaves
the text unfinished, finish_reason "length"). The ids past the tokenizer's pieces (a padded vocabulary) are never
allowed. The JSON comes as json.dumps writes it (", " and ": ", no other whitespace) unless the schema's own
"x-guidance" says otherwise: with any whitespace allowed, a weak model can write spaces and newlines until its
budget runs out (measured on stories260K).

The constrained text is the text a user sees: a completion is read after its prompt (its first SentencePiece piece
keeps its '▁' space, as llguidance's byte table spells it), so a JSON schema allows no space before the value and
LLaMA-2 writes '{' where it would write '▁{' unconstrained.

Compiled grammars are kept per model (COMPILED of them, by their text); each generation gets a copy of one, which
costs microseconds where a compile costs a millisecond or more.
"""

from __future__ import annotations

import collections
import functools
import json
import re
import threading
from typing import Sequence

import numpy as np

from ..common.errors import GenerationError, OptionError, option

# json.dumps' style: what chat templates' tojson writes, and no whitespace to run away in
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "regex", "grammar")
COMPILED = 64  # compiled grammars a model keeps
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar's own text at most
ERROR_CHARS = 300  # the most of llguidance's message an error quotes
EXTRA = "pip install 'cullama[constrained]'"
# The oldest llguidance that takes a list of EOS ids (LLTokenizer's eos_token; 1.6 takes one id): setup.cfg's floor
LLGUIDANCE_MIN = (1, 7)


@functools.cache  # once a process: a constrained request compiles its grammar through here (a failure is not kept)
def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise OptionError("constraint", f"needs llguidance, which is not installed ({EXTRA})") from None
    installed = _version("llguidance")
    if installed is not None and installed < LLGUIDANCE_MIN:
        need = ".".join(map(str, LLGUIDANCE_MIN))
        raise OptionError("constraint", f"needs llguidance {need} or newer, and {'.'.join(map(str, installed))} "
                                        f"is installed (pip install -U 'llguidance>={need}')")
    return llguidance


def _version(distribution: str) -> tuple[int, ...] | None:
    """An installed distribution's version as its leading numbers (1.7.0rc1: (1, 7, 0)); None where unknown."""
    from importlib import metadata

    try:
        leading = re.match(r"\d+(?:\.\d+)*", metadata.version(distribution))
    except metadata.PackageNotFoundError:
        return None
    return tuple(map(int, leading.group().split("."))) if leading else None


class Constraint:
    """What a generation's text must match. kind: "json_schema" (source: the schema, a dict), "regex" (a pattern)
    or "grammar" (a Lark grammar, llguidance's dialect: %json {...} embeds a schema, <|name|> a special token);
    strict (JSON schemas): a keyword llguidance cannot enforce is an error (False: it is ignored, as OpenAI's
    "strict": false); option: the option an error names."""

    __slots__ = ("kind", "source", "strict", "option")

    def __init__(self, kind: str, source, strict: bool = True, option: str | None = None):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.kind, self.source, self.strict, self.option = kind, source, bool(strict), option or kind

    @classmethod
    def json_schema(cls, schema: dict | str, strict: bool = True, option: str = "json_schema") -> "Constraint":
        """A JSON schema (a dict, or its JSON text); OptionError naming `option` for text that is not a JSON
        object."""
        if isinstance(schema, str):
            _bounded(schema, option)
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as exc:
                raise OptionError(option, f"is not JSON: {_one_line(str(exc))}") from None
        if not isinstance(schema, dict):
            raise OptionError(option, f"must be a JSON schema (a JSON object), got {type(schema).__name__}")
        try:
            _bounded(json.dumps(schema), option)
        except (TypeError, ValueError, RecursionError) as exc:
            raise OptionError(option, f"is not a JSON object: {_one_line(str(exc))}") from None
        return cls("json_schema", schema, strict, option)

    @classmethod
    def json_object(cls, option: str = "response_format") -> "Constraint":
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_schema", {"type": "object"}, True, option)

    @classmethod
    def regex(cls, pattern: str, option: str = "regex") -> "Constraint":
        if not isinstance(pattern, str):
            raise OptionError(option, f"must be a string (a regular expression), got {type(pattern).__name__}")
        return cls("regex", _bounded(pattern, option), True, option)

    @classmethod
    def grammar(cls, lark: str, option: str = "grammar") -> "Constraint":
        if not isinstance(lark, str):
            raise OptionError(option, f"must be a string (a Lark grammar), got {type(lark).__name__}")
        return cls("grammar", _bounded(lark, option), True, option)

    def entry(self) -> dict:
        """This constraint as one grammar of llguidance's grammar list (name not set)."""
        if self.kind == "json_schema":
            style = {**JSON_STYLE, **_own_style(self.source)}  # llguidance: defaults, then the schema's own
            if not self.strict:
                style["lenient"] = True
            return {"json_schema": {**self.source, "x-guidance": style}}
        if self.kind == "regex":
            return json.loads(_llguidance().LLMatcher.grammar_from_regex(self.source))["grammars"][0]
        return {"lark_grammar": self.source}

    def text(self) -> str:
        """llguidance's grammar: {"grammars": [...]}."""
        return json.dumps({"grammars": [{k: v for k, v in self.entry().items() if k != "name"}]})

    def _key(self):
        return self.kind, json.dumps(self.source, sort_keys=True), self.strict, self.option

    def __eq__(self, other) -> bool:
        return isinstance(other, Constraint) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        shown = json.dumps(self.source) if self.kind == "json_schema" else repr(self.source)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        strict = "" if self.strict else ", strict=False"
        return f"Constraint.{'grammar' if self.kind == 'grammar' else self.kind}({shown}{strict})"


def _own_style(schema: dict) -> dict:
    style = schema.get("x-guidance", {})
    return style if isinstance(style, dict) else {}


def _bounded(text: str, option: str) -> str:
    if len(text) > MAX_GRAMMAR_CHARS:
        raise OptionError(option, f"is longer than {MAX_GRAMMAR_CHARS} characters")
    return text


def _one_line(message: str, limit: int = ERROR_CHARS) -> str:
    text = " ".join(str(message).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def checked_constraint(json_schema=None, regex=None, grammar=None, constraint=None) -> Constraint | None:
    """The constraint of a generation's options (json_schema=, regex=, grammar= or constraint=, at most one), its
    type checked (a JSON schema's text parsed); OptionError naming the option. It is compiled against the model's
    tokenizer later (Grammars.matcher)."""
    given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                                             ("constraint", constraint)) if value is not None}
    if len(given) > 1:
        first, second = list(given)[:2]
        raise OptionError(second, f"cannot go with {option(first)}: a generation takes one constraint")
    if not given:
        return None
    if constraint is not None:
        if not isinstance(constraint, Constraint):
            raise OptionError("constraint", f"must be a cullama.Constraint, got {type(constraint).__name__}")
        return constraint
    if json_schema is not None:
        return Constraint.json_schema(json_schema)
    if regex is not None:
        return Constraint.regex(regex)
    return Constraint.grammar(grammar)


# -- a model's grammars -----------------------------------------------------------------------------------------
class Grammars:
    """One model's: its tokenizer as llguidance reads it (built on first use), the grammars compiled for it.
    Thread-safe: a server compiles on its request threads, its engine thread copies."""

    def __init__(self, tokenizer, n_vocab: int, eos_ids: Sequence[int]):
        self.tokenizer, self.n_vocab, self.eos_ids = tokenizer, int(n_vocab), [int(i) for i in eos_ids]
        self.words = -(-self.n_vocab // 32)  # mask words: the plan's mask_words(n_vocab)
        self._lock = threading.Lock()
        self._llg_tokenizer = None
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()

    def llg_tokenizer(self):
        with self._lock:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llg_tokenizer(self.tokenizer, self.n_vocab, self.eos_ids)
            return self._llg_tokenizer

    def compiled(self, constraint: Constraint):
        """The compiled matcher of `constraint` (never advanced: generations get copies); OptionError naming
        constraint.option where llguidance cannot enforce it."""
        llg = _llguidance()
        text = constraint.text()
        with self._lock:
            template = self._compiled.get(text)
            if template is not None:
                self._compiled.move_to_end(text)
                return template
        tok = self.llg_tokenizer()
        template = llg.LLMatcher(tok, text, log_level=0, limits=llg.LLParserLimits(verbose_errors=False))
        if template.is_error():
            raise OptionError(constraint.option, f"cannot be enforced: {_one_line(template.get_error())}")
        with self._lock:
            self._compiled[text] = template
            while len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        return template

    def check(self, constraint: Constraint) -> None:
        """OptionError unless `constraint` compiles for this model (compiled once, then kept)."""
        self.compiled(constraint)

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A fresh matcher of `constraint` for one generation."""
        template = self.compiled(constraint)
        with self._lock:  # one borrow of the template at a time
            return Matcher(template.deep_copy(), self.words)


class Matcher:
    """One generation's place in its grammar: the runtime's TokenMask (runtime/token_mask.py). One thread at a time
    (llguidance refuses two)."""

    def __init__(self, matcher, words: int):
        self._m, self.words = matcher, words

    def fill(self, out: np.ndarray) -> None:
        """out (uint32 [words], C-contiguous) = the ids allowed next (llguidance releases the GIL meanwhile)."""
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)

    def accept(self, token: int) -> None:
        """The token sampled. One the mask did not allow cannot come from the sampler: a failure here is cullama's."""
        if not self._m.consume_token(int(token)):
            raise GenerationError(f"constrained decoding: token {token} does not follow the grammar "
                                  f"({_one_line(self._m.get_error())})")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` may follow what was accepted (the state is unchanged)."""
        return self._m.validate_tokens([int(t) for t in tokens]) if len(tokens) else 0

    def fill_drafts(self, drafts: Sequence[int], out: np.ndarray) -> None:
        """Speculative decoding: out[r] = the mask after the first r drafts, r = 0..len(drafts) (out: uint32
        [>= len(drafts) + 1, words], C-contiguous), the drafts a valid prefix (valid_prefix); the state is unchanged."""
        if not len(drafts):
            return self.fill(out[0])
        _executor().unsafe_compute_mask_ptr_with_draft_token([(self._m, 0, [int(t) for t in drafts])],
                                                             out.ctypes.data, out.shape[1] * 4, len(drafts) + 1)

    @property
    def stopped(self) -> bool:
        """Nothing but an EOS may follow."""
        return self._m.is_stopped()

    def reset(self) -> None:
        """Back to the grammar's start (a benchmark that generates document after document)."""
        self._m.reset()


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _llguidance().LLExecutor(num_threads=1)
        return _EXECUTOR


# -- tokenizers as llguidance reads them ---------------------------------------------------------------------------
def llg_tokenizer(tokenizer, n_vocab: int, eos_ids: Sequence[int]):
    """llguidance's LLTokenizer of a cullama tokenizer over n_vocab ids (the model's logit rows: those past the
    tokenizer's pieces are never allowed), its EOS ids `eos_ids`."""
    llg = _llguidance()
    if hasattr(tokenizer, "json_text"):  # a tokenizer.json: llguidance's own loader reads its bytes
        return llg.LLTokenizer(tokenizer.json_text(), n_vocab=n_vocab, eos_token=list(eos_ids))
    return llg.LLTokenizer(_PieceTable(tokenizer, n_vocab), n_vocab=n_vocab, eos_token=list(eos_ids))


class _PieceTable:
    """A SentencePiece tokenizer as llguidance's TokenizerWrapper: each id's bytes (padded to n_vocab with ids no
    text spells), those special ids, and the tokenization of a text inside a longer one (llguidance tokenizes the
    bytes a grammar forces, and allows only those ids there)."""

    is_tokenizer_wrapper = True

    def __init__(self, tokenizer, n_vocab: int):
        tokens, special = tokenizer.token_table
        self.tokens = list(tokens) + [f"<[{i}]>".encode() for i in range(len(tokens), n_vocab)]
        self.special_token_ids = sorted(special | set(range(len(tokens), n_vocab)))
        self.bos_token_id = tokenizer.bos_id if tokenizer.bos_id >= 0 else None
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id >= 0 else None
        self._encode = tokenizer.encode_inside

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._encode(text)
