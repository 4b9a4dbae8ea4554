"""Twin of kernels_cu/fill.cu: counter-based uniform weights, bit for bit the kernel's."""

from __future__ import annotations

import numpy as np

SOURCE = "fill.cu"
VARIANTS = [()]
THREADS = 256
GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)


def uniforms(seed: int, n: int) -> np.ndarray:
    """float32 [n]: uniform(seed, i) for i < n (cullama.sampling.uniform, vectorised)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64, as on the device
        z = np.uint64(seed) * GOLDEN64 + np.arange(n, dtype=np.uint64) + np.uint64(1)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def fill_uniform(out, n, seed, mean, std):
    """out.flat[:n] = float16(mean + std * sqrt(3) * (2u - 1)), each step rounded in float32."""
    half_width = np.float32(std) * np.float32(1.7320508)
    u = uniforms(seed, n)
    values = np.float32(mean) + half_width * (np.float32(2.0) * u - np.float32(1.0))
    out.reshape(-1)[:n] = values.astype(np.float16)
