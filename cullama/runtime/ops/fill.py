"""Twin of kernels_cu/fill.cu: counter-based synthetic weights, bit for bit the kernels'."""

from __future__ import annotations

import numpy as np

SOURCE = "fill.cu"
VARIANTS = [()]
THREADS = 256
GOLDEN64 = np.uint64(0x9E3779B97F4A7C15)


def uniforms(seed: int, n: int) -> np.ndarray:
    """float32 [n]: uniform(seed, i) for i < n (cullama.runtime.sampling.uniform, vectorised)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64, as on the device
        z = np.uint64(seed) * GOLDEN64 + np.arange(n, dtype=np.uint64) + np.uint64(1)
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))


def _values(n, seed, mean, std) -> np.ndarray:
    """float32 [n]: mean + std * sqrt(3) * (2u - 1), each step rounded in float32."""
    half_width = np.float32(std) * np.float32(1.7320508)
    return np.float32(mean) + half_width * (np.float32(2.0) * uniforms(seed, n) - np.float32(1.0))


def fill_uniform(out, n, seed, mean, std):
    """out.flat[:n] = float16(mean + std * sqrt(3) * (2u - 1)), each step rounded in float32."""
    out.reshape(-1)[:n] = _values(n, seed, mean, std).astype(np.float16)


def fill_words(out, n, seed):
    """out.flat[:n] (uint32) = the top 16 bits of uniform's 24 at counter 2i, then 2i + 1 in the high half."""
    bits16 = (uniforms(seed, 2 * n) * np.float32(1 << 24)).astype(np.uint32) >> np.uint32(8)  # [2n]
    out.reshape(-1)[:n] = bits16[0::2] | (bits16[1::2] << np.uint32(16))


def fill_qparams(out, pairs, seed, mean, std, zero):
    """out [.., 2] FP16 pairs: (fill_uniform's value i, zero) for the first `pairs` pairs."""
    flat = out.reshape(-1, 2)
    flat[:pairs, 0] = _values(pairs, seed, mean, std).astype(np.float16)
    flat[:pairs, 1] = np.float16(zero)
