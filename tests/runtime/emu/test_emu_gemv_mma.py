"""gemv_mma.cu as written, run on the CPU by cullama.runtime.emu: every format at every row count against its twin bit
for bit (the twin models the executor's MMA and the kernel's order), in every warp schedule; a token row of a T-row
launch equal to the row alone and to row 0 of a launch of other rows; and seeded bugs (a fragment half swapped, a
wrong code pair, a group index off by one, the warp order of the partials, a missed barrier, the rows past
the first left unwritten, ...) that these checks must catch."""

from __future__ import annotations

import pytest

from cullama.runtime import emu
from cullama.runtime.ops import gemv_mma as twin
from tests.emulated import check_seeded_bug, emu_launcher
from tests.runtime.ops import test_gemv_mma as checks

pytestmark = pytest.mark.emu


@pytest.mark.parametrize("bits", twin.FORMATS)
@pytest.mark.parametrize("tokens", range(1, twin.MAX_TOKENS + 1))
def test_every_variant_is_its_twin(bits, tokens):
    checks.check_against_twin(emu_launcher("shuffled"), bits, tokens)


@pytest.mark.parametrize("schedule", emu.SCHEDULES)
@pytest.mark.parametrize("bits", twin.FORMATS)
def test_every_schedule(bits, schedule):
    checks.check_against_twin(emu_launcher(schedule), bits, 9, cases=checks.CASES[bits][:2])


@pytest.mark.parametrize("bits,form", [(16, "prep"), (16, "x"), (8, "prep"), (4, "prep")])  # "x": gemv_logits_x
@pytest.mark.parametrize("tokens", [2, 8, 9, 16])
def test_a_row_is_the_row_alone_and_row_0(bits, tokens, form):
    checks.check_row_independence(emu_launcher("shuffled"), bits, tokens, form=form)


def against_twin(bits, tokens=9):
    return lambda launch: checks.check_against_twin(launch, bits, tokens, cases=checks.CASES[bits][:3])


