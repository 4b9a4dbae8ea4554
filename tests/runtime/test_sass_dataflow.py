"""The machine-code check behind "a row's arithmetic does not depend on its company": every kernel variant that a
verify step (k + 1 token rows) or a batched decode step (B rows) launches computes each row through the same chains
of floating-point operations as the decode step's one-row variant, in its sm_90 SASS (tests/sass_dataflow.py: the
dataflow of every value, traced through registers, loop bodies compared per iteration). The CPU executor compiles
without FMA contraction, so it cannot see a contraction or a reassociation that ptxas makes in one variant only;
this can, as the seeded changes show. (Leaves of one kind are interchangeable in the chains, so a sum of loads in
another order is not seen here: the executor sees that, since it adds in the source's order, and neither NVVM nor
ptxas reorders an IEEE sum on its own.)

The kernels a batched step launches with more than one row: gemv.cu's, and gemv_quant.cu's for a quantized model,
with TOKENS = rows (a batch of B <= 9 rows runs the verify step's variants, more rows in groups of them:
plan.batch_groups), attention_decode and sample (one binary for every row count: the rows only offset addresses,
so there is no other variant to compare)."""

from __future__ import annotations

import re
import shutil

import pytest

from tests import sass_dataflow as sd
from cullama.model import layout as layouts, quant
from cullama.runtime import plan as plans, registry
from cullama.model.config import preset
from cullama.runtime.ops import gemv as gemv_twin, gemv_quant as gemv_quant_ops
from cullama.kernels_cu import SOURCE_DIR

GEMV_KERNELS = ("gemv_qkv_rope", "gemv_residual", "gemv_gate_up_silu", "gemv_logits")
ARCH = "sm_90"


@pytest.fixture(scope="module")
def tool():
    found = sd.cuobjdump()
    if found is None:
        pytest.skip("cuobjdump -sass needs cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and "
                    "nvidia-cuda-nvdisasm wheels, in the `test` extra)")
    return found


def signatures(tool, source: str, defines: tuple, kernels, nodes: sd.Nodes) -> dict[str, set[int]]:
    text = sd.sass(registry.compile_module(source, defines, ARCH).cubin_path, tool)
    return {name: sd.signature(sd.parse(text, name), nodes) for name in kernels}


def check_rows_variants(tool, source: str, one: tuple, many: list[tuple], kernels) -> None:
    """Each of `many` (multi-row defines) has exactly the one-row variant's floating-point chains, per kernel."""
    nodes = sd.Nodes()
    reference = signatures(tool, source, one, kernels, nodes)
    for name, found in reference.items():
        assert len(found) >= 3, f"{name}: no chains found in its SASS: the parser lost them"
    for defines in many:
        for name, found in signatures(tool, source, defines, kernels, nodes).items():
            assert found == reference[name], (f"{source} {name} {defines} against {one}: "
                                              + sd.difference(found, reference[name], nodes))


def gemv_launches(model, source: str) -> set[tuple[str, tuple]]:
    """(kernel, defines) of every `source` launch the plans of `model` (a config or a layout) make: its decode step,
    its verify steps of 1..MAX_DRAFT drafts and its batched steps' groups of 1..VERIFY_ROWS rows."""
    steps = ([plans.decode_plan(model, 64)] + [plans.verify_plan(model, 64, k) for k in range(1, plans.MAX_DRAFT + 1)]
             + [plans.batch_plan(model, 64, rows) for rows in range(1, plans.VERIFY_ROWS + 1)])
    return {(s.name, s.defines) for step in steps for s in step.kernels() if s.source == source}


def test_every_multi_row_gemv_has_the_decode_steps_chains(tool):
    """TOKENS 2..9 (a verify step of 1..8 drafts; a batched step of 2..9 rows, or a group of a larger one): every
    gemv.cu variant the plans launch."""
    one = plans.gemv(GEMV_KERNELS[0], 1).defines
    assert gemv_twin.VERIFY_VARIANTS == [plans.gemv(GEMV_KERNELS[0], t).defines for t in range(2, 10)]
    assert gemv_launches(preset("tiny"), "gemv.cu") == {(name, d) for name in GEMV_KERNELS
                                                        for d in [one] + gemv_twin.VERIFY_VARIANTS}
    check_rows_variants(tool, "gemv.cu", one, gemv_twin.VERIFY_VARIANTS, GEMV_KERNELS)


