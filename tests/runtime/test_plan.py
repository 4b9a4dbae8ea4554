"""The decode and prefill plans on the numpy backend (the kernels' twins) against the FP32 reference,
step by step, on the goldens and stories260K."""

import dataclasses

import numpy as np
import pytest

from cullama.runtime import plan as plans
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.model.config import preset
from cullama.runtime.engine import PlanRunner
from cullama.model.weights import host_weights
from cullama.runtime.load import load_checkpoint
from cullama.common.errors import KernelError
from cullama.runtime.prefill_kernels import PrefillKernels
from cullama.model.reference import ReferenceModel
from cullama.runtime.sampling import SamplingParams
from tests.conftest import load_golden

GREEDY = SamplingParams(temperature=0.0, seed=0)


def numpy_runner(directory, max_seq=None):
    ckpt = open_checkpoint(directory)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt)
    return PlanRunner(ckpt.config, backend, max_seq or ckpt.config.max_seq_len), ckpt


def fp16_close(ours, ref, tol=2e-2):
    """Within FP16 tolerance: the error relative to the logits' own scale."""
    return np.max(np.abs(ours - ref)) <= tol * max(1.0, np.max(np.abs(ref)))


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-gqa-sharded"])
def test_decode_matches_reference_step_by_step(name):
    directory, cases, _ = load_golden(name)
    runner, ckpt = numpy_runner(directory)
    reference = ReferenceModel(host_weights(ckpt))
    for case in cases:
        prompt = case["prompt_ids"]
        token = runner.start(prompt, GREEDY)
        reference.reset()
        ref_logits = reference.forward(prompt)[-1]
        for step in range(40):
            assert fp16_close(runner.backend.read("logits"), ref_logits), (name, step)
            if step < len(case["greedy_ids"]) and case["greedy_top1_margins"][step] > 0.05:
                assert token == case["greedy_ids"][step]
            assert token == int(np.argmax(runner.backend.read("logits")))
            ref_logits = reference.forward([token])[-1]  # follow our own tokens
            token = runner.next()


@pytest.mark.parametrize("name", ["tiny-mha", "tiny-gqa-sharded"])
def test_prefill_logits_match_huggingface(name, monkeypatch):
    monkeypatch.setattr(plans, "PREFILL_CHUNK", 16)  # several chunks for the longer prompts
    directory, cases, logits = load_golden(name)
    runner, _ = numpy_runner(directory)
    for case in cases:
        ours = runner.logits(case["prompt_ids"])
        assert ours.shape == logits[case["logits_key"]].shape
        assert fp16_close(ours, logits[case["logits_key"]])


def test_stories260k_greedy_ids_through_the_plans(stories_dir, stories_expected):
    runner, _ = numpy_runner(stories_dir)
    ids = [runner.start(stories_expected["prompt_ids"], GREEDY)]
    ids += [runner.next() for _ in range(len(stories_expected["ids"]) - 1)]
    assert ids == stories_expected["ids"]


def test_state_advances_one_position_per_step(stories_dir):
    runner, _ = numpy_runner(stories_dir)
    runner.start([1, 403, 407], GREEDY)
    assert runner.backend.read("state")[0, 0] == 3  # the first sampled token sits at position 3
    runner.next()
    assert runner.backend.read("state")[0, 0] == 4 and runner.backend.read("state")[0, 2] == 2


def test_seeded_sampling_equals_the_reference_sampler(stories_dir):
    from cullama.runtime.sampling import Sampler

    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=1234)
    runner, ckpt = numpy_runner(stories_dir)
    ours = [runner.start([1], params)] + [runner.next() for _ in range(30)]
    reference, sampler = ReferenceModel(host_weights(ckpt)), Sampler(params, 512, [1])
    theirs = [sampler(reference.forward([1])[-1])]
    for _ in range(30):
        theirs.append(sampler(reference.forward([theirs[-1]])[-1]))
    assert ours[:20] == theirs[:20]  # same draws; FP16 rounding may move a rare one later


def test_unsupported_shapes_are_clear_errors():
    cfg = preset("tiny")
    odd = type(cfg)(**{**cfg.__dict__, "head_dim": 48, "name": "odd"})
    with pytest.raises(KernelError, match="head_dim 48"):
        plans.decode_plan(odd, 64)
    with pytest.raises(KernelError, match="multiple of 8"):
        plans.decode_plan(type(cfg)(**{**cfg.__dict__, "hidden_size": 260, "name": "odd"}), 64)


