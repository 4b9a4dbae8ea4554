"""The static issue budget of the decode GEMVs (issue 26; `cullama kernels --issue`).

At batch 1 a decode GEMV is worth the fraction of HBM bandwidth it reaches, and it can only reach it if it issues
few enough instructions per byte: an SM issues 4 warp-instructions (128 lane-instructions) a clock, so at 132 SMs
and 1.98 GHz full bandwidth allows at most 7.53 lane-instructions per weight byte on an H200 (4.44 TB/s) and 9.99 on
an H100 (3.35 TB/s). This counts, statically, the sm_90 SASS of every GEMV variant the decode, verify and batch plans
launch for a model (LLaMA-2-7B by default: the shapes the issue names) in FP16, int8 and int4, and holds it against
those budgets and against LIMIT (5.0 per byte over the whole kernel: two thirds of the H200's, the issue's bar).

Method (the note /work/shared/notes/sass-budget-2026-12-06.md's, which these counts reproduce for the CUDA-core
GEMVs within a few per cent): the kernel's SASS is cut into basic blocks (cullama/bench/sass.py); only code reached
from the entry counts (a subroutine reached by CALL, the slow path of a division, does not).
- The main loop is the innermost loop that holds the streaming weight loads (LDG .NA: load_stream's
  ld.global.nc.L1::no_allocate): a back edge's natural loop, every block that reaches its tail without passing its
  head (not the address range from head to tail: ptxas may place part of a body after the code that follows). Its
  steady-state iteration runs every instruction in its blocks, an inner loop times its trip count (read off the
  ISETP against a constant that ends it, counting up by a constant step).
  loop instr/B = those instructions / the weight bytes the iteration's streaming loads bring (16 per LDG.128).
- The whole kernel, per thread: everything outside the main loop once (prologue, reduction), the loop as many times
  as the thread's share of the streamed bytes (the block's, at the real shape: total / grid / threads) asks, where
  the weight loads issued before the loop (a first batch before griddepcontrol.wait) count for the first iteration
  and that iteration skips the loop's own load batch (the forward branch around it); the epilogue past the block's
  last barrier once per block where a predicated EXIT right after that barrier sends the other threads away (one
  warp: `if (threadIdx.x >= N) return;`, its predicate traced back to threadIdx.x and immediates alone; an EXIT
  that also reads a parameter or blockIdx, `if (p >= n_pairs) return;`, leaves every warp in every block but the
  last), else on every warp; all over the thread's share of the block's weight bytes (codes and quantization
  parameters). Fractional iterations stand for the last, partial ones; a loop outside the main one runs its trip
  count (the same ISETP rule, `for (i = threadIdx.x; i < n; i += THREADS)` included). A loop whose trip count does
  not read off the SASS (a bound known only at run time: ptxas's remainder loops of an epilogue's `for (i =
  threadIdx.x; i < n; i += THREADS)`) counts once, too few times where it runs more, and the report says how many
  did (the plans' GEMVs have none: their epilogues run in rounds of a known count). Both sides of a branch count,
  as if every warp ran both (the q and the K/V stores of qkv's epilogue): an upper bound there.
  So whole-kernel instr/B = issue slots a block spends / the bytes it reads. Only 16-byte streaming loads count as
  weight vectors (a 4-byte (scale, zero) load is not one, as in the note).
Every instruction counts as one issue slot (sm_90 has no dual issue); stalls, the launch cost and the sub-limits of
single pipes are not in these numbers, which are therefore a lower bound on issue time: an upper bound on the
bandwidth the issue rate allows ("ceiling" = min(1, budget / whole-kernel instr/B)).

The variants are read off the plans (cullama/bench/gemvs.py), never listed here: whichever kernels the plans
launch whose name starts with "gemv" (gemv_mma.cu's) are the ones counted.
"""

from __future__ import annotations

import dataclasses
import re

from ..model.config import LlamaConfig
from ..runtime.registry import compile_module
from . import sass
from .gemvs import FORMATS, Variant, plan_variants

SMS, CLOCK = 132, 1.98e9  # H100 SXM and H200: 132 SMs; the boost clock a streaming kernel holds
LANES_PER_CLOCK = 128  # 4 schedulers x 32 lanes issue per SM and clock
ARCH = "sm_90"
LIMIT = 5.0  # lane-instructions per weight byte over the whole kernel that a plan's GEMV may take (issue 26)


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    bandwidth: float  # bytes / s (the H200's measured, the H100's datasheet)

    @property
    def budget(self) -> float:
        """The most lane-instructions per weight byte that still allow full bandwidth."""
        return LANES_PER_CLOCK * SMS * CLOCK / self.bandwidth


