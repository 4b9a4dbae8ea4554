"""The plan, the kernels and the twins agree on every launch: parameter count, order, names and types,
and each buffer's dtype against the kernel's pointer type. A mismatch here would be silent garbage
on the GPU, so it is checked on the CPU, statically, from the .cu sources."""

import inspect
import re

import numpy as np
import pytest

from cullama.runtime import ops, plan as plans
from cullama.model.config import preset
from cullama.model.layout import device_config
from cullama.model.weights import config_layout
from cullama.runtime.prefill_kernels import ATTENTIONS, GEMMS, PrefillKernels
from cullama.kernels_cu import SOURCE_DIR

KERNEL = re.compile(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)', re.S)
POINTER_DTYPES = {"half_t": "float16", "float": "float32", "int": "int32", "unsigned char": "uint8",
                  "unsigned int": "uint32", "uint4": None}  # uint4: raw 16-byte data, any dtype
SCALAR_TYPES = {"int": np.int32, "float": np.float32, "size_t": np.uint64, "unsigned long long": np.uint64}


def kernel_signatures() -> dict[tuple[str, str], list[tuple[str, str, bool]]]:
    """(file, kernel) -> [(base type, name, is_pointer)] parsed from kernels_cu/*.cu."""
    out = {}
    for path in SOURCE_DIR.glob("*.cu"):
        for name, params in KERNEL.findall(path.read_text()):
            parsed = []
            for param in (p.strip() for p in params.split(",") if p.strip()):
                param = re.sub(r"\b(const|__restrict__)\b", " ", param)
                is_pointer = "*" in param
                words = param.replace("*", " ").split()
                parsed.append((" ".join(words[:-1]), words[-1], is_pointer))
            out[path.name, name] = parsed
    return out


SIGNATURES = kernel_signatures()


def buffers(cfg, max_seq):
    return {b.name: b for b in plans.weight_buffers(cfg) + plans.runtime_buffers(cfg, max_seq)}


@pytest.mark.parametrize("name", ["llama-2-7b", "tiny"])
def test_every_launch_matches_its_kernel_signature(name):
    cfg = device_config(preset(name))
    bufs = buffers(cfg, 512)
    launches = plans.decode_plan(cfg, 512).launches
    for output in plans.PREFILL_OUTPUTS:
        launches += plans.prefill_plan(cfg, 512, 64, 37, output).launches
    for k in range(1, plans.MAX_DRAFT + 1):
        launches += plans.verify_plan(cfg, 512, k).launches
    for launch in launches:
        where = f"{launch.spec.source}:{launch.spec.name}"
        params = SIGNATURES[launch.spec.source, launch.spec.name]
        assert len(params) == len(launch.args), where
        for (ctype, pname, is_pointer), arg in zip(params, launch.args):
            if is_pointer:
                assert isinstance(arg, plans.Ref), f"{where}: {pname} needs a buffer"
                expected = POINTER_DTYPES[ctype]
                assert expected in (None, bufs[arg.name].dtype), f"{where}: {pname} is {ctype}*, {arg.name} is {bufs[arg.name].dtype}"
            else:
                assert type(arg) is SCALAR_TYPES[ctype], f"{where}: {pname} is {ctype}, got {type(arg).__name__}"


def test_every_kernel_has_a_twin_with_its_parameters():
    for (source, name), params in SIGNATURES.items():
        twin = ops.twin(source, name)
        twin_params = [p for p in inspect.signature(twin).parameters.values() if p.kind is not p.KEYWORD_ONLY]
        assert [p.name for p in twin_params] == [p[1] if p[1] != "in" else "inp" for p in params], name


def test_every_kernel_source_is_in_an_ops_module():
    sources = {module.SOURCE for module in map(ops.module, ops.STEMS)}
    assert sources == {p.name for p in SOURCE_DIR.glob("*.cu")}


def test_grids_cover_every_output_row():
    cfg = device_config(preset("llama-2-7b"))
    grid = {l.spec.name: l.grid for l in plans.decode_plan(cfg, 512).launches}
    rows, pairs = plans.GEMV_ROWS, plans.GEMV_ROWS // 2
    assert grid["gemv_qkv_rope"][0] * pairs * 2 >= cfg.qkv_dim
    assert grid["gemv_gate_up_silu"][0] * pairs >= cfg.intermediate_size
    assert grid["gemv_logits"][0] * rows >= cfg.vocab_size
    assert grid["attention_decode"] == (cfg.num_kv_heads, plans.attention_splits(cfg), 1)
    for k in (1, 8):  # a verify step: the same output rows per block, k + 1 token rows
        verify = {l.spec.name: l for l in plans.verify_plan(cfg, 512, k).launches}
        per_block = plans.gemv_rows(k + 1)
        assert verify["gemv_qkv_rope"].grid[0] * per_block >= cfg.qkv_dim
        assert verify["gemv_gate_up_silu"].grid[0] * per_block // 2 >= cfg.intermediate_size
        assert verify["gemv_logits"].grid[0] * per_block >= cfg.vocab_size
        assert verify["attention_decode"].grid == (cfg.num_kv_heads, plans.attention_splits(cfg), k + 1)
        assert verify["sample"].grid == verify["embed_rows_prepared"].grid == (k + 1, 1, 1)
        assert {dict(l.spec.defines).get("TOKENS") for l in verify.values() if l.spec.source == "gemv_mma.cu"} == {k + 1}


