"""Chat templates: the checkpoint's own Jinja template, rendered as transformers renders it, in a bounded sandbox.

Where it comes from (the first found): `chat_template.jinja`, `chat_template.json` ({"chat_template": ...}),
then `tokenizer_config.json`'s "chat_template": a string, or a list of {"name", "template"} of which "default"
is used. How it is rendered is transformers' `apply_chat_template`: jinja2's ImmutableSandboxedEnvironment
with trim_blocks and lstrip_blocks, the loop controls (break, continue), `{% generation %}` (rendered as its
body), `raise_exception`, `strftime_now` and transformers' `tojson` (no HTML escaping, its keyword options);
the variables are `messages`, `tools` (the request's tool definitions, as OpenAI's API and transformers'
`tools=` give them, else None) and `documents` (None), `add_generation_prompt` (True) and the tokenizer's special
tokens (`bos_token`, `eos_token`, ...). A message may carry `tool_calls` (an assistant turn that called tools, each
call's arguments a dict) or be a `tool` turn (a call's result): `supports` says whether the template reads them.

A template is code from a file, so rendering it is bounded on top of the sandbox, which already refuses the
internals of objects (`__class__`, `__globals__`, ...: here at once, as an error) and changes to lists and
dicts. A render stops after RENDER_SECONDS: sys.settrace sees every line of the template's code, so a loop
ends in time however it is nested. No value it builds is larger than MAX_CHARS characters or MAX_ITEMS items
(counted as often as they appear, so that a list holding itself twice, forty times over, is 2**40 items):
what can make a value larger than its operands (`+`, `*`, `%`, `**`, `~`, filters, method calls) is checked
before it runs where its size can be told from its operands, and after; what is compared or hashed is checked
first, since comparing nested values is C-level work the trace cannot stop; a render prints no more than
MAX_CHARS in all, blocks that `set` captures included; and the values it builds (slices too) add up to no more
than MAX_RENDER_CHARS, however many it keeps. MAX_RENDERS render at once, so renders on many threads (the
server's) hold together at most MAX_RENDERS times that.

Every failure is one line naming the file: a template that does not compile is a TokenizerError when the
tokenizer loads; one that fails while rendering is a TokenizerError too, except `raise_exception`, the
template refusing the messages it was given, which is a PromptError (a bad request, not a broken model).
"""

from __future__ import annotations

import json
import re
import string
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator, operators
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..common.errors import PromptError, TokenizerError
from ..common.untrusted import read_json

MAX_CHARS = 8 << 20  # the longest string, list or output a render builds: 2M tokens and more, past any context
# what one render may build in all, each value counted once as it is made: a long chat's template copies its
# messages a few times (a slice, a trim, a join), 8M characters of them at most (and the output apart)
MAX_RENDER_CHARS = 8 * MAX_CHARS
MAX_RENDERS = 2  # renders at once in a process (the server's worker threads): pure Python, the GIL runs one
RENDER_SECONDS = 5.0  # LLaMA-3.1's template renders a 200-message chat in ~60 ms (2 busy CPU cores)
TEMPLATE_CODE = "<template>"  # the file name of the Python code jinja2 compiles a template to
MAX_ITEMS = 1 << 17  # the most objects a value a render builds may hold (counted as often as they appear)
MAX_INT_BITS = 4096  # the largest integer `*` and `**` may make
MAX_SOURCE_CHARS = 1 << 20  # a template's own size (LLaMA-3.1's, the longest common one, is ~5k characters)
# the calls whose integer arguments are widths or counts of what they make (str methods, filters, lipsum)
WIDTH_CALLS = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs", "indent", "wordwrap", "truncate",
                         "batch", "slice", "generate_lorem_ipsum"})
MAX_FORMAT_CHARS = 256  # strftime_now's format, tojson's indent: each copied over and over into the output
ERROR_CHARS = 200  # the most of a template's own message (raise_exception) that an error quotes


