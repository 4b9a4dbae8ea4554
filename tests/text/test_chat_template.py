"""Chat templates: found where transformers finds them, rendered as it renders them, and bounded: a template that
raises, reaches outside its sandbox, loops or grows without end is one line naming its file."""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
import tracemalloc
from datetime import datetime

import jinja2.ext
import pytest
from click.testing import CliRunner
from jinja2.runtime import Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment

import cullama
from cullama.text import chat_template
from cullama.text.chat_template import ChatTemplate, find
from cullama.model.checkpoint import write_random
from cullama.cli.main import main
from cullama.model.config import LlamaConfig
from cullama.common.errors import PromptError, TokenizerError
from cullama.text.tokenizer import Tokenizer, load_tokenizer
from tests.conftest import shared_path

USER = [{"role": "user", "content": "Hi"}]
CHAT = [{"role": "system", "content": "Be <b>brief</b>."}, {"role": "user", "content": "Name a colour, \"é\"."},
        {"role": "assistant", "content": " Blue. "}, {"role": "user", "content": "Another?"}]
# Meta's LLaMA-2 chat template as its HF repository ships it
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def render(source: str, messages=USER, **special) -> str:
    return ChatTemplate(source, "T.jinja").render(messages, special)


def transformers_render(source: str, messages, **special) -> str:
    """transformers' own environment (utils/chat_template_utils.py), as the oracle for what a render gives."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    return env.from_string(source).render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                          **special)


# -- where a template comes from ----------------------------------------------------------------


def test_the_jinja_file_then_the_json_file_then_tokenizer_config(tmp_path):
    config_file = tmp_path / "tokenizer_config.json"
    assert find(tmp_path, {}, config_file) is None
    assert find(tmp_path, {"chat_template": "config"}, config_file).source == str(config_file)
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert render_found(tmp_path, {"chat_template": "config"}) == "json"
    (tmp_path / "chat_template.jinja").write_text("jinja\n")  # its last newline is dropped, as jinja2 does
    assert render_found(tmp_path, {"chat_template": "config"}) == "jinja"


def render_found(directory, config) -> str:
    template = find(directory, config, directory / "tokenizer_config.json")
    return template.render(USER, {})


def test_named_templates_use_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    assert render_found(tmp_path, {"chat_template": named}) == "plain"


@pytest.mark.parametrize("file, content, why", [
    ("chat_template.json", "[]", 'expected a JSON object with a "chat_template" string'),
    ("chat_template.json", '{"template": "x"}', 'expected a JSON object with a "chat_template" string'),
    ("chat_template.json", '{"chat_template": 5}', "the chat template must be a string, got int"),
    ("chat_template.json", "{", "not valid JSON"),
    ("chat_template.jinja", b"\xff{{ x }}", "not UTF-8 text"),
    ("chat_template.jinja", "{% if %}", "the chat template does not compile"),
])
def test_bad_template_files_are_one_line(tmp_path, file, content, why):
    (tmp_path / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TokenizerError) as info:
        find(tmp_path, {}, tmp_path / "tokenizer_config.json")
    assert str(info.value).startswith(str(tmp_path / file)) and why in str(info.value)
    assert "\n" not in str(info.value)


# -- rendering as transformers does -------------------------------------------------------------


@pytest.mark.parametrize("source", [
    LLAMA2_TEMPLATE,
    # trim_blocks, lstrip_blocks, loop controls, loop variables, namespaces, macros, captured blocks
    "{% for m in messages %}\n  {% if loop.index0 > 2 %}{% break %}{% endif %}\n"
    "  {% if m.role == 'assistant' %}{% continue %}{% endif %}\n"
    "  [{{ loop.index }}/{{ loop.length }}] {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}>{% endif %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}{% endfor %}"
    "{{ ns.n }}{% macro turn(m) %}<{{ m.role|upper }}>{{ m.content|trim }}{% endmacro %}"
    "{% for m in messages %}{{ turn(m) }}{% endfor %}{% set block %}{{ bos_token }}x{% endset %}{{ block * 2 }}",
    # transformers' tojson: no HTML escaping, non-ASCII kept, its keyword options
    "{{ messages|tojson }}|{{ messages[0]|tojson(indent=2) }}|{{ messages|tojson(ensure_ascii=True) }}"
    "|{{ {'b': 1, 'a': [1, 2]}|tojson(sort_keys=True, separators=(',', ':')) }}",
    # the variables transformers passes, and operators, filters and methods a template uses
    "{{ tools is none }}{{ documents is none }}{{ eos_token }}{{ 'x' ~ 1 ~ messages|length }}"
    "{{ messages|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(' | ') }}"
    "{{ '%s-%05.1f' % ('a', 2.5) }}{{ '{}:{:>4}'.format('b', 7) }}{{ 1 < 2 <= 2 }}{{ 'Hi' in messages[1].content }}"
    "{{ {'k': 'v'}['k'] }}{{ messages[-1].content.replace('?', '!').split('o') }}{{ undefined_name is defined }}",
])
def test_renders_as_transformers(source):
    assert render(source, CHAT, bos_token="<s>", eos_token="</s>") == \
        transformers_render(source, CHAT, bos_token="<s>", eos_token="</s>")


def test_generation_tag_and_strftime_now():
    assert render("{% generation %}{{ messages[0].content }}{% endgeneration %}!") == "Hi!"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)


def test_raise_exception_is_a_prompt_error_naming_the_file():
    with pytest.raises(PromptError) as info:
        render(LLAMA2_TEMPLATE, [{"role": "assistant", "content": "x"}])
    assert str(info.value) == "T.jinja: the chat template refuses these messages: Conversation roles must " \
                              "alternate user/assistant/user/assistant/..."
    with pytest.raises(PromptError, match=r"^T.jinja: .*: no\s+way$"):
        render("{{ raise_exception('no\\nway') }}")  # one line, whatever the template says
    for said, quoted in (("a" * 200, "a" * 200), ("b" * 201, "b" * 197 + "...")):  # ERROR_CHARS of it at most
        with pytest.raises(PromptError, match=f"^T.jinja: the chat template refuses these messages: {quoted}$"):
            render(f"{{{{ raise_exception('{said}') }}}}")


@pytest.mark.parametrize("source, why", [
    ("{{ messages[0].content.nope() }}", "UndefinedError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{{ messages|tojson(default=1) }}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ messages[0]|tojson }}{{ nothing|tojson }}", "not JSON serializable"),
])
def test_a_failing_template_is_one_line(source, why):
    with pytest.raises(TokenizerError) as info:
        render(source)
    assert str(info.value).startswith("T.jinja: the chat template failed: ") and why in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("source", ["{{ '\\ud800' }}", "a\ud800", "{{ bos_token }}{{ '\\udfff' }}"])
def test_a_lone_surrogate_in_the_text_is_one_line(source):
    # issue 30 item 2: no tokenizer encodes it (the tokenizers library raised a TypeError, the CLI printed 46 lines)
    with pytest.raises(TokenizerError) as info:
        render(source, bos_token="<s>")
    assert str(info.value).startswith("T.jinja: the chat template made text that is not valid Unicode (character ")
    assert str(info.value).endswith(" is the lone surrogate U+D800)") or str(info.value).endswith("U+DFFF)")


@pytest.mark.parametrize("source, why", [
    ("{% for %}", "Expected an expression, got 'end of statement block' (line 1)"),
    ("\n{{ x|no_such_filter }}", "No filter named 'no_such_filter'. (line 2)"),
    ("{{ x }", "unexpected '}' (line 1)"),
])
def test_a_template_that_does_not_compile_is_one_line(source, why):
    with pytest.raises(TokenizerError) as info:
        ChatTemplate(source, "T.jinja")
    assert str(info.value) == f"T.jinja: the chat template does not compile: {why}"


# -- the sandbox and its bounds -----------------------------------------------------------------


@pytest.mark.parametrize("source", [
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['sys'].modules['os'].system('true') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ (messages|first).items.__self__ }}",
    "{{ messages.append(1) }}",  # the sandbox is immutable: no change to what it is given
    "{% set d = {} %}{{ d.update(a=1) }}",
    "{{ messages[0].pop('role') }}",
    "{{ '{0.__class__}'.format(1) }}",  # str.format reads attributes: jinja2's sandboxed format, kept
])
def test_reaching_outside_the_sandbox_is_one_line(source):
    with pytest.raises(TokenizerError) as info:
        render(source)
    assert str(info.value).startswith("T.jinja: the chat template tried to leave its sandbox: access to attribute")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("source", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",  # no call in the loop
    "{% set s = 'x' * 8000000 %}{% for i in range(100000) %}{% if 'zz' in s %}{% endif %}{% endfor %}",
    "{{ lipsum(5000000) }}",
    "{% macro f(n) %}{% for i in range(100) %}{{ f(n + 1) if n < 10 else '' }}{% endfor %}{% endmacro %}{{ f(0) }}",
])
def test_a_render_that_runs_too_long_is_stopped(monkeypatch, source):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    tracer = sys.gettrace()  # a debugger's or coverage's: put back afterwards
    with pytest.raises(TokenizerError, match=r"^T.jinja: the chat template stopped: it ran for more than 0.3 s$"):
        render(source)
    assert sys.gettrace() is tracer


GROWTH = "{% set ns = namespace(x=[1], y=[1], s='x') %}{% for i in range(40) %}{% set ns.x = [ns.x, ns.x] %}" \
         "{% set ns.y = [ns.y, ns.y] %}{% endfor %}"  # lists that hold 2**40 items, counted as printing counts them


@pytest.mark.parametrize("source", [
    "{{ 'x' * 10**9 }}",
    "{{ [1] * 10**9 }}",
    "{% set n = 10 %}{{ n ** 100000 }}",
    "{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "{% for i in range(100000) %}" + "x" * 1000 + "{% endfor %}",
    "{% set s %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}",
    GROWTH + "{{ ns.x }}",
    GROWTH + "{{ ns.x|tojson }}",
    GROWTH + "{{ ns.x ~ '' }}",
    GROWTH + "{{ ns.x|string }}",
    GROWTH + "{{ '%s' % (ns.x,) }}",
    GROWTH + "{{ ns.x == ns.y }}",
    GROWTH + "{{ {ns.x|join: 1} }}",
    "{{ ('x' * 100000)|replace('x', 'y' * 1000) }}",
    "{{ ('x' * 10000).join(range(10000)|map('string')) }}",
    "{{ range(10000)|map('string')|join('x' * 10000) }}",
    "{{ ('\\n' * 100000)|indent('x' * 1000) }}",
    "{{ ('\\t' * 1000).expandtabs(1000000) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ [1]|batch(10**8, 'x')|list }}",
    "{{ '%999999999s' % 'x' }}",
    "{{ '%*s' % (999999999, 'x') }}",
    "{{ '%.999999999f'|format(1.0) }}",
    "{{ '{:>999999999}'.format('x') }}",
    "{{ '{:{w}}'.format('x', w=999999999) }}",
    "{{ strftime_now('%c' * 1000) }}",
    "{{ messages|tojson(indent=10**6) }}",
])
def test_a_render_that_grows_too_large_is_stopped(source):
    with pytest.raises(TokenizerError) as info:
        render(source)
    assert str(info.value).startswith("T.jinja: the chat template stopped") and "\n" not in str(info.value)


def test_large_numbers_that_are_not_sizes_are_fine():
    assert render("{{ '{}'.format(12345678901234) }}{{ '%d' % 12345678901234 }}{{ 10 ** 10 ** 2 > 0 }}") == \
        "1234567890123412345678901234True"
    assert render("{{ [1, 2]|join(10 ** 7) }}") == "1100000002"  # join's separator, not a width


# -- the bounds at their edges (MAX_CHARS, MAX_ITEMS, MAX_INT_BITS: one past is refused, the limit is not) --------
MAX, ITEMS = chat_template.MAX_CHARS, chat_template.MAX_ITEMS


def test_sizes_count_each_object_once_and_each_string_by_its_length():
    size = chat_template._size
    assert [size("abc"), size(["ab", "c"]), size(("a",)), size({"k": "vv"}), size({1, 2}), size(7)] == \
        [4, 8, 4, 7, 5, 1]
    assert size(Namespace(a="xy")) == 8  # itself, then its attributes' dict
    assert size(2 ** 4096 - 1) == 1 and size(2 ** 4096) == size(-(2 ** 4096)) == MAX + 1  # 4097 bits
    assert size([0] * (ITEMS - 1)) == 2 * ITEMS - 1 and size([0] * ITEMS) == MAX + 1  # objects looked at
    # a container whose own count reaches the limit exactly still has its items counted
    assert size([[0, 0], "x" * (MAX - 9)]) == MAX and size([[0, 0], "x" * (MAX - 7)]) == MAX + 1
    assert size([{0: 0}, "x" * (MAX - 8)]) == MAX and size([{0: 0}, "x" * (MAX - 6)]) == MAX + 1


def test_a_value_of_the_limit_passes_and_one_past_it_is_refused():
    assert chat_template._sized("x" * MAX) is not None and chat_template._sized(["x" * (MAX - 3)]) is not None
    for value in ("x" * (MAX + 1), ["x" * (MAX - 2)]):
        with pytest.raises(chat_template._TooCostly):
            chat_template._sized(value)


def test_a_render_prints_up_to_the_limit_in_all_blocks_that_set_captures_included():
    assert len(render(f"{{{{ 'x' * {MAX} }}}}")) == MAX
    with pytest.raises(TokenizerError, match=f"stopped: it repeated a value of length 1 {MAX + 1} times"):
        render(f"{{{{ 'x' * {MAX + 1} }}}}")
    # printed in all: the block set captures, then as much again
    assert len(render(f"{{% set s %}}{{{{ 'x' * {MAX // 2} }}}}{{% endset %}}{{{{ 'y' * {MAX // 2} }}}}")) == MAX // 2
    assert len(render("z" * 1000 + f"{{{{ 'x' * {MAX - 1000} }}}}")) == MAX  # the template's own text counts
    with pytest.raises(TokenizerError, match=f"stopped: it built a text of more than {MAX} characters"):
        render("z" * 1000 + f"{{{{ 'x' * {MAX - 999} }}}}")
    half = MAX // 2  # half and one more than half: one past the limit, each block alone within it
    with pytest.raises(TokenizerError, match=f"stopped: it printed more than {MAX} characters"):
        render(f"{{% set s %}}{{{{ 'x' * {half} }}}}{{% endset %}}{{{{ 'y' * {half + 1} }}}}")


def test_widths_and_calls_at_the_limit():
    centered = "{% set w = WIDTH %}{{ 'x'|center(w) }}"  # w a variable: jinja2 does not fold it when it compiles
    assert len(render(centered.replace("WIDTH", str(MAX)))) == MAX and render(centered.replace("WIDTH", "True")) == "x"
    assert render(f"{{{{ ('x' * {MAX}).upper()|length }}}}") == str(MAX)  # a call on a value of the limit
    for width, shown in ((MAX + 1, MAX + 1), (2 ** 64 - 1, 2 ** 64 - 1), (2 ** 64, "a huge number")):
        with pytest.raises(TokenizerError, match=f"stopped: it asked for a width or count of {shown}$"):
            render(centered.replace("WIDTH", str(width)))


def test_powers_are_bounded_by_the_bits_they_could_make():
    big = 2 ** 4100  # a literal past MAX_INT_BITS: only its power is refused, a power of 0 is 1
    assert render("{{ 2 ** 2048 > 0 }}") == "True" and render(f"{{{{ {big} ** 0 }}}}") == "1"  # 2 bits x 2048
    for source, exponent in (("{{ 2 ** 2049 > 0 }}", 2049), (f"{{{{ {big} ** 1 > 0 }}}}", 1),
                             (f"{{{{ 2 ** {2 ** 64 - 1} }}}}", 2 ** 64 - 1),
                             (f"{{{{ 2 ** {2 ** 64} }}}}", "a huge number")):
        with pytest.raises(TokenizerError, match=f"stopped: {exponent} as an exponent is too large$"):
            render(source)


def test_products_and_repeats_at_the_limit():
    half = "{% set a = 2 ** 2047 %}"  # 2048 bits
    assert render(half + "{{ a * a > 0 }}") == "True"  # 2048 + 2048 bits
    with pytest.raises(TokenizerError, match="stopped: it multiplied numbers past 4096 bits$"):
        render(half + "{{ a * (a * 2) > 0 }}")
    for count, shown in ((2 ** 64 - 1, 2 ** 64 - 1), (2 ** 64, "a huge number of")):
        with pytest.raises(TokenizerError, match=f"stopped: it repeated a value of length 1 {shown} times$"):
            render(f"{{% set n = {count} %}}{{{{ 'x' * n }}}}")


@pytest.mark.parametrize("spec, use, width", [
    ("%9000000s", "f % 'x'", "9000000"),  # 7 digits, past MAX_CHARS
    ("{:>9000000}", "f.format('x')", "9000000"),
    ("%" + "9" * 5000 + "s", "f % 'x'", "9" * 20),  # 5000 digits: refused unread (int() would refuse to read it)
])
def test_a_format_width_past_the_limit_is_refused_before_it_runs(spec, use, width):
    with pytest.raises(TokenizerError, match=f"stopped: its format string asks for a width of {width}$"):
        render(f"{{% set f = '{spec}' %}}{{{{ {use} }}}}")


@pytest.mark.parametrize("source", ["{{ '%*s' % (w, 'x') }}", "{{ '{:{w}}'.format('x', w=w) }}",
                                    "{{ '%*s'|format(w, 'x') }}"])
def test_a_width_a_format_takes_from_its_arguments_is_a_width(source):
    with pytest.raises(TokenizerError, match=f"stopped: it asked for a width or count of {MAX + 1}$"):
        render(f"{{% set w = {MAX + 1} %}}" + source)


def test_joining_two_values_at_the_limit():
    assert render(f"{{% set a = 'x' * {MAX - 1} %}}{{{{ (a + 'y')|length }}}}") == str(MAX)
    with pytest.raises(TokenizerError, match=f"stopped: it built a value of more than {MAX} characters$"):
        render(f"{{% set a = 'x' * {MAX} %}}{{{{ (a + 'y')|length }}}}")


def test_format_widths_within_the_limit_run():
    assert render("{% set f = '%8388608s' %}{{ (f % 'x')|length }}") == str(MAX)
    # two fields side by side are two widths, not one of their digits run together
    assert render("{% set f = '{:>5000}{:5000}' %}{{ f.format('x', 'y')|length }}") == "10000"
    assert render("{% set f = '%0000000003s' %}{% set g = '{:0000000003}' %}{{ f|format('x') }}|{{ g.format('y') }}") \
        == ("%0000000003s" % "x") + "|" + "{:0000000003}".format("y")  # leading zeros: a flag, not a width


def test_the_documented_limits_in_absolute_terms():
    items = "{{ ((range(100000)|list) + (range(N)|list))|length }}"  # jinja2 refuses ranges past 100000
    assert render(items.replace("N", "31071")) == "131071"  # MAX_ITEMS: 131072 objects, the list one of them
    with pytest.raises(TokenizerError, match="stopped: it built a value of more than 8388608 characters or 131072 "):
        render(items.replace("N", "31072"))
    source = "x" * (1 << 20)  # MAX_SOURCE_CHARS: a template of 1 MiB compiles, one character more does not
    assert render(source) == source
    with pytest.raises(TokenizerError, match="^T.jinja: the chat template is longer than 1048576 characters$"):
        render(source + "x")
    # MAX_FORMAT_CHARS: strftime_now's format and tojson's indent, 256 characters
    assert render("{{ strftime_now('x' * 256) }}") == "x" * 256 and render("{{ [1]|tojson(indent=256) }}") == \
        "[\n" + " " * 256 + "1\n]"
    assert render("{{ [1]|tojson(indent='" + " " * 256 + "') }}") == "[\n" + " " * 256 + "1\n]"
    for source, what in (("{{ strftime_now('x' * n) }}", "strftime_now was given a format"),
                         ("{{ [1]|tojson(indent=n) }}", "tojson was given an indent"),
                         ("{{ [1]|tojson(indent=' ' * n) }}", "tojson was given an indent")):
        with pytest.raises(TokenizerError, match=f"stopped: {what} of more than 256 characters$"):
            render("{% set n = 257 %}" + source)  # n a variable: not folded while compiling


def test_a_template_file_of_the_longest_text_reads_and_one_longer_is_refused_as_too_long(tmp_path):
    emoji = "\U0001F600" * (1 << 20)  # MAX_SOURCE_CHARS characters of 4 bytes each
    for text in (emoji, "\ufeff" + emoji):  # a BOM is not the template's
        (tmp_path / "chat_template.jinja").write_text(text)
        assert len(find(tmp_path, {}, tmp_path / "tokenizer_config.json").render([], {})) == 1 << 20
    # too long, whatever the read's last byte: inside a character ("aa", "a" and one more), or bad UTF-8
    for data in ((emoji + "x").encode(), ("aa" + emoji).encode(), ("a" + emoji + "\U0001F600").encode(),
                 b"x" * 5_000_000, b"x" * ((4 << 20) + 3) + b"\xff", b"x" * 4_500_000 + b"\xff"):
        (tmp_path / "chat_template.jinja").write_bytes(data)
        with pytest.raises(TokenizerError, match="chat_template.jinja: the chat template is longer than 1048576 "):
            find(tmp_path, {}, tmp_path / "tokenizer_config.json")


def test_a_method_call_counts_its_object_and_joins_count_their_parts():
    with pytest.raises(TokenizerError, match="stopped: a call could make 100000000 characters$"):
        render("{{ ('x' * 100000).replace('x', 'y' * 1000) }}")  # the string replaced in is an argument too
    with pytest.raises(TokenizerError, match="stopped: a call could make 100000000 characters$"):
        render("{{ ('x' * 10000).join(range(10000)|map('string')) }}")  # the parts, counted before the join
    assert render("{{ 'abc'.startswith('a') }}{{ '-'.join(['a', 'b']) }}{{ 'a,b'.split(',')|length }}") == "Truea-b2"
    # formats whose widths come from their arguments, within the limit, run as they would
    assert render("{{ '{:>{w}}'.format('x', w=3) }}|{{ '%s-%*d'|format('a', 3, 7) }}|{{ '%s'|format(1) }}") == \
        "  x|a-  7|1"


# -- what renders build in all (issue 30 item 3: many 8 MB values reached 2.1-2.4 GB in one render) --------------
KEPT = "{% set a = 'x' * 8000000 %}"  # a value within the limit, then copies of it, each kept in a variable


def traced_peak(work) -> int:
    """The most bytes Python held at once (all threads) while `work()` ran, over what it held before."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        work()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("copy", ["a[{i}:]", "a + '{i}'", "a ~ {i}", "a|upper", "a.upper()", "[a ~ {i}]|first"])
