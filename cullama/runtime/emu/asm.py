"""The one change the emulator makes to a kernel source: each GNU inline-asm statement with PTX becomes a call of
the C++ function (cullama/runtime/emu/ptx.h) that its literal template maps to in PTX_TEMPLATES, with the asm's file and
line, then its operands in order (outputs by reference, inputs by value). A template not in the table, or one
whose operand constraints differ from the table's, fails the build with its text: a typo in a PTX string fails
here as it would in ptxas. So does a collective (.sync.aligned: mma.sync, ldmatrix, wgmma) not written `asm
volatile`, which the compiler could move or merge. It works on preprocessed text (templates built from macros are whole by then).

One declaration form C++ cannot take either: `extern __shared__ T name[];` (the dynamic shared memory window)
becomes `T* const name = (T*)emu_dynamic_shared();`, the same window the runtime maps at its shared address.
"""

from __future__ import annotations

import ast
import re

from ...common.errors import KernelError


def _wgmma_template(n: int) -> str:
    regs = ", ".join(f"%{i}" for i in range(n // 2))
    a, b, scale = n // 2, n // 2 + 1, n // 2 + 2
    return (f"{{ .reg .pred p; setp.ne.b32 p, %{scale}, 0; wgmma.mma_async.sync.aligned.m64n{n}k16.f32.f16.f16 "
            f"{{{regs}}}, %{a}, %{b}, p, 1, 1, 0, 0; }}")


# Normalised template (whitespace runs as one space) -> (ptx.h function, operand constraints in order).
PTX_TEMPLATES: dict[str, tuple[str, str]] = {
    "cvt.f32.f16 %0, %1;": ("cvt_f32_f16", "=f h"),
    "cvt.rn.f16.f32 %0, %1;": ("cvt_rn_f16_f32", "=h f"),
    "cvt.rn.f16x2.f32 %0, %1, %2;": ("cvt_rn_f16x2_f32", "=r f f"),
    "ex2.approx.ftz.f32 %0, %1;": ("ex2_approx_ftz_f32", "=f f"),
    "ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];": ("ld_global_nc_v4_u32", "=r =r =r =r l"),
    "ld.global.cg.f32 %0, [%1];": ("ld_global_cg_f32", "=f l"),
    "ld.global.cg.v2.f32 {%0, %1}, [%2];": ("ld_global_cg_v2_f32", "=f =f l"),
    "griddepcontrol.wait;": ("griddepcontrol_wait", ""),
    "griddepcontrol.launch_dependents;": ("griddepcontrol_launch_dependents", ""),
    "": ("compiler_barrier", "+f"),
    "{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }": ("cvta_to_shared", "=r l"),
    "cp.async.cg.shared.global [%0], [%1], 16, %2;": ("cp_async_cg_16", "r l r"),
    "cp.async.commit_group;": ("cp_async_commit_group", ""),
    "cp.async.wait_group %0;": ("cp_async_wait_group", "n"),
    "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];": ("ldmatrix_x4", "=r =r =r =r r"),
    "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];": ("ldmatrix_x4_trans", "=r =r =r =r r"),
    "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
    "{%0, %1, %2, %3};": ("mma_m16n8k16_f32_f16", "+f +f +f +f r r r r r r"),
    "fence.proxy.async.shared::cta;": ("fence_proxy_async_shared_cta", ""),
    "wgmma.fence.sync.aligned;": ("wgmma_fence", ""),
    "wgmma.commit_group.sync.aligned;": ("wgmma_commit_group", ""),
    "wgmma.wait_group.sync.aligned %0;": ("wgmma_wait_group", "n"),
    # quantized weights (kernels_cu/dequant.cuh): lop3 and prmt take their immLut / selector as an immediate
    "lop3.b32 %0, %1, %2, %3, %4;": ("lop3_b32", "=r r r r n"),
    "prmt.b32 %0, %1, %2, %3;": ("prmt_b32", "=r r r n"),
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; mov.b32 %0, {hi, hi}; }": ("hi_x2", "=r r"),
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; mov.b32 %0, {lo, lo}; }": ("lo_x2", "=r r"),
    "add.rn.f16x2 %0, %1, %2;": ("add_rn_f16x2", "=r r r"),
    "sub.rn.f16x2 %0, %1, %2;": ("sub_rn_f16x2", "=r r r"),
    "mul.rn.f16x2 %0, %1, %2;": ("mul_rn_f16x2", "=r r r"),
    **{_wgmma_template(n): (f"wgmma_m64n{n}k16_f32_f16", " ".join(["+f"] * (n // 2) + ["l", "l", "r"]))
       for n in (64, 128, 192, 256)},
}

_ASM = re.compile(r"\b(?:asm|__asm__|__asm)\b(?:\s+(?:volatile|__volatile__|inline|goto))*\s*\(")
_LINE_MARKER = re.compile(r'^# (\d+) "([^"]*)"', re.M)
_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?([\w\s]+?)\s+(\w+)\s*\[\s*\]\s*;")


def _skip_literal(text: str, i: int) -> int:
    """Index just past the string or char literal starting at text[i]."""
    quote, i = text[i], i + 1
    while text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    return i + 1


def _outside_literals(text: str, start: int = 0):
    """(index, char, bracket depth after it) for each char of text[start:] outside string and char literals."""
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _skip_literal(text, i)
            continue
        depth += (c in "([{") - (c in ")]}")
        yield i, c, depth
        i += 1


def _balanced(text: str, start: int) -> int:
    """Index of the ')' closing the '(' at text[start]."""
    return next(i for i, _, depth in _outside_literals(text, start) if depth == 0)


def _split_top(text: str, sep: str) -> list[str]:
    """text split at `sep` outside brackets and literals."""
    parts, last = [], 0
    for i, c, depth in _outside_literals(text):
        if c == sep and depth == 0:
            parts.append(text[last:i])
            last = i + 1
    parts.append(text[last:])
    return parts


def _location(text: str, pos: int) -> str:
    """file:line of text[pos] in preprocessed text, from its line markers."""
    markers = list(_LINE_MARKER.finditer(text, 0, pos))
    if not markers:
        return f"line {text.count(chr(10), 0, pos) + 1}"
    m = markers[-1]
    line = int(m.group(1)) + text.count("\n", m.end(), pos) - 1
    return f"{m.group(2)}:{line}"


def _operands(section: str, where: str) -> list[tuple[str, str]]:
    """[(constraint, expression)] of an asm operand list: `"=r"(x), "l"(p)`."""
    out = []
    for op in (o.strip() for o in _split_top(section, ",") if o.strip()):
        m = re.fullmatch(r'"([^"]*)"\s*\((.*)\)', op, re.S)
        if not m:
            raise KernelError(f"{where}: asm operand {op!r} is not of the form \"constraint\"(expression)")
        out.append((m.group(1), m.group(2).strip()))
    return out


def _rewrite_asm(text: str, start: int, open_paren: int) -> tuple[str, int]:
    """The ptx.h call for the asm statement whose '(' is at open_paren; and the index after its ')'."""
    where = _location(text, start)
    close = _balanced(text, open_paren)
    sections = _split_top(text[open_paren + 1:close], ":")
    literals = re.findall(r'"(?:[^"\\]|\\.)*"', sections[0])
    if not literals or re.sub(r'"(?:[^"\\]|\\.)*"', "", sections[0]).strip():
        raise KernelError(f"{where}: asm template is not a string literal: {sections[0].strip()[:80]!r}")
    template = " ".join("".join(ast.literal_eval(s) for s in literals).split())
    outputs = _operands(sections[1], where) if len(sections) > 1 else []
    inputs = _operands(sections[2], where) if len(sections) > 2 else []
    entry = PTX_TEMPLATES.get(template)
    if entry is None:
        raise KernelError(f"{where}: inline PTX the emulator does not know (cullama/runtime/emu/asm.py PTX_TEMPLATES): "
                          f"{template!r}")
    function, expected = entry
    if ".sync.aligned" in template and not re.search(r"\b(?:volatile|__volatile__)\b", text[start:open_paren]):
        # A warp- or warpgroup-collective: every lane must execute it together, where the source puts it. Without
        # volatile the compiler may move it (under a branch, across a barrier) or merge two alike ones, as CUTLASS
        # writes them to prevent.
        raise KernelError(f"{where}: asm {template[:60]!r} is a collective (.sync.aligned) instruction: it must be "
                          f"asm volatile")
    constraints = " ".join(c for c, _ in outputs + inputs)
    if constraints != expected:
        raise KernelError(f"{where}: asm {template[:60]!r} has operand constraints {constraints!r}, the emulator's "
                          f"{function} takes {expected!r}")
    args = ", ".join(["__FILE__", "__LINE__", *(f"({e})" for _, e in outputs + inputs)])
    return f"emu_ptx::{function}({args})", close + 1


def rewrite(text: str) -> str:
    """Preprocessed kernel source -> the same with every asm statement and `extern __shared__` array rewritten."""
    def shared(m: re.Match) -> str:
        return f"{m.group(1)}* const {m.group(2)} = ({m.group(1)}*)emu_dynamic_shared();"

    text = _EXTERN_SHARED.sub(shared, text)
    out, i = [], 0
    for m in _ASM.finditer(text):
        if m.start() < i:
            continue
        call, end = _rewrite_asm(text, m.start(), m.end() - 1)
        out += [text[i:m.start()], call]
        i = end
    out.append(text[i:])
    return "".join(out)
