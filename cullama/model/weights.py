"""The loader: a checkpoint's weights (or random ones) into the device layout that cullama/model/layout.py defines.

One FP16 tensor's path (checkpoint.py reads the files, layout.py says where everything goes):

    model.layers.3.mlp.up_proj.weight   [ff, d] in model-00002-of-00003.safetensors (F16, BF16 or F32)
      -> Checkpoint.rows(name)          FP16 rows, a chunk at a time, checked finite
      -> layout.parts(): field w_gate_up of layer 3, first row ff (q|k|v and gate|up are fused by rows)
      -> the device layout: rows start at ff_dev instead (ff padded; down_proj gains zero columns)
      -> layout.buffer_name(): "layers.3.w_gate_up"
      -> backend.set(buffer, rows, row)

A linear that is quantized (an AWQ or GPTQ checkpoint's, or any with quantize="int8" | "int4"), or whose rows or
columns move (act-order), is built whole on the host first (linear_tensors: quant_checkpoint.read and
quant.pack, or quant.quantize of its FP16 rows, a block of rows at a time) and then set.

checkpoint_layout() makes the layout and, for a quantized checkpoint, runs the checks that read data (every scale
finite, every g_idx a grouping, the parts of a fused linear sharing one g_idx) before any weight reaches the
device. host_weights() gives the reference model the same weights in the model's own order (layout.model_weight).
Putting them on a device is the runtime's (cullama/runtime/load.py: load_checkpoint, random_weights).
"""

from __future__ import annotations

import math
import os
from typing import Callable

import numpy as np

from . import layout as layouts, quant, quant_checkpoint
from .checkpoint import Checkpoint, expected_shapes, open_checkpoint, quantized_linear
from .config import LlamaConfig
from ..common.errors import CheckpointError, OptionError
from .layout import (LINEARS, PARTS, LayerWeights, Layout, Weights, fused_shapes, layer_fields, linear_parts,
                     module_name, parts)

Progress = Callable[[int, int], None]  # (FP16 bytes done, total)
QUANTIZE_ROWS = 1024  # rows quantized at a time on load: bounds the float32 temporaries (16 MiB at K = 4096)


def fp16_bytes(config: LlamaConfig) -> int:
    """What loading reads, in FP16 bytes of the model (the progress unit; a tied lm_head counts twice)."""
    shapes = expected_shapes(config)
    return sum(2 * math.prod(shapes[name]) for *_, name in parts(config))


# ---------------------------------------------------------------------------------------------
# The layout of a checkpoint


def check_quantize(quantize) -> str | None:
    """The quantize option, checked: None, "int8" or "int4"."""
    if quantize is not None and quantize not in layouts.QUANTIZE:
        raise OptionError("quantize", f"must be one of {', '.join(layouts.QUANTIZE)}, not {quantize!r}")
    return quantize


def config_layout(config: LlamaConfig, quantize: str | None = None) -> Layout:
    """The layout the config and the quantize option give, before the checkpoint's data is read (act-order,
    which g_idx decides, is added by checkpoint_layout): cheap, for the checks before any weight loads."""
    check_quantize(quantize)
    if config.quantization is not None:
        if quantize is not None:
            raise OptionError("quantize", f"{quantize} cannot apply to {config.name}: the checkpoint is already "
                                          f"quantized ({config.quantization.describe()}) and runs as it is stored")
        return layouts.from_checkpoint(config)
    return layouts.fp16(config) if quantize is None else layouts.on_load(config, quantize)


def checkpoint_layout(ckpt: Checkpoint, quantize: str | None = None) -> Layout:
    """The checkpoint's device layout. A quantized checkpoint's scales and g_idx are read and checked here (a
    CheckpointError naming the tensor), before any weight reaches the device."""
    layout = config_layout(ckpt.config, quantize)
    q = ckpt.config.quantization
    if q is None:
        return layout
    shapes, permuted = expected_shapes(ckpt.config), set()
    for i in range(ckpt.config.num_layers):
        for field in LINEARS:
            g_idx = {}
            for part in PARTS[field]:
                name = module_name(i, part)
                if quantized_linear(ckpt.config, f"{name}.weight"):
                    quant_checkpoint.check_data(q, name, *shapes[f"{name}.weight"], ckpt.stored, ckpt.directory)
                    if q.method == "gptq":
                        g_idx[name] = ckpt.stored(f"{name}.g_idx")
            first, *others = g_idx.items() or [(None, None)]
            for name, other in others:  # one input, so one order
                if not np.array_equal(first[1], other):
                    raise CheckpointError(f"{ckpt.directory}: {first[0]}.g_idx and {name}.g_idx differ, but the "
                                          f"parts of {field} share one input (and so one act-order)")
            if first[0] is not None and quant_checkpoint.perm_of(first[1]) is not None:
                permuted.add((i, field))
    return layouts.from_checkpoint(ckpt.config, permuted)


# ---------------------------------------------------------------------------------------------
# One linear, built on the host


def _part_fp16(ckpt: Checkpoint, module: str) -> np.ndarray:
    """A part as FP16 [N, K] in the model's input order: the stored weight, or a quantized part dequantized and
    rounded to FP16 (a fused field that is only partly quantized is FP16)."""
    if not quantized_linear(ckpt.config, f"{module}.weight"):
        return ckpt.tensor(f"{module}.weight")
    q = ckpt.config.quantization
    codes, scale, zero, perm = quant_checkpoint.read(q, module, ckpt.stored, ckpt.directory)
    w = quant.dequantize(quant.pack(codes, q.bits), quant.params(scale, zero), q.bits, np.float16)  # [N, K]
    if perm is None:
        return w
    unsorted = np.empty_like(w)
    unsorted[:, perm] = w  # column k holds input perm[k]
    return unsorted


