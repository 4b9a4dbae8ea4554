"""The floating-point dataflow of a kernel's machine code (SASS, from `cuobjdump -sass`), for comparing two
compiled variants of one kernel: does every value they compute come out of the same chain of floating-point
operations? The CPU executor (cullama.emu) compiles kernels without FMA contraction, so it cannot see what the GPU
compiler does to a*b + c (fused or not) or to a sum's order in one variant and not in another; this sees it.

Method, per function:
- The SASS is split into basic blocks (at branch targets, after branches and exits). Each block is evaluated
  symbolically: every register holds an expression node, interned so that equal expressions are one node. A
  floating-point instruction (FADD, FMUL, FFMA, MUFU, FSEL, FMNMX, HADD2 conversions, F2F, I2F, ...) makes a node of
  its opcode, modifiers and operand nodes (the operands of commutative ones sorted: a + b and b + a are one node);
  SHFL makes a node too (its lane distance kept), so a warp butterfly is a chain. Moves pass their node on. Every
  other value is a leaf named by where it came from, never by its address: a global, shared or constant load
  ("ldg", "lds", "ldc" with the constant's offset), an integer result ("int"), a register live into the block
  ("in"), a predicated write ("pw": the instruction's own node is kept as an output). Loops are not unrolled: a
  block of a loop body is one iteration, its loop-carried registers leaves, so the bodies of two variants are
  compared per iteration whatever their unroll factors.
- The block's outputs are the maximal expressions: floating-point nodes that no other floating-point node of the
  block consumes (what is stored, shuffled on, compared, or carried to the next block), and the values of stores.
- A function's signature is the set of its blocks' outputs. Two variants whose rows are computed alike (more or
  fewer of them, in a loop unrolled more or less) have the same set: each row's chains are the same chains. A
  contraction one variant makes and the other does not, or a sum in another order, puts a chain in one set that is
  not in the other.

Register widths follow the opcodes (64- and 128-bit loads, IMAD.WIDE, CS2R write 2 or 4 registers); an instruction
this does not know is an integer op whose result is a leaf, which can only make the comparison stricter (a
leaf where a chain continues loses nothing the other variant has, since both go through the same code).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

FP_OPS = {"FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK", "FRND", "MUFU", "F2F", "F2I", "I2F", "I2FP", "F2FP",
          "HADD2", "HMUL2", "HFMA2", "HSETP2", "HMNMX2", "DADD", "DMUL", "DFMA", "FSWZADD", "SHFL"}
COMMUTATIVE = {"FADD", "FMUL", "FMNMX", "HADD2", "HMUL2", "DADD", "DMUL"}
MOVES = {"MOV", "UMOV", "R2UR", "S2UR"}  # S2UR: a special register; as a leaf below
LOADS = {"LDG": "ldg", "LD": "ld", "LDS": "lds", "LDL": "ldl", "LDC": "ldc", "ULDC": "ldc", "ATOMG": "ldg",
         "ATOM": "ld", "ATOMS": "lds", "LDSM": "lds"}
STORES = {"STG", "ST", "STS", "STL", "RED", "REDG"}
BRANCHES = {"BRA", "JMP", "BRX", "JMX", "RET", "EXIT", "CALL"}
NO_DEST = STORES | BRANCHES | {"BAR", "BSYNC", "BSSY", "WARPSYNC", "NOP", "MEMBAR", "ERRBAR", "CCTL", "DEPBAR",
                               "PREEXIT", "ACQBULK", "YIELD", "FENCE", "BPT", "KILL", "CGAERRBAR", "SYNCS", "UCGABAR_ARV",
                               "UCGABAR_WAIT", "BMOV"}
PREDICATE_DEST = {"ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "PLOP3", "FCHK", "UISETP", "UPLOP3", "R2P", "VOTEU"}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
REGISTER = re.compile(r"^(-?)(\|?)(U?R(?:\d+|Z))(\|?)((?:\.[A-Za-z0-9_]+)*)$")


@dataclasses.dataclass
class Instruction:
    address: int
    predicate: str | None  # "P0", "!P0", None (always)
    opcode: str  # "FFMA"
    modifiers: tuple[str, ...]  # ("RZ", "FTZ")
    operands: list[str]


def parse(text: str, function: str) -> list[Instruction]:
    """The instructions of `function` in cuobjdump -sass output."""
    out, inside = [], False
    for line in text.splitlines():
        if "Function :" in line:
            inside = line.split("Function :")[1].strip() == function
            continue
        if not inside:
            continue
        match = LINE.search(line)
        if not match:
            continue
        body = match.group(2).strip()
        predicate = None
        if body.startswith("@"):
            predicate, body = body[1:].split(None, 1)
        name, _, rest = body.partition(" ")
        opcode, *modifiers = name.split(".")
        out.append(Instruction(int(match.group(1), 16), predicate, opcode, tuple(modifiers), split_operands(rest)))
    return out


def split_operands(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def targets(ins: Instruction) -> list[int]:
    return [int(o.strip("`()"), 16) for o in ins.operands if re.fullmatch(r"`?\(?0x[0-9a-f]+\)?", o)]


def blocks(instructions: list[Instruction]) -> tuple[list[list[Instruction]], list[set[int]]]:
    """Basic blocks in address order (a new one at every branch target and after every branch or exit), and each
    block's predecessors (indices)."""
    starts = {instructions[0].address} if instructions else set()
    for i, ins in enumerate(instructions):
        if ins.opcode in BRANCHES or ins.opcode == "BSSY":
            starts.update(targets(ins))
            if i + 1 < len(instructions) and ins.opcode in BRANCHES:
                starts.add(instructions[i + 1].address)
    out: list[list[Instruction]] = []
    for ins in instructions:
        if ins.address in starts or not out:
            out.append([])
        out[-1].append(ins)
    index = {block[0].address: i for i, block in enumerate(out)}
    preds: list[set[int]] = [set() for _ in out]
    for i, block in enumerate(out):
        last = block[-1]
        if last.opcode in ("BRA", "JMP", "CALL"):
            for target in targets(last):
                if target in index and last.opcode != "CALL":
                    preds[index[target]].add(i)
        ends = last.opcode in ("BRA", "JMP", "BRX", "JMX", "RET", "EXIT") and last.predicate is None
        if not ends and i + 1 < len(out):
            preds[i + 1].add(i)
    return out, preds


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
        self.consumed: set[int] = set()  # fp nodes used by another fp node of the block
        self.made: list[int] = []  # fp nodes in order
        self.stored: list[int] = []  # values of stores and predicated fp writes

    def value(self, operand: str) -> tuple[str, int]:
        """(prefix: "-", "|", "-|" or "", node) of a source operand."""
        m = REGISTER.match(operand)
        if m:
            sign, bar, reg, _, suffix = m.groups()
            prefix = sign + bar
            if reg in ("RZ", "URZ"):
                return prefix, self.nodes.leaf("0")
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
        return "", self.nodes.leaf(operand)  # an immediate: its value

    def write(self, ins: Instruction, node: int, first: int = 0) -> None:
        dest = ins.operands[first] if len(ins.operands) > first else ""
        for i, reg in enumerate(registers(dest, dest_width(ins))):
            self.regs[reg] = node if i == 0 else self.nodes.leaf(f"{self.nodes.text(node)}+{i}")  # ldg+1: 2nd word

    def run(self, ins: Instruction) -> None:
        op, nodes = ins.opcode, self.nodes
        if op in STORES:
            for operand in ins.operands[1:]:
                _, n = self.value(operand)
                if nodes.is_fp(n):
                    self.stored.append(n)
            return
        if op in NO_DEST:
            return
        if op in FP_OPS:
            first = 1 if op == "SHFL" else 0  # SHFL.BFLY PT, Rd, Ra, b, c
            sources = ins.operands[first + 1:]
            if op in PREDICATE_DEST or op == "FSETP":
                first, sources = None, [s for s in ins.operands if not s.startswith(("P", "!P", "UP")) and s != "PT"]
            if all(not REGISTER.match(s) or REGISTER.match(s).group(3) in ("RZ", "URZ") for s in sources):
                self.write(ins, nodes.leaf("const " + ",".join(sources)), first or 0)  # HFMA2.MMA R, -RZ, RZ, imm
                return
            if op in ("I2F", "I2FP"):  # an integer in: where it came from does not matter
                sources = []
            operands = [self.value(s) for s in sources]
            for _, n in operands:
                if nodes.is_fp(n):
                    self.consumed.add(n)
            if op in COMMUTATIVE:
                operands.sort()
            elif op in ("FFMA", "HFMA2", "DFMA") and len(operands) == 3:
                operands[:2] = sorted(operands[:2])
            n = nodes.node(("op", ".".join((op,) + ins.modifiers), tuple(operands)))
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
        if op in LOADS:
            kind = LOADS[op] + (":" + ins.operands[1] if op in ("LDC", "ULDC") else "")
            self.write(ins, nodes.leaf(kind))
            return
        self.write(ins, nodes.leaf("int"))

    def outputs(self) -> set[int]:
        return {n for n in self.made if n not in self.consumed} | set(self.stored)