def test_what_one_render_builds_in_all_is_bounded(copy):
    source = KEPT + "".join(f"{{% set b{i} = {copy.format(i=i)} %}}" for i in range(12))
    stopped = f"^T.jinja: the chat template stopped: it built more than {chat_template.MAX_RENDER_CHARS} " \
              "characters in all$"

    def work():
        with pytest.raises(TokenizerError, match=stopped):
            render(source)

    assert traced_peak(work) < chat_template.MAX_RENDER_CHARS + 2 * MAX  # 12 copies: 104 MB held before the bound


def test_a_long_chat_through_a_template_that_copies_it_renders():
    # a chat of nearly the longest text, each message copied a few times (a slice, strip, +), is within the bound
    messages = [{"role": ("user", "assistant")[i % 2], "content": " x" * (MAX // 420)} for i in range(199)]
    assert len(render(LLAMA2_TEMPLATE, [{"role": "system", "content": "Be brief."}, *messages], bos_token="<s>",
                      eos_token="</s>")) > 0.9 * MAX


def test_renders_take_turns_so_that_together_they_hold_what_two_may(monkeypatch):
    # four chat requests at once held 1.77 GB: each holds what it built until its time runs out
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.3)
    template = ChatTemplate(KEPT + "{% set b = a ~ 1 %}{% for i in range(100000) %}{% for j in range(100000) %}"
                            "{% endfor %}{% endfor %}", "T.jinja")  # 16 MB held until its time runs out
    running, most, enter = [0], [0], chat_template._Budget.__enter__

    def entering(budget):
        running[0] += 1
        most[0] = max(most[0], running[0])
        return enter(budget)

    def leaving(budget, *exc):
        running[0] -= 1
        sys.settrace(budget._previous)
        chat_template._active.budget = None

    monkeypatch.setattr(chat_template._Budget, "__enter__", entering)
    monkeypatch.setattr(chat_template._Budget, "__exit__", leaving)
    errors = []

    def one():
        try:
            template.render(USER, {})
        except TokenizerError as exc:
            errors.append(str(exc))

    def work():
        threads = [threading.Thread(target=one) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    peak = traced_peak(work)
    assert errors == ["T.jinja: the chat template stopped: it ran for more than 0.3 s"] * 4
    assert most[0] == chat_template.MAX_RENDERS == 2
    assert peak < 3 * 16_000_000  # two renders' 16 MB each, never four


# -- chats through a template --------------------------------------------------------------------


@pytest.fixture
def llama2_with_template(tmp_path):
    """The real LLaMA-2 tokenizer.model with Meta's chat template beside it, as its HF repository has them."""
    shutil.copy(shared_path("tokenizers", "llama2", "tokenizer.model"), tmp_path / "tokenizer.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "chat_template": LLAMA2_TEMPLATE}))
    return load_tokenizer(tmp_path), Tokenizer(tmp_path / "tokenizer.model")


def test_sentencepiece_with_meta_template_gives_meta_ids(llama2_with_template):
    # The template's <s> and </s> are read as BOS and EOS, the text between them as sentencepiece reads it: the
    # ids are those of LLaMA-2's own format (Meta's chat_completion), which is what a tokenizer without one uses.
    templated, plain = llama2_with_template
    assert templated.template is not None and plain.template is None
    for messages, system in [(USER, None), (CHAT[1:], None), (CHAT[1:], "Be brief."), (CHAT, None)]:
        assert templated.chat_ids(messages, system=system) == plain.chat_ids(messages, system=system)
    with pytest.raises(PromptError, match="tokenizer_config.json: the chat template refuses these messages"):
        templated.chat_ids([USER[0], USER[0]])


@pytest.mark.parametrize("messages, system, why", [
    ([{"role": "assistant", "content": "x"}], None, "chat has no user message"),
    ([{"role": "tool", "content": "x"}], None, "message 0 has role 'tool'"),
    ([{"role": "user", "content": None}], None, "content of type NoneType"),
    ([CHAT[0], *USER], "Be brief.", "system prompt given twice"),
    ([*USER, CHAT[0]], None, "message 1 has role 'system'; only the first message may"),
    ([{"role": "user", "content": "a\udc80"}], None, "message 0 is not valid Unicode (it holds a lone surrogate)"),
    (USER, "\ud800", "the system prompt is not valid Unicode (it holds a lone surrogate)"),
])
def test_messages_are_checked_before_the_template(llama2_with_template, messages, system, why):
    templated, _ = llama2_with_template
    with pytest.raises(PromptError, match=re.escape(why)):
        templated.chat_ids(messages, system=system)


@pytest.fixture
def model_with_template(tmp_path):
    """A random LLaMA-3-vocabulary model with tiny-llama3's tokenizer.json; its template is the test's to write."""
    cfg = LlamaConfig(vocab_size=506, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_seq_len=64, bos_token_id=500, eos_token_ids=(504,),
                      name="templated")
    write_random(tmp_path, cfg, seed=2)
    shutil.copy(shared_path("golden", "tiny-llama3", "tokenizer.json"), tmp_path / "tokenizer.json")
    return tmp_path


def write_template(directory, source: str) -> None:
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                 "eos_token": "<|eot_id|>", "chat_template": source}))


def test_a_broken_template_is_refused_before_the_weights_load(model_with_template):
    write_template(model_with_template, "{% for m in messages %}")
    (model_with_template / "model.safetensors").write_bytes(b"never read")
    with pytest.raises(TokenizerError, match=r"tokenizer_config.json: the chat template does not compile: .*endfor"):
        cullama.Llama.from_pretrained(model_with_template, device="cpu")


def test_cli_chat_with_a_template_that_raises_is_one_line(model_with_template):
    write_template(model_with_template, "{{ raise_exception('this model does not chat') }}")
    result = CliRunner().invoke(main, ["chat", "--model", str(model_with_template), "--device", "cpu"], input="Hi\n")
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == f"error: {model_with_template / 'tokenizer_config.json'}: the " \
                                                     "chat template refuses these messages: this model does not chat"


SURROGATE_ERROR = "tokenizer_config.json: the chat template made text that is not valid Unicode (character 2 is the " \
                  "lone surrogate U+D800)"


def test_a_lone_surrogate_from_a_template_is_one_line_from_the_cli_and_a_400_from_the_server(model_with_template):
    # issue 30 item 2: a 46-line traceback from the CLI, a TypeError from the library, a 500 from the server
    write_template(model_with_template, "{% for m in messages %}{{ m.content }}{% endfor %}{{ '\\ud800' }}")
    result = CliRunner().invoke(main, ["generate", "--model", str(model_with_template), "--device", "cpu", "--chat",
                                       "Hi"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"error: {model_with_template / SURROGATE_ERROR}"]

    from cullama.server.app import prepare
    from cullama.server.protocol import ApiError, ChatRequest

    llm = cullama.Llama.from_pretrained(model_with_template, device="cpu")
    with pytest.raises(TokenizerError, match=re.escape(SURROGATE_ERROR)):
        llm.chat_ids(USER)
    with pytest.raises(ApiError) as refused:
        prepare(llm, ChatRequest.model_validate({"messages": USER}), chat=True, speculative={})
    assert refused.value.status == 400 and refused.value.message == str(model_with_template / SURROGATE_ERROR)


def test_cli_chat_turns_go_through_the_template(model_with_template):
    write_template(model_with_template, "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
                                        "{{ m.content }}<|eot_id|>{% endfor %}<|start_header_id|>assistant"
                                        "<|end_header_id|>")
    tok = load_tokenizer(model_with_template)
    result = CliRunner().invoke(main, ["chat", "--model", str(model_with_template), "--device", "cpu", "--system",
                                       "Be brief.", "--max-new-tokens", "3", "--json", "--ignore-eos"],
                                input="Hi\nAgain\n")
    assert result.exit_code == 0, result.output
    first, second = (json.loads(line) for line in result.stdout.splitlines())
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "Again"}]
    assert first["prompt_ids"] == tok.chat_ids(history[:1], system="Be brief.")
    assert second["prompt_ids"] == tok.chat_ids(history, system="Be brief.")
