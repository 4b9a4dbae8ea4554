"""The CUDA C sources of cullama's kernels, shipped as package data and compiled at run time by NVRTC."""

from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
