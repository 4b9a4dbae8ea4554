"""cullama: FP16 LLaMA-2 inference on one NVIDIA GPU, hand-written CUDA kernels, lowest latency at batch 1.

The map of the package (each folder, its one job, what it may import) is the README's "Development" section;
tests/test_layers.py holds every import to it.

This module itself holds the version and the public names, imported on first use; it imports nothing else.
"""

import importlib
import importlib.util

__version__ = "0.1.0"
__all__ = ["Llama", "LlamaConfig", "Generation", "CullamaError", "Constraint", "PRESETS", "preset", "__version__"]

# The public names are imported on first use (PEP 562), not with the package: `cullama` on the command line
# imports nothing heavy before its Ctrl-C handling is in place, so an early Ctrl-C exits 130 in one line.
_HOMES = {"Llama": "llama", "LlamaConfig": "model.config", "PRESETS": "model.config", "preset": "model.config",
          "Generation": "generation.generate", "CullamaError": "common.errors", "Constraint": "text.grammar"}


def __getattr__(name: str):
    if name not in _HOMES:  # a subpackage, as `import cullama; cullama.model.config.LlamaConfig` reads it
        if name.startswith("_") or importlib.util.find_spec(f"{__name__}.{name}") is None:
            raise AttributeError(f"module 'cullama' has no attribute {name!r}")
        return importlib.import_module(f".{name}", __name__)
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # imported once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
