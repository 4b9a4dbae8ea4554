"""The decode GEMV launches the plans make (cullama/runtime/plan.py), read off the plans themselves: for a model (LLaMA-2-7B
by default) in FP16, int8 and int4 (quantized on load), every GEMV launch (a kernel whose name starts with "gemv") of
the decode step, of every verify step (1..MAX_DRAFT drafts) and of every batched group (1..VERIFY_ROWS rows), with its
kernel spec, grid, token rows and the bytes of weights it reads. The issue budget (issue.py) counts them and
benchmarks/gemv_sweep.py --rows times them, so both follow whatever kernels the plans launch, never a list of their own.
"""

from __future__ import annotations

import dataclasses
import re

from ..model import layout as layouts
from ..model.config import LlamaConfig, preset
from ..runtime import plan as plans

FORMATS = ("float16", "int8", "int4")
SHAPE_NAMES = {"wqkv": "qkv", "wo": "o_proj", "w_gate_up": "gate_up", "w_down": "down", "lm_head": "lm_head"}
SHAPE_ORDER = ("qkv", "o_proj", "gate_up", "down", "lm_head")  # a decode step's order


@dataclasses.dataclass(frozen=True)
class Variant:
    """One GEMV launch a plan makes, as the budget sees it."""

    fmt: str  # "float16", "int8", "int4"
    rows: int  # token rows
    source: str  # "gemv.cu"
    kernel: str  # "gemv_residual"
    defines: tuple
    shape: str  # "o_proj"
    M: int
    K: int
    grid: tuple[int, int, int]
    threads: int  # per block
    streamed: int  # bytes of the largest weight buffer (W, or the codes), which the streaming loads read
    weight_bytes: int  # bytes of every weight matrix the launch reads (codes and parameters)
    steps: tuple[str, ...] = ()  # the plans that launch it: "decode", "verify 4", "batch 5"

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]

    @property
    def define_text(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.defines) or "-"

    @property
    def label(self) -> str:
        return f"{self.fmt}-{self.rows}row-{self.kernel}-{self.shape}-{self.source}"


def layout_for(config: LlamaConfig, fmt: str) -> layouts.Layout:
    return layouts.fp16(config) if fmt == "float16" else layouts.on_load(config, fmt)


def steps(layout: layouts.Layout, max_seq: int = 64) -> list[tuple[str, int, plans.Plan]]:
    """(name, token rows, plan) of the decode step, every verify step (1..MAX_DRAFT drafts) and every batched
    group (1..VERIFY_ROWS rows) the runtime can run."""
    out = [("decode", 1, plans.decode_plan(layout, max_seq))]
    out += [(f"verify {k}", k + 1, plans.verify_plan(layout, max_seq, k)) for k in range(1, plans.MAX_DRAFT + 1)]
    out += [(f"batch {r}", r, plans.batch_plan(layout, max_seq, r)) for r in range(1, plans.VERIFY_ROWS + 1)]
    return out


def plan_variants(config: LlamaConfig | None = None, formats=FORMATS) -> list[Variant]:
    """Every distinct GEMV launch (a kernel whose name starts with "gemv") of the plans of `config` (LLaMA-2-7B)
    in each format, with the plans that make it; layer 0's launches (every layer launches the same)."""
    config = config or preset("llama-2-7b")
    found: dict[tuple, Variant] = {}
    for fmt in formats:
        layout = layout_for(config, fmt)
        buffers = {b.name: b for b in layout.buffers()}
        for step, rows, plan in steps(layout):
            for launch in plan.launches:
                if not launch.spec.name.startswith("gemv"):
                    continue
                matrices = [buffers[a.name] for a in launch.args
                            if getattr(a, "name", None) in buffers and len(buffers[a.name].shape) >= 2]
                names = [re.sub(r"^layers\.\d+\.", "", b.name).split(".")[0] for b in matrices]
                if any(re.match(r"layers\.(?!0\.)", b.name) for b in matrices):
                    continue  # another layer: the same launch
                field = names[0]
                M = matrices[0].shape[0]
                K = layout.shape(field)[1] if field in layouts.LINEARS else config.hidden_size
                v = Variant(fmt, rows, launch.spec.source, launch.spec.name, launch.spec.defines,
                            SHAPE_NAMES.get(field, field), M, K, tuple(launch.grid), launch.block,
                            max(b.nbytes for b in matrices), sum(b.nbytes for b in matrices))
                key = dataclasses.replace(v, steps=())
                old = found.get(key, key)
                if step not in old.steps:
                    found[key] = dataclasses.replace(old, steps=old.steps + (step,))
    return sorted(found.values(), key=lambda v: (FORMATS.index(v.fmt), v.rows, SHAPE_ORDER.index(v.shape)
                                                 if v.shape in SHAPE_ORDER else len(SHAPE_ORDER), v.kernel))
