"""Quantized plans (cullama/runtime/plan.py on a quantized layout): which kernels run and with what, and on the numpy
backend (the kernels' twins) against the reference on the dequantized weights, step by step, for AWQ, GPTQ with
act-order, and int8 / int4 quantized on load; speculative verify on a quantized model equals its own plain
greedy; and, once kernels_cu has them, every quantized launch against its kernel's signature."""

from __future__ import annotations

import numpy as np
import pytest

from cullama.model import layout as layouts
from cullama.runtime import plan as plans
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.model.config import Quantization, preset
from cullama.runtime.engine import PlanRunner
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.ops import gemv_mma
from cullama.runtime.prefill_kernels import MMA_GEMM, PrefillKernels
from cullama.model.reference import ReferenceModel
from cullama.runtime.sampling import SamplingParams
from cullama.model.weights import checkpoint_layout, host_weights
from cullama.runtime.load import load_checkpoint
from tests.conftest import load_golden
from tests.quant_checkpoints import CONFIG, write
from tests.runtime.test_plan import fp16_close
from tests.runtime.test_verify import speculative_ids

GREEDY = SamplingParams(temperature=0.0, seed=0)
ACT_ORDER = Quantization("gptq", 4, 64, "gptq", sym=False, desc_act=True)


def runner_for(directory, quantize=None, max_seq=None, chunk=None):
    ckpt = open_checkpoint(directory)
    layout = checkpoint_layout(ckpt, quantize)
    backend = NumpyBackend()
    runner = PlanRunner(layout, backend, max_seq or ckpt.config.max_seq_len, prefill_chunk=chunk)
    load_checkpoint(backend, ckpt, layout=layout)
    return runner, ReferenceModel(host_weights(ckpt, layout=layout))


@pytest.fixture(scope="module")
def act_order_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("act-order")
    write(directory, CONFIG, ACT_ORDER, seed=3)
    return directory


def checkpoints(request, act_order_dir, stories_dir):
    """(directory, quantize) of each case: an AWQ golden, a GPTQ act-order checkpoint, stories int8 and int4."""
    return {"awq": (load_golden("tiny-awq-g64")[0], None), "gptq-act-order": (act_order_dir, None),
            "stories-int8": (stories_dir, "int8"), "stories-int4": (stories_dir, "int4")}[request]


CASES = ["awq", "gptq-act-order", "stories-int8", "stories-int4"]


@pytest.mark.parametrize("case", CASES)
def test_quantized_decode_and_prefill_match_the_reference_on_the_dequantized_weights(case, act_order_dir,
                                                                                    stories_dir):
    directory, quantize = checkpoints(case, act_order_dir, stories_dir)
    runner, reference = runner_for(directory, quantize, max_seq=128, chunk=16)
    prompt = [1, 5, 9, 33, 77, 100, 42]
    token = runner.start(prompt, GREEDY)
    ref_logits = reference.forward(prompt)[-1]
    for step in range(20):
        assert fp16_close(runner.backend.read("logits"), ref_logits), step
        assert token == int(np.argmax(runner.backend.read("logits")))
        ref_logits = reference.forward([token])[-1]  # follow our own tokens
        token = runner.next()
    ids = list(range(3, 3 + 40))  # three prefill chunks of at most 16
    reference.reset()
    assert fp16_close(runner.logits(ids), reference.forward(ids))


def kernels_of(plan) -> list[tuple[str, str]]:
    return [(launch.spec.source, launch.spec.name) for launch in plan.launches]


