"""The static issue budget in CI (issue 26): every GEMV variant that the decode, verify and batch plans launch at
the LLaMA-2-7B shapes (FP16, int8, int4; read off the plans, never listed here) issues at most issue.LIMIT (5.0)
SASS lane-instructions per weight byte over the whole kernel (cullama/bench/issue.py), and the check can fail: a
seeded GEMV with an extra FFMA chain per weight element is over it, the same kernel without the chain under it.
Every loop of those kernels counts at its trip count (none has one the SASS does not say), and an early return
sends warps away only where its condition reads threadIdx.x alone.
"""

from __future__ import annotations

import shutil

import pytest

from cullama.bench import issue, sass
from cullama.kernels_cu import SOURCE_DIR
from cullama.runtime import plan as plans, registry

VARIANTS = issue.plan_variants()


@pytest.fixture(scope="module")
def tool():
    found = sass.cuobjdump()
    if found is None:
        pytest.skip(sass.MISSING)
    return found


@pytest.fixture(scope="module")
def disassembled():
    return {}  # (source, defines) -> (SASS, resources), shared by the cases


@pytest.mark.parametrize("variant", [pytest.param(v, id=v.label) for v in VARIANTS])
def test_every_plan_gemv_is_within_the_issue_budget(variant, tool, disassembled):
    counted, _ = issue.count_variant(variant, tool, disassembled)
    print(f"{variant.label}: loop {counted.loop_per_byte:.2f}/B, whole {counted.whole_per_byte:.2f}/B")
    assert counted.loop_bytes > 0, f"{variant.label}: no streaming weight loads (LDG .NA) found in its SASS"
    # A loop of run-time trip count counts once (the module's method), too low where it runs more: the plans'
    # kernels have none (their epilogues run in rounds the compiler knows: gemv_mma.cu's for_items)
    assert counted.guessed_trips == 0, f"{variant.label}: {counted.guessed_trips} loops of unread trip count"
    problem = issue.over_budget(variant, counted)
    assert problem is None, problem


def test_the_plans_variants_cover_every_format_shape_and_row_count():
    """The parametrisation above sees every GEMV the plans launch: five shapes in each format at 1 to VERIFY_ROWS
    token rows (decode, verify 1..MAX_DRAFT, batch groups), with the 7B shapes."""
    shapes = {"qkv": (12288, 4096), "o_proj": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008),
              "lm_head": (32000, 4096)}
    for fmt in issue.FORMATS:
        for rows in range(1, plans.VERIFY_ROWS + 1):
            found = {v.shape: (v.M, v.K) for v in VARIANTS if v.fmt == fmt and v.rows == rows}
            assert found == shapes, (fmt, rows)
    steps = {s for v in VARIANTS for s in v.steps}
    assert {"decode", f"verify {plans.MAX_DRAFT}", f"batch {plans.VERIFY_ROWS}"} <= steps


# A GEMV of the plans' shape (x += W · in, ROWS rows a block, 128 threads sweeping K in 16-byte streaming loads)
# whose every weight element also goes through EXTRA dependent FFMAs: the slow variant that the budget must catch.
SEEDED = r"""
#include "common.cuh"
#define THREADS 128
extern "C" __global__ void __launch_bounds__(THREADS)
gemv_residual(const float* __restrict__ in, const half_t* __restrict__ W, float* __restrict__ x, int M, int K) {
    __shared__ float part[ROWS][THREADS / WARP];
    float acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
    for (int v = threadIdx.x; v < K / 8; v += THREADS) {
        const float4 a = reinterpret_cast<const float4*>(in)[2 * v], b = reinterpret_cast<const float4*>(in)[2 * v + 1];
        const float xv[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            float w[8];
            unpack8(load_stream(reinterpret_cast<const uint4*>(W + (size_t)(blockIdx.x * ROWS + r) * K) + v), w);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float p = w[i];
#pragma unroll
                for (int e = 0; e < EXTRA; ++e) p = fmaf(p, xv[i], p);  // the seeded slowness
                acc[r] = fmaf(p, xv[i], acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const float s = warp_sum(acc[r]);
        if (threadIdx.x % WARP == 0) part[r][threadIdx.x / WARP] = s;
    }
    __syncthreads();
    if (threadIdx.x >= ROWS) return;
    float s = 0.f;
    for (int w = 0; w < THREADS / WARP; ++w) s += part[threadIdx.x][w];
    x[blockIdx.x * ROWS + threadIdx.x] += s;
}
"""


