"""fill.cu: synthetic weights from the counter-based RNG, bit for bit the same on the CPU and the GPU."""

import numpy as np
import pytest

from cullama.weights import FILL, random_weights
from cullama.ops import fill as twin
from cullama.sampling import uniform
from conftest import poisoned


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
    from cullama.backends.numpy_backend import NumpyBackend
    from cullama.config import preset

    first, second = NumpyBackend(), NumpyBackend()
    random_weights(first, preset("tiny"), seed=3)
    random_weights(second, preset("tiny"), seed=3)
    assert all(np.array_equal(first.arrays[k], second.arrays[k]) for k in first.arrays)
    assert not np.array_equal(first.arrays["layers.0.wqkv"], first.arrays["layers.1.wqkv"])


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


@pytest.mark.gpu
def test_gpu_synthetic_weights_equal_the_cpus():
    from cullama.backends.cuda_backend import CudaBackend
    from cullama.backends.numpy_backend import NumpyBackend
    from cullama.config import preset

    cpu, gpu = NumpyBackend(), CudaBackend()
    random_weights(cpu, preset("tiny"), seed=5)
    random_weights(gpu, preset("tiny"), seed=5)
    for name, array in cpu.arrays.items():
        assert np.array_equal(gpu.read(name), array), name
