"""cullama: FP16 LLaMA-2 inference on one NVIDIA GPU, hand-written CUDA kernels, lowest latency at batch 1.

The map. Each folder has one job and imports only the folders listed above it (tests/test_layers.py holds every
import to it, and finds any circle):

    common/      the error types and the reading of untrusted input                      imports nothing of cullama
    model/       the model on disk and in host memory: config, checkpoint readers (safetensors, AWQ, GPTQ),
                 the quantized format, the device layout, host weights, the FP32 reference        imports common
    text/        text and token ids: tokenizers, chat templates, stop strings                     imports common
    runtime/     running the model: the kernel registry (NVRTC), the device, plans (launches as data), the
                 engine, the backends (CUDA graphs, NumPy), the kernels' twins (ops/), the CPU executor (emu/),
                 sampling and log-probabilities as the kernels compute them, weights onto the device
                                                                                           imports model, common
    generation/  the token loops over a runner: generate / stream, speculative decoding and its drafters,
                 batches                                                  imports runtime, text, model, common
    llama.py     Llama, the one class a user holds: load, generate, stream, chat      imports generation and below
    bench/       the benchmarks of record: `cullama bench` (latency, batch, speculative) and `cullama kernels`
                                                                                     imports generation and below
    server/      `cullama serve`: the OpenAI-compatible HTTP API                 imports llama.py and below
    cli/         (the repo's top-level cli/, installed as cullama.cli) the commands          imports all the above
    kernels_cu/  (top-level, installed as cullama.kernels_cu) the CUDA C sources the registry compiles

This module itself holds the version and the public names, imported on first use; it imports nothing else.
"""

import importlib
import importlib.util

__version__ = "0.1.0"
__all__ = ["Llama", "LlamaConfig", "Generation", "CullamaError", "PRESETS", "preset", "__version__"]

# The public names are imported on first use (PEP 562), not with the package: `cullama` on the command line
# imports nothing heavy before its Ctrl-C handling is in place, so an early Ctrl-C exits 130 in one line.
_HOMES = {"Llama": "llama", "LlamaConfig": "model.config", "PRESETS": "model.config", "preset": "model.config",
          "Generation": "generation.generate", "CullamaError": "common.errors"}


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
