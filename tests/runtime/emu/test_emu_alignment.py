"""Misaligned typed accesses fail on the executor as they fault on a GPU ("misaligned address"): kernel code is
compiled with -fsanitize=alignment and runtime.cpp's handler fails the launch (cullama/runtime/emu/build.py). Seeded
misaligned loads and stores in a tiny kernel, each of the vector types the kernels cast to; and the sample
kernel over a verify step's rows at a V % 4 != 0 (rows at a stride of V rounded up to 4, so every row is 16-byte
aligned) against its twin, and as it was at a stride of V, caught on row 1."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from tests.runtime import test_verify as verify
from tests.emulated import seeded_copy
from tests.runtime.ops.test_sampling_kernel import assert_prepared, next_input
from cullama.runtime import emu, sampling
from cullama.runtime import plan as plans
from cullama.runtime.emu import build
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime.ops import sampling as sample_twin
from cullama.runtime.registry import KernelSpec
from cullama.runtime.sampling import SamplingParams

pytestmark = pytest.mark.emu

# Each kernel reads or writes one `type` per thread at `elems + offset + width * threadIdx.x`, through a
# reinterpret_cast as the kernels do; `offset` (in its own elements) misaligns it.
PROBES = r"""#include "common.cuh"
struct __align__(4) half2_bits { half_t x, y; };  // __half2's size and alignment

extern "C" __global__ void load_float4(const float* in, float* out, int offset) {
    const float4 v = *reinterpret_cast<const float4*>(in + offset + 4 * threadIdx.x);
    out[threadIdx.x] = v.x + v.y + v.z + v.w;
}
extern "C" __global__ void store_float4(float* out, int offset) {
    *reinterpret_cast<float4*>(out + offset + 4 * threadIdx.x) = make_float4(1.f, 2.f, 3.f, 4.f);
}
extern "C" __global__ void load_uint4(const half_t* in, float* out, int offset) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(in + offset + 8 * threadIdx.x), f);
    out[threadIdx.x] = f[0] + f[7];
}
extern "C" __global__ void store_uint2(half_t* out, int offset) {
    *reinterpret_cast<uint2*>(out + offset + 4 * threadIdx.x) = make_uint2(0x3c003c00u, 0x3c003c00u);
}
extern "C" __global__ void load_half2(const half_t* in, float* out, int offset) {
    const half2_bits h = *reinterpret_cast<const half2_bits*>(in + offset + 2 * threadIdx.x);
    out[threadIdx.x] = h2f(h.x) + h2f(h.y);
}
extern "C" __global__ void load_word(const unsigned char* in, float* out, int offset) {
    out[threadIdx.x] = (float)*reinterpret_cast<const uint32_t*>(in + offset + 4 * threadIdx.x);
}
"""
THREADS = 32
# kernel -> (element dtype of its first argument, elements per thread, the type's name, its alignment);
# the compiler words the type: GCC's 'const struct float4' is clang's 'const float4'
CASES = {
    "load_float4": (np.float32, 4, "float4", 16),
    "store_float4": (np.float32, 4, "float4", 16),
    "load_uint4": (np.float16, 8, "uint4", 16),
    "store_uint2": (np.float16, 4, "uint2", 8),
    "load_half2": (np.float16, 2, "half2_bits", 4),
    "load_word": (np.uint8, 4, "uint32_t", 4),
}


def access_line(name: str) -> int:
    """The line of kernel `name`'s reinterpret_cast in PROBES."""
    lines = PROBES.splitlines()
    start = next(i for i, l in enumerate(lines) if f" void {name}(" in l)
    return next(i for i in range(start, len(lines)) if "reinterpret_cast" in lines[i]) + 1


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    source_dir = tmp_path_factory.mktemp("emu_alignment") / "kernels_cu"
    shutil.copytree(SOURCE_DIR, source_dir)
    (source_dir / "probes.cu").write_text(PROBES)
    return source_dir


def launch_probe(source_dir, name, offset):
    dtype, width, *_ = CASES[name]
    data = np.zeros(width * (THREADS + 1), dtype)  # room for the offset; every value a finite 0
    args = (data, np.int32(offset)) if name.startswith("store") else (data, np.zeros(THREADS, np.float32),
                                                                      np.int32(offset))
    emu.launch(KernelSpec("probes.cu", name), 1, THREADS, args, source_dir=source_dir)
    return data


