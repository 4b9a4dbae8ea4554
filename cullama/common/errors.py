"""Errors a user can cause. Each message is one line naming the file, tensor or option at fault.

The CLI prints `error: <message>` and exits with the error's `exit_code` for any CullamaError: 2 for bad
input (the default), 1 for a machine that cannot do it now (memory, a full disk, a closed output), and
INTERRUPTED (130) for a Ctrl-C;
anything else is a bug and keeps its traceback.

A message names an option in its reader's terms: written `option("tokenizer")`, str(error) says "the tokenizer
argument" (a Python caller's), `error.for_cli()` says "--tokenizer" (what the CLI prints).
"""

from .untrusted import printable

INTERRUPTED = 130  # the exit code of a Ctrl-C: 128 + SIGINT, as a shell reports a command Ctrl-C stopped
OPTION = "\0"  # brackets an option's Python name inside a message (no path, nor any shown value, holds a NUL)


def option(name: str) -> str:
    """The option `name` (its Python name) inside an error's message, said as the reader knows it."""
    return f"{OPTION}{name}{OPTION}"


def flag(name: str) -> str:
    """The CLI flag of the option `name`: top_p -> --top-p."""
    return "--" + name.replace("_", "-")


class CullamaError(Exception):
    """Base class: a problem with the user's input, reported in one line."""

    exit_code = 2

    def __str__(self) -> str:
        return self._said(lambda name: f"the {name} argument")

    def for_cli(self) -> str:
        """The message as the CLI prints it: each option as its flag."""
        return self._said(flag)

    def _said(self, term) -> str:
        """The message, each option said by `term`, and anything unprintable it interpolated escaped."""
        parts = super().__str__().split(OPTION)
        return printable("".join(term(part) if i % 2 else part for i, part in enumerate(parts)))


class ConfigError(CullamaError):
    """config.json missing, malformed, or describing a model cullama does not run."""


class CheckpointError(CullamaError):
    """A weight file that is missing, truncated, corrupt, or does not match the config."""


class TokenizerError(CullamaError):
    """A tokenizer.model that is missing or unreadable."""


class PromptError(CullamaError):
    """A prompt or generation request that cannot be served (too long, bad options)."""


class OptionError(PromptError):
    """An option of the wrong type or out of range. `option` is its Python name (top_p); the message
    starts with it, and the CLI says it as its flag (--top-p)."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option} {problem}")
        self.option, self.problem = option, problem

    def for_cli(self) -> str:
        parts = self.problem.split(OPTION)  # other options the problem names: their flags too
        problem = "".join(flag(part) if i % 2 else part for i, part in enumerate(parts))
        return printable(f"{flag(self.option)} {problem}")


class SupersededError(CullamaError):
    """A stream read after another generation started on the same model (one generation at a time)."""


class DeviceError(CullamaError):
    """The requested device is not available (no GPU, no CuPy, no NVRTC)."""


class ResourceError(CullamaError):
    """Not enough memory or disk for the request, or an output that cannot be written: exit code 1."""

    exit_code = 1


class KernelError(CullamaError):
    """A CUDA kernel failed to compile, or was asked for a shape it does not support."""


class GenerationError(CullamaError):
    """A generation that cannot go on: the model gave logits no token can be drawn from (all NaN or -inf)."""