def test_a_quantized_decode_step_runs_the_quantized_kernels_with_their_group():
    layout = layouts.on_load(preset("llama-2-7b"), "int4")
    plan = plans.decode_plan(layout, 512)
    per_layer = [("gemv_mma.cu", "gemv_qkv_rope"), ("attention.cu", "attention_decode"),
                 ("gemv_mma.cu", "gemv_residual"), ("gemv_mma.cu", "gemv_gate_up_silu"),
                 ("gemv_mma.cu", "gemv_residual")]
    # every layer's qkv on the prepared input (layer 0's: the embedding's, as sample prepared it)
    assert kernels_of(plan) == per_layer * 32 + [("gemv_mma.cu", "gemv_logits"), ("sampling.cu", "sample")]
    first = plan.launches[0]
    assert first.spec.defines == gemv_mma.defines(4, 1, 128) and first.block == gemv_mma.THREADS
    assert plan.launches[-2].spec.defines == gemv_mma.defines(16, 1)  # the lm_head stays FP16
    assert [a.name for a in first.args[2:4]] == ["layers.0.wqkv.qweight", "layers.0.wqkv.qparams"]
    assert first.args[-1] == np.int32(128) and type(first.args[-1]) is np.int32  # the group, last
    rows = gemv_mma.rows_per_block(gemv_mma.defines(4, 1))
    grids = {l.spec.name: l.grid[0] for l in plan.launches[:5]}
    assert grids["gemv_qkv_rope"] * rows >= 12288 and grids["gemv_gate_up_silu"] * rows // 2 >= 11008
    assert plan.launches[4].args[-2:] == (np.int32(11008), np.int32(128))  # down: K = ff, its group
    verify = plans.verify_plan(layout, 512, 4)
    quantized = [l for l in verify.launches if l.spec.source == "gemv_mma.cu" and l.spec.name != "gemv_logits"]
    assert {l.spec.defines for l in quantized} == {gemv_mma.defines(4, 5, 128)}


def test_a_quantized_prefill_runs_gemm_quant_with_the_mma_geometry_and_an_fp16_lm_head():
    layout = layouts.on_load(preset("tiny"), "int8")
    for gemm in ("mma", "wgmma"):
        plan = plans.prefill_plan(layout, 512, 0, 37, "logits", PrefillKernels(gemm=gemm))
        gemms = [l for l in plan.launches if "gemm" in l.spec.name]
        lm_head = "gemm.cu" if gemm == "mma" else "gemm_wgmma.cu"  # FP16, the plan's choice
        assert [l.spec.source for l in gemms] == ["gemm_quant.cu"] * 16 + [lm_head]
        for launch in gemms[:-1]:
            assert launch.spec.defines == (("BITS", 8),) and launch.block == MMA_GEMM.threads
            M, N, K = (int(a) for a in launch.args[-5:-2])
            assert launch.grid == MMA_GEMM.grid(M, N, K) and launch.args[-1] == np.int32(K)  # per channel: group K