class ChatTemplate:
    """A compiled chat template and the file it came from (`source`, for messages)."""

    def __init__(self, text: str, source: Path | str) -> None:
        self.source = str(source)
        self.text = text  # its source (what it can render: `supports`; its tool-call format: text/tools.py)
        if not isinstance(text, str):
            raise TokenizerError(f"{self.source}: the chat template must be a string, got {type(text).__name__}")
        if len(text) > MAX_SOURCE_CHARS:
            raise TokenizerError(f"{self.source}: the chat template is longer than {MAX_SOURCE_CHARS} characters")
        try:
            with _Budget(RENDER_SECONDS):  # jinja2 computes constant expressions while it compiles
                self._template = _Sandbox().from_string(text)
        except _TooCostly as exc:
            raise TokenizerError(f"{self.source}: the chat template stopped while compiling: {exc}") from None
        except TemplateSyntaxError as exc:
            raise TokenizerError(f"{self.source}: the chat template does not compile: "
                                 f"{_one_line(exc.message or str(exc))} (line {exc.lineno})") from None
        except Exception as exc:  # jinja2 may raise others while compiling (e.g. RecursionError on deep nesting)
            raise TokenizerError(f"{self.source}: the chat template does not compile: "
                                 f"{type(exc).__name__}: {_one_line(str(exc))}") from None

    def supports(self, feature: str) -> bool:
        """Whether the template reads "tools" (the tool definitions), "tool_calls" (an assistant turn's calls) or
        "tool" messages (a call's result): it names them (a template that does not would drop them, or fail)."""
        if feature == "tool":
            return re.search(r"""["']tool["']""", self.text) is not None
        return re.search(rf"\b{feature}\b", self.text) is not None

    def render(self, messages: list[dict], special_tokens: Mapping[str, str], tools: list | None = None) -> str:
        """The prompt text, as transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=True)
        renders it; PromptError when the template refuses the messages, TokenizerError when it fails otherwise."""
        variables = {**special_tokens, "messages": messages, "tools": tools or None, "documents": None,
                     "add_generation_prompt": True}
        try:
            with _RENDERS, _Budget(RENDER_SECONDS):
                text = _joined(self._template.generate(**variables))
        except _Refused as exc:
            raise PromptError(f"{self.source}: the chat template refuses these messages: {exc}") from None
        except _TooCostly as exc:
            raise TokenizerError(f"{self.source}: the chat template stopped: {exc}") from None
        except SecurityError as exc:
            raise TokenizerError(f"{self.source}: the chat template tried to leave its sandbox: "
                                 f"{_one_line(str(exc))}") from None
        except Exception as exc:  # a template is code: anything it raises is its failure, in one line
            raise TokenizerError(f"{self.source}: the chat template failed: {type(exc).__name__}: "
                                 f"{_one_line(str(exc))}") from None
        return self._unicode(text)

    def _unicode(self, text: str) -> str:
        """`text`, once it is known to be Unicode that a tokenizer can take: a template can spell a lone UTF-16
        surrogate ('\\ud800' in its source), which no tokenizer encodes (the tokenizers library raised a
        TypeError). The messages and special tokens are checked before, so it is the template's doing."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(f"{self.source}: the chat template made text that is not valid Unicode (character "
                                 f"{exc.start} is the lone surrogate U+{ord(text[exc.start]):04X})") from None
        return text


def find(directory: Path, tokenizer_config: Mapping, config_file: Path) -> ChatTemplate | None:
    """The chat template that comes with a tokenizer in `directory` (see the module docstring), or None.
    `tokenizer_config` is the parsed `config_file` ({} when there is none)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return ChatTemplate(_read_text(jinja_file), jinja_file)
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        raw = read_json(json_file, TokenizerError)
        if not isinstance(raw, dict) or "chat_template" not in raw:
            raise TokenizerError(f"{json_file}: expected a JSON object with a \"chat_template\" string")
        return ChatTemplate(raw["chat_template"], json_file)
    template = tokenizer_config.get("chat_template")
    if template is None:
        return None
    if isinstance(template, list):  # named templates (e.g. "default", "tool_use"): transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(f"{config_file}: chat_template lists templates named "
                                 f"{', '.join(map(str, named)) or 'nothing'} but none named \"default\"")
        template = named["default"]
    return ChatTemplate(template, config_file)


# -- bounds ------------------------------------------------------------------------------------


class _Refused(Exception):
    """raise_exception(message): the template refuses its input."""


class _TooCostly(BaseException):
    """A render past RENDER_SECONDS, or a value past MAX_CHARS. A BaseException, so that no `except Exception`
    on the way out (in jinja2, in a filter) can swallow it and let the render go on."""


def _size(value) -> int:
    """About how long `value` is as text: a string's length, a container's items counted as often as they
    appear (a list that holds itself twice, forty times over, is 2**40 items). Past MAX_CHARS, or past
    MAX_ITEMS objects looked at, it stops counting and says MAX_CHARS + 1."""
    total, stack, seen = 0, [value], 0
    while stack:
        item = stack.pop()
        seen += 1
        total += 1
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += len(item)
            if total <= MAX_CHARS:
                stack.extend(item)
        elif isinstance(item, dict):
            total += len(item)
            if total <= MAX_CHARS:
                stack.extend(item.keys())
                stack.extend(item.values())
        elif isinstance(item, Namespace):
            stack.append(object.__getattribute__(item, "_Namespace__attrs"))
        elif isinstance(item, int) and item.bit_length() > MAX_INT_BITS:
            return MAX_CHARS + 1
        if total > MAX_CHARS or seen > MAX_ITEMS:
            return MAX_CHARS + 1
    return total


