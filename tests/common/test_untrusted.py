"""Escaping in messages: a name, path or value with control characters (an ANSI escape, a newline, NUL, a C1
control, a bidi override, a line separator, a lone surrogate from undecodable bytes) never reaches a message
raw, however short it is. `shown` escapes (and cuts) what a file holds; every CullamaError escapes whatever its
message interpolated (paths, option values) when it is said, so no message can clear a terminal, colour it,
forge a second line or fail to print."""

from __future__ import annotations

import subprocess
import sys

import pytest

import cullama
from cullama.common import errors
from cullama.common.errors import CheckpointError, ConfigError, OptionError, PromptError
from cullama.common.untrusted import SHOWN_CHARS, printable, shown

NASTY = ["\x1b", "\n", "\r", "\x00", "\t", "\x7f", "\x9b", "\u202e", "\u2028", "\udcff"]
SHORT = ["\x1b[31mred", "a\nb", "nul\x00", "x" * (SHOWN_CHARS - 1) + "\x1b", "\x1b[2J", *NASTY]
IN_MESSAGES = [v for v in SHORT if "\x00" not in v]  # a NUL brackets an option's name (errors.OPTION): never in a path


def clean(text: str) -> bool:
    return text.isprintable()


@pytest.mark.parametrize("value", SHORT + ["\x1b[31m" * 30], ids=repr)
def test_shown_escapes_control_characters_whatever_the_length(value):
    out = shown(value)
    assert clean(out) and len(out) <= SHOWN_CHARS and out != value, out
    assert clean(shown(value, quote=True))
    assert clean(shown([value])) and clean(shown({value: value}))


def test_shown_keeps_a_short_printable_string_and_cuts_a_long_one():
    assert shown("model.layers.0.mlp") == "model.layers.0.mlp" and shown("494", quote=True) == '"494"'
    assert shown("naïve 中文") == "naïve 中文"  # printable non-ASCII stays as it is
    assert shown("x" * SHOWN_CHARS) == "x" * SHOWN_CHARS
    assert len(shown("x" * (SHOWN_CHARS + 1))) == SHOWN_CHARS and shown("x" * 1000).endswith("...")
    assert shown("a\nb") == '"a\\nb"' and shown("\x1b[2J") == '"\\u001b[2J"'
    assert shown("naïve 中文", quote=True) == '"naïve 中文"'  # quoted, not escaped: it is printable
    # 60 characters at most, the JSON spelling's included: 60 whole, 61 cut to 57 and "..."
    assert SHOWN_CHARS == 60 and shown("x" * 60) == "x" * 60 and shown("x" * 61) == '"' + "x" * 56 + "..."
    assert shown("a\n" + "x" * 55) == '"a\\n' + "x" * 55 + '"'  # its JSON spelling: 60 characters
    assert shown("a\n" + "x" * 56) == '"a\\n' + "x" * 53 + "..."


@pytest.mark.parametrize("value", SHORT, ids=repr)
def test_printable_escapes_each_control_character_and_keeps_the_rest(value):
    out = printable(value)
    assert clean(out) and out != value
    assert printable("plain text, naïve 中文 (ok)") == "plain text, naïve 中文 (ok)"
    assert printable("a\x1b[31mb\nc") == "a\\u001b[31mb\\nc"


@pytest.mark.parametrize("error", [ConfigError, CheckpointError, PromptError, errors.TokenizerError,
                                   errors.ResourceError, errors.KernelError, errors.DeviceError])
@pytest.mark.parametrize("value", IN_MESSAGES, ids=repr)
def test_every_error_says_its_message_escaped(error, value):
    exc = error(f"/models/{value}/config.json: no such file ({errors.option('tokenizer')})")
    for said in (str(exc), exc.for_cli()):
        assert clean(said) and "no such file" in said, said
    assert exc.for_cli().endswith("(--tokenizer)") and str(exc).endswith("(the tokenizer argument)")


@pytest.mark.parametrize("value", IN_MESSAGES, ids=repr)
def test_an_option_error_says_its_value_escaped(value):
    exc = OptionError("top_p", f"must be a number, got {value}")
    assert clean(str(exc)) and clean(exc.for_cli()) and exc.for_cli().startswith("--top-p must be")


# ---- where a path or a name reaches a message ----------------------------------------------------------------
def test_a_model_directory_with_control_characters_is_named_escaped(tmp_path):
    missing = tmp_path / "m\x1b[31m\nx"
    with pytest.raises(ConfigError, match="no such model directory") as info:
        cullama.Llama.from_pretrained(missing, device="cpu")
    assert clean(str(info.value)) and clean(info.value.for_cli()) and "\\u001b[31m\\nx" in str(info.value)
    empty = tmp_path / "ok\x1b[2J"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json") as info:
        cullama.Llama.from_pretrained(empty, device="cpu")
    assert clean(str(info.value))


def test_a_weights_file_with_control_characters_in_its_name_is_named_escaped(stories_dir, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((stories_dir / "config.json").read_text())
    (model / "w\x1b[2J\x9b.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as info:
        cullama.Llama.from_pretrained(model, device="cpu", tokenizer=stories_dir / "tokenizer.model")
    assert clean(str(info.value)) and "w\\u001b[2J\\u009b.safetensors" in str(info.value)


def test_the_cli_prints_one_clean_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", "from cullama.cli.main import main; main()", "generate", "--device",
                           "cpu", "--model", str(tmp_path / "m\x1b[31m\nx"), "hi"], capture_output=True, text=True,
                           timeout=120)
    assert done.returncode == 2 and "\x1b" not in done.stderr
    assert done.stderr.endswith("\\u001b[31m\\nx: no such model directory\n")
    assert [line[:7] for line in done.stderr.splitlines()] == ["error: "]


def test_a_model_name_in_a_request_is_echoed_escaped_and_short():
    pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[test]')")
    from cullama.server.app import Settings, check_model
    from cullama.server.protocol import ApiError

    settings = Settings(model_name="stories260K", context=512)
    for name in ("\x1b[2J\nevil", "x" * 100_000):
        with pytest.raises(ApiError) as info:
            check_model(name, settings)
        assert info.value.status == 404 and clean(info.value.message) and len(info.value.message) < 200


def test_a_json_file_is_read_up_to_64_mib_and_refused_past_it(tmp_path):
    """Sparse files of exactly 64 MiB (read, then refused as JSON: they are NULs) and one byte more (refused for
    its size, before parsing)."""
    from cullama.common.untrusted import MAX_JSON_BYTES, read_json

    assert MAX_JSON_BYTES == 64 << 20  # the documented limit
    for size, words in ((64 << 20, "not valid JSON"), ((64 << 20) + 1, "larger than 64 MiB")):
        file = tmp_path / f"{size}.json"
        with open(file, "wb") as fh:
            fh.truncate(size)
        with pytest.raises(ConfigError, match=words):
            read_json(file, ConfigError)