@pytest.mark.parametrize("name", CASES)
def test_a_misaligned_vector_access_fails_the_launch(probes, name):
    """Aligned: it runs. One element off: EmuError at the access's line, naming the type, address, alignment."""
    dtype, width, type_name, align = CASES[name]
    line = access_line(name)
    data = launch_probe(probes, name, 0)
    if name.startswith("store"):
        assert (data[:width * THREADS] != 0).all(), "the aligned stores did not land"
    for offset in sorted({1, align // np.dtype(dtype).itemsize // 2} - {0}):
        with pytest.raises(emu.EmuError) as caught:
            launch_probe(probes, name, offset)
        message = str(caught.value)
        assert re.search(rf"^{name} block \(0, 0, 0\) thread \(0, 0, 0\) at probes\.cu:{line}: ", message), message
        assert re.search(rf"misaligned address 0x[0-9a-f]+ for type '[^']*\b{type_name}', which requires "
                         rf"{align}-byte alignment$", message), message


def test_the_check_is_compiled_in_and_libubsan_is_not_linked():
    """The flag is part of every kernel library's cache key; the handler is the runtime's, not libubsan's."""
    assert "-fsanitize=alignment" in build.KERNEL_FLAGS
    lib = build.library("sampling.cu")
    data = lib.path.read_bytes()
    assert b"__ubsan_handle_type_mismatch_v1" in data and b"libubsan" not in data


# -- sampling.cu over a verify step's rows, any V: row r starts at logits + r logits_stride(V) --------------------
GREEDY = (0.0, 0, 1.0, 1.3)  # temperature, top_k, top_p, repetition penalty
SAMPLED = (0.9, 50, 0.95, 1.2)


def check_sample_rows(V, rows, options, schedule, source_dir=None, D=24):
    """Each row's pick is the twin's (sampled: or within rounding of a bucket edge, the draft's bucket first); the
    verdict, state, seen and x follow from the picks (greedy: all of it exactly the twin's); logits put back."""
    temperature, top_k, top_p, penalty = options
    logits, seen, embed = verify.sample_case(V=V, rows=rows, seed=V + rows, spike=9.0 if temperature else 0.0)
    embed = np.ascontiguousarray(embed[:, :D])
    fp = np.array([temperature, top_p, penalty, 0.0], np.float32)
    argmax = SamplingParams(repetition_penalty=penalty, seed=0)
    ids = [3]
    for r in range(rows - 1):  # the rows' argmaxes as drafts, the second one wrong (where there is one)
        before = seen.astype(bool) | np.isin(np.arange(V), ids[1:])
        pick = sampling.sample(logits[r], argmax, before, 0)
        ids.append(pick if r != 1 else (pick + 1) % V)
    state = verify.state_at(11, step=3, seed=99, top_k=top_k)
    kernel_logits, kernel_seen, kernel_state = verify.at_row_stride(logits), seen.copy(), state.copy()
    x, picks, out = verify.nan(D), np.full(rows, -7, np.int32), np.full(rows + 1, -7, np.int32)
    arrivals = np.zeros(1, np.uint32)
    nxt = next_input(x)
    emu.launch(plans.SAMPLE, (rows,), plans.SAMPLE_THREADS,
               (kernel_logits, kernel_seen, kernel_state, fp, embed, *nxt, verify.verify_rows(rows),
                np.array(ids, np.int32), picks, out, arrivals, *verify.verify_sizes(V, D)), schedule=schedule, seed=7,
               source_dir=source_dir)
    assert_prepared(nxt)
    twin_seen, twin_state = seen.copy(), state.copy()
    twin_out, twin_picks, twin_x = verify.run_sample_twin(logits, twin_seen, twin_state, fp, embed, ids)
    np.testing.assert_array_equal(kernel_logits[:, :V], logits)  # the drafts' logits, penalised in place, put back
    assert int(arrivals[0]) == 0
    if temperature == 0:
        np.testing.assert_array_equal(picks, twin_picks)
        np.testing.assert_array_equal(out, twin_out)
        np.testing.assert_array_equal(kernel_state, twin_state)
        np.testing.assert_array_equal(kernel_seen, twin_seen)
        np.testing.assert_array_equal(x, twin_x)
        return
    params = sample_twin.params_from(state, fp)
    for r in range(rows):
        before = seen.astype(bool) | np.isin(np.arange(V), ids[1:r + 1])
        draft = ids[r + 1] if r + 1 < rows else None
        assert picks[r] == twin_picks[r] or verify.explained(picks[r], logits[r], params, before, 3 + r, draft), r
    n = next((r + 1 for r in range(rows - 1) if picks[r] != ids[r + 1]), rows)
    assert out[:n + 1].tolist() == [n, *ids[1:n], picks[n - 1]]
    assert kernel_state[sample_twin.STATE_STEP] == 3 + n and kernel_state[sample_twin.STATE_TOKEN] == picks[n - 1]
    np.testing.assert_array_equal(x, embed[picks[n - 1]].astype(np.float32))


# V % 4 = 1, 1, 0; rows 2..5: at a row stride of V, rows would start at every offset
@pytest.mark.parametrize("V", [517, 1001, 516])
@pytest.mark.parametrize("rows", [2, 3, 5])
@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_verify_sample_rows_at_any_vocabulary_size(V, rows, options):
    check_sample_rows(V, rows, options, emu.SCHEDULES[(V + rows) % 3])


@pytest.mark.parametrize("options", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_misaligned_rows_read_with_float4_loads_fail(tmp_path, options):
    """The check has teeth: sampling.cu as it was (rows at a stride of V, read with float4 loads) fails on row 1 at
    V = 517."""
    source_dir = seeded_copy(tmp_path, "sampling.cu", "(size_t)row * logits_stride(V)", "(size_t)row * V")
    with pytest.raises(emu.EmuError, match=r"^sample block \(1, 0, 0\) .* at sampling\.cu:\d+: .*misaligned address "
                                            r"0x[0-9a-f]+ for type '[^']*\bfloat4', which requires 16-byte "
                                            r"alignment$"):
        check_sample_rows(517, 2, options, "forward", source_dir)
