"""The CUDA backend's host code (cuda_backend, load_checkpoint's GPU branch, random_weights' fill kernel,
graph capture and replay, the pinned token read) run end to end on the CPU: CuPy is tests/fake_cupy.py,
whose kernels are the NumPy twins, so every result must equal the numpy backend's bit for bit."""

import ctypes

import numpy as np
import pytest

from tests import fake_cupy
from tests.conftest import load_golden
from cullama import Llama
from cullama.runtime import plan as plans
from cullama.runtime.backends.cuda_backend import CudaBackend
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.runtime.engine import PlanRunner
from cullama.model.layout import device_config
from cullama.runtime.load import FILL, load_checkpoint
from cullama.common.errors import KernelError, PromptError
from cullama.runtime.sampling import SamplingParams

GREEDY = SamplingParams(seed=0)


@pytest.fixture
def fake(monkeypatch):
    return fake_cupy.install(monkeypatch)


def runner_on(backend, directory, max_seq=None):
    ckpt = open_checkpoint(directory)
    load_checkpoint(backend, ckpt)
    return PlanRunner(ckpt.config, backend, max_seq or ckpt.config.max_seq_len)


def weights_equal(a, b, cfg):
    for buffer in plans.weight_buffers(device_config(cfg)):
        np.testing.assert_array_equal(a.read(buffer.name), b.read(buffer.name), err_msg=buffer.name)


def test_stories260k_equals_the_numpy_backend_bit_for_bit(fake, stories_dir, stories_expected):
    llm = Llama.from_pretrained(stories_dir, device="cuda")
    gpu, cpu = llm.runner, Llama.from_pretrained(stories_dir, device="cpu").runner
    assert isinstance(gpu.backend, CudaBackend) and gpu.cfg.intermediate_size == 176  # padded from 172
    weights_equal(gpu.backend, cpu.backend, gpu.cfg)
    w_down, w_gate_up = gpu.backend.read("layers.0.w_down"), gpu.backend.read("layers.0.w_gate_up")
    assert not w_down[:, 172:].any() and not w_gate_up[172:176].any() and w_gate_up[176:348].any()
    assert llm.generate([1], max_new_tokens=40, ignore_eos=True).token_ids == stories_expected["ids"][:40]
    tokens = {r: [r.start([1], GREEDY)] for r in (gpu, cpu)}
    for _ in range(39):
        for r in (gpu, cpu):
            tokens[r].append(r.next())
        np.testing.assert_array_equal(gpu.backend.read("logits"), cpu.backend.read("logits"))
        np.testing.assert_array_equal(gpu.backend.read("state"), cpu.backend.read("state"))
    assert tokens[gpu] == tokens[cpu] == stories_expected["ids"][:40]
    assert all(l.stream is gpu.backend.stream for l in fake.launches)  # never the legacy stream


def test_decode_graph_is_captured_once_and_replayed_per_token(fake, stories_dir):
    runner = runner_on(CudaBackend(), stories_dir)
    stream = runner.backend.stream
    assert stream.non_blocking and stream.ptr != 0
    first = runner.start([1, 403], GREEDY)
    assert fake.graphs == [] and not any(l.captured for l in fake.launches)
    eager, ran = len(fake.launches), len(fake.runs)
    tokens = [runner.next() for _ in range(6)]
    (graph,) = fake.graphs  # one capture, on the first next()
    assert runner.backend.graphs == {"decode": graph} and graph.replays == 6
    n = len(graph.launches)  # during next(): the capture, nothing launched eagerly
    assert len(fake.launches) == eager + n and all(a is b for a, b in zip(fake.launches[eager:], graph.launches))
    assert all(l.captured and l.stream is stream for l in graph.launches)
    assert [(l.spec, l.grid, l.block[0]) for l in graph.launches] == \
        [(l.spec, l.grid, l.block) for l in runner.decode.launches]
    for launch, planned in zip(graph.launches, runner.decode.launches):  # the plan's buffers, not copies
        for arg, ref in zip(launch.args, planned.args):
            if isinstance(ref, plans.Ref):
                assert np.shares_memory(arg, runner.backend.arrays[ref.name])
    replayed = fake.runs[ran:]
    assert len(replayed) == 6 * n
    for i in range(6):  # each replay ran the captured launches, the same argument objects, in order
        assert all(ran is captured for ran, captured in zip(replayed[i * n:(i + 1) * n], graph.launches))
    assert int(runner.backend.read("state")[0, 0]) == 2 + 6  # the position advanced on the device
    cpu = runner_on(NumpyBackend(), stories_dir)
    assert [first] + tokens == [cpu.start([1, 403], GREEDY)] + [cpu.next() for _ in range(6)]