@pytest.mark.parametrize("bits", quant.BITS)
def test_every_multi_row_quantized_gemv_has_the_decode_steps_chains(tool, bits):
    """gemv_quant.cu (W4A16, W8A16): every variant the plans launch with more than one row against the decode
    step's (gemv_logits stays FP16: gemv.cu's, checked above). The one-row variant unrolls its loop over a vector's
    quads of codes and the multi-row ones keep it rolled (gemv_quant.cu's QUAD_UNROLL, for registers), and ptxas
    writes the dequantization's FP16 subtraction as HADD2 or as HFMA2.MMA by 1.0 as its schedule suits it: the
    checker compares accumulations link by link and takes fma(a, 1, c) for a + c (sass_dataflow.py's docstring)."""
    launched = gemv_launches(layouts.on_load(preset("tiny"), f"int{bits}"), gemv_quant_ops.SOURCE)
    names = sorted({name for name, _ in launched})
    one = gemv_quant_ops.defines(bits)
    many = sorted({defines for _, defines in launched} - {one}, key=lambda d: dict(d)["TOKENS"])
    assert names == sorted(GEMV_KERNELS[:3])
    assert many == [gemv_quant_ops.defines(bits, t) for t in range(2, gemv_quant_ops.MAX_TOKENS + 1)]
    assert launched == {(name, d) for name in names for d in [one] + many}
    check_rows_variants(tool, gemv_quant_ops.SOURCE, one, many, names)


# (id, file in kernels_cu, its original text, the replacement, kernel, the difference the check must report):
# changes whose arithmetic is the same in every variant without contraction or on every input the kernels see (so
# the CPU executor computes the same bits for them), and which ptxas compiles into other chains in the multi-row
# variants: the check must fail on each, naming what differs.
SEEDED = [
    # x += dot * 0.3: the product rounded on its own in the multi-row variants (__fmul_rn), where the one-row
    # variant lets ptxas fuse it into the add (one rounding): what a contraction decided by the code around it does
    ("contracted-in-one-variant-only", "gemv.cuh",
     "if (row < M) x[(size_t)t * M + row] = __fadd_rn(x[(size_t)t * M + row], dot[r]);",
     "if (row < M) x[(size_t)t * M + row] += TOKENS > 1 ? __fmul_rn(dot[r], 0.3f) : dot[r] * 0.3f;",
     "gemv_residual", r"FMUL\(.*0x3e99999a"),
    # x + (p0 + p1 + p2 + p3) as (x + (p0 + p1 + p2)) + p3 in the multi-row variants (the warps' sums p_w)
    ("reassociated-in-one-variant-only", "gemv.cuh",
     "if (row < M) x[(size_t)t * M + row] = __fadd_rn(x[(size_t)t * M + row], dot[r]);",
     "if (row < M) x[(size_t)t * M + row] = TOKENS == 1 ? x[(size_t)t * M + row] + dot[r] : "
     "(x[(size_t)t * M + row] + ((sums.partial[0][t][r] + sums.partial[1][t][r]) + sums.partial[2][t][r])) + "
     "sums.partial[3][t][r];", "gemv_residual", r"FADD\(.*FADD\(ldg"),
    # gemv_quant.cu's dot product, one link per code (a rolled loop against an unrolled one): contracted into FFMA
    # in the multi-row variants, rounded twice (FMUL, then FADD) in the one-row variant
    ("quantized-dot-contracted-in-the-multi-row-variants-only", "gemv_quant.cu",
     "for (int i = 0; i < 4; ++i) part[t][r] = fmaf(w[i], xv[t][i], part[t][r]);",
     "for (int i = 0; i < 4; ++i) part[t][r] = TOKENS > 1 ? w[i] * xv[t][i] + part[t][r] "
     ": __fadd_rn(__fmul_rn(w[i], xv[t][i]), part[t][r]);", "gemv_residual", r"FADD\(FMUL\(ldg"),
    # the group's scale applied to a vector's sum: contracted in the multi-row variants only
    ("quantized-scale-contracted-in-the-multi-row-variants-only", "gemv_quant.cu",
     "for (int t = 0; t < TOKENS; ++t) acc[t][r] = fmaf(part[t][r], scale, acc[t][r]);",
     "for (int t = 0; t < TOKENS; ++t) acc[t][r] = TOKENS > 1 ? part[t][r] * scale + acc[t][r] "
     ": __fadd_rn(__fmul_rn(part[t][r], scale), acc[t][r]);", "gemv_residual",
     r"FADD\(in, FMUL\(HADD2\.F32\(HALF\.H0_H0"),
    # the dequantization's subtraction as an FMA by 1.0 that flushes subnormals (.ftz), in the multi-row variants
    # only: the same value for every code (q - zero is an integer), another operation in general, which the
    # checker's fma(a, 1, c) == a + c must not take for an add
    ("quantized-dequant-flushed-in-the-multi-row-variants-only", "dequant.cuh",
     "    return hsub2(biased, bias);",
     "    if (TOKENS == 1) return hsub2(biased, bias);\n    uint32_t d;\n"
     '    asm("{ .reg .b32 n; neg.f16x2 n, %3; fma.rn.ftz.f16x2 %0, %1, %2, n; }" '
     ': "=r"(d) : "r"(biased), "r"(0x3C003C00u), "r"(bias));\n    return d;', "gemv_residual",
     r"(HADD2|HFMA2\.MMA)\.FTZ\(int, "),
]


