"""fill.cu: synthetic weights from the counter-based RNG, bit for bit the same on the CPU and the GPU."""

import numpy as np
import pytest

from cullama.model import layout as layouts, quant
from cullama.runtime.load import FILL, FILL_QPARAMS, FILL_WORDS, random_weights
from cullama.runtime.ops import fill as twin
from cullama.runtime.sampling import uniform
from tests.conftest import poisoned


def test_uniforms_are_the_samplers_rng():
    u = twin.uniforms(2**64 - 5, 257)
    assert [float(v) for v in u] == [uniform(2**64 - 5, i) for i in range(257)]


def test_fill_has_the_asked_mean_and_spread_and_is_reproducible():
    a, b, c = (np.empty(100_003, np.float16) for _ in range(3))
    twin.fill_uniform(a, a.size, 7, 0.0, 0.02)
    twin.fill_uniform(b, b.size, 7, 0.0, 0.02)
    twin.fill_uniform(c, c.size, 8, 0.0, 0.02)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert abs(a.astype(np.float64).mean()) < 3e-4 and abs(a.astype(np.float64).std() - 0.02) < 3e-4
    assert np.abs(a).max() <= 0.02 * np.sqrt(3) * 1.001


def test_fill_writes_only_n_values():
    out = np.full(10, np.float16(7))
    twin.fill_uniform(out, 6, 1, 1.0, 0.1)
    assert (out[6:] == 7).all() and (np.abs(out[:6] - 1) <= 0.18).all()


def test_synthetic_weights_depend_only_on_the_seed():
    from cullama.runtime.backends.numpy_backend import NumpyBackend
    from cullama.model.config import preset

    first, second = NumpyBackend(), NumpyBackend()
    random_weights(first, preset("tiny"), seed=3)
    random_weights(second, preset("tiny"), seed=3)
    assert all(np.array_equal(first.arrays[k], second.arrays[k]) for k in first.arrays)
    assert not np.array_equal(first.arrays["layers.0.wqkv"], first.arrays["layers.1.wqkv"])


def test_fill_words_are_uniform_bits_from_the_same_stream():
    out = np.zeros(20_001, np.uint32)
    twin.fill_words(out, 20_000, 9)
    u = twin.uniforms(9, 40_000)
    k = (u * 2**24).astype(np.uint32) >> 8  # the top 16 of each 24-bit draw
    assert np.array_equal(out[:20_000], k[0::2] | (k[1::2] << 16)) and out[20_000] == 0
    nibbles = (out[:20_000, None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 15  # every 4-bit code equally likely
    counts = np.bincount(nibbles.ravel(), minlength=16)
    assert counts.min() > 0.95 * counts.mean() and counts.max() < 1.05 * counts.mean()


def test_fill_qparams_pairs_a_uniform_scale_with_the_zero():
    out = np.full((7, 3, 2), np.float16(-1))
    twin.fill_qparams(out, 20, 5, 0.01, 0.001, 8.0)
    scales = np.empty(20, np.float16)
    twin.fill_uniform(scales, 20, 5, 0.01, 0.001)
    flat = out.reshape(-1, 2)
    assert np.array_equal(flat[:20, 0], scales) and (flat[:20, 1] == 8).all() and (flat[20:] == -1).all()


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_synthetic_quantized_weights_spread_like_the_fp16_ones(quantize):
    from cullama.runtime.backends.numpy_backend import NumpyBackend
    from cullama.model.config import preset

    layout, backend = layouts.on_load(preset("tiny"), quantize), NumpyBackend()
    random_weights(backend, layout, seed=3)
    w = quant.dequantize(backend.arrays["layers.1.w_down.qweight"], backend.arrays["layers.1.w_down.qparams"],
                         int(quantize[3:]))
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.003
    assert set(backend.arrays) == {b.name for b in layout.buffers()}


@pytest.mark.gpu
def test_gpu_fill_equals_the_twin_bit_for_bit(kernels):
    import cupy as cp

    n = 1_000_003
    out = poisoned(cp, n + 5, np.float16)
    kernels.function(FILL)((97,), (twin.THREADS,), (out, np.uint64(n), np.uint64(2**63 + 11), np.float32(0.5),
                                                   np.float32(0.25)))
    expected = np.empty(n, np.float16)
    twin.fill_uniform(expected, n, 2**63 + 11, 0.5, 0.25)
    got = out.get()
    assert np.array_equal(got[:n], expected) and np.isnan(got[n:].astype(np.float32)).all()
    words = cp.zeros(n + 3, np.uint32)
    kernels.function(FILL_WORDS)((97,), (twin.THREADS,), (words, np.uint64(n), np.uint64(7)))
    expected_words = np.zeros(n + 3, np.uint32)
    twin.fill_words(expected_words, n, 7)
    assert np.array_equal(words.get(), expected_words)
    pairs = poisoned(cp, (n // 2 + 1, 2), np.float16)
    kernels.function(FILL_QPARAMS)((97,), (twin.THREADS,), (pairs, np.uint64(n // 2), np.uint64(3), np.float32(0.01),
                                                            np.float32(0.002), np.float32(8)))
    expected_pairs = np.full((n // 2 + 1, 2), np.nan, np.float16)
    twin.fill_qparams(expected_pairs, n // 2, 3, 0.01, 0.002, 8.0)
    assert np.array_equal(pairs.get()[:-1], expected_pairs[:-1]) and np.isnan(pairs.get()[-1].astype(np.float32)).all()


@pytest.mark.gpu
def test_gpu_synthetic_weights_equal_the_cpus():
    from cullama.runtime.backends.cuda_backend import CudaBackend
    from cullama.runtime.backends.numpy_backend import NumpyBackend
    from cullama.model.config import preset

    for model in (preset("tiny"), layouts.on_load(preset("tiny"), "int4")):
        cpu, gpu = NumpyBackend(), CudaBackend()
        random_weights(cpu, model, seed=5)
        random_weights(gpu, model, seed=5)
        for name, array in cpu.arrays.items():
            assert np.array_equal(gpu.read(name), array), name