H200, H100 = Gpu("H200", 4.44e12), Gpu("H100", 3.35e12)
GPUS = (H200, H100)


@dataclasses.dataclass(frozen=True)
class Count:
    """A kernel's static issue count at one launch shape (per thread: every lane of a warp issues alike)."""

    loop_instructions: float  # one steady-state iteration of the main loop
    loop_bytes: int  # weight bytes its streaming loads bring
    whole_instructions: float  # the whole kernel, per thread, the epilogue's share included
    thread_bytes: float  # the block's weight bytes / threads
    iterations: float  # main-loop iterations per thread
    guessed_trips: int = 0  # inner loops whose trip count could not be read (counted once)

    @property
    def loop_per_byte(self) -> float:
        return self.loop_instructions / self.loop_bytes if self.loop_bytes else float("nan")

    @property
    def whole_per_byte(self) -> float:
        return self.whole_instructions / self.thread_bytes

    def ceiling(self, gpu: Gpu) -> float:
        """The fraction of the bandwidth limit that the issue rate allows (an upper bound)."""
        return min(1.0, gpu.budget / self.whole_per_byte)


# -- counting ------------------------------------------------------------------------------------------------------
def _weight_load_bytes(ins: sass.Instruction) -> int:
    """Bytes one thread's streaming weight load brings (LDG.E.NA.128: load_stream's 16-byte
    ld.global.nc.L1::no_allocate); 0 for others (a 4-byte (scale, zero) load is a parameter, not a weight vector)."""
    return 16 if ins.opcode == "LDG" and "NA" in ins.modifiers and "128" in ins.modifiers else 0


def _immediate(text: str) -> int | None:
    try:
        return int(text, 16) if text.lower().startswith("0x") else int(text)
    except ValueError:
        return None