@pytest.mark.parametrize("seed", SEEDED, ids=[s[0] for s in SEEDED])
def test_a_seeded_difference_between_variants_fails_the_check(tool, tmp_path, monkeypatch, seed):
    _, file, original, replacement, kernel, reported = seed
    source_dir = tmp_path / "kernels_cu"
    shutil.copytree(SOURCE_DIR, source_dir)
    path = source_dir / file
    text = path.read_text()
    assert text.count(original) == 1, f"the seeded change's original text is not in {file} exactly once"
    path.write_text(text.replace(original, replacement))
    monkeypatch.setattr(registry, "SOURCE_DIR", source_dir)
    monkeypatch.setenv("CULLAMA_CACHE", str(tmp_path / "cache"))
    source, one, many = (("gemv.cu", plans.gemv(kernel, 1).defines, plans.gemv(kernel, 5).defines)
                         if file == "gemv.cuh" else
                         (gemv_quant_ops.SOURCE, gemv_quant_ops.defines(4), gemv_quant_ops.defines(4, 5)))
    with pytest.raises(AssertionError, match=kernel) as failed:
        check_rows_variants(tool, source, one, [many], (kernel,))
    assert re.search(reported, str(failed.value)), f"not the seeded difference: {failed.value}"


SNIPPET = """
        Function : toy
        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0010*/                   FMUL R3, R2, 0.5 ;
        /*0020*/                   FADD R6, R3, R2 ;
        /*0030*/                   FADD R7, R2, R3 ;
        /*0040*/              @P0  FFMA R8, R2, R3, R6 ;
        /*0050*/                   STG.E desc[UR4][R4.64], R7 ;
        /*0060*/                   EXIT ;
"""


def test_the_dataflow_of_a_snippet():
    """Commutative operands in either order are one node; a predicated write keeps its own node as an output; a
    value stored is an output; leaves are named by where they come from, immediates by their bits (0.5:
    0x3f000000); an FFMA's addend is cut off (acc) and is an output of its own, the accumulation a CHAIN of
    links."""
    nodes = sd.Nodes()
    found = {nodes.text(n) for n in sd.signature(sd.parse(SNIPPET, "toy"), nodes)}
    link = "FFMA(ldg, FMUL(ldg, 0x3f000000), acc)"
    assert found == {"FADD(ldg, FMUL(ldg, 0x3f000000))", link, f"CHAIN({link})"}


def function(name: str, lines: list[str]) -> list[sd.Instruction]:
    """`lines` as cuobjdump prints a function, at addresses 0x0, 0x10, ..."""
    body = "".join(f"        /*{16 * i:04x}*/  {line} ;\n" for i, line in enumerate(lines))
    return sd.parse(f"        Function : {name}\n{body}", name)


# A dot product of two dequantized codes, x = q - zero in FP16 (zero's bias from a register live in) and x * x
# summed: unrolled, as a decode step's variant does it, and in a loop, as the multi-row variants do, with the bias
# hoisted out of the loop and the sum carried around it.
UNROLLED = ["HADD2 R7, R6, 1024, 1024", "LDG.E R2, desc[UR4][R4.64]", "HADD2 R3, R2, -R7", "FFMA R8, R3, R3, RZ",
            "LDG.E R2, desc[UR4][R4.64+0x4]", "HFMA2.MMA R3, R2, 1, 1, -R7", "FFMA R8, R3, R3, R8",
            "STG.E desc[UR4][R4.64], R8", "EXIT"]