def down_order(ckpt: Checkpoint, layout: Layout, layer: int) -> np.ndarray | None:
    """down_proj's input order under act-order (its columns, and gate_proj's and up_proj's rows, are stored in
    it), else None."""
    if not layout.linear(layer, "w_down").permuted:
        return None
    return quant_checkpoint.perm_of(ckpt.stored(f"{module_name(layer, 'mlp.down_proj')}.g_idx"))


def linear_tensors(ckpt: Checkpoint, layout: Layout, layer: int, field: str) -> dict[str, np.ndarray]:
    """One linear's device buffers (name -> host array: layout.weight_names, perm_name), in the
    device layout: padded; w_gate_up's gate and up rows in down_order."""
    linear = layout.linear(layer, field)
    row_perm = down_order(ckpt, layout, layer) if field == "w_gate_up" else None
    M, K = layout.shape(field)
    pieces = linear_parts(layout, layer, field)
    q = ckpt.config.quantization
    if linear.format is not None and q is not None:  # the checkpoint's own codes, repacked
        # K is never padded here (quant_checkpoint.check_sizes: the inputs are a multiple of 32); padded rows of
        # gate and up get code 0, scale 0, zero 0: weights of exactly 0
        codes = np.zeros((M, K), np.uint8)  # [M, K]
        scale = np.zeros((M, K // linear.format.group), np.float16)  # [M, groups]
        zero = np.zeros((M, K // linear.format.group), np.float32)  # [M, groups]
        for module, start, rows in pieces:  # the parts share one input order, perm (checkpoint_layout)
            c, s, z, perm = quant_checkpoint.read(q, module, ckpt.stored, ckpt.directory)
            order = slice(None) if row_perm is None else row_perm
            codes[start:start + rows], scale[start:start + rows] = c[order], s[order]
            zero[start:start + rows] = z[order]
        out = dict(zip(layout.weight_names(layer, field), (quant.pack(codes, q.bits), quant.params(scale, zero))))
    else:
        w = np.zeros((M, K), np.float16)  # [M, K] padded: zero rows and columns
        for module, start, rows in pieces:
            part = _part_fp16(ckpt, module)
            w[start:start + rows, :part.shape[1]] = part[row_perm] if row_perm is not None else part
        if linear.format is None:
            out = {layout.weight_names(layer, field)[0]: w}
        else:  # quantized on load, a block of rows at a time (quantize is row by row)
            blocks = [quant.quantize(w[r:r + QUANTIZE_ROWS], linear.format) for r in range(0, M, QUANTIZE_ROWS)]
            out = dict(zip(layout.weight_names(layer, field), map(np.concatenate, zip(*blocks))))
        perm = None
    if layout.perm_name(layer, field):
        out[layout.perm_name(layer, field)] = perm
    return out


def streams(ckpt: Checkpoint, layout: Layout, layer: int, field: str) -> bool:
    """Whether a linear's FP16 rows go straight from the file to the device (no quantizing, no reordering,
    no dequantized part)."""
    return (layout.linear(layer, field).format is None
            and not (field == "w_gate_up" and layout.linear(layer, "w_down").permuted)
            and not any(quantized_linear(layout.config, f"{module}.weight")
                        for module, _, _ in linear_parts(layout, layer, field)))


# ---------------------------------------------------------------------------------------------
# On the host


def host_weights(ckpt: Checkpoint, progress: Progress | None = None, layout: Layout | None = None) -> Weights:
    """The model's weights in its own order and shapes (layout.Weights), q|k|v and gate|up fused: FP16, and
    float32 where the layout quantizes a linear (its exact dequantized values: what the kernels compute with).
    progress(done_bytes, total_bytes) is called after each tensor, counting FP16 bytes."""
    config = ckpt.config
    layout = layout or checkpoint_layout(ckpt)
    shapes, fused = expected_shapes(config), fused_shapes(config)
    total, done = fp16_bytes(config), 0
    arrays: dict[tuple[str, int | None], np.ndarray] = {}
    whole: dict[str, np.ndarray] = {}  # tensors used as they are, by HF name (tied lm_head)
    for field, layer, row, name in parts(config):
        if layer is not None and field in LINEARS and not streams(ckpt, layout, layer, field):
            if (field, layer) not in arrays:
                arrays[field, layer] = layouts.model_weight(layout, layer, field,
                                                            linear_tensors(ckpt, layout, layer, field),
                                                            down_order(ckpt, layout, layer))
        elif shapes[name] == fused[field]:  # a part that is the whole field: no copy needed
            if name not in whole:
                whole[name] = ckpt.tensor(name)
            arrays[field, layer] = whole[name]
        else:
            if (field, layer) not in arrays:
                arrays[field, layer] = np.empty(fused[field], np.float16)
            for first, rows in ckpt.rows(name):
                arrays[field, layer][row + first:row + first + len(rows)] = rows
        done += 2 * math.prod(shapes[name])
        if progress is not None:
            progress(done, total)
    layers = [LayerWeights(**{field: arrays[field, i] for field in layer_fields(config)})
              for i in range(config.num_layers)]
    return Weights(config=config, embed=arrays["embed", None], layers=layers,
                   final_norm=arrays["final_norm", None], lm_head=arrays["lm_head", None])


def load_weights(path: str | os.PathLike, config: LlamaConfig | None = None, progress: Progress | None = None,
                 quantize: str | None = None) -> Weights:
    """open_checkpoint + host_weights, for callers that do not need the note."""
    ckpt = open_checkpoint(path, config)
    return host_weights(ckpt, progress, checkpoint_layout(ckpt, quantize))
