"""The weight layout: where each checkpoint tensor goes, on the host and on the device.

One tensor's path, all of it here (checkpoint.py reads the files):

    model.layers.3.mlp.up_proj.weight   [ff, d] in model-00002-of-00003.safetensors (F16, BF16 or F32)
      -> Checkpoint.rows(name)          FP16 rows, a chunk at a time, checked finite
      -> parts(): field w_gate_up of layer 3, first row ff (q|k|v and gate|up are fused by rows)
      -> device_config(): rows start at ff_dev instead (ff rounded up to a multiple of 8; down_proj
         gains zero columns), so every row is 16-byte aligned for the kernels
      -> buffer_name(): "layers.3.w_gate_up", one of plan.weight_buffers(device_config(cfg))
      -> backend.set(buffer, rows, row)

The host-side `Weights` (fused FP16 arrays, zero-copy memmap views where a tensor is a whole field)
serve the reference model and the CPU backend, which binds them without a copy when no padding is
needed. `random_weights` makes synthetic weights of any shape where they live (no checkpoint).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from . import plan as plans
from .checkpoint import EMBED, FINAL_NORM, LM_HEAD, Checkpoint, expected_shapes, layer_name, open_checkpoint
from .config import LlamaConfig
from .ops import fill as fill_twin
from .registry import KernelSpec

Progress = Callable[[int, int], None]  # (FP16 bytes done, total)
FILL = KernelSpec("fill.cu", "fill_uniform")

# How each layer's HF tensors are laid out in the fused arrays: (field, HF parts in row order).
LAYER_PLAN = (
    ("attn_norm", ("input_layernorm",)),
    ("wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("wo", ("self_attn.o_proj",)),
    ("ffn_norm", ("post_attention_layernorm",)),
    ("w_gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    ("w_down", ("mlp.down_proj",)),
)


@dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [d]              fp16  input_layernorm
    wqkv: np.ndarray  # [qkv_dim, d]     fp16  rows q_proj (q_dim) | k_proj (kv_dim) | v_proj (kv_dim)
    wo: np.ndarray  # [d, q_dim]       fp16  o_proj
    ffn_norm: np.ndarray  # [d]              fp16  post_attention_layernorm
    w_gate_up: np.ndarray  # [2*ff, d]        fp16  rows gate_proj (ff) | up_proj (ff)
    w_down: np.ndarray  # [d, ff]          fp16  down_proj


@dataclass
class Weights:
    """All weights in FP16. Unfused FP16 tensors are read-only memmap views of the files;
    fused and converted ones are ordinary arrays."""

    config: LlamaConfig
    embed: np.ndarray  # [vocab, d] fp16
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [d] fp16
    lm_head: np.ndarray  # [vocab, d] fp16 (the embedding itself when tie_word_embeddings)


def fused_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every field of Weights / LayerWeights: what a backend allocates."""
    d, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    return {"embed": (vocab, d), "attn_norm": (d,), "wqkv": (config.qkv_dim, d), "wo": (d, config.q_dim),
            "ffn_norm": (d,), "w_gate_up": (2 * ff, d), "w_down": (d, ff), "final_norm": (d,),
            "lm_head": (vocab, d)}


def parts(config: LlamaConfig) -> Iterator[tuple[str, int | None, int, str]]:
    """The fusion plan: (field, layer index or None, first row in the field, HF tensor name).

    `field` names a Weights / LayerWeights attribute, whose shape is fused_shapes()[field].
    A tied lm_head's part is the embedding tensor itself.
    """
    shapes = expected_shapes(config)
    yield "embed", None, 0, EMBED
    for i in range(config.num_layers):
        for field, hf_parts in LAYER_PLAN:
            row = 0
            for part in hf_parts:
                name = layer_name(i, part)
                yield field, i, row, name
                row += shapes[name][0]
    yield "final_norm", None, 0, FINAL_NORM
    yield "lm_head", None, 0, EMBED if config.tie_word_embeddings else LM_HEAD


def _fp16_bytes(config: LlamaConfig) -> int:
    """What loading copies, in FP16 bytes (the progress total; a tied lm_head counts twice)."""
    shapes = expected_shapes(config)
    return sum(2 * math.prod(shapes[name]) for *_, name in parts(config))


# ---------------------------------------------------------------------------------------------
# On the host