ROLLED = ["HADD2 R7, R6, 1024, 1024", "CS2R R8, SRZ", "LDG.E R2, desc[UR4][R4.64]", "HADD2 R3, R2, -R7",
          "FFMA R8, R3, R3, R8", "@P0 BRA 0x20", "STG.E desc[UR4][R4.64], R8", "EXIT"]
LINK = "FFMA(HADD2(ldg, -HADD2(in, 0x64006400)), HADD2(ldg, -HADD2(in, 0x64006400)), acc)"


@pytest.mark.parametrize("subtract, accumulate, alike", [
    ("HFMA2.MMA R3, R2, 1, 1, -R7", ["FFMA R8, R3, R3, R8"], True),  # fma(a, 1, c) == a + c
    ("HFMA2 R3, R2, 1, 1, -R7", ["FFMA R8, R3, R3, R8"], True),
    ("HFMA2.MMA R3, R2, 1, 2, -R7", ["FFMA R8, R3, R3, R8"], False),  # the high half multiplied by 2
    ("HFMA2.MMA.FTZ R3, R2, 1, 1, -R7", ["FFMA R8, R3, R3, R8"], False),  # subnormals flushed
    ("HADD2 R3, R2, -R7", ["FMUL R9, R3, R3", "FADD R8, R9, R8"], False),  # rounded twice
])
def test_a_rolled_loop_compares_link_by_link_with_its_unrolled_form(subtract, accumulate, alike):
    """The rolled loop's one link, its hoisted bias substituted, is each link of the unrolled chain; a different
    operation in one link is not."""
    nodes = sd.Nodes()
    rolled = sd.signature(function("rolled", ROLLED), nodes)
    assert {nodes.text(n) for n in rolled} == {LINK, f"CHAIN({LINK})"}
    unrolled = UNROLLED[:5] + [subtract] + accumulate + UNROLLED[7:]
    assert (sd.signature(function("unrolled", unrolled), nodes) == rolled) is alike


@pytest.mark.parametrize("second, alike", [(["FFMA R8, R2, R2, R8", "FFMA R8, R3, R3, R8"], True),
                                           (["FFMA R8, R3, R3, R8", "FFMA R8, R2, R2, R8"], False)])
def test_an_unrolled_accumulation_must_repeat_the_loops_links_in_their_order(second, alike):
    """Σ x0² + x1² over pairs (x0, x1), rolled against unrolled twice: the same links either way, but an unrolled
    chain that adds the second pair's terms in the other order is not the loop's iteration repeated."""
    nodes = sd.Nodes()
    rolled = ["CS2R R8, SRZ", "LDG.E.64 R2, desc[UR4][R4.64]", "FFMA R8, R2, R2, R8", "FFMA R8, R3, R3, R8",
              "@P0 BRA 0x10", "STG.E desc[UR4][R4.64], R8", "EXIT"]
    unrolled = (["LDG.E.64 R2, desc[UR4][R4.64]", "FFMA R8, R2, R2, RZ", "FFMA R8, R3, R3, R8",
                 "LDG.E.64 R2, desc[UR4][R4.64+0x8]"] + second + ["STG.E desc[UR4][R4.64], R8", "EXIT"])
    expected = sd.signature(function("rolled", rolled), nodes)
    assert {nodes.text(n) for n in expected} >= {"CHAIN(FFMA(ldg, ldg, acc), FFMA(ldg+1, ldg+1, acc))"}
    assert (sd.signature(function("unrolled", unrolled), nodes) == expected) is alike


def test_a_call_or_a_second_way_into_a_loop_leaves_nothing_known():
    """A register a subroutine may have written is a leaf, not the value it had before the call; so is one at the
    head of a loop that is also entered from elsewhere."""
    nodes = sd.Nodes()
    called = ["FADD R2, R3, R3", "CALL.REL.NOINC 0x40", "FMUL R5, R2, R2", "EXIT", "RET.REL.NODEC R20 0x0"]
    assert {nodes.text(n) for n in sd.signature(function("called", called), nodes)} == {"FADD(in, in)",
                                                                                      "FMUL(in, in)"}
    # R7 = X, and into the loop's second block; or R7 = Y, and into its head; the head uses R7 (X or Y)
    entered = ["FADD R7, R3, R3", "@P1 BRA 0x40", "FMUL R7, R3, R3", "FMUL R5, R7, R7", "@P0 BRA 0x30", "EXIT"]
    found = {nodes.text(n) for n in sd.signature(function("entered", entered), nodes)}
    assert found == {"FADD(in, in)", "FMUL(in, in)"}  # not FMUL(Y, Y)
