"""What a model directory holds is read without trusting it: JSON of bounded size and depth, and values
shown in one-line messages short, escaped, and never a file's raw bytes.

A config.json or model.safetensors.index.json can be anything a download or a hostile user put there:
megabytes of nesting (json raises RecursionError), invalid UTF-8, a 10 GB file. Each becomes one line
naming the file, of the caller's error class.
"""

from __future__ import annotations

import json
from pathlib import Path

MAX_JSON_BYTES = 64 * 1024 * 1024  # a LLaMA config.json is ~1 kB, a 405B index ~100 kB
SHOWN_CHARS = 60  # the longest value a message quotes


def shown(value, quote: bool = False) -> str:
    """A value read from a file, fit for a one-line message: a printable short string as it is (with `quote`,
    quoted: a JSON value whose type matters, "494" and not 494), anything else in its JSON spelling (control
    and non-ASCII characters escaped), cut to SHOWN_CHARS."""
    if isinstance(value, str) and value.isprintable() and len(value) <= SHOWN_CHARS:
        return json.dumps(value, ensure_ascii=False) if quote else value
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def printable(text: str) -> str:
    """`text` with each character that is not printable escaped as JSON writes it (an ANSI escape as \\u001b, a
    newline as \\n; NUL, C1 controls, bidi overrides, line separators, lone surrogates alike): what a message
    interpolated (a path, an option's value) can neither recolour nor clear a terminal, nor start a line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else json.dumps(c)[1:-1] for c in text)


def parse_json(raw: bytes, where: Path | str, error: type[Exception]):
    """Parse JSON bytes; a one-line `error` naming `where` when they are not JSON (the message gives
    positions, never the bytes themselves)."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not valid JSON (invalid UTF-8 at byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply)") from None


def read_json(file: Path, error: type[Exception]):
    """Read and parse a small JSON file; every failure is a one-line `error` naming the file."""
    return parse_json(read_bounded(file, error, "a JSON description"), file, error)


def read_bounded(file: Path, error: type[Exception], what: str) -> bytes:
    """A file's bytes, at most MAX_JSON_BYTES of them (`what` it should be names it in the error past that)."""
    try:
        with open(file, "rb") as fh:
            raw = fh.read(MAX_JSON_BYTES + 1)
    except OSError as exc:
        raise error(f"{file}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_JSON_BYTES:
        raise error(f"{file}: larger than {MAX_JSON_BYTES >> 20} MiB, too large for {what}")
    return raw