def test_decode_plan_is_about_five_launches_per_layer():
    cfg = preset("llama-2-7b")
    plan = plans.decode_plan(cfg, 4096)
    assert len(plan.launches) == 5 * cfg.num_layers + 2


def test_decoding_stops_at_the_end_of_the_kv_cache(stories_dir):
    from cullama.common.errors import PromptError

    runner, _ = numpy_runner(stories_dir, max_seq=8)
    runner.start([1, 403, 407], GREEDY)  # the first sampled token goes to position 3
    for _ in range(5):  # positions 3..7 fill the cache
        runner.next()
    with pytest.raises(PromptError, match="context of 8 tokens is full"):
        runner.next()
    with pytest.raises(PromptError, match="context is 8"):
        runner.start(list(range(1, 9)), GREEDY)


def test_reuse_prefills_only_what_the_cache_does_not_hold(stories_dir, monkeypatch):
    runner, _ = numpy_runner(stories_dir)
    first = [runner.start([1, 403, 407], GREEDY)] + [runner.next() for _ in range(6)]
    assert runner.cached == [1, 403, 407] + first[:-1]  # the last sampled token is not in the cache yet
    starts = []
    real = runner._prefill_plan
    monkeypatch.setattr(runner, "_prefill_plan", lambda start, n, out: starts.append(start) or real(start, n, out))
    follow_up = [1, 403, 407] + first[:4] + [261, 378]  # shares 7 ids with the cache
    reused = runner.start(follow_up, GREEDY, reuse=True)
    reused_logits = runner.backend.read("logits")
    assert starts == [7]
    fresh_runner, _ = numpy_runner(stories_dir)
    assert fresh_runner.start(follow_up, GREEDY) == reused
    assert fp16_close(reused_logits, fresh_runner.backend.read("logits"))
    starts.clear()
    runner.start(follow_up, GREEDY, reuse=True)  # all of it cached: only the last id runs again
    assert starts == [len(follow_up) - 1]
    starts.clear()
    runner.start(follow_up, GREEDY)  # reuse off: everything again
    assert starts == [0]


def test_decoding_after_logits_needs_a_start(stories_dir):
    from cullama.common.errors import PromptError

    runner, _ = numpy_runner(stories_dir)
    runner.logits([1, 403])
    with pytest.raises(PromptError, match="start"):
        runner.next()


# -- the prefill kernel choice (prefill_kernels.py) -------------------------------------------------
@pytest.mark.parametrize("gemm,attention", [("wgmma", "scalar"), ("mma", "mma"), ("wgmma", "mma")])
def test_every_prefill_kernel_choice_gives_the_same_logits(gemm, attention, monkeypatch):
    """The plan launches the chosen kernels with their own grids and shared memory; their twins compute the
    same function, so the logits equal the default's bit for bit (the GPU tests compare the kernels)."""
    monkeypatch.setattr(plans, "PREFILL_CHUNK", 16)  # several chunks: start > 0 for the attention
    directory, cases, _ = load_golden("tiny-gqa-sharded")
    default, chosen = numpy_runner(directory)[0], numpy_runner(directory)[0]
    kernels = PrefillKernels(gemm=gemm, attention=attention)
    chosen.set_prefill_kernels(kernels)
    prompt = cases[-1]["prompt_ids"]
    np.testing.assert_array_equal(chosen.logits(prompt), default.logits(prompt))
    assert chosen.start(prompt, GREEDY) == default.start(prompt, GREEDY)
    names = {l.spec.name for p in chosen._prefills.values() for l in p.launches}
    assert ("gemm_wgmma" in names) == (gemm == "wgmma") and ("gemm" in names) == (gemm == "mma")
    assert ("attention_prefill_mma" in names) == (attention == "mma")
    assert ("attention_prefill" in names) == (attention == "scalar")


def test_mma_attention_falls_back_to_scalar_for_head_dim_8():
    cfg = dataclasses.replace(preset("tiny"), num_heads=8, num_kv_heads=4, head_dim=8, name="hd8")  # as stories260K
    names = [l.spec.name for l in plans.prefill_plan(cfg, 64, 0, 5, "none", PrefillKernels(attention="mma")).launches]
    assert "attention_prefill" in names and "attention_prefill_mma" not in names