def kernel_body(text: str, name: str) -> str:
    """The text between a kernel's opening brace and its matching closing brace."""
    match = re.search(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s+)?' + name + r"\s*\([^)]*\)\s*\{",
                      text, re.S)
    assert match, name
    depth, i = 1, match.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[match.end():i - 1]


def pre_wait_reads(body: str, pointer_params: list[str]) -> set[str] | None:
    """The pointer parameters a kernel body names before its pdl_wait() (None: it never waits)."""
    if "pdl_wait();" not in body:
        return None
    before = re.sub(r"//[^\n]*", "", body.split("pdl_wait();")[0])
    return {p for p in pointer_params if re.search(rf"(?<![.\w]){p}\b", before)}  # not blockIdx.x


def every_plan_launch(cfg) -> list:
    """The decode step's launches, a verify step's for every k, and a prefill chunk's, with every output and
    every prefill kernel choice."""
    launches = list(plans.decode_plan(cfg, 512).launches)
    for k in range(1, plans.MAX_DRAFT + 1):
        launches += plans.verify_plan(cfg, 512, k).launches
    for gemm in GEMMS:
        for attention in ATTENTIONS:
            for output in plans.PREFILL_OUTPUTS:
                launches += plans.prefill_plan(cfg, 512, 64, 37, output, PrefillKernels(gemm, attention)).launches
    return launches


def weight_params(cfg, name: str) -> dict[str, bool]:
    """For each pointer parameter of kernel `name`: is it bound to a weight buffer in every launch of it?"""
    bufs = buffers(cfg, 512)
    launches = [l for l in every_plan_launch(cfg) if l.spec.name == name]
    assert launches, f"{name} is in no plan"
    params = SIGNATURES[launches[0].spec.source, name]
    return {pname: all(bufs[l.args[i].name].kind == "weight" for l in launches)
            for i, (_, pname, is_pointer) in enumerate(params) if is_pointer}


# Overlap-safe kernels that only quantized layouts launch (the gathers: only GPTQ act-order ones): their sources are
# checked by test_quantized_kernels_touch_only_weights_before_pdl_wait below.
QUANT_ONLY = {"gemm_quant", "gather_f16"}


@pytest.mark.parametrize("name", sorted(plans.OVERLAP_SAFE - QUANT_ONLY))
def test_overlap_safe_kernels_touch_only_weights_before_pdl_wait(name):
    """Launched overlapped, a kernel runs next to the one before it until pdl_wait(): reading an
    activation there would read a stale value, writing one would race. Weights never change."""
    cfg = device_config(preset("llama-2-7b"))
    weights = weight_params(cfg, name)
    source = next(src for src, kernel in SIGNATURES if kernel == name)
    touched = pre_wait_reads(kernel_body((SOURCE_DIR / source).read_text(), name), list(weights))
    assert touched is not None, f"{name} never calls pdl_wait()"
    assert all(weights[p] for p in touched), f"{name} touches {sorted(p for p in touched if not weights[p])} " \
                                             "before pdl_wait()"


def test_the_pre_wait_check_catches_a_read_of_an_activation():
    body = kernel_body((SOURCE_DIR / "gemv_mma.cu").read_text(), "gemv_residual")
    assert pre_wait_reads(body, ["in", "W", "qparams", "x"]) == {"W", "qparams"}
    first = "first_batch<PLAIN_ROWS>(loads, W, qparams, K, group, M, 0, 0);"
    planted = body.replace("pdl_wait();", "").replace(first, first + "\n    x[0] = 0.f;\n    pdl_wait();")
    assert pre_wait_reads(planted, ["in", "W", "qparams", "x"]) == {"W", "qparams", "x"}
    assert pre_wait_reads(body.replace("pdl_wait();", ""), ["W"]) is None


def test_every_plan_kernel_may_overlap():
    cfg = device_config(preset("llama-2-7b"))
    fp16 = {l.spec.name for l in every_plan_launch(cfg)}
    assert fp16 == plans.OVERLAP_SAFE - QUANT_ONLY
    int4 = {l.spec.name for l in every_plan_launch(config_layout(preset("llama-2-7b"), "int4"))}
    assert "gemm_quant" in int4 and int4 <= plans.OVERLAP_SAFE


# The quantized kernels' weights by parameter name (cullama/model/quant.py's qweight and qparams; gather's perm):
# whether or not a plan launches them yet, they may read these, and only these, before pdl_wait().
QUANT_WEIGHTS = {"gemv_mma.cu": {"W", "qparams"}, "gemm_quant.cu": {"qweight", "qparams"}, "gather.cu": {"perm"}}


@pytest.mark.parametrize("source,name", sorted(k for k in SIGNATURES if k[0] in QUANT_WEIGHTS
                                                and k not in {("gemv_mma.cu", "gemv_logits"),
                                                              ("gemv_mma.cu", "gemv_logits_x")}))  # FP16 only
def test_quantized_kernels_touch_only_weights_before_pdl_wait(source, name):
    pointers = [pname for _, pname, is_pointer in SIGNATURES[source, name] if is_pointer]
    assert QUANT_WEIGHTS[source] <= set(pointers), f"{name}'s weights are not named {sorted(QUANT_WEIGHTS[source])}"
    touched = pre_wait_reads(kernel_body((SOURCE_DIR / source).read_text(), name), pointers)
    assert touched is not None, f"{name} never calls pdl_wait()"
    assert touched and touched <= QUANT_WEIGHTS[source], f"{name} touches {sorted(touched)} before pdl_wait()"
