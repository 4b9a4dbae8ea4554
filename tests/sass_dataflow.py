"""The floating-point dataflow of a kernel's machine code (SASS, from `cuobjdump -sass`), for comparing two
compiled variants of one kernel: does every value they compute come out of the same chain of floating-point
operations? The CPU executor (cullama.runtime.emu) compiles kernels without FMA contraction, so it cannot see what the
GPU compiler does to a*b + c (fused or not) or to a sum's order in one variant and not in another; this sees it.

What it proves: every floating-point operation of one variant, with the whole chains of operations that feed it,
is an operation of the other variant and the other way round, apart from the cuts below: so a contraction that
ptxas makes in one variant only (FFMA against FMUL then FADD), or a sum associated otherwise (FADD chains are never
cut), or an operation with another rounding, flush (.FTZ) or constant, shows as a chain in one set that is not in
the other; and every accumulation (a chain of FFMAs) is, link by link in its order, some number of repetitions of
the same iteration. What it does not prove: that the values are equal (leaves of one kind are interchangeable, so
a sum of loads in another order or a load from another address is not seen, nor how many iterations a loop runs,
nor where an accumulation starts): the executor compares the variants' values bit for bit, in the source's order,
and neither NVVM nor ptxas reorders an IEEE sum or an fma chain on its own.

Method, per function:
- The SASS is split into basic blocks (at branch targets, after branches and exits), evaluated in address order.
  Every register holds an expression node, interned so that equal expressions are one node. A floating-point
  instruction (FADD, FMUL, FFMA, MUFU, FSEL, FMNMX, HADD2 conversions, F2F, I2F, ...) makes a node of its opcode,
  modifiers and operand nodes (the operands of commutative ones sorted: a + b and b + a are one node); SHFL makes a
  node too (its lane distance kept), so a warp butterfly is a chain. Moves pass their node on. Every other value is
  a leaf named by where it came from, never by its address: a global, shared or constant load ("ldg", "lds", "ldc"
  with the constant's offset), an integer result ("int"), a predicated write ("pw": the instruction's own node is
  kept as an output), a register no single value reaches ("in"). Constants are named by their 32-bit pattern in
  hex, whether an immediate (FP32 0.5 and FP16 pairs such as "1024, 1024") or a register ptxas filled (HFMA2.MMA R,
  -RZ, RZ, a, b), since ptxas chooses between them per variant.
- A block starts from the registers that reach it alike on every path (entry_registers): a value from before a
  loop that the loop does not write (a hoisted loop invariant) is that value inside it; a value carried around a
  loop, merged from paths that differ, or written by a subroutine (CALL) is the leaf "in". So a rolled loop's body
  is one iteration, from its carried sums, whatever the unroll factor.
- The function's outputs are the nodes no other floating-point node consumes (what is stored, shuffled on,
  compared, or carried around a loop), and the values of stores.
- Accumulations are cut into links (per_link): every FFMA(a, b, c) becomes FFMA(a, b, acc), c an output of its own,
  and every link is in the signature; so is every chain of links as its period, the shortest run of links that
  repeats to make it (accumulations: CHAIN(link, ...)). An unrolled loop's one long chain (Σ a_i b_i from 0, as a
  decode step's variant computes a vector's dot product: 8 quads of codes, 4 links each) and a rolled loop's
  chain per iteration (from the carried sum, as the multi-row variants do: one quad) then give the same links and
  the same period, where whole chains could never compare.
- One equivalence: HFMA2 (on either pipe, .MMA or not, no other modifier) whose multiplier is 1.0 in both halves is
  HADD2. fma(a, 1, c) == a + c for every FP16 input in round-to-nearest: a * 1 is exact (a itself: NaN, inf, -0
  and subnormals included), so both round a + c once; an exact zero sum of opposite signs is +0 in both (fma(-0,
  1, +0) = -0 + +0 = +0), and neither flushes FP16 subnormals without .FTZ, which this does not take. ptxas itself
  treats them as one operation: it writes one `sub.rn.f16x2` of the source as HADD2 or HFMA2.MMA(c, 1, 1, -o) as its
  schedule suits it, both within one variant, and a `fma.rn.ftz.f16x2` by 1.0 as HADD2.FTZ.

A function's signature is the set of those outputs, links and periods. Two variants whose rows are computed alike
(more or fewer of them, in loops unrolled more or less) have the same set.

Register widths follow the opcodes (64- and 128-bit loads, IMAD.WIDE, CS2R write 2 or 4 registers); an instruction
this does not know is an integer op whose result is a leaf, which can only make the comparison stricter (a leaf
where a chain continues loses nothing the other variant has, since both go through the same code).
"""

