"""Batched decoding through the CUDA backend: its host code on the CPU against tests/fake_cupy.py (the `fake`
fixture: the NumPy twins as kernels), and the GPU test (marked gpu) that CULLAMA_FAKE_GPU=emu runs on the real
kernels (tests/runtime/emu/test_emu_end_to_end.py). Each sequence of a batched step gets bit for bit what its solo steps
give."""

import numpy as np
import pytest

from cullama.runtime.backends.cuda_backend import CudaBackend
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.runtime.engine import PlanRunner
from cullama.runtime.sampling import SamplingParams
from cullama.runtime.load import load_checkpoint
from tests.runtime.backends.test_cuda_host import fake as fake  # noqa: F401 - the fixture, as test_cuda_host.py has it

PROMPTS = [[1, 403, 407], [1, 29, 4, 13, 99], [1, 77]]
PARAMS = [SamplingParams(seed=0), SamplingParams(temperature=0.9, top_p=0.95, seed=5),
          SamplingParams(temperature=1.1, top_k=30, repetition_penalty=1.2, seed=6)]


def runner_on(backend, directory, slots=1, chunk=None):
    ckpt = open_checkpoint(directory)
    load_checkpoint(backend, ckpt)
    return PlanRunner(ckpt.config, backend, ckpt.config.max_seq_len, slots=slots, prefill_chunk=chunk)


def solo_tokens(backend, directory, steps):
    """Each prompt alone on a one-slot runner: its first token and `steps` decode steps."""
    runner = runner_on(backend, directory)
    return [[runner.start(p, params)] + [runner.next() for _ in range(steps)] for p, params in zip(PROMPTS, PARAMS)]


def batched_tokens(runner, steps, order=(2, 0, 1)):
    """The prompts in slots 0..2, then `steps` batched steps over them in `order`; the third leaves halfway and
    the batch goes on with two rows (set_batch again)."""
    tokens = []
    for slot, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)):
        runner.slot = slot
        tokens.append([runner.start(prompt, params)])
    rows = list(order)
    runner.set_batch(rows)
    for step in range(steps):
        if step == steps // 2:  # slot 1 leaves, the others go on; it finishes alone (a plain decode step)
            rows.remove(1)
            runner.set_batch(rows)
        for slot, token in zip(rows, runner.batch_step()):
            tokens[slot].append(token)
    runner.slot = 1
    tokens[1] += [runner.next() for _ in range(steps - len(tokens[1]) + 1)]
    return tokens


LONG = [1] + [3 + (7 * i) % 500 for i in range(40)]  # 41 ids: three prefill chunks of CHUNK
CHUNK = 16


def joined_tokens(runner, steps):
    """Slot 0 decodes PROMPTS[0] while LONG joins in slot 1, a chunk per batched step (BatchSession's order); then
    both decode `steps` steps together."""
    runner.slot = 0
    tokens = [[runner.start(PROMPTS[0], PARAMS[0])], []]
    runner.set_batch([0])
    runner.slot = 1
    prefill, first = runner.begin(LONG, PARAMS[1]), None
    while first is None:
        first = prefill.advance()
        tokens[0] += runner.batch_step()
    tokens[1].append(first)
    runner.set_batch([0, 1])
    for _ in range(steps):
        for slot, token in enumerate(runner.batch_step()):
            tokens[slot].append(token)
    return tokens


def alone_tokens(runner, steps):
    """What joined_tokens' two sequences get alone on a one-slot runner."""
    first = [runner.start(PROMPTS[0], PARAMS[0])] + [runner.next() for _ in range(steps + 3)]
    return [first, [runner.start(LONG, PARAMS[1])] + [runner.next() for _ in range(steps)]]


def test_a_prompt_of_several_chunks_joining_on_the_cuda_host_code(fake, stories_dir):
    runner = runner_on(CudaBackend(), stories_dir, slots=2, chunk=CHUNK)
    assert joined_tokens(runner, 8) == alone_tokens(runner_on(NumpyBackend(), stories_dir, chunk=CHUNK), 8)


@pytest.mark.gpu
def test_gpu_a_prompt_of_several_chunks_joining_gets_its_solo_tokens(stories_dir):
    """On a GPU (or the real kernels on the CPU executor): a prompt longer than the chunk joins a running sequence
    one chunk per batched step; both get their solo tokens on a one-slot runner with the same chunk."""
    runner = runner_on(CudaBackend(), stories_dir, slots=2, chunk=CHUNK)
    assert joined_tokens(runner, 6) == alone_tokens(runner_on(CudaBackend(), stories_dir, chunk=CHUNK), 6)


def test_batched_steps_on_the_cuda_host_code_equal_solo_steps(fake, stories_dir):
    runner = runner_on(CudaBackend(), stories_dir, slots=3)
    assert batched_tokens(runner, 16) == solo_tokens(NumpyBackend(), stories_dir, 16)
    graphs = runner.backend.graphs
    assert {"batch[3]#0", "batch[2]#0", "decode@1"} <= set(graphs)  # a graph per batch size
    # each captured once, when its size was first used, and replayed by every step of that size: a join or a
    # leave writes the rows table, never recaptures
    assert (graphs["batch[3]#0"].replays, graphs["batch[2]#0"].replays) == (8, 8)
    assert len(fake.graphs) == len(graphs) and graphs["batch[3]#0"] in fake.graphs
    cpu = runner_on(NumpyBackend(), stories_dir, slots=3)
    batched_tokens(cpu, 16)
    for name in ("state", "seen", "k_cache", "v_cache"):
        np.testing.assert_array_equal(runner.backend.read(name), cpu.backend.read(name), err_msg=name)


@pytest.mark.gpu
def test_gpu_batched_steps_equal_solo_steps(stories_dir):
    """On a GPU (or the real kernels on the CPU executor): a batch of three sequences, one leaving halfway, against
    each one alone on the same backend."""
    runner = runner_on(CudaBackend(), stories_dir, slots=3)
    assert batched_tokens(runner, 12) == solo_tokens(CudaBackend(), stories_dir, 12)


def test_a_batch_of_two_groups_on_the_cuda_host_code(fake, stories_dir):
    """Eleven sequences: a batched step replays two graphs, a group of VERIFY_ROWS rows and one of the rest (each
    its own rows table and ids); every sequence gets its solo tokens."""
    from cullama.runtime import plan as plans

    n, steps = plans.VERIFY_ROWS + 2, 4
    prompts = [[1, 3 + (37 * i) % 500, 3 + (91 * i) % 500] for i in range(n)]
    params = [SamplingParams(temperature=0.9, top_k=40, seed=i) for i in range(n)]
    alone = runner_on(NumpyBackend(), stories_dir)
    expected = [[alone.start(p, q)] + [alone.next() for _ in range(steps)] for p, q in zip(prompts, params)]
    runner = runner_on(CudaBackend(), stories_dir, slots=n)
    got = []
    for slot, (prompt, p) in enumerate(zip(prompts, params)):
        runner.slot = slot
        got.append([runner.start(prompt, p)])
    order = list(range(n))[::-1]
    runner.set_batch(order)
    for _ in range(steps):
        for slot, token in zip(order, runner.batch_step()):
            got[slot].append(token)
    assert got == expected
    assert {f"batch[{plans.VERIFY_ROWS}]#0", "batch[2]#1"} <= set(runner.backend.graphs)
