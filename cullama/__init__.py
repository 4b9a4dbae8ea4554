"""cullama: FP16 LLaMA-2 inference on one NVIDIA GPU, hand-written CUDA kernels, lowest latency at batch 1."""

from .config import LlamaConfig, PRESETS, preset
from .errors import CullamaError
from .generate import Generation
from .llama import Llama

__version__ = "0.1.0"
__all__ = ["Llama", "LlamaConfig", "Generation", "CullamaError", "PRESETS", "preset", "__version__"]
