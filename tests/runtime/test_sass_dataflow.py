"""tests/sass_dataflow.py, the reader of a kernel's floating-point dataflow in its SASS (cuobjdump -sass), on
hand-written SASS: what it takes for one node, what it keeps apart, how it cuts a loop into links.

It compared the machine code of the CUDA-core decode GEMVs (gemv.cu, gemv_quant.cu), whose one-row and multi-row
variants (TOKENS 1 against 2..9) were separate loops that ptxas contracted and unrolled as it chose, so a row's
arithmetic could depend on its company in the SASS alone. Those kernels are gone: gemv_mma.cu computes every token
row as a row of M in the same mma.sync instructions (A rows past TOKENS zero), a row's sums are the MMA's and its
epilogue's arithmetic explicit (__fadd_rn, __fmul_rn, __fdiv_rn), so there are no per-variant chains left to
compare; a token row against the same row alone is checked bit for bit where it can differ, on the GPU
(tests/runtime/ops/test_gemv_mma.py test_gpu_rows_are_independent) and on the executor. attention_decode and sample
have one binary for every row count. The reader stays for the next kernel whose variants need it."""

from __future__ import annotations

import pytest

from tests import sass_dataflow as sd


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