def host_weights(ckpt: Checkpoint, progress: Progress | None = None) -> Weights:
    """All weights in FP16, q|k|v and gate|up fused. progress(done_bytes, total_bytes) is called after
    each tensor, counting FP16 bytes."""
    config = ckpt.config
    shapes, fused = expected_shapes(config), fused_shapes(config)
    total, done = _fp16_bytes(config), 0
    arrays: dict[tuple[str, int | None], np.ndarray] = {}
    whole: dict[str, np.ndarray] = {}  # tensors used as they are, by HF name (tied lm_head)
    for field, layer, row, name in parts(config):
        if shapes[name] == fused[field]:  # a part that is the whole field: no copy needed
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
    layers = [LayerWeights(**{field: arrays[field, i] for field, _ in LAYER_PLAN})
              for i in range(config.num_layers)]
    return Weights(config=config, embed=arrays["embed", None], layers=layers,
                   final_norm=arrays["final_norm", None], lm_head=arrays["lm_head", None])


def load_weights(path: str | os.PathLike, config: LlamaConfig | None = None,
                 progress: Progress | None = None) -> Weights:
    """open_checkpoint + host_weights, for callers that do not need the note."""
    return host_weights(open_checkpoint(path, config), progress)


# ---------------------------------------------------------------------------------------------
# On the device


def buffer_name(field: str, layer: int | None) -> str:
    """The plan's buffer for a field (plan.weight_buffers names them so)."""
    return field if layer is None else f"layers.{layer}.{field}"


def device_config(cfg: LlamaConfig) -> LlamaConfig:
    """The shapes the kernels run: intermediate_size rounded up to a multiple of 8 (16-byte rows).
    The added SwiGLU units have zero weights, so they add silu(0) * 0 = 0: the model is unchanged."""
    ff = plans.cdiv(cfg.intermediate_size, 8) * 8
    return cfg if ff == cfg.intermediate_size else dataclasses.replace(cfg, intermediate_size=ff)


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


def load_checkpoint(backend, ckpt: Checkpoint, progress: Progress | None = None) -> None:
    """Weights onto the backend, in the device layout: each HF tensor is copied a chunk of rows at a time
    straight into its slice of the fused buffer (no host-side concatenation), each chunk checked finite
    just before its copy; the CPU binds FP16 views where it can."""
    cfg, dev = ckpt.config, device_config(ckpt.config)
    if backend.device == "cpu" and dev is cfg:
        weights = host_weights(ckpt, progress)
        backend.bind("embed", weights.embed)
        backend.bind("final_norm", weights.final_norm)
        backend.bind("lm_head", weights.lm_head)
        for i, layer in enumerate(weights.layers):
            for field, _ in LAYER_PLAN:
                backend.bind(buffer_name(field, i), getattr(layer, field))
        return
    backend.allocate(plans.weight_buffers(dev))  # zero-filled: padding stays zero
    shapes = expected_shapes(cfg)
    total, done = _fp16_bytes(cfg), 0
    for field, layer, row, name in parts(cfg):
        for first, rows in ckpt.rows(name):
            at, placed = _padded(field, row + first, rows, cfg.intermediate_size, dev.intermediate_size)
            backend.set(buffer_name(field, layer), placed, row=at)
        done += 2 * math.prod(shapes[name])
        if progress:
            progress(done, total)


def random_weights(backend, cfg: LlamaConfig, seed: int = 0, std: float = 0.02) -> None:
    """Synthetic weights of any shape, made where they live (on the GPU for `bench --synthetic`) by
    kernels_cu/fill.cu or its twin: the same seed gives the same weights on both devices."""
    buffers = plans.weight_buffers(device_config(cfg))
    if backend.device == "cuda":
        backend.allocate(buffers)
    for index, b in enumerate(buffers):
        mean, spread = (1.0, 0.1) if len(b.shape) == 1 else (0.0, std)  # norm weights near 1
        buffer_seed = (seed * 1_000_003 + index) % 2**64  # a stream of its own per buffer
        if backend.device == "cpu":
            array = np.empty(b.shape, np.float16)
            fill_twin.fill_uniform(array, array.size, buffer_seed, mean, spread)
            backend.bind(b.name, array)
        else:
            array = backend.arrays[b.name]
            blocks = min(plans.cdiv(array.size, fill_twin.THREADS), 4096)
            backend.run(plans.Plan("fill", [plans.Launch(FILL, (blocks, 1, 1), fill_twin.THREADS, (
                plans.Ref(b.name), np.uint64(array.size), np.uint64(buffer_seed), np.float32(mean),
                np.float32(spread)))]))