def signature(instructions: list[Instruction], nodes: Nodes) -> set[int]:
    """The function's floating-point outputs, block by block (see the module docstring). A block whose one
    predecessor comes before it (a guard's fall-through, the far side of an if) starts from that block's registers;
    any other block (a loop's head, where paths meet) from leaves."""
    found: set[int] = set()
    code, preds = blocks(instructions)
    out_regs: list[dict[str, int]] = []
    for i, block in enumerate(code):
        state = Block(nodes)
        if len(preds[i]) == 1 and min(preds[i]) < i:
            state.regs = dict(out_regs[min(preds[i])])
        for ins in block:
            state.run(ins)
        found |= state.outputs()
        out_regs.append(state.regs)
    return found


def cuobjdump() -> str | None:
    """cuobjdump on PATH, or from the nvidia-cuda-cuobjdump wheel (nvidia/cu*/bin/cuobjdump), where nvdisasm (its
    -sass needs it) is beside it or on PATH."""
    found = shutil.which("cuobjdump")
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations if spec and not found else []):
        found = found or next((str(p) for p in sorted(Path(base).glob("cu*/bin/cuobjdump"))), None)
    if found is None:
        return None
    return found if shutil.which("nvdisasm") or (Path(found).parent / "nvdisasm").exists() else None


def sass(cubin: Path, tool: str) -> str:
    env_path = f"{Path(tool).parent}:{shutil.os.environ.get('PATH', '')}"
    done = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, timeout=300,
                          env={**shutil.os.environ, "PATH": env_path})
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass {cubin} failed: {done.stderr.strip()}")
    return done.stdout


def difference(a: set[int], b: set[int], nodes: Nodes, limit: int = 3) -> str:
    """What a has that b lacks and the other way round, spelt out (at most `limit` each)."""
    only_a = sorted(nodes.text(n) for n in a - b)[:limit]
    only_b = sorted(nodes.text(n) for n in b - a)[:limit]
    return f"only in the first: {only_a}; only in the second: {only_b}"