def test_prefill_kernel_choices_are_checked():
    with pytest.raises(KernelError, match="not one of mma, wgmma"):
        PrefillKernels(gemm="cublas")
    with pytest.raises(KernelError, match="not one of scalar, mma"):
        PrefillKernels(attention="flash")
    with pytest.raises(KernelError, match="needs an sm_90 GPU"):
        PrefillKernels(gemm="wgmma").check_arch("sm_80")
    PrefillKernels(gemm="wgmma").check_arch("sm_90")
    PrefillKernels(gemm="wgmma").check_arch(None)  # the CPU twins


@pytest.mark.parametrize("name,quantize,chunk", [("llama-2-7b", None, 64), ("llama-2-7b", "int8", 32),
                                                  ("llama-2-7b", "int4", 16), ("llama3.2-1b", None, 80),
                                                  ("llama3-8b", None, 64)])
def test_the_batch_prefill_chunk_is_the_roofline_s_largest_that_costs_a_decode_step(name, quantize, chunk):
    """plan.batch_prefill_chunk: the largest multiple of 16 rows whose predicted prefill takes no longer than a
    decode step (the weights' read at the H200's bandwidth); the next multiple takes longer. Fewer weight bytes (a
    quantized model: the same FLOPs, a shorter step) make it smaller."""
    from cullama.model.layout import decode_floor_ms, fp16, on_load

    layout = on_load(preset(name), quantize) if quantize else fp16(preset(name))
    step = decode_floor_ms(layout.decode_bytes())
    assert plans.batch_prefill_chunk(layout) == chunk
    assert plans.predicted_prefill_ms(layout, chunk) <= step < plans.predicted_prefill_ms(layout, chunk + 16)
    assert plans.prefill_chunk_for(layout, 1) == plans.PREFILL_CHUNK == 256
    assert plans.prefill_chunk_for(layout, 8) == chunk
    # 7B FP16: a 256-row chunk ~11 ms (3.7 steps of ~3 ms), a 64-row one a step (PREDICTIONS.md)
    if (name, quantize) == ("llama-2-7b", None):
        assert 2.9 < step < 3.0 and 10.5 < plans.predicted_prefill_ms(layout, 256) < 11.5


def test_the_batch_prefill_chunk_goes_up_to_prefill_chunk_itself():
    """Where a whole PREFILL_CHUNK's prefill costs no more than a decode step (LLaMA-3.2-1B's shape with one layer:
    the step reads mostly the 128256 x 2048 lm_head, which a prefill chunk does not multiply), the batch chunk is
    PREFILL_CHUNK: the largest candidate, included."""
    from cullama.model.layout import decode_floor_ms, fp16

    layout = fp16(dataclasses.replace(preset("llama3.2-1b"), num_layers=1))
    assert plans.predicted_prefill_ms(layout, plans.PREFILL_CHUNK) <= decode_floor_ms(layout.decode_bytes())
    assert plans.batch_prefill_chunk(layout) == plans.PREFILL_CHUNK == 256


def test_a_runner_with_slots_prefills_in_the_batch_chunk(stories_dir):
    ckpt = open_checkpoint(stories_dir)
    backend = NumpyBackend()
    runner = PlanRunner(ckpt.config, backend, ckpt.config.max_seq_len, slots=2)
    assert runner.prefill_chunk == plans.batch_prefill_chunk(ckpt.config) == 64
    assert backend.arrays["x_rows"].shape[0] == 64


def test_the_prefill_chunk_is_a_runner_choice(stories_dir):
    """A runner's prefill_chunk sizes its prefill buffers and cuts prompts into passes of that many rows; how a
    prompt is cut changes no bit of its logits (each row of the prefill twins depends on that row alone)."""
    default = numpy_runner(stories_dir)[0]
    ckpt = open_checkpoint(stories_dir)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt)
    short = PlanRunner(ckpt.config, backend, ckpt.config.max_seq_len, prefill_chunk=7)
    assert backend.arrays["x_rows"].shape[0] == 7 and default.backend.arrays["x_rows"].shape[0] == plans.PREFILL_CHUNK
    prompt = [1] + list(range(300, 319))  # 20 tokens: passes of 7, 7 and 6 rows
    assert np.array_equal(short.logits(prompt), default.logits(prompt))
    assert short.start(prompt, GREEDY) == default.start(prompt, GREEDY)
    assert {key[:2] for key in short._prefills} >= {(0, 7), (7, 7), (14, 6)}
    with pytest.raises(KernelError, match="does not fit"):
        plans.prefill_plan(short.cfg, 64, 0, 8, chunk=7)