@pytest.fixture
def seeded_source(tmp_path, monkeypatch):
    """kernels_cu with the seeded GEMV beside the real headers, as the registry compiles from."""
    for header in SOURCE_DIR.glob("*.cuh"):
        shutil.copy(header, tmp_path / header.name)
    (tmp_path / "seeded_gemv.cu").write_text(SEEDED)
    monkeypatch.setattr(registry, "SOURCE_DIR", tmp_path)
    return "seeded_gemv.cu"


@pytest.mark.parametrize("extra, over", [(0, False), (8, True)])
def test_the_budget_catches_a_seeded_slow_gemv(tool, seeded_source, extra, over):
    """At o_proj's shape (4096 x 4096, 4 rows a block: 1024 blocks), the plain kernel costs ~1.5-2.5 lane-
    instructions per byte; eight more FFMAs per weight element (4 per byte) put it over the 5.0 limit."""
    rows, M, K = 4, 4096, 4096
    v = issue.Variant("float16", 1, seeded_source, "gemv_residual", (("ROWS", rows), ("EXTRA", extra)), "o_proj", M, K,
                      (M // rows, 1, 1), 128, 2 * M * K, 2 * M * K, ("seeded",))
    counted, _ = issue.count_variant(v, tool)
    print(f"EXTRA={extra}: loop {counted.loop_per_byte:.2f}/B, whole {counted.whole_per_byte:.2f}/B")
    assert counted.loop_bytes == rows * 16  # one 16-byte streaming load per row and iteration
    assert counted.iterations == pytest.approx(K / 8 / 128)
    problem = issue.over_budget(v, counted)
    assert (problem is not None) == over, problem
    if over:
        assert "seeded_gemv.cu gemv_residual (ROWS=4 EXTRA=8) at o_proj 4096x4096" in problem


def test_the_report_lists_every_variant_or_says_why_not(monkeypatch):
    """Without the tools, one line says what is missing."""
    monkeypatch.setattr(sass, "cuobjdump", lambda: None)
    assert issue.report() == [f"issue budget: not counted: {sass.MISSING}"]


def test_the_budgets_are_the_issues():
    assert issue.H200.budget == pytest.approx(7.53, abs=0.01)
    assert issue.H100.budget == pytest.approx(9.99, abs=0.01)


def test_cullama_kernels_issue_prints_the_report(monkeypatch):
    """`cullama kernels --issue`: the resource table, then the budget's lines (here without compiling anything)."""
    from click.testing import CliRunner

    from cullama.bench import kernels
    from cullama.cli.main import main

    monkeypatch.setattr(kernels, "compile_all", lambda arch: [])
    monkeypatch.setattr(issue, "report", lambda: ["issue budget: line one", "0 GEMV launches over 5.0"])
    done = CliRunner().invoke(main, ["kernels", "--issue"])
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    assert lines[-3].startswith("0 kernels compiled for sm_90") and lines[-2:] == ["issue budget: line one",
                                                                                   "0 GEMV launches over 5.0"]
    plain = CliRunner().invoke(main, ["kernels"])
    assert plain.exit_code == 0 and "issue budget" not in plain.output


def test_a_loop_body_placed_after_the_loop_is_counted():
    """ptxas may place part of a loop's body after the code that follows the loop (a branch out and back): the main
    loop is the back edge's natural loop (every block reaching its tail without passing its head), so those
    instructions count on every iteration, not once (an address-range loop would miss the 8 FFMAs)."""
    def ins(address, opcode, *operands, modifiers=(), predicate=None):
        return sass.Instruction(address, predicate, opcode, tuple(modifiers), list(operands))

    code = [ins(0x00, "MOV", "R1", "RZ"),
            ins(0x10, "LDG", "R4", "[R2]", modifiers=("E", "NA", "128")),  # head: the streaming load
            ins(0x20, "BRA", "0x60"),  # out to the rest of the body
            ins(0x30, "ISETP", "P0", "PT", "R1", "0x40", "PT", modifiers=("GE", "AND")),  # tail
            ins(0x40, "BRA", "0x10", predicate="!P0"),  # the back edge
            ins(0x50, "EXIT")]
    code += [ins(0x60 + 0x10 * i, "FFMA", "R5", "R4", "R4", "R5") for i in range(8)]
    code += [ins(0xe0, "IADD3", "R1", "R1", "0x1", "RZ"), ins(0xf0, "BRA", "0x30")]
    counted = issue.count(code, threads=32, thread_streamed=16 * 64, thread_bytes=16 * 64)
    assert counted.loop_bytes == 16
    assert counted.loop_instructions == 2 + 2 + 10  # head, tail, and the 8 FFMAs + IADD3 + BRA placed after the exit
    assert counted.iterations == 64


def test_a_jump_back_that_closes_no_cycle_is_no_loop():
    """ptxas may end a stretch with a branch to an earlier address that does not lead back (straight-line code laid
    out out of order): that is no loop, and must not be taken for the main loop (here it would hold the first batch
    of weight loads and be smaller than the real loop)."""
    def ins(address, opcode, *operands, modifiers=(), predicate=None):
        return sass.Instruction(address, predicate, opcode, tuple(modifiers), list(operands))

    ldg = ("E", "NA", "128")
    code = [ins(0x00, "LDG", "R4", "[R2]", modifiers=ldg),  # the first batch, before the loop
            ins(0x10, "BRA", "0xa0"),  # to straight-line code placed after the loop
            ins(0x20, "MOV", "R1", "RZ"),  # ... which comes back here
            ins(0x30, "LDG", "R4", "[R2]", modifiers=ldg),  # the real loop (three blocks): head
            ins(0x40, "BRA", "0x60", predicate="P1"),
            ins(0x50, "FFMA", "R5", "R4", "R4", "R5"),
            ins(0x60, "IADD3", "R1", "R1", "0x1", "RZ"),
            ins(0x70, "ISETP", "P0", "PT", "R1", "0x40", "PT", modifiers=("GE", "AND")),
            ins(0x80, "BRA", "0x30", predicate="!P0"),  # the back edge
            ins(0x90, "EXIT"),
            ins(0xa0, "FADD", "R6", "R6", "R6"),
            ins(0xb0, "BRA", "0x20")]  # an earlier address, but no cycle: not a loop (three blocks with the entry)
    counted = issue.count(code, threads=32, thread_streamed=16 * 64, thread_bytes=16 * 64)
    assert counted.loop_instructions == 6 and counted.loop_bytes == 16


@pytest.mark.parametrize("bound, one_warp", [("0xf", True), ("c[0x0][0x210]", False), ("UR4", False)])
def test_an_early_return_counts_one_warp_only_when_it_reads_threadidx_alone(bound, one_warp):
    """Past the last barrier, `if (threadIdx.x >= 16) return;` (a predicated EXIT from S2R SR_TID.X and an immediate)
    leaves one warp to run the rest: that code counts once per block (1/4 per thread of 128). An EXIT that compares
    with a kernel parameter (`if (p >= n_pairs) return;`, c[..] or a uniform register) sends no warp away outside
    the last block: the rest counts on every warp."""
    def ins(address, opcode, *operands, modifiers=(), predicate=None):
        return sass.Instruction(address, predicate, opcode, tuple(modifiers), list(operands))

    code = [ins(0x00, "S2R", "R0", "SR_TID.X"),
            ins(0x10, "LOP3", "R1", "R0", "0x7f", "RZ", "0xc0", "!PT"),
            ins(0x20, "LDG", "R4", "[R2]", modifiers=("E", "NA", "128")),
            ins(0x30, "BAR", "SYNC", "0x0"),
            ins(0x40, "ISETP", "P0", "PT", "R1", bound, "PT", modifiers=("GT", "U32", "AND")),
            ins(0x50, "EXIT", predicate="P0")]
    code += [ins(0x60 + 0x10 * i, "FADD", "R5", "R5", "R4") for i in range(40)]
    code += [ins(0x60 + 0x10 * 40, "EXIT")]
    counted = issue.count(code, threads=128, thread_streamed=16, thread_bytes=16)
    before = 4 + 2  # S2R, LOP3, LDG, BAR; ISETP and EXIT (in the barrier's block)
    epilogue = 41  # the FADDs and the last EXIT
    assert counted.whole_instructions == pytest.approx(before + (epilogue / 4 if one_warp else epilogue))
