"""Reading a kernel's machine code: `cuobjdump -sass` of a cubin, split into instructions and basic blocks.

The tools come from the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels (the `test` extra) or a CUDA toolkit
on PATH; without them `cuobjdump()` is None and the callers say so in one line (`cullama kernels --issue`, the
tests that read SASS skip with that line). No GPU is needed: the cubins are NVRTC's (cullama.runtime.registry).
tests/sass_dataflow.py builds its floating-point dataflow on these; cullama/bench/issue.py counts instructions.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

BRANCHES = {"BRA", "JMP", "BRX", "JMX", "RET", "EXIT", "CALL"}
LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.+?)\s*;")
MISSING = ("reading SASS needs cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, "
           "in the `test` extra, or a CUDA toolkit on PATH)")


@dataclasses.dataclass
class Instruction:
    address: int
    predicate: str | None  # "P0", "!P0", None (always)
    opcode: str  # "FFMA"
    modifiers: tuple[str, ...]  # ("RZ", "FTZ")
    operands: list[str]


def functions(text: str) -> list[str]:
    """The names of the functions in cuobjdump -sass output."""
    return [line.split("Function :")[1].strip() for line in text.splitlines() if "Function :" in line]


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
    """cuobjdump -sass of a cubin: every function's SASS."""
    env_path = f"{Path(tool).parent}:{os.environ.get('PATH', '')}"
    done = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": env_path})
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump -sass {cubin} failed: {done.stderr.strip()}")
    return done.stdout