def _sized(value):
    """`value` unchanged, once its size is known to be within MAX_CHARS."""
    _checked_size(value)
    return value


def _checked_size(value) -> int:
    """_size(value) of a string or container (0 for anything else), once it is known to be within MAX_CHARS."""
    if type(value) is str:  # the common case, first
        size = len(value)
    elif isinstance(value, (list, tuple, dict, set, frozenset, str, int, Namespace)):
        size = _size(value)
    else:
        return 0
    if size > MAX_CHARS:
        raise _TooCostly(f"it built a value of more than {MAX_CHARS} characters or {MAX_ITEMS} items")
    return 0 if isinstance(value, int) else size  # an int's memory is bounded by MAX_INT_BITS


def _built(value):
    """`value`, a value the render made (what an operator, a call, a filter or a slice gives), once its size is
    within MAX_CHARS and, added to all the render made before, within MAX_RENDER_CHARS. Each value counts when it
    is made, however long the render then keeps it, so what a render holds at once (in variables, namespaces,
    lists) is within that bound too; a value given back unchanged (`messages|first`) counts again, which only
    makes the bound tighter."""
    size = _checked_size(value)
    budget = getattr(_active, "budget", None)
    if budget is not None and size:
        budget.built += size
        if budget.built > MAX_RENDER_CHARS:
            raise _TooCostly(f"it built more than {MAX_RENDER_CHARS} characters in all")
    return value


def _printed(value):
    """The environment's finalize, which sees every value a {{ ... }} prints (in a block that `set` captures,
    a macro, the output): what a render prints, all told, stays within MAX_CHARS."""
    budget = getattr(_active, "budget", None)
    size = len(value) if type(value) is str else _size(value)
    if size > MAX_CHARS or (budget is not None and budget.printed + size > MAX_CHARS):
        raise _TooCostly(f"it printed more than {MAX_CHARS} characters")
    if budget is not None:
        budget.printed += size
    return value


def _joined(parts) -> str:
    """"".join(parts), refused as soon as it would pass MAX_CHARS."""
    out, total = [], 0
    for part in parts:
        total += len(part)
        if total > MAX_CHARS:
            raise _TooCostly(f"it built a text of more than {MAX_CHARS} characters")
        out.append(part)
    return "".join(out)


def _check_arguments(args, kwargs, widths: bool = False) -> None:
    """A call's arguments, before it runs: none too large, and not a long value with a long second one (or,
    with `widths`, a large number: a width or a count). What a call makes is at most one copy of one argument
    at each item of another (replace, join, indent, wordwrap, center, expandtabs, batch, "%*s"), so the product
    of the two bounds it."""
    lengths, numbers = [0, 0], [0]
    for value in (*args, *kwargs.values()):
        if isinstance(value, (str, list, tuple, dict)):
            lengths.append(len(_sized(value)))
        elif widths and isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > MAX_CHARS:
                shown = value if value < 1 << 64 else "a huge number"
                raise _TooCostly(f"it asked for a width or count of {shown}")
            numbers.append(abs(value))
        else:
            _sized(value)
    *_, second, longest = sorted(lengths)
    if longest * max(1, second, *numbers) > MAX_CHARS:
        raise _TooCostly(f"a call could make {longest * max(1, second, *numbers)} characters")


def _check_binop(operator: str, left, right) -> None:
    """`+`, `*`, `%` and `**` before they run: the size of what they would make."""
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                abs(left).bit_length() * right > MAX_INT_BITS:
            exponent = right if right.bit_length() <= 64 else "a huge number"
            raise _TooCostly(f"{exponent} as an exponent is too large")
    elif operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _TooCostly("it multiplied numbers past 4096 bits")
            return
        sequence, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and hasattr(sequence, "__len__") and len(sequence) * count > MAX_CHARS:
            times = count if count < 1 << 64 else "a huge number of"
            raise _TooCostly(f"it repeated a value of length {len(sequence)} {times} times")
    elif operator == "+":
        if hasattr(left, "__len__") and hasattr(right, "__len__") and len(left) + len(right) > MAX_CHARS:
            raise _TooCostly(f"it built a value of more than {MAX_CHARS} characters")
    elif operator == "%" and isinstance(left, str):
        _check_arguments((left, *(right if isinstance(right, tuple) else (right,))), {}, widths=_check_format(left))