def test_act_order_gathers_before_wqkv_wo_and_gate_up_but_not_down(act_order_dir):
    layout = checkpoint_layout(open_checkpoint(act_order_dir))
    assert all(layout.linear(i, f).permuted for i in range(2) for f in layouts.LINEARS)
    decode = kernels_of(plans.decode_plan(layout, 64))
    layer = decode[:len(decode) // 2 - 1]
    # act-order: each gathered linear's kernel reads its input in the weight's order: the prepared xn gathered (beside
    # the same Σ x² parts: a sum the order does not change), attention's output gathered
    assert [name for _, name in layer] == ["gather_f16", "gemv_qkv_rope", "attention_decode", "gather_f16",
                                           "gemv_residual", "gather_f16", "gemv_gate_up_silu", "gemv_residual"]
    launches = plans.decode_plan(layout, 64).launches
    assert [a.name for a in launches[0].args[:3]] == ["xn", "layers.0.wqkv.perm", "xn_perm"]
    assert [a.name for a in launches[1].args[:2]] == ["xn_perm", "x_ss"]
    assert launches[4].args[0].name == "attn_out_perm" and [a.name for a in launches[6].args[:2]] == ["xn_perm", "x_ss"]
    # gemv_residual prepares x with the model's own norm weights, in the model's order (the gather permutes xn)
    assert launches[4].args[4].name == "layers.0.ffn_norm" and launches[7].args[4].name == "layers.1.attn_norm"
    prefill = plans.prefill_plan(layout, 64, 0, 9, "none").launches
    gathers = [l for l in prefill if l.spec.name == "gather_f16"]
    assert [(l.args[0].name, l.args[2].name, l.grid) for l in gathers[:3]] == [
        ("xn_rows", "xn_rows_perm", (9, 1, 1)), ("attn_rows", "attn_rows_perm", (9, 1, 1)),
        ("xn_rows", "xn_rows_perm", (9, 1, 1))]
    verify = plans.verify_plan(layout, 64, 3).launches
    assert verify[1].spec.name == "gather_f16" and verify[1].grid == (4, 1, 1)
    assert verify[1].args[2] == plans.Ref("verify_xn_perm", rows=4)
    names = {b.name for b in plans.runtime_buffers(layout, 64)}
    assert {"xn_perm", "attn_out_perm", "verify_xn_perm", "verify_attn_out_perm", "xn_rows_perm",
            "attn_rows_perm"} <= names
    assert "xn_perm" not in {b.name for b in plans.runtime_buffers(layouts.on_load(CONFIG, "int4"), 64)}


@pytest.mark.parametrize("case", ["gptq-act-order", "stories-int4"])
def test_speculative_greedy_on_a_quantized_model_is_its_own_plain_greedy(case, act_order_dir, stories_dir):
    directory, quantize = checkpoints(case, act_order_dir, stories_dir)
    plain, _ = runner_for(directory, quantize, max_seq=128)
    spec, _ = runner_for(directory, quantize, max_seq=128)
    prompt = [1, 203, 107, 61]
    expected = [plain.start(prompt, GREEDY)] + [plain.next() for _ in range(40)]
    for k in (1, 4, 8):
        assert speculative_ids(spec, prompt, GREEDY, expected, k, 41) == expected


# -- the launches against the kernels' signatures (once kernels_cu holds the quantized kernels) ----------------
def test_every_quantized_launch_matches_its_kernel_signature(act_order_dir):
    from tests.runtime.test_contracts import POINTER_DTYPES, SCALAR_TYPES, SIGNATURES

    missing = sorted({"gemv_mma.cu", "gemm_quant.cu", "gather.cu"} - {p.name for p in SOURCE_DIR.glob("*.cu")})
    if missing:
        pytest.skip(f"kernels_cu has no {', '.join(missing)} yet (branch qkernels)")
    for layout in (layouts.on_load(preset("llama-2-7b"), "int4"), layouts.on_load(preset("tiny"), "int8"),
                   checkpoint_layout(open_checkpoint(act_order_dir))):
        buffers = {b.name: b for b in plans.weight_buffers(layout) + plans.runtime_buffers(layout, 64)}
        launches = plans.decode_plan(layout, 64).launches + plans.prefill_plan(layout, 64, 3, 37, "logits").launches
        for k in range(1, plans.MAX_DRAFT + 1):
            launches += plans.verify_plan(layout, 64, k).launches
        for launch in launches:
            params = SIGNATURES[launch.spec.source, launch.spec.name]
            assert len(params) == len(launch.args), launch.spec
            for (ctype, name, pointer), arg in zip(params, launch.args):
                if pointer:
                    assert POINTER_DTYPES[ctype] in (None, buffers[arg.name].dtype), (launch.spec, name)
                else:
                    assert type(arg) is SCALAR_TYPES[ctype], (launch.spec, name)


def test_every_quantized_kernel_variant_the_plans_launch_is_the_twins_and_compiled():
    """The plans' quantized gemv_mma defines are the twin's (ops/gemv_mma.defines), among the VARIANTS CI compiles."""
    for bits in (4, 8):
        layout = layouts.on_load(preset("tiny"), f"int{bits}")
        specs = set()
        for k in range(1, plans.MAX_DRAFT + 1):
            specs |= plans.verify_plan(layout, 64, k).kernels()
        defines = {s.defines for s in specs | plans.decode_plan(layout, 64).kernels()
                   if s.source == "gemv_mma.cu" and s.name != "gemv_logits"}
        groups = {layout.linear(0, field).format.group for field in layouts.LINEARS}
        assert defines == {gemv_mma.defines(bits, tokens, group) for tokens in range(1, plans.VERIFY_ROWS + 1)
                           for group in groups}
        assert defines <= set(gemv_mma.VARIANTS)
