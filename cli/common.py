"""What every `cullama` command shares: one line and an exit code for any error (friendly_errors), printing
that survives a closed or full standard output (out), the click classes of the group and its commands (--help
printed through out), and the options several commands take (NonEmptyPath, --quantize, --prefill-chunk)."""

from __future__ import annotations

import functools
import os
import sys

import click

from .. import __version__
from ..common.errors import INTERRUPTED, CullamaError, PromptError, ResourceError


def note(text: str) -> None:
    click.echo(f"note: {text}", err=True)


def option_file(file: str, flag: str) -> str:
    """The text of the file an option names (--json-schema FILE, --grammar FILE); one line naming both where it
    cannot be read."""
    from pathlib import Path

    try:
        return Path(file).read_text(encoding="utf-8")
    except OSError as exc:
        raise PromptError(f"cannot read {flag} {file}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PromptError(f"{flag} {file} is not UTF-8 text") from None


def friendly_errors(command):
    """A CullamaError becomes one line and its exit code, Ctrl-C exit code 130: never a traceback. The
    options it names are said as their flags (--top-p, not top_p)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except CullamaError as exc:
            click.echo(f"error: {exc.for_cli()}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(INTERRUPTED)

    return wrapper


def require_stdout() -> None:
    """ResourceError (exit 1) where standard output is closed (`>&-`): Python then has no sys.stdout, and click
    would print into nothing. The commands that print their result call it first, before any work."""
    if sys.stdout is None:
        raise ResourceError("cannot write to standard output: it is closed")


def out(text: str, nl: bool = True) -> None:
    """Text to standard output, flushed; a full disk, a closed pipe or a closed stdout is a ResourceError
    (exit 1)."""
    require_stdout()
    try:
        click.echo(text, nl=nl)
    except OSError as exc:
        _discard_stdout()
        raise ResourceError(f"cannot write to standard output: {exc.strerror or exc}") from None


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null, so that Python's own flush at exit does not fail a second time
    and print a traceback of its own."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a real file (a test runner's buffer): nothing is flushed at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def show_help(ctx, param, value) -> None:
    """click's --help, written through out(): a full disk or a closed pipe is one line, exit 1."""
    if value and not ctx.resilient_parsing:
        out(ctx.get_help())
        ctx.exit()


def show_version(ctx, param, value) -> None:
    """click's --version, written through out()."""
    if value and not ctx.resilient_parsing:
        out(f"cullama, version {__version__}")
        ctx.exit()


class HelpThroughOut:
    """A click command whose --help prints with show_help."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.callback = show_help
        return option


class Command(HelpThroughOut, click.Command):
    """Every `cullama` command (the group's command_class)."""


class Group(HelpThroughOut, click.Group):
    """The `cullama` group. Its parsing (--help and --version included) and every command it runs go through
    friendly_errors, so no command can miss it."""

    command_class = Command

    def make_context(self, *args, **kwargs):
        return friendly_errors(super().make_context)(*args, **kwargs)

    def invoke(self, ctx):
        return friendly_errors(super().invoke)(ctx)


class NonEmptyPath(click.Path):
    """click.Path, but an empty value is refused in one line naming the flag: `--model ""` would otherwise name
    the current directory, and load whatever checkpoint is there."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value:
            flag = param.opts[0] if param is not None else "a path"
            raise PromptError(f"{flag} is empty: name a path (\".\" for the current directory)")
        return super().convert(value, param, ctx)


# --quantize of generate, chat, serve and bench (a value it does not list is refused by click, exit 2)
QUANTIZE = click.option("--quantize", type=click.Choice(["int8", "int4"]),
                        help="Quantize an FP16 / BF16 / FP32 checkpoint's linear weights on load: int8 per output "
                             "channel, int4 in groups of 128 (AWQ and GPTQ checkpoints run as they are stored).")

# --prefill-chunk of generate, chat, serve and bench (cullama.runtime.plan.MAX_PREFILL_CHUNK is its top)
PREFILL_CHUNK = click.option(
    "--prefill-chunk", type=click.IntRange(1, 4096),
    help="Prompt tokens per prefill pass; a prompt's answer can depend on it [default: 256 with --max-batch 1, "
         "else sized so that a joining prompt keeps the running requests within about two decode steps "
         "between tokens: 64 for a 7B model in FP16]. `cullama generate --prefill-chunk N` gives the answers of a "
         "server whose ready line says prefill chunk N.")


# --model of every command that takes one: a checkpoint directory or a HuggingFace hub id (cullama/model/hub.py)
MODEL_HELP = "HF LLaMA checkpoint directory, or a HuggingFace hub id (org/name: read from the local hub cache, " \
             "downloaded where missing; the hub extra)."
# --revision, beside it
REVISION = click.option("--revision", help="The hub id's branch, tag or commit id [default: its default branch].")