def _check_format(text: str) -> bool:
    """No field width or precision in a format string ("%9999999s", "{:>9999999}") past MAX_CHARS; True when
    the string takes one from the arguments ("%*s", "{:{w}}")."""
    specs = [m.group(0) for m in re.finditer(r"%[-#0 +]*(?:\d+|\*)?(?:\.(?:\d+|\*))?", text)]
    try:
        specs += [spec for _, _, spec, _ in string.Formatter().parse(text) if spec]
    except ValueError:
        pass  # not a valid str.format string: it fails as it is used
    # apart: "{:>50}{:50}" asks for 50 twice, not 5050; leading zeros (flags) left out: "%000001s" asks for 1
    for number in re.findall(r"0*(\d+)", " ".join(specs)):
        if len(number) > 7 or int(number) > MAX_CHARS:  # 8 digits are past MAX_CHARS: never int() a huge one
            raise _TooCostly(f"its format string asks for a width of {number[:20]}")
    return any("*" in spec or "{" in spec for spec in specs)


class _Budget:
    """A render's budget: its time, what it prints (`printed`, kept by _printed) and what it builds (`built`,
    kept by _built).

    A render still running RENDER_SECONDS after it started is stopped: sys.settrace (this thread only) looks at
    the clock at every Python call, and at every line of the template's own code, so a loop ends in time
    however it is nested (a line takes little time, since no value grows past MAX_CHARS). The tracer that was
    there (a debugger, coverage) is put back afterwards."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.printed, self.built = seconds, 0, 0

    def __enter__(self) -> None:
        self.end = time.monotonic() + self.seconds
        self._previous = sys.gettrace()
        _active.budget = self
        sys.settrace(self._call)

    def __exit__(self, *exc) -> None:
        sys.settrace(self._previous)
        _active.budget = None

    def _call(self, frame, event, arg):
        if time.monotonic() > self.end:
            raise _TooCostly(f"it ran for more than {self.seconds:g} s")
        return self._line if frame.f_code.co_filename == TEMPLATE_CODE else None

    def _line(self, frame, event, arg):
        if time.monotonic() > self.end:
            raise _TooCostly(f"it ran for more than {self.seconds:g} s")
        return self._line


_active = threading.local()  # .budget: the _Budget of the render running in this thread
# Renders wait their turn, MAX_RENDERS at a time, so that together they hold at most MAX_RENDERS times what one
# may build (the server renders on up to 32 worker threads); their time runs from their turn.
_RENDERS = threading.BoundedSemaphore(MAX_RENDERS)


# -- the sandbox ---------------------------------------------------------------------------------


def _raise_exception(message) -> None:
    raise _Refused(_one_line(str(message), ERROR_CHARS))


def _strftime_now(format: str) -> str:
    if len(str(format)) > MAX_FORMAT_CHARS:  # "%c" alone is 24 characters: a long format is a long output
        raise _TooCostly(f"strftime_now was given a format of more than {MAX_FORMAT_CHARS} characters")
    return datetime.now().strftime(format)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson (json.dumps with these options: no HTML escaping, unlike jinja2's), built in
    chunks so that its size is checked as it grows."""
    if len(str(indent) if isinstance(indent, str) else " " * (indent or 0)) > MAX_FORMAT_CHARS:
        raise _TooCostly(f"tojson was given an indent of more than {MAX_FORMAT_CHARS} characters")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    return _joined(encoder.iterencode(value))