def test_the_fake_enforces_capture_rules(fake):
    backend = CudaBackend()
    kernel, out = fake_cupy.Kernel(FILL), fake_cupy.zeros((4,), "float16")
    args = (out, np.uint64(4), np.uint64(1), np.float32(1), np.float32(0.1))
    with pytest.raises(TypeError):
        kernel((1, 1, 1), (256, 1, 1), (out, 4, 1, 0.0, 1.0))  # Python scalars: not a kernel's types
    with backend.stream:
        backend.stream.begin_capture()
        kernel((1, 1, 1), (256, 1, 1), args)
    with pytest.raises(fake_cupy.CaptureError):
        kernel((1, 1, 1), (256, 1, 1), args)  # outside the stream context: the legacy stream
    with pytest.raises(fake_cupy.CaptureError):
        backend.stream.synchronize()
    with pytest.raises(fake_cupy.CaptureError, match="Invalidated"):
        backend.stream.end_capture()  # those failures invalidated the capture, as in CUDA
    with backend.stream:
        backend.stream.begin_capture()
        kernel((1, 1, 1), (256, 1, 1), args)
    graph = backend.stream.end_capture()
    assert not out.get(stream=backend.stream).any()  # captured, not run
    graph.launch(stream=backend.stream)
    assert not out.get().any()  # queued on backend.stream: the legacy stream's get does not wait for it
    assert out.get(stream=backend.stream).all()


def test_synthetic_tiny_equals_the_cpu_weights_and_tokens(fake):
    gpu, cpu = Llama.synthetic("tiny", device="cuda"), Llama.synthetic("tiny", device="cpu")
    buffers = plans.weight_buffers(device_config(gpu.config))
    assert [l.spec for l in fake.launches[:len(buffers)]] == [FILL] * len(buffers)
    weights_equal(gpu.runner.backend, cpu.runner.backend, gpu.config)
    for options in ({}, {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}):
        ids = [llm.generate([1, 5, 9], max_new_tokens=8, ignore_eos=True, **options).token_ids for llm in (gpu, cpu)]
        assert ids[0] == ids[1]


@pytest.mark.parametrize("name", ["tiny-gqa-sharded", "tiny-llama3", "tiny-qwen2", "tiny-mistral"])
def test_golden_logits_equal_the_cpu_path(fake, name):
    """Every golden family through the CUDA backend's host code (BF16 converted on load, Qwen2's biases, Mistral's
    window): its logits and greedy ids the numpy backend's, bit for bit."""
    directory, cases, _ = load_golden(name)
    gpu, cpu = (Llama.from_pretrained(directory, device=d) for d in ("cuda", "cpu"))
    for case in cases:
        np.testing.assert_array_equal(gpu.logits(case["prompt_ids"]), cpu.logits(case["prompt_ids"]))
    ids = [llm.generate(cases[0]["prompt_ids"], max_new_tokens=12, ignore_eos=True).token_ids for llm in (gpu, cpu)]
    assert ids[0] == ids[1]


