"""Twin of kernels_cu/prepare.cuh: the prepared RMSNorm input that a kernel writing a token row of x leaves for the
RMSNorm GEMV that reads x next (gemv_mma.cu's X_PREP), xn = fp16(x * norm_w) and Σ x² in parts of SS_SPAN elements.
Its writers are gemv_residual (ops/gemv_mma.py), sample (ops/sampling.py) and embed_rows_prepared (ops/prefill.py);
its reader is gemv_mma.py's prepared_ss."""

from __future__ import annotations

import numpy as np

from .rows import token_rows

SS_SPAN = 32  # x elements per Σ x² part (prepare.cuh SS_SPAN): the rows of one gemv_residual block


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fmaf(a, b, c) in float32 with one rounding: a b exact in double, the double sum's error (TwoSum) used to break
    the one case where rounding twice differs (a sum that lands on a float32 tie)."""
    p = a.astype(np.float64) * b
    c64 = c.astype(np.float64)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    s = np.where(err != 0, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def prepare(x: np.ndarray, norm_w: np.ndarray, M: int) -> tuple[np.ndarray, np.ndarray]:
    """The prepared input of x [T, M] float32 rows: xn [T, M] float16 = fp16(x * norm_w) and ssp [T, ceil(M / SS_SPAN)]
    float32, part b the fmaf chain of x^2 over elements b SS_SPAN .. in order (each part starting at +0; elements past
    M, +0 here, add +0)."""
    x32 = np.ascontiguousarray(token_rows(x)[:, :M], np.float32)
    xn = (x32 * norm_w[:M].astype(np.float32)).astype(np.float16)
    parts = -(-M // SS_SPAN)
    spans = np.zeros((x32.shape[0], parts * SS_SPAN), np.float32)
    spans[:, :M] = x32
    spans = spans.reshape(x32.shape[0], parts, SS_SPAN)
    ssp = np.zeros((x32.shape[0], parts), np.float32)
    for i in range(SS_SPAN):  # every part's chain at once, element i of each
        ssp = fma32(spans[..., i], spans[..., i], ssp)
    return xn, ssp


def write_prepared(x: np.ndarray, norm_w: np.ndarray, xn: np.ndarray, ssp: np.ndarray, d: int) -> None:
    """xn [T, >= d] and ssp [T, >= ceil(d / SS_SPAN)] rows = prepare(x [T, >= d]) in place."""
    n, parts = prepare(x, norm_w, d)
    token_rows(xn)[:, :d] = n
    token_rows(ssp)[:, :parts.shape[1]] = parts