class _GenerationTag(jinja2.ext.Extension):
    """transformers' {% generation %}...{% endgeneration %}, which marks the assistant's tokens for training
    masks: here it renders as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _CodeGenerator(CodeGenerator):
    """jinja2's, but `a ~ b` joins through the environment (size-checked) instead of a plain str join, a slice is
    counted as built, and the values compared (`==`, `in`, ...) and used as dict keys are size-checked first:
    comparing or hashing nested values is C-level work that nothing else would bound."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame) -> None:
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_Getitem(self, node: jinja2.nodes.Getitem, frame) -> None:
        # jinja2 writes a slice as Python's `a[i:j]`, past environment.getitem: a copy, counted as built
        if not isinstance(node.arg, jinja2.nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        self.write("environment.built(")
        super().visit_Getitem(node, frame)
        self.write(")")

    def visit_Compare(self, node: jinja2.nodes.Compare, frame) -> None:
        self.write("(")
        self._operand(node.expr, frame)
        for op in node.ops:
            self.visit(op, frame)
        self.write(")")

    def visit_Operand(self, node: jinja2.nodes.Operand, frame) -> None:
        self.write(f" {operators[node.op]} ")
        self._operand(node.expr, frame)

    def visit_Dict(self, node: jinja2.nodes.Dict, frame) -> None:
        self.write("{")
        for item in node.items:
            self._operand(item.key, frame)
            self.write(": ")
            self.visit(item.value, frame)
            self.write(", ")
        self.write("}")

    def _operand(self, node: jinja2.nodes.Expr, frame) -> None:
        """`node`, size-checked unless it is a constant (the template's own text, small)."""
        if isinstance(node, jinja2.nodes.Const):
            self.visit(node, frame)
            return
        self.write("environment.operand(")
        self.visit(node, frame)
        self.write(")")


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment, with every operation that can make a value larger bounded (module docstring)."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, finalize=_printed,
                         extensions=[jinja2.ext.loopcontrols, _GenerationTag])
        self.filters["tojson"] = _tojson
        self.filters["format"] = _format_filter(self.filters["format"])
        self.filters["join"] = _join_filter(self.filters["join"])
        self.filters = {name: _bounded(f, name) for name, f in self.filters.items()}
        self.tests = {name: _bounded(f, name) for name, f in self.tests.items()}
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    # blocks captured by {% set %}, macros and caller() join their output here
    concat = staticmethod(_joined)

    @staticmethod
    def concat_values(values) -> str:
        return _built(_joined(str(_sized(v)) for v in values))

    operand = staticmethod(_sized)
    built = staticmethod(_built)

    def getitem(self, obj, argument):
        item = super().getitem(obj, _sized(argument))  # a key is hashed
        return _built(item) if isinstance(argument, slice) else item  # a slice (of constants, folded) is a copy

    def unsafe_undefined(self, obj, attribute):
        # jinja2 returns an Undefined that fails only when used: a template that reaches for an object's
        # internals is refused at once.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, operator, left, right):
        _check_binop(operator, left, right)
        return _built(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
        subject = getattr(__obj, "__self__", None)  # a method's object ("a".replace: "a") is an argument too
        name = getattr(__obj, "__name__", None)
        if name == "join" and isinstance(subject, str) and len(args) == 1:
            args = (list(args[0]),)  # the parts, counted before they are joined
        _check_arguments(args if subject is None else (subject, *args), kwargs, widths=name in WIDTH_CALLS)
        return _built(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value):
        # jinja2 sandboxes str.format and str.format_map: their format string must not ask for a huge width,
        # nor take one from the arguments ("{:{w}}")
        wrapper = super().wrap_str_format(value)
        if wrapper is None or not _check_format(value.__self__):
            return wrapper

        def checked(*args, **kwargs):
            _check_arguments(args, kwargs, widths=True)
            return wrapper(*args, **kwargs)

        return checked


def _format_filter(format_filter):
    """jinja2's `format` filter (`"%s"|format(x)`, which is `%`), its format string checked first."""

    def format(value, *args, **kwargs):
        if _check_format(str(value)):
            _check_arguments(args, kwargs, widths=True)
        return format_filter(value, *args, **kwargs)

    return format


def _join_filter(join_filter):
    """jinja2's `join` filter, its parts (a generator, maybe) counted before they are joined."""

    def join(eval_ctx, value, *args, **kwargs):
        parts = list(value)
        _check_arguments((parts, *args), kwargs)
        return join_filter(eval_ctx, parts, *args, **kwargs)

    join.jinja_pass_arg = join_filter.jinja_pass_arg  # pass_eval_context, as jinja2's
    return join


def _bounded(function, name: str):
    """The filter or test `name`, checking its arguments and its result."""

    def bounded(*args, **kwargs):
        _check_arguments(args, kwargs, widths=name in WIDTH_CALLS)
        return _built(function(*args, **kwargs))

    # keep jinja2's pass_context / pass_environment marks (they say what the first argument is)
    bounded.__dict__.update(getattr(function, "__dict__", {}))
    return bounded


def _read_text(path: Path) -> str:
    most = 4 * MAX_SOURCE_CHARS + 3  # the bytes of MAX_SOURCE_CHARS characters (4 each at most) and a BOM
    try:
        with open(path, "rb") as fh:
            raw = fh.read(most + 1)
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > most:  # too long, wherever the read cut it (inside a character: it is not bad UTF-8)
        raise TokenizerError(f"{path}: the chat template is longer than {MAX_SOURCE_CHARS} characters")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path}: not UTF-8 text (invalid byte at {exc.start})") from None


def _one_line(text: str, limit: int = ERROR_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
