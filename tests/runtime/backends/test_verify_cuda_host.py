"""The verify step on the CUDA backend's host code, run on the CPU against tests/fake_cupy.py (its kernels are the
NumPy twins): the same tokens and buffers as the numpy backend bit for bit, one captured graph per k, a few bytes
each way per verify, a step queued ahead accounted for, and the overlapped capture."""

import numpy as np
import pytest

from tests import fake_cupy
from cullama.runtime.backends.cuda_backend import CudaBackend
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.runtime.sampling import SamplingParams
from tests.runtime.backends.test_cuda_host import RecordingPdl, runner_on
from tests.runtime.backends.test_cuda_host import fake as fake  # noqa: F401 - the fixture, as test_cuda_host.py has it
from tests.runtime.test_verify import drafts_from

GREEDY = SamplingParams(seed=0)
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, repetition_penalty=1.1, seed=5)


def plain_tokens(stories_dir, prompt, params, n):
    runner = runner_on(NumpyBackend(), stories_dir)
    return [runner.start(prompt, params)] + [runner.next() for _ in range(n - 1)]


def verify_run(runner, prompt, params, expected, ks, calls=12):
    """start(), then verify calls with k cycling over ks and drafts from a plain run's continuation `expected`
    (wrong from a varying row on odd calls); the tokens, and the buffers after each verdict."""
    tokens, buffers = [runner.start(prompt, params)], []
    for call in range(calls):
        drafts, _ = drafts_from(expected[len(tokens):], ks[call % len(ks)], call, runner.cfg.vocab_size)
        tokens += runner.verify(drafts)
        buffers.append({name: runner.backend.read(name) for name in
                        ("verify_logits", "verify_out", "state", "seen", "x", "k_cache")})
    return tokens, buffers


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_verify_equals_the_numpy_backend_bit_for_bit(fake, stories_dir, params):
    expected = plain_tokens(stories_dir, [1, 403, 407], params, 80)
    (gpu_tokens, gpu_buffers), (cpu_tokens, cpu_buffers) = (
        verify_run(runner_on(backend, stories_dir), [1, 403, 407], params, expected, (1, 2, 4, 8))
        for backend in (CudaBackend(), NumpyBackend()))
    assert gpu_tokens == cpu_tokens and len(gpu_tokens) > 1 + 12
    for gpu, cpu in zip(gpu_buffers, cpu_buffers):
        for name in gpu:
            np.testing.assert_array_equal(gpu[name], cpu[name], err_msg=name)
    if params is GREEDY:  # the plain run's own tokens
        assert gpu_tokens == expected[:len(gpu_tokens)]


def test_one_graph_per_k_and_a_few_bytes_each_way(fake, stories_dir, monkeypatch):
    runner = runner_on(CudaBackend(), stories_dir)
    runner.start([1, 403], GREEDY)
    copies, real_copy = [], fake_cupy.runtime.memcpyAsync
    monkeypatch.setattr(fake_cupy.runtime, "memcpyAsync",
                        lambda dst, src, size, kind, stream: copies.append((kind, size)) or real_copy(dst, src, size,
                                                                                                      kind, stream))
    reads = []
    monkeypatch.setattr(fake_cupy.ndarray, "get", lambda self, stream=None: reads.append(self.shape))
    for call, k in enumerate((2, 5, 2, 5, 5)):
        launched = len(fake.launches)
        runner.verify([3] * k)
        assert copies == [(fake_cupy.runtime.memcpyHostToDevice, 4 * (k + 1)),
                          (fake_cupy.runtime.memcpyDeviceToHost, 4 * (k + 2))]  # ids in, verdict out
        copies.clear()
        plan = runner.verify_plan(k)
        graph = runner.backend.graphs[plan.name]
        assert plan.name == f"verify[{k}]"
        assert len(fake.launches) == launched + (len(plan.launches) if call < 2 else 0)  # captured on first use
        assert [(l.spec, l.grid) for l in graph.launches] == [(l.spec, l.grid) for l in plan.launches]
    assert reads == []  # nothing else read back
    assert sorted(runner.backend.graphs) == ["verify[2]", "verify[5]"]
    assert [g.replays for g in fake.graphs] == [2, 3]


def test_a_step_queued_ahead_is_the_first_verdict(fake, stories_dir):
    """next(ahead=True) leaves a step queued for `last`: verify takes its token as the first result, checks it
    against the first draft, and verifies the other drafts after it only if they agree."""
    gpu, expected = runner_on(CudaBackend(), stories_dir), plain_tokens(stories_dir, [1, 403], GREEDY, 12)
    got = [gpu.start([1, 403], GREEDY), gpu.next(ahead=True)]
    assert gpu._queued is not None
    decode = fake.graphs[0]
    got += gpu.verify(expected[2:6])  # the queued step's token agrees: a verify of 3 drafts after it
    assert gpu._queued is None and decode.replays == 2 and "verify[3]" in gpu.backend.graphs
    assert got == expected[:7]
    got.append(gpu.next(ahead=True))
    got += gpu.verify([(expected[8] + 1) % 512, expected[9]])  # the queued token disagrees: it alone
    assert got == expected[:9] and "verify[1]" not in gpu.backend.graphs
    got.append(gpu.next(ahead=True))
    got += gpu.verify([])
    assert got == expected[:11] and gpu._queued is None
    np.testing.assert_array_equal(gpu.backend.read("state")[0, :3], [2 + 10, expected[10], 11])


def test_the_overlapped_verify_graph_links_every_kernel_but_the_first(fake, stories_dir, monkeypatch):
    import cullama.runtime.backends.pdl as pdl_module
    monkeypatch.setattr(pdl_module, "PdlLauncher", RecordingPdl)
    monkeypatch.setenv("CULLAMA_OVERLAP", "1")
    RecordingPdl.launches = []
    overlapped, expected = runner_on(CudaBackend(), stories_dir), plain_tokens(stories_dir, [1], GREEDY, 6)
    assert overlapped.start([1], GREEDY) == expected[0]
    RecordingPdl.launches = []
    assert overlapped.verify(expected[1:5]) == expected[1:6]
    names = [l.spec.name for l in overlapped.verify_plan(4).launches]
    assert names[0] == "embed_rows_prepared" and RecordingPdl.launches == [(name, True) for name in names[1:]]
