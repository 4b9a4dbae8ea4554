"""Errors a user can cause. Each message is one line naming the file, tensor or option at fault.

The CLI prints `error: <message>` and exits non-zero for any CullamaError; anything else is a bug
and keeps its traceback.
"""


class CullamaError(Exception):
    """Base class: a problem with the user's input, reported in one line."""


class ConfigError(CullamaError):
    """config.json missing, malformed, or describing a model cullama does not run."""


class CheckpointError(CullamaError):
    """A weight file that is missing, truncated, corrupt, or does not match the config."""


class TokenizerError(CullamaError):
    """A tokenizer.model that is missing or unreadable."""


class PromptError(CullamaError):
    """A prompt or generation request that cannot be served (too long, bad options)."""


class DeviceError(CullamaError):
    """The requested device is not available (no GPU, no CuPy, no NVRTC)."""


class KernelError(CullamaError):
    """A CUDA kernel failed to compile, or was asked for a shape it does not support."""


class GenerationError(CullamaError):
    """A generation that cannot go on: the model gave logits no token can be drawn from (all NaN or -inf)."""