from __future__ import annotations

import re
import struct

# The SASS reading (instructions, basic blocks, the tools) is cullama/bench/sass.py's, shared with the issue budget.
from cullama.bench.sass import BRANCHES, Instruction, blocks, cuobjdump, parse, sass, split_operands, targets  # noqa: F401

FP_OPS = {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "FRND", "MUFU", "F2F", "F2I", "I2F", "I2FP", "F2FP",
          "HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2", "DADD", "DMUL", "DFMA", "FSWZADD", "SHFL"}
COMMUTATIVE = {"FADD", "FMUL", "FMNMX", "HADD2", "HMUL2", "DADD", "DMUL"}
HALF_OPS = {"HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2"}  # two FP16 immediates, one per half
FP32_OPS = {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "FSWZADD"}  # an immediate is a float32
MOVES = {"MOV", "UMOV", "R2UR", "S2UR"}  # S2UR: a special register; as a leaf below
LOADS = {"LDG": "ldg", "LD": "ld", "LDS": "lds", "LDL": "ldl", "LDC": "ldc", "ULDC": "ldc", "ATOMG": "ldg",
         "ATOM": "ld", "ATOMS": "lds", "LDSM": "lds"}
STORES = {"STG", "ST", "STS", "STL", "RED", "REDG"}
NO_DEST = STORES | BRANCHES | {"BAR", "BSYNC", "BSSY", "WARPSYNC", "NOP", "MEMBAR", "ERRBAR", "CCTL", "DEPBAR",
                               "PREEXIT", "ACQBULK", "YIELD", "FENCE", "BPT", "KILL", "CGAERRBAR", "SYNCS", "UCGABAR_ARV",
                               "UCGABAR_WAIT", "BMOV"}