def test_prefix_reuse_and_the_full_context_match_numpy(fake, stories_dir):
    results = []
    for backend in (CudaBackend(), NumpyBackend()):
        r = runner_on(backend, stories_dir, max_seq=24)
        first = [r.start([1, 403, 407], GREEDY)] + [r.next() for _ in range(8)]
        follow_up = [1, 403, 407] + first[:5] + [400, 378]  # shares 8 ids with the cache
        first.append(r.start(follow_up, GREEDY, reuse=True))
        assert (8, 2, "sample", r.prefill_kernels) in r._prefills  # only what the cache did not hold was prefilled
        logits = backend.read("logits")
        while len(r.cached) < 24:
            first.append(r.next())
        with pytest.raises(PromptError, match="full"):
            r.next()
        with pytest.raises(PromptError):
            r.start(list(range(1, 25)), GREEDY)
        results.append((first, logits, backend.read("state"), backend.read("k_cache")))
    for gpu, cpu in zip(*results):
        np.testing.assert_array_equal(gpu, cpu)
    assert fake.graphs[0].replays == 8 + 24 - 10  # the full-context guard stops before replaying


def test_a_plan_is_resolved_once_and_reused(fake, stories_dir, monkeypatch):
    runner = runner_on(CudaBackend(), stories_dir)
    resolved = []
    real = CudaBackend._arg
    monkeypatch.setattr(CudaBackend, "_arg", lambda self, a: resolved.append(a) or real(self, a))
    first = runner.start([1, 403, 407], GREEDY)
    count = len(resolved)
    assert count > 0
    assert runner.start([1, 403, 407], GREEDY) == first  # the same prefill plan again: nothing re-resolved
    assert len(resolved) == count


class RecordingPdl:
    """Stands in for backends.pdl.PdlLauncher: checks the parameter array it would pass the driver, notes
    each launch as overlapped (with its plan's stream capturing or not) and launches it on the fake."""

    launches: list = []  # (kernel name, captured) per overlapped launch

    def __init__(self):
        from cullama.runtime.backends.pdl import kernel_params
        self.kernel_params = kernel_params

    def prepare(self, fn, grid, block, args, stream_ptr, smem=0):
        params, _ = self.kernel_params(args)
        assert len(params) == len(args)
        for value, arg in zip(params, args):
            if not isinstance(arg, np.generic):  # device arrays: their address
                assert ctypes.cast(value, ctypes.POINTER(ctypes.c_void_p)).contents.value == arg.data.ptr

        def launch():
            assert stream_ptr == fake_cupy.get_current_stream().ptr
            RecordingPdl.launches.append((fn.spec.name, fake_cupy.state.capturing is not None))
            fn(grid, block, args, shared_mem=smem)

        return launch


def test_overlap_links_every_kernel_but_each_plans_first_and_changes_no_token(fake, stories_dir, monkeypatch):
    import cullama.runtime.backends.pdl as pdl_module
    monkeypatch.setattr(pdl_module, "PdlLauncher", RecordingPdl)
    RecordingPdl.launches = []
    plain = runner_on(CudaBackend(overlap=False), stories_dir)
    monkeypatch.setenv("CULLAMA_OVERLAP", "1")
    overlapped = runner_on(CudaBackend(), stories_dir)
    assert overlapped.backend.overlap and not plain.backend.overlap
    tokens = {r: [r.start([1, 403], GREEDY)] + [r.next() for _ in range(6)] for r in (plain, overlapped)}
    assert tokens[plain] == tokens[overlapped]
    np.testing.assert_array_equal(plain.backend.read("logits"), overlapped.backend.read("logits"))
    (prefill,) = overlapped._prefills.values()
    decode = [l.spec.name for l in overlapped.decode.launches]
    # the prefill chunk eagerly, then the decode step's capture: each plan's first launch is plain
    assert RecordingPdl.launches == [(l.spec.name, False) for l in prefill.launches[1:]] + \
        [(name, True) for name in decode[1:]]
    overlapped.backend.set_overlap(False)  # a captured graph is dropped, and the next capture is plain
    assert overlapped.backend.graphs == {}
    count = len(RecordingPdl.launches)
    overlapped.next()
    overlapped.start([1, 403], GREEDY)
    assert len(RecordingPdl.launches) == count and len(fake.graphs) == 3


def test_overlap_stays_off_before_sm_90(fake, monkeypatch):
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "80")
    assert not CudaBackend(overlap=True).overlap


