"""Weights onto a backend's device: a checkpoint's (load_checkpoint), in the layout cullama/model/weights.py and
cullama/model/layout.py make, or synthetic ones of any shape (random_weights), made where they live by
kernels_cu/fill.cu or its twin (no checkpoint)."""

from __future__ import annotations

import math

import numpy as np

from ..model import layout as layouts
from ..model.checkpoint import BIAS_STD, Checkpoint, expected_shapes
from ..model.config import LlamaConfig
from ..model.layout import BIAS, LINEARS, Layout, buffer_name, layer_fields, parts
from ..model.weights import Progress, checkpoint_layout, fp16_bytes, host_weights, linear_tensors, streams
from . import plan as plans
from .ops import fill as fill_twin
from .registry import KernelSpec

FILL = KernelSpec("fill.cu", "fill_uniform")
FILL_WORDS, FILL_QPARAMS = KernelSpec("fill.cu", "fill_words"), KernelSpec("fill.cu", "fill_qparams")


def _padded(field: str, row: int, rows: np.ndarray, ff: int, ff_dev: int) -> tuple[int, np.ndarray]:
    """Place checkpoint rows in the padded device layout: up rows start at ff_dev, not ff, and
    down_proj rows gain zero columns."""
    if ff == ff_dev:
        return row, rows
    if field == "w_gate_up" and row >= ff:
        return row - ff + ff_dev, rows
    if field == "w_down":
        wide = np.zeros((rows.shape[0], ff_dev), np.float16)  # [n, ff_dev]
        wide[:, :ff] = rows
        return row, wide
    return row, rows


def load_checkpoint(backend, ckpt: Checkpoint, progress: Progress | None = None, layout: Layout | None = None) -> None:
    """Weights onto the backend, in `layout` (default: the checkpoint's own, FP16 or as stored quantized). FP16
    tensors are copied a chunk of rows at a time straight into their slice of the fused buffer (no host-side
    concatenation), each chunk checked finite just before its copy; the CPU binds FP16 views where it can.
    Quantized or reordered linears are built whole on the host (linear_tensors) and copied once."""
    layout = layout or checkpoint_layout(ckpt)
    cfg, dev = ckpt.config, layout.device
    if backend.device == "cpu" and dev is cfg and layout.source == "float16":
        weights = host_weights(ckpt, progress, layout)
        backend.bind("embed", weights.embed)
        backend.bind("final_norm", weights.final_norm)
        backend.bind("lm_head", weights.lm_head)
        for i, layer in enumerate(weights.layers):
            for field in layer_fields(cfg):
                backend.bind(buffer_name(field, i), getattr(layer, field))
        return
    backend.allocate(layout.buffers())  # zero-filled: padding stays zero
    shapes = expected_shapes(cfg)
    total, done = fp16_bytes(cfg), 0
    for field, layer, row, name in parts(cfg):
        if layer is not None and field in LINEARS and not streams(ckpt, layout, layer, field):
            if row == 0:  # the field's first part: build it whole
                for buffer, array in linear_tensors(ckpt, layout, layer, field).items():
                    backend.set(buffer, array)
        else:
            for first, rows in ckpt.rows(name):
                at, placed = _padded(field, row + first, rows, cfg.intermediate_size, dev.intermediate_size)
                backend.set(buffer_name(field, layer), placed, row=at)
        done += 2 * math.prod(shapes[name])
        if progress:
            progress(done, total)


def random_weights(backend, model: LlamaConfig | Layout, seed: int = 0, std: float = 0.02) -> None:
    """Synthetic weights of any shape (a config: FP16; a layout: in its formats), made where they live (on the
    GPU for `bench --synthetic`) by kernels_cu/fill.cu or its twin: the same seed gives the same weights on both
    devices. FP16 weights are uniform with standard deviation `std` (norm weights 1 +- 0.17, q/k/v biases 0 +-
    0.87); quantized ones
    random codes with zero 2**(bits - 1) and scales around std / the codes' standard deviation, so that they
    spread about as much."""
    layout = layouts.as_layout(model)
    buffers = layout.buffers()
    bits = {layout.weight_names(i, f)[1]: layout.linear(i, f).format.bits for i in range(layout.config.num_layers)
            for f in LINEARS if layout.linear(i, f).format is not None}  # qparams buffer -> bits
    if backend.device == "cuda":
        backend.allocate(buffers)
    for index, b in enumerate(buffers):
        buffer_seed = np.uint64((seed * 1_000_003 + index) % 2**64)  # a stream of its own per buffer
        if b.dtype == "uint32":  # codes
            spec, args = FILL_WORDS, (np.uint64(math.prod(b.shape)), buffer_seed)
        elif b.name in bits:  # (scale, zero) pairs
            scale = std / ((1 << bits[b.name]) / math.sqrt(12))  # codes uniform in [0, 2**bits)
            spec, args = FILL_QPARAMS, (np.uint64(math.prod(b.shape[:-1])), buffer_seed, np.float32(scale),
                                        np.float32(scale / 10), np.float32(1 << (bits[b.name] - 1)))
        else:  # norm weights near 1; biases around 0, as write_random's
            mean, spread = (0.0, BIAS_STD) if b.name.endswith(BIAS) else (1.0, 0.1) if len(b.shape) == 1 \
                else (0.0, std)
            spec, args = FILL, (np.uint64(math.prod(b.shape)), buffer_seed, np.float32(mean), np.float32(spread))
        if backend.device == "cpu":
            array = np.empty(b.shape, b.dtype)
            getattr(fill_twin, spec.name)(array, *(a.item() for a in args))
            backend.bind(b.name, array)
        else:
            blocks = min(plans.cdiv(int(args[0]), fill_twin.THREADS), 4096)
            backend.run(plans.Plan("fill", [plans.Launch(spec, (blocks, 1, 1), fill_twin.THREADS,
                                                         (plans.Ref(b.name), *args))]))
