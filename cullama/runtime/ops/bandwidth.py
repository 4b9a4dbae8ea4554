"""Twin of kernels_cu/bandwidth.cu: the streaming read that measures the GPU's HBM read bandwidth."""

from __future__ import annotations

import numpy as np

SOURCE = "bandwidth.cu"
VARIANTS = [()]  # UNROLL 4, the default


def read_sum(data, n_vec, out):
    """out[0] += Σ of the first n_vec 16-byte vectors of `data`, read as float32 (4 per vector)."""
    flat = np.ascontiguousarray(data).reshape(-1).view(np.float32)[: 4 * n_vec]
    out[0] += np.float32(flat.sum(dtype=np.float64))
