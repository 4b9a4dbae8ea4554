"""The decode GEMV launches the plans make (cullama/runtime/plan.py), read off the plans themselves: for a model (LLaMA-2-7B
by default) in FP16, int8 and int4 (quantized on load), every GEMV launch (a kernel whose name starts with "gemv") of
the decode step, of every verify step (1..MAX_DRAFT drafts) and of every batched group (1..VERIFY_ROWS rows), with its
kernel spec, grid, token rows and the bytes of weights it reads. The issue budget (issue.py) counts them and
benchmarks/gemv_sweep.py --rows times them, so both follow whatever kernels the plans launch, never a list of their own.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from ..model import layout as layouts
from ..model.config import LlamaConfig, preset
from ..runtime import plan as plans

FORMATS = ("float16", "int8", "int4")
SHAPE_NAMES = {"wqkv": "qkv", "wo": "o_proj", "w_gate_up": "gate_up", "w_down": "down", "lm_head": "lm_head"}
SHAPE_ORDER = ("qkv", "o_proj", "gate_up", "down", "lm_head")  # a decode step's order
FIELDS = {shape: field for field, shape in SHAPE_NAMES.items() if field in layouts.LINEARS}  # "qkv" -> "wqkv"


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
    in each format, with the plans that make it; layers 0 and 1's launches (every later layer launches layer 1's)."""
    config = config or preset("llama-2-7b")
    found: dict[tuple, Variant] = {}
    for fmt in formats:
        layout = layout_for(config, fmt)
        buffers = {b.name: b for b in layout.buffers()}
        for step, rows, plan in steps(layout):
            for launch in plan.launches:
                if not launch.spec.name.startswith("gemv"):
                    continue
                passed = dict.fromkeys(a.name for a in launch.args if getattr(a, "name", None) in buffers)
                matrices = [buffers[n] for n in passed if len(buffers[n].shape) >= 2]  # a buffer passed twice: once
                names = [re.sub(r"^layers\.\d+\.", "", b.name).split(".")[0] for b in matrices]
                if any(re.match(r"layers\.(?!0\.|1\.)", b.name) for b in matrices):
                    continue  # another layer: the same launch (layer 1: a step's first qkv is another kernel)
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


def field_of(launch: plans.Launch, layout: layouts.Layout) -> str | None:
    """The weight a GEMV launch reads, as SHAPE_NAMES names it ("qkv", ..., "lm_head"), where it is layer 0's or 1's
    (or the lm_head); None for another layer's."""
    buffers = {b.name for b in layout.buffers()}
    for a in launch.args:
        name = getattr(a, "name", None)
        if name in buffers and (name == "lm_head" or re.match(r"layers\.[01]\.", name)):
            field = re.sub(r"^layers\.[01]\.", "", name).split(".")[0]
            if field in SHAPE_NAMES:
                return SHAPE_NAMES[field]
    return None


def batch_launches(layout: layouts.Layout, rows: int, max_seq: int = 64) -> dict[str, plans.Launch]:
    """{shape: Launch} of the GEMVs of a batched step of `rows` token rows (layer 0's, layer 1's qkv and the
    lm_head's): the same kernels a verify step of rows - 1 drafts and (rows = 1) a decode step launch, on the verify
    buffers' first rows."""
    out = {}
    for launch in plans.batch_plan(layout, max_seq, rows).launches:
        if launch.spec.name.startswith("gemv") and (shape := field_of(launch, layout)) is not None:
            out.setdefault(shape, launch)
    return out


POSITION_ROOM = 16  # token rows a launch may have: buffers put row 0 at max_seq - 16, row t at + t


def launch_buffers(launch: plans.Launch, layout: layouts.Layout, rng, max_seq: int = 64,
                   matrices: bool = True) -> dict:
    """Every buffer a launch of the plans names, whole, as host arrays with random content: FP16 weights around 0.05
    (norm weights around 1), quantized codes any words and (scale, zero) pairs in range, activations standard normal,
    the caches zero, the rope table the model's, state's positions at max_seq - POSITION_ROOM and every rows table
    (slot 0, offset t). With matrices=False the weight matrices (W, qweight, qparams) are left out for the caller."""
    from ..model import quant

    specs = {b.name: b for b in layout.buffers() + plans.runtime_buffers(layout, max_seq, slots=1)}
    out = {}
    for name in dict.fromkeys(a.name for a in launch.args if isinstance(a, plans.Ref)):
        b = specs[name]
        matrix = b.kind == "weight" and len(b.shape) >= 2
        if matrix and not matrices:
            continue
        if name.endswith(".qweight"):
            out[name] = rng.integers(0, 1 << 32, b.shape, dtype=np.uint32)  # any word is a word of codes
        elif name.endswith(".qparams"):
            bits = layout.linear(0, name.split(".")[2]).format.bits  # layers.<i>.<field>.qparams
            zeros = rng.integers(0, (1 << bits) + 1, b.shape[:2])
            scales = 0.1 / (1 << bits) * rng.choice([-1.0, 1.0], zeros.shape) * (0.5 + rng.random(zeros.shape))
            out[name] = quant.params(scales, zeros)
        elif name == "rope":
            out[name] = plans.rope_table(layout.device, max_seq)
        elif name == "state":
            out[name] = np.zeros(b.shape, np.int32)
            out[name][:, 0] = max_seq - POSITION_ROOM
        elif b.dtype == "int32":  # a rows table [..., rows, 2]: (slot 0, offset t)
            out[name] = np.zeros(b.shape, np.int32)
            out[name][..., 1] = np.arange(b.shape[-2])
        elif name.endswith("x_ss"):  # Σ x² parts of a prepared input: sums of squares, never negative
            out[name] = np.abs(rng.standard_normal(b.shape)).astype(b.dtype) * 32
        elif b.kind == "cache":
            out[name] = np.zeros(b.shape, b.dtype)
        elif b.kind == "weight":
            base, spread = (1.0, 0.1) if len(b.shape) == 1 else (0.0, 0.05)
            out[name] = (base + spread * rng.standard_normal(b.shape)).astype(b.dtype)
        else:
            out[name] = rng.standard_normal(b.shape).astype(b.dtype)
    return out


def matrix_names(launch: plans.Launch, layout: layouts.Layout) -> list[str]:
    """The weight matrices a launch reads (W, or qweight and qparams), each once."""
    specs = {b.name: b for b in layout.buffers()}
    return [n for n in dict.fromkeys(a.name for a in launch.args if isinstance(a, plans.Ref))
            if n in specs and len(specs[n].shape) >= 2]