PREDICATE_DEST = {"ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "FCHK", "UISETP", "UPLOP3", "R2P", "VOTEU"}
REGISTER = re.compile(r"^(-?)(\|?)(U?R(?:\d+|Z))(\|?)((?:\.[A-Za-z0-9_]+)*)$")


ONE_X2 = "0x3c003c00"  # FP16 1.0 in both halves


def is_immediate(operand: str) -> bool:
    return bool(re.fullmatch(r"[-+]?(0x[0-9a-f]+|[0-9.]+(e[-+]?\d+)?|INF|QNAN|NAN)", operand, re.IGNORECASE))


def immediate(text: str, fp32: bool) -> tuple[str, str]:
    """(sign, name) of an immediate operand: its 32-bit pattern in hex, as a constant materialized in a register is
    named (a float32 one's sign as a prefix, as -R is written); text it cannot read stays as written."""
    sign, body = ("-", text[1:]) if fp32 and text.startswith("-") else ("", text)
    try:
        if re.fullmatch(r"[-+]?0x[0-9a-f]+", body, re.IGNORECASE):
            return sign, hex(int(body, 16) & 0xFFFFFFFF)
        if fp32:
            return sign, hex(struct.unpack("<I", struct.pack("<f", float(body)))[0])
        if re.fullmatch(r"[-+]?\d+", body):
            return sign, hex(int(body) & 0xFFFFFFFF)
    except (ValueError, OverflowError):
        pass
    return sign, text


def half_pair(high: str, low: str) -> str:
    """Two FP16 immediates as SASS prints them (HFMA2.MMA R, -RZ, RZ, 3.7421875, 0 makes 0x437c0000): one 32-bit
    pattern in hex."""
    try:
        h, l = (struct.unpack("<H", struct.pack("<e", float(t)))[0] for t in (high, low))
    except (ValueError, OverflowError):
        return f"{high},{low}"
    return hex(h << 16 | l)


def constant(op: str, sources: list[str]) -> str:
    """The name of a constant an instruction with no register source makes (HFMA2.MMA R, -RZ, RZ, a, b: the pair
    (a, b), ptxas's way of materializing a 32-bit constant)."""
    if op in HALF_OPS and len(sources) == 4 and sources[:2] == ["-RZ", "RZ"]:
        return half_pair(sources[2], sources[3])
    return "const " + ",".join(sources)


class Nodes:
    """Interned expression nodes: equal expressions are the same int; text(n) spells one out (for messages)."""

    def __init__(self):
        self.ids: dict[tuple, int] = {}
        self.keys: list[tuple] = []

    def node(self, key: tuple) -> int:
        if key not in self.ids:
            self.ids[key] = len(self.keys)
            self.keys.append(key)
        return self.ids[key]

    def leaf(self, name: str) -> int:
        return self.node(("leaf", name))

    def is_fp(self, n: int) -> bool:
        return self.keys[n][0] == "op"

    def text(self, n: int, depth: int = 0) -> str:
        key = self.keys[n]
        if key[0] == "leaf":
            return key[1]
        if depth > 12:
            return "..."
        _, op, operands = key
        return f"{op}(" + ", ".join(prefix + self.text(m, depth + 1) for prefix, m in operands) + ")"


def registers(operand: str, width: int) -> list[str]:
    """The registers an operand names as a destination of `width` registers (R4 with width 4: R4..R7)."""
    m = REGISTER.match(operand)
    if not m or m.group(3) in ("RZ", "URZ"):
        return []
    reg = m.group(3)
    prefix, number = ("UR", int(reg[2:])) if reg.startswith("UR") else ("R", int(reg[1:]))
    return [f"{prefix}{number + i}" for i in range(width)]


def dest_width(ins: Instruction) -> int:
    mods = set(ins.modifiers)
    if "128" in mods:
        return 4
    if "64" in mods or ins.opcode == "CS2R" or (ins.opcode in ("IMAD", "UIMAD") and "WIDE" in mods):
        return 2
    return 1


class Block:
    """Symbolic evaluation of one basic block (see the module docstring)."""

    def __init__(self, nodes: Nodes):
        self.nodes = nodes
        self.regs: dict[str, int] = {}
        self.consumed: set[int] = set()  # fp nodes used by another fp node
        self.made: list[int] = []  # fp nodes in order
        self.stored: list[int] = []  # values of stores and predicated fp writes
        self.written: set[str] = set()  # registers the block writes

    def value(self, operand: str, fp32: bool = False) -> tuple[str, int]:
        """(prefix: "-", "|", "-|" or "", node) of a source operand; `fp32`: an immediate is a float32 value."""
        m = REGISTER.match(operand)
        if m:
            sign, bar, reg, _, suffix = m.groups()
            prefix = sign + bar
            if reg in ("RZ", "URZ"):
                return prefix, self.nodes.leaf("0x0")
            halves = [s for s in suffix.split(".") if s.startswith("H")]  # .H0_H0 / .H1_H1: which half
            base = self.regs.setdefault(reg, self.nodes.leaf("in"))
            if halves:
                return prefix, self.nodes.node(("op", "HALF." + halves[0], (("", base),)))
            return prefix, base
        if operand.startswith("c[") or operand.startswith("-c[") or operand.startswith("|c["):
            return "", self.nodes.leaf(operand.lstrip("-|"))
        if operand.startswith(("P", "!P", "UP", "!UP")) or operand in ("PT", "!PT"):
            return "", self.nodes.leaf("p")  # a predicate: which one never matters to the arithmetic
        if operand.startswith(("SR_", "SRZ")):
            return "", self.nodes.leaf(operand)
        sign, bits = immediate(operand, fp32)
        return sign, self.nodes.leaf(bits)  # an immediate: its bits (as a constant in a register is named)

    def operands(self, op: str, sources: list[str]) -> list[tuple[str, int]]:
        """The source operands' values; in a half-precision op two immediates in a row are one 32-bit constant
        (HADD2 R, R, 1024, 1024 adds the constant 0x64006400, as a register holding it would)."""
        out, i = [], 0
        while i < len(sources):
            if op in HALF_OPS and i + 1 < len(sources) and is_immediate(sources[i]) and is_immediate(sources[i + 1]):
                out.append(("", self.nodes.leaf(half_pair(sources[i], sources[i + 1]))))
                i += 2
                continue
            out.append(self.value(sources[i], fp32=op in FP32_OPS))
            i += 1
        return out

    def write(self, ins: Instruction, node: int, first: int = 0) -> None:
        dest = ins.operands[first] if len(ins.operands) > first else ""
        for i, reg in enumerate(registers(dest, dest_width(ins))):
            self.regs[reg] = node if i == 0 else self.nodes.leaf(f"{self.nodes.text(node)}+{i}")  # ldg+1: 2nd word
            self.written.add(reg)

    def run(self, ins: Instruction) -> None:
        op, nodes = ins.opcode, self.nodes
        if op in STORES:
            for operand in ins.operands[1:]:
                _, n = self.value(operand)
                if nodes.is_fp(n):
                    self.stored.append(n)
            return
        if op == "CALL":  # a subroutine (the slow path of a division, say) may write any register
            self.regs.clear()
            self.written.add("*")
            return
        if op in NO_DEST:
            return
        if op in FP_OPS:
            first = 1 if op == "SHFL" else 0  # SHFL.BFLY PT, Rd, Ra, b, c
            sources = ins.operands[first + 1:]
            if op in PREDICATE_DEST or op == "FSETP":
                first, sources = None, [s for s in ins.operands if not s.startswith(("P", "!P", "UP")) and s != "PT"]
            if all(not REGISTER.match(s) or REGISTER.match(s).group(3) in ("RZ", "URZ") for s in sources):
                self.write(ins, nodes.leaf(constant(op, sources)), first or 0)  # HFMA2.MMA R, -RZ, RZ, 1024, 1024
                return
            if op in ("I2F", "I2FP"):  # an integer in: where it came from does not matter
                sources = []
            operands = self.operands(op, sources)
            name = ".".join((op,) + ins.modifiers)
            one = ("", nodes.leaf(ONE_X2))
            if op == "HFMA2" and set(ins.modifiers) <= {"MMA"} and len(operands) == 3 and one in operands[:2]:
                # fma(a, 1, c) == a + c in every half, bit for bit (see the module docstring): ptxas issues an FP16
                # add on either pipe (HADD2, or HFMA2.MMA with the multiplier 1.0) as the schedule suits it.
                name, operands = "HADD2", [operands[1] if operands[0] == one else operands[0], operands[2]]
            for _, n in operands:
                if nodes.is_fp(n):
                    self.consumed.add(n)
            if name.split(".")[0] in COMMUTATIVE:
                operands.sort()
            elif op in ("FFMA", "HFMA2", "DFMA") and len(operands) == 3:
                operands[:2] = sorted(operands[:2])
            n = nodes.node(("op", name, tuple(operands)))
            self.made.append(n)
            if first is None:
                return
            if ins.predicate is not None:
                self.stored.append(n)
                self.write(ins, nodes.leaf("pw"), first)
                return
            self.write(ins, n, first)
            return
        if ins.predicate is not None:
            self.write(ins, nodes.leaf("pw"))
            return
        if op in MOVES and len(ins.operands) == 2 and op != "S2UR":
            self.write(ins, self.value(ins.operands[1])[1])
            return
        if op == "IMAD" and "MOV" in ins.modifiers and len(ins.operands) == 4:  # IMAD.MOV Rd, RZ, RZ, Rs
            self.write(ins, self.value(ins.operands[3])[1])
            return
        if op == "CS2R" and ins.operands[1:] == ["SRZ"]:  # two registers zeroed, as MOV R, RZ zeroes one
            for reg in registers(ins.operands[0], 2):
                self.regs[reg] = nodes.leaf("0x0")
                self.written.add(reg)
            return
        if op in LOADS:
            kind = LOADS[op] + (":" + ins.operands[1] if op in ("LDC", "ULDC") else "")
            self.write(ins, nodes.leaf(kind))
            return
        self.write(ins, nodes.leaf("int"))


def entry_registers(i: int, preds: list[set[int]], out_regs: list[dict[str, int]], written: list[set[str]],
                    nodes: Nodes) -> dict[str, int]:
    """The registers' values at block i's start: a register takes the node that reaches it on every path (its
    predecessors before it agree, and a loop that i heads (blocks i .. p, entered only through i, p the back edge's
    source) does not write it: a loop invariant such as a hoisted bias); any other register, a value carried
    around a loop or merged from paths that differ, is the leaf "in" (absent from the dict)."""
    forward = [p for p in preds[i] if p < i]
    in_loop: set[str] = set()
    for p in preds[i] - set(forward):
        if any(q < i or q > p for k in range(i + 1, p + 1) for q in preds[k]):
            return {}  # another way into the loop: nothing known
        in_loop = in_loop.union(*written[i:p + 1])
    if "*" in in_loop:  # a call in the loop
        return {}
    if not forward:
        return {}
    regs = {}
    for reg in set().union(*(out_regs[p] for p in forward)) - in_loop:
        found = {out_regs[p].get(reg, nodes.leaf("in")) for p in forward}
        if len(found) == 1:
            regs[reg] = found.pop()
    return regs


def per_link(outputs: set[int], nodes: Nodes) -> set[int]:
    """The outputs with every FFMA's addend cut off: FFMA(a, b, c) becomes FFMA(a, b, acc) (the leaf "acc", c's
    sign kept), and c, where it is a floating-point node, an output of its own (cut the same way). An accumulation
    a_n b_n + (... + (a_1 b_1 + s)) becomes its links a_i b_i + acc, each with its multiplicands' whole chains, and
    its period (accumulations), so a loop's body compares alike whether the loop is rolled (its iteration's links
    from a carried sum) or unrolled (one long chain from 0): see the module docstring for what this gives up."""
    reachable, stack = set(), list(outputs)
    while stack:
        n = stack.pop()
        if n not in reachable and nodes.is_fp(n):
            reachable.add(n)
            stack.extend(m for _, m in nodes.keys[n][2])
    cut: dict[int, int] = {}
    found = set()
    for n in sorted(reachable):  # operands are interned before the nodes that use them
        _, op, operands = nodes.keys[n]
        new = [(prefix, cut.get(m, m)) for prefix, m in operands]
        if op == "FFMA" and len(new) == 3:
            if nodes.is_fp(operands[2][1]):
                found.add(cut[operands[2][1]])
            new = sorted(new[:2]) + [(new[2][0], nodes.leaf("acc"))]
        elif op.split(".")[0] in COMMUTATIVE:
            new.sort()
        cut[n] = nodes.node(("op", op, tuple(new)))
        if op == "FFMA":
            found.add(cut[n])  # every link, also one that only a multiplication consumes (a rolled loop's last)
    return found | {cut.get(n, n) for n in outputs} | accumulations(reachable, cut, nodes)


def accumulations(reachable: set[int], cut: dict[int, int], nodes: Nodes) -> set[int]:
    """Each accumulation (a chain of FFMAs, each the next one's addend) as its period: the shortest run of links
    that repeats to make it (CHAIN(link, ...), first link first). A loop's body unrolled k times repeats its
    iteration's links k times, so the period is the iteration's links in their order, whatever k: this keeps the
    order of the links and which chain each continues, which the links alone do not."""
    ffma = {n for n in reachable if nodes.keys[n][1] == "FFMA" and len(nodes.keys[n][2]) == 3}
    addend = {n: nodes.keys[n][2][2][1] for n in ffma}
    continued = {addend[n] for n in ffma} & ffma
    found = set()
    for top in ffma - continued:
        links, n = [], top
        while n in ffma:
            links.append(cut[n])
            n = addend[n]
        links.reverse()
        period = next(p for p in range(1, len(links) + 1) if links[p:] == links[:len(links) - p])
        found.add(nodes.node(("op", "CHAIN", tuple(("", link) for link in links[:period]))))
    return found


def signature(instructions: list[Instruction], nodes: Nodes) -> set[int]:
    """The function's floating-point outputs (see the module docstring): its blocks evaluated in address order,
    each from entry_registers, an output a node that no floating-point node of the function consumes, or a value
    stored; then cut into links (per_link)."""
    code, preds = blocks(instructions)
    written = []
    for block in code:  # which registers each block writes (for the loops' invariants)
        state = Block(Nodes())
        for ins in block:
            state.run(ins)
        written.append(state.written)
    made, consumed, stored = set(), set(), set()
    out_regs: list[dict[str, int]] = []
    for i, block in enumerate(code):
        state = Block(nodes)
        state.regs = entry_registers(i, preds, out_regs, written, nodes)
        for ins in block:
            state.run(ins)
        made.update(state.made)
        consumed |= state.consumed
        stored.update(state.stored)
        out_regs.append(state.regs)
    return per_link((made - consumed) | stored, nodes)


def difference(a: set[int], b: set[int], nodes: Nodes, limit: int = 3) -> str:
    """What a has that b lacks and the other way round, spelt out (at most `limit` each)."""
    only_a = sorted(nodes.text(n) for n in a - b)[:limit]
    only_b = sorted(nodes.text(n) for n in b - a)[:limit]
    return f"only in the first: {only_a}; only in the second: {only_b}"