def _trip_count(code: list[list[sass.Instruction]], blocks: frozenset[int], tail: int) -> int | None:
    """A loop's trip count where it reads off the SASS: its back-edge branch's predicate set by an ISETP of a
    register against a constant, that register stepped by a constant in the loop (from zero)."""
    branch = code[tail][-1]
    if not branch.predicate:
        return None
    pred = branch.predicate.lstrip("!")
    body = [ins for b in sorted(blocks) for ins in code[b]]
    setp = next((ins for ins in reversed(body) if ins.opcode == "ISETP" and ins.operands[:1] == [pred]), None)
    if setp is None or len(setp.operands) < 4:
        return None
    counter, bound = setp.operands[2], _immediate(setp.operands[3])
    step = next((_immediate(ins.operands[2]) for ins in body if ins.opcode in ("IADD3", "VIADD", "IADD")
                 and ins.operands[:2] == [counter, counter] and not ins.predicate), None)
    if not bound or not step or step < 0:
        return None
    return -(-bound // step)  # from 0, or from a thread's index below `step` (for i = threadIdx.x; i < n; i += THREADS)


def count(instructions: list[sass.Instruction], threads: int, thread_streamed: float,
          thread_bytes: float) -> Count:
    """The static issue count of one kernel's SASS (see the module docstring) for a launch in which each thread's
    share of the streamed weight bytes is `thread_streamed` and of all its weight bytes `thread_bytes`."""
    code, preds = sass.blocks(instructions)
    succ: list[set[int]] = [set() for _ in code]
    for i, p in enumerate(preds):
        for q in p:
            succ[q].add(i)
    reached, stack = {0}, [0]
    while stack:
        for j in succ[stack.pop()] - reached:
            reached.add(j)
            stack.append(j)
    size = [len(block) for block in code]
    loads = [sum(_weight_load_bytes(ins) for ins in block) for block in code]
    # Each back edge tail -> head (tail at or after head, and reached from head: a jump back to an earlier address
    # that closes no cycle is no loop) and its natural loop: head and every block reached from head that reaches
    # tail without passing head. ptxas may place part of a loop's body after the code that follows the loop (a
    # branch out and back), so a loop is that set of blocks, not the address range from head to tail.
    def forward(head: int) -> set[int]:
        seen, stack = {head}, [head]
        while stack:
            for j in succ[stack.pop()] - seen:
                seen.add(j)
                stack.append(j)
        return seen

    def natural(head: int, tail: int) -> frozenset[int]:
        ahead = forward(head)
        body, stack = {head}, [tail]
        while stack:
            b = stack.pop()
            if b not in body and b in ahead:
                body.add(b)
                stack.extend(p for p in preds[b] if p in reached)
        return frozenset(body)

    loops = sorted(((i, q, natural(i, q)) for i in reached for q in preds[i]
                    if q >= i and q in reached and q in forward(i)), key=lambda l: (len(l[2]), l[0]))
    streaming = [l for l in loops if any(loads[b] for b in l[2])]
    main = streaming[0] if streaming else None
    inside = set(main[2]) if main else set()
    guessed = 0
    mult = [1.0] * len(code)
    for head, tail, body in loops:
        if main and body >= main[2]:
            continue  # the main loop and any loop around it: the iteration count below covers them
        trips = _trip_count(code, body, tail)
        guessed += trips is None
        for b in body:
            mult[b] *= trips or 1
    loop_instr = sum(size[b] * mult[b] for b in inside if b in reached)
    loop_bytes = sum(loads[b] * mult[b] for b in inside if b in reached)
    before = sum(loads[b] * mult[b] for b in reached - inside)  # a first batch issued before the loop
    if main:
        batches = max(0.0, (thread_streamed - before) / loop_bytes)  # the loop's own load batches
        skip = _skipped_batch(code, main[2], loads)
        iterations = batches + 1 if before and skip else max(batches, 1.0)
        skipped = (iterations - batches) * sum(size[b] * mult[b] for b in skip if b in reached) if skip else 0.0
    else:
        iterations, skipped = 0.0, 0.0
    barriers = [b for b in reached if any(ins.opcode == "BAR" for ins in code[b])
                and (not main or (b > main[1] and b not in inside))]
    epilogue = {b for b in reached if barriers and b > max(barriers)} if _sends_away(code, barriers) else set()
    per_warp = sum(size[b] * mult[b] for b in reached - inside - epilogue)
    once = sum(size[b] * mult[b] for b in epilogue)
    whole = per_warp + iterations * loop_instr - skipped + once / max(1, threads // 32)
    return Count(loop_instr, loop_bytes, whole, thread_bytes, iterations, guessed)


def _sends_away(code: list[list[sass.Instruction]], barriers: list[int]) -> bool:
    """Whether the kernel sends most threads away right after its last barrier (`if (threadIdx.x >= N) return;`: a
    predicated EXIT before any branch, its predicate computed from threadIdx.x and constants alone), so that what
    follows runs on one warp; else on every warp. An EXIT whose predicate also reads a kernel parameter or blockIdx
    (`if (p >= n_pairs) return;`: the last block's rows past the matrix) sends no warp away in the other blocks."""
    if not barriers:
        return False
    last = code[max(barriers)]
    after = last[next(i for i, ins in enumerate(last) if ins.opcode == "BAR") + 1:]
    following = after + (code[max(barriers) + 1] if max(barriers) + 1 < len(code) else [])
    for ins in following:
        if ins.opcode == "EXIT":
            if ins.predicate is None:
                return False
            linear = [i for block in code for i in block]
            return _from_thread_index(linear, linear.index(ins), ins.predicate.lstrip("!"))
        if ins.opcode in sass.BRANCHES:
            return False
    return False


_CONSTANT = re.compile(r"^-?(0x[0-9a-f]+|[0-9.]+(e[+-]?[0-9]+)?|RZ|PT|!PT|URZ)$", re.IGNORECASE)


def _from_thread_index(linear: list[sass.Instruction], at: int, register: str, depth: int = 12) -> bool:
    """Whether `register` (R or P), as read by linear[at], holds a value computed from threadIdx.x (S2R SR_TID.X)
    and immediates alone: its last write before `at` in address order, and so on back (straight-line code: the
    prologue and the code between it and the barrier). Anything else (a load, a kernel parameter c[..] or a uniform
    register, blockIdx, a write not found) is no."""
    if depth == 0:
        return False
    for j in range(at - 1, -1, -1):
        ins = linear[j]
        # the destination, and a predicate written beside it (ISETP's second, IADD3's or LEA's carry)
        written = ins.operands[:1] + [o for o in ins.operands[1:2] if re.fullmatch(r"P[0-9]+|PT", o)]
        if register not in written:
            continue
        if ins.predicate is not None or ins.opcode in ("LDG", "LDS", "LDC", "LD", "S2UR", "SHFL", "CALL"):
            return False  # a conditional write or a value from memory
        if ins.opcode == "S2R":
            return ins.operands[1:] == ["SR_TID.X"]
        for operand in ins.operands[len(written):]:
            name = operand.split(".")[0].strip("-!|")
            if _CONSTANT.match(operand.lstrip("|")):
                continue
            if re.fullmatch(r"[RP][0-9]+", name):
                if not _from_thread_index(linear, j, name, depth - 1):
                    return False
                continue
            return False  # c[..] (a parameter), UR, SR_CTAID, an address
        return True
    return False


def _skipped_batch(code: list[list[sass.Instruction]], body: frozenset[int], loads: list[int]) -> set[int]:
    """The blocks of the main loop (the set `body`) that a forward branch inside it skips and that hold all its
    streaming loads (`if (base != first) load_batch(...)`: the first iteration's batch was issued before the loop),
    the smallest such region; empty where there is none."""
    starts = {block[0].address: i for i, block in enumerate(code)}
    load_blocks = {b for b in body if loads[b]}
    best: set[int] = set()
    for b in sorted(body):
        last = code[b][-1]
        if last.opcode != "BRA" or not last.predicate:
            continue
        target = starts.get(next(iter(sass.targets(last)), -1))
        if target is None or not b < target <= max(body) + 1:
            continue
        region = set(range(b + 1, target)) & body
        if load_blocks <= region and (not best or len(region) < len(best)):
            best = region
    return best


def count_variant(v: Variant, tool: str, cache: dict | None = None) -> tuple[Count, int]:
    """(the count, registers) of a plan's variant, compiled for sm_90 (cached by NVRTC's cache; `cache` keeps the
    disassembly of a module between variants)."""
    cache = {} if cache is None else cache
    key = (v.source, v.defines)
    if key not in cache:
        module = compile_module(v.source, v.defines, ARCH)
        cache[key] = (sass.sass(module.cubin_path, tool), module.resources)
    text, resources = cache[key]
    instructions = sass.parse(text, v.kernel)
    if not instructions:
        raise RuntimeError(f"{v.source} {v.define_text}: no function {v.kernel} in its SASS")
    per_thread = v.blocks * v.threads
    return count(instructions, v.threads, v.streamed / per_thread, v.weight_bytes / per_thread), \
        resources[v.kernel].registers


def over_budget(v: Variant, c: Count) -> str | None:
    """A one-line complaint where a variant's whole kernel takes more than LIMIT lane-instructions per byte."""
    if c.whole_per_byte <= LIMIT:
        return None
    return (f"{v.source} {v.kernel} ({v.define_text}) at {v.shape} {v.M}x{v.K}, {v.fmt}, {v.rows} token rows "
            f"({', '.join(v.steps)}): {c.whole_per_byte:.2f} lane-instructions per weight byte over the whole kernel, "
            f"over the issue budget's {LIMIT}")


def report(config: LlamaConfig | None = None, formats=FORMATS) -> list[str]:
    """The lines of `cullama kernels --issue`: every plan's GEMV variant with its counts beside the budgets."""
    tool = sass.cuobjdump()
    if tool is None:
        return [f"issue budget: not counted: {sass.MISSING}"]
    lines = [f"issue budget, sm_90 SASS, lane-instructions per weight byte (whole kernel <= {LIMIT}; full bandwidth "
             f"allows {H200.budget:.2f} on an H200, {H100.budget:.2f} on an H100)",
             f"{'format':<8} {'rows':>4} {'kernel':<18} {'shape':<8} {'file':<14} {'defines':<30} {'regs':>4} "
             f"{'loop/B':>7} {'whole/B':>8} {'H200':>5} {'H100':>5}  steps"]
    cache: dict = {}
    over = 0
    for v in plan_variants(config, formats):
        c, regs = count_variant(v, tool, cache)
        flag = " OVER" if over_budget(v, c) else ""
        over += bool(flag)
        lines.append(f"{v.fmt:<8} {v.rows:>4} {v.kernel:<18} {v.shape:<8} {v.source:<14} {v.define_text:<30} "
                     f"{regs:>4} {c.loop_per_byte:>7.2f} {c.whole_per_byte:>8.2f} {c.ceiling(H200):>5.0%} "
                     f"{c.ceiling(H100):>5.0%}  {_steps(v.steps)}{flag}"
                     + (f" ({c.guessed_trips} loops of unread trip count counted once)" if c.guessed_trips else ""))
    lines.append(f"{over} GEMV launches over {LIMIT} lane-instructions per weight byte")
    return lines


def _steps(names: tuple[str, ...]) -> str:
    """"decode, verify 1-8, batch 2-9" from the step names."""
    groups: dict[str, list[str]] = {}
    for name in names:
        kind, _, n = name.partition(" ")
        groups.setdefault(kind, []).append(n)
    parts = []
    for kind, ns in groups.items():
        nums = [n for n in ns if n]
        parts.append(kind if not nums else f"{kind} {nums[0]}" if len(nums) == 1 else f"{kind} {nums[0]}-{nums[-1]}")
    return ", ".join(parts)
