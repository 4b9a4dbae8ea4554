"""The plan, the kernels and the twins agree on every launch: parameter count, order, names and types,
and each buffer's dtype against the kernel's pointer type. A mismatch here would be silent garbage
on the GPU, so it is checked on the CPU, statically, from the .cu sources."""

import inspect
import re

import numpy as np
import pytest

from cullama import ops, plan as plans
from cullama.config import preset
from cullama.engine import device_config
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
    assert grid["attention_decode"][:2] == (cfg.num_kv_heads, plans.attention_splits(cfg))