# (id, file, original text, its replacement, the check that must fail)
MUTATIONS = [
    ("fp16-b-fragment-halves-swapped", "gemv_mma.cu", "b0 = words[2 * s], b1 = words[2 * s + 1];",
     "b0 = words[2 * s + 1], b1 = words[2 * s];", against_twin(16)),
    ("quant-wrong-code-pair", "gemv_mma.cu", "b1 = code_pair4(word, word >> 8, bias, bias64, pair + 1);",
     "b1 = code_pair4(word, word >> 8, bias, bias64, pair);", against_twin(4)),
    ("int4-odd-pair-under-the-wrong-bias", "dequant.cuh",
     "hsub2(lop3<LUT_A_AND_B_OR_C>(src, 0x00F000F0u, FP16_64X2), bias64)",
     "hsub2(lop3<LUT_A_AND_B_OR_C>(src, 0x00F000F0u, FP16_64X2), bias)", against_twin(4)),
    ("quant-scale-not-applied", "gemv_mma.cu", "    b0 = hmul2(b0, scale);\n",
     "\n", against_twin(8)),
    ("quant-group-of-the-next-chunk", "gemv_mma.cu", "const int cc = min(c, b.vecs - 1), group = group_of(b, cc);",
     "const int cc = min(c, b.vecs - 1), group = min(group_of(b, cc + 1), b.vecs / b.group_vecs - 1);",
     against_twin(8)),
    ("quant-weights-past-k-not-zeroed", "gemv_mma.cu",
     "b.p[u][j] = KBLOCK_SCALE || inside ? b.P[b.params[j] + group] : 0u;",
     "b.p[u][j] = b.P[b.params[j] + group];", against_twin(4)),
    ("kblock-scale-of-the-wrong-row", "gemv_mma.cu", "lo_f(b.p[u][2 * J + e / 2])", "lo_f(b.p[u][2 * J])",
     against_twin(4)),
    ("kblock-sum-not-restarted", "gemv_mma.cu",
     "part[J][n][0] = part[J][n][1] = part[J][n][2] = part[J][n][3] = 0.f;",
     "part[J][n][0] = part[J][n][1] = part[J][n][2] = part[J][n][3] = acc[J][n][0];", against_twin(4)),
    ("x-second-half-token-row-off", "gemv_mma.cu", "x_pair(x + (size_t)(g + 8) * K + k, gn, inside, x1[s], ss1);",
     "x_pair(x + (size_t)(g + 7) * K + k, gn, inside, x1[s], ss1);", against_twin(16, 12)),
    ("residual-writes-row-0-only", "gemv_mma.cu", "        x[(size_t)tok * M + row] = v;",
     "        if (tok == 0) x[(size_t)tok * M + row] = v;", against_twin(8, 3)),
    # the prepared input (gemv_residual writes it, gemv_qkv_rope / gate_up / logits read it)
    ("prepared-xn-normed-by-the-first-weight", "gemv_mma.cu", "norm_input(v, norm_w[row])",
     "norm_input(v, norm_w[0])", against_twin(16)),
    ("prepared-ss-part-in-the-next-block's-place", "gemv_mma.cu",
     "ssp[(size_t)tok * parts + first / SS_SPAN] = ss;",
     "ssp[(size_t)tok * parts + min(first / SS_SPAN + 1, parts - 1)] = ss;", against_twin(16)),
    ("prepared-ss-last-row-of-a-block-left-out", "gemv_mma.cu", "return part.x[tok][p * SS_SPAN + i]; }, rows);",
     "return part.x[tok][p * SS_SPAN + i]; }, rows - 1);", against_twin(4)),
    # prepare.cuh, every writer's (the residual's here; sample's and embed_rows_prepared's: test_emu_mutations.py)
    ("prepared-part-misses-its-last-element", "prepare.cuh", "        if (i < n) {", "        if (i < n - 1) {",
     against_twin(8)),
    ("prepared-scale-butterfly-skips-odd-lanes", "gemv_mma.cu",
     "for (int m = 1; m < WARP; m *= 2) v[t] = __fadd_rn(v[t], __shfl_xor_sync(",
     "for (int m = 2; m < WARP; m *= 2) v[t] = __fadd_rn(v[t], __shfl_xor_sync(",
     against_twin(16)),
    # lane t keeps the warp's t-th row's sum: at 9 rows warp 0's rows 0, 4, 8 (row 4's scale from lane 1)
    ("prepared-scale-of-every-row-from-lane-0", "gemv_mma.cu", "if (lane == t) mine = v[t];",
     "if (lane == 0) mine = v[t];", against_twin(16, 9)),
    ("fp16-input-read-as-float32", "gemv_mma.cu", "if (FORM == X_PREP || FORM == X_HALF) {", "if (FORM == X_PREP) {",
     against_twin(8, 3)),
    ("prepared-x-of-token-row-0", "gemv_mma.cu", "xn + (size_t)g * K + (size_t)c * ELEMS",
     "xn + (size_t)0 * K + (size_t)c * ELEMS", against_twin(8, 3)),
    ("last-partial-k-block-skipped", "gemv_mma.cu", "const int kblocks = (b.vecs + 3) / 4;",
     "const int kblocks = b.vecs / 4;", against_twin(16)),
    ("warp-partials-in-reverse", "gemv_mma.cu",
     "    float d = part.dot[0][i][tok];\n#pragma unroll\n    for (int w = 1; w < WARPS; ++w) d = __fadd_rn(d, part.dot[w][i][tok]);",
     "    float d = part.dot[WARPS - 1][i][tok];\n#pragma unroll\n    for (int w = WARPS - 2; w >= 0; --w) d = __fadd_rn(d, part.dot[w][i][tok]);",
     against_twin(16)),
    ("norm-sum-of-squares-skips-a-lane", "gemv_mma.cu", "if (w || t) ss = __fadd_rn(ss, part.ss[w][t][tok]);",
     "if (w || t > 1) ss = __fadd_rn(ss, part.ss[w][t][tok]);", against_twin(16)),  # gemv_logits_x's (FP16 only)
    ("partials-barrier-removed", "gemv_mma.cu", "        part.ss[warp][t][g + 8] = ss1;\n    }\n    __syncthreads();",
     "        part.ss[warp][t][g + 8] = ss1;\n    }", against_twin(16)),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_seeded_bug_fails_its_check(tmp_path, mutation):
    check_seeded_bug(tmp_path, mutation)