def test_a_step_queued_ahead_runs_before_its_token_is_asked_for(fake, stories_dir):
    runner, cpu = runner_on(CudaBackend(), stories_dir, max_seq=24), runner_on(NumpyBackend(), stories_dir, max_seq=24)
    prompt = [1, 403, 407]
    expected = [cpu.start(prompt, GREEDY)] + [cpu.next() for _ in range(21)]
    got = [runner.start(prompt, GREEDY)]
    for i in range(10):
        got.append(runner.next(ahead=True))
        assert fake.graphs[0].replays == i + 2  # this token's step and the one queued behind it
    runner.drain()  # waits for the queued step; its token is kept for the next call
    replays = fake.graphs[0].replays
    got.append(runner.next())
    assert fake.graphs[0].replays == replays  # nothing launched: the drained step's token
    while len(runner.cached) < 23:
        got.append(runner.next(ahead=True))
    assert fake.graphs[0].replays == 21  # positions 3..23: the last one queued ahead
    got.append(runner.next(ahead=True))  # position 23, the context's last: nothing queued behind it
    assert got == expected and len(runner.cached) == 24 and fake.graphs[0].replays == 21
    with pytest.raises(PromptError, match="full"):
        runner.next(ahead=True)
    assert runner.start(prompt, GREEDY) == expected[0]


def test_generation_queues_ahead_and_drains_at_a_stop(fake, stories_dir):
    gpu, cpu = (Llama.from_pretrained(stories_dir, device=d) for d in ("cuda", "cpu"))
    for options in ({"max_new_tokens": 30}, {"max_new_tokens": 30, "stop": [" the"]}):
        outs = [llm.generate([1], ignore_eos=True, **options) for llm in (gpu, cpu)]
        assert outs[0].token_ids == outs[1].token_ids and outs[0].text == outs[1].text
    assert outs[0].finish_reason == "stop"
    assert gpu.runner._queued is not None  # stopped with a step queued: drained, kept, unused
    assert not gpu.runner.backend.stream.pending  # drain ran it
    second = gpu.generate([1], max_new_tokens=5, ignore_eos=True).token_ids
    assert second == cpu.generate([1], max_new_tokens=5, ignore_eos=True).token_ids


def test_the_wgmma_prefill_launches_with_its_shared_memory_allowed(fake, stories_dir, monkeypatch):
    """gemm_wgmma needs ~200 KB of dynamic shared memory: the backend raises each kernel's limit once, before
    its first launch (the fake refuses a launch above the limit, as CUDA does), and launches with it."""
    from functools import partial

    from cullama.runtime.backends import func_attr
    from cullama.runtime.prefill_kernels import WGMMA_GEMM, PrefillKernels

    allowed = []
    real = partial(func_attr.allow_dynamic_shared, library=fake_cupy.libcuda)
    monkeypatch.setattr(func_attr, "allow_dynamic_shared", lambda fn, n: allowed.append((fn.spec, n)) or real(fn, n))
    gpu, cpu = runner_on(CudaBackend(), stories_dir), runner_on(NumpyBackend(), stories_dir)
    gpu.set_prefill_kernels(PrefillKernels(gemm="wgmma", attention="mma"))
    prompt = [1, 403, 407, 261, 378, 43]
    assert gpu.start(prompt, GREEDY) == cpu.start(prompt, GREEDY)
    assert gpu.start(prompt + [9], GREEDY) == cpu.start(prompt + [9], GREEDY)
    assert allowed == [(WGMMA_GEMM.spec, WGMMA_GEMM.smem)]  # once: the same loaded kernel for every launch
    wgmma = [l for l in fake.launches if l.spec == WGMMA_GEMM.spec]
    assert wgmma and all(l.shared_mem == WGMMA_GEMM.smem and l.block == (WGMMA_GEMM.threads, 1, 1) for l in wgmma)
    monkeypatch.setattr(fake_cupy.device, "compute_capability", "80")
    with pytest.raises(KernelError, match="needs an sm_90 GPU"):
        runner_on(CudaBackend(), stories_dir).set_prefill_kernels(PrefillKernels(gemm="wgmma"))
