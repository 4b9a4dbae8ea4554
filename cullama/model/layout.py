"""The device weight layout: how every tensor of a model lives on the device, for every dtype, in one place.

Everything that places, reads or counts weights asks this module: the loader (weights.py) fills the buffers it
names, the plan (plan.py) picks each linear's kernels by its format and passes them the buffers it names, the
memory check and the benchmark records count its bytes, and the reference model reads the weights it describes
(model_weight: float32 where quantized, so the reference is the oracle of quantized plans too).

Fields: the checkpoint's tensors fused by rows (parts()), per layer i:

    attn_norm  [d]                       input_layernorm
    wqkv       [q_dim + 2 kv_dim, d]     rows q_proj | k_proj | v_proj
    wo         [d, q_dim]                o_proj
    ffn_norm   [d]                       post_attention_layernorm
    w_gate_up  [2 ff, d]                 rows gate_proj (ff) | up_proj (ff)
    w_down     [d, ff]                   down_proj

and, where the model has q/k/v biases (Qwen2),

    bqkv       [q_dim + 2 kv_dim]        rows q_proj.bias | k_proj.bias | v_proj.bias, added before RoPE

and embed [vocab, d], final_norm [d], lm_head [vocab, d] (the embedding itself when tied). Embeddings, norms,
biases and the lm_head are FP16 (an AWQ or GPTQ checkpoint keeps its biases FP16 too). A model without biases
runs the same kernels on NO_BIAS, one zero row of q_dim + 2 kv_dim that the plan allocates (bias_name). Each
linear (LINEARS) has a format, FP16 or a quant.QuantFormat (bits, group), and lives in buffers named after it:

    FP16         layers.i.F            float16 [M, K]
    quantized    layers.i.F.qweight    uint32 [M, K bits / 32]     cullama/model/quant.py's format
                 layers.i.F.qparams    float16 [M, K / group, 2]   (scale, zero) per row and group
    act-order    layers.i.F.perm       int32 [K]                   column k holds input perm[k] (F: wqkv, wo, w_gate_up)
                 layers.i.N.permuted   float16 [d]                 the RMSNorm weight fused into F's kernels, in the
                                                                   same order (N: attn_norm, ffn_norm)

Formats: a fused field is quantized when all its parts are, with their one format; one with only some parts
quantized (modules_to_not_convert naming a part) is FP16, its quantized parts dequantized at load and rounded to
FP16 (a note says so). Quantizing on load: int8 per output channel (group = K), int4 in groups of 128 along K,
or where 128 does not divide K the largest of 96, 64 and 32 that does (int4_group).

Padding: intermediate_size (ff) is rounded up to a multiple of 8 (16-byte FP16 rows), or of 32 when any linear is
quantized (a 4-bit vector of 32 codes is one load). The added SwiGLU units have zero gate and up rows (zero codes
with zero scale and zero point, when quantized) and their down_proj columns are zero (or multiply those units'
zero outputs): the model is unchanged.

Act-order (GPTQ desc_act): a linear's inputs are sorted by g_idx at load so its groups are contiguous. Before
wqkv, wo and w_gate_up the plan gathers the input into that order (ops/gather.py), and the norm fused into
wqkv's and w_gate_up's kernels is permuted alike. down_proj's order is absorbed instead: gate_proj's and
up_proj's rows are stored in down_proj's input order (SwiGLU is per channel), so h arrives in it.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import numpy as np

from . import quant, quant_checkpoint
from .checkpoint import EMBED, FINAL_NORM, LM_HEAD, QKV_PARTS, bias_name as hf_bias_name, expected_shapes, layer_name
from .config import LlamaConfig
from ..common.errors import ConfigError

# How each layer's HF tensors are laid out in the fused fields: (field, HF parts in row order).
LAYER_PLAN = (
    ("attn_norm", ("input_layernorm",)),
    ("wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("wo", ("self_attn.o_proj",)),
    ("ffn_norm", ("post_attention_layernorm",)),
    ("w_gate_up", ("mlp.gate_proj", "mlp.up_proj")),
    ("w_down", ("mlp.down_proj",)),
)
PARTS = dict(LAYER_PLAN)
BIAS = "bqkv"  # the q|k|v bias field (Qwen2), rows as wqkv's: the biases of QKV_PARTS
NO_BIAS = "no_bias"  # the zero q|k|v bias a model without biases runs with (a runtime buffer of the plan's)
LINEARS = ("wqkv", "wo", "w_gate_up", "w_down")
NORM_OF = {"wqkv": "attn_norm", "w_gate_up": "ffn_norm"}  # the RMSNorm fused into a linear's kernels
GATHERED = ("wqkv", "wo", "w_gate_up")  # act-order linears whose input the plan gathers (w_down's is absorbed)
QUANTIZE = ("int8", "int4")  # quantizing on load
INT4_GROUPS = (128, 96, 64, 32)  # on-load int4: the first that divides K
FP16_PAD, QUANT_PAD = 8, 32  # intermediate_size rounded up to a multiple of these
H200_READ_BYTES_PER_S = 4.44e12  # measured HBM read bandwidth (DESIGN.md §1): the floors reported


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name
    kind: str  # "weight" | "cache" | "state" | "constant" | "activation"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


# -- the model's weights on the host (the reference model's input) --------------------------------------------
@dataclasses.dataclass
class LayerWeights:
    attn_norm: np.ndarray  # [d]              fp16  input_layernorm
    wqkv: np.ndarray  # [qkv_dim, d]     fp16 or f32  rows q_proj (q_dim) | k_proj (kv_dim) | v_proj (kv_dim)
    wo: np.ndarray  # [d, q_dim]       fp16 or f32  o_proj
    ffn_norm: np.ndarray  # [d]              fp16  post_attention_layernorm
    w_gate_up: np.ndarray  # [2*ff, d]        fp16 or f32  rows gate_proj (ff) | up_proj (ff)
    w_down: np.ndarray  # [d, ff]          fp16 or f32  down_proj
    bqkv: np.ndarray | None = None  # [qkv_dim] fp16  q|k|v biases (Qwen2); None: none


@dataclasses.dataclass
class Weights:
    """The model's weights, fused, in the model's own order and shapes (no padding): FP16, or float32 where a
    linear is quantized (its exact dequantized values). Unfused FP16 tensors are read-only memmap views of the
    files; fused and converted ones are ordinary arrays."""

    config: LlamaConfig
    embed: np.ndarray  # [vocab, d] fp16
    layers: list[LayerWeights]
    final_norm: np.ndarray  # [d] fp16
    lm_head: np.ndarray  # [vocab, d] fp16 (the embedding itself when tie_word_embeddings)


def fused_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every field of Weights / LayerWeights (the model's, unpadded)."""
    d, ff, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    return {"embed": (vocab, d), "attn_norm": (d,), "wqkv": (config.qkv_dim, d), "wo": (d, config.q_dim),
            "ffn_norm": (d,), "w_gate_up": (2 * ff, d), "w_down": (d, ff), BIAS: (config.qkv_dim,),
            "final_norm": (d,), "lm_head": (vocab, d)}


def layer_fields(config: LlamaConfig) -> tuple[str, ...]:
    """The fields of a layer (LayerWeights') that the model has: LAYER_PLAN's, and the bias where it has one."""
    return tuple(field for field, _ in LAYER_PLAN) + ((BIAS,) if config.qkv_bias else ())


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
        row = 0
        for part in QKV_PARTS if config.qkv_bias else ():
            yield BIAS, i, row, hf_bias_name(i, part)
            row += shapes[hf_bias_name(i, part)][0]
    yield "final_norm", None, 0, FINAL_NORM
    yield "lm_head", None, 0, EMBED if config.tie_word_embeddings else LM_HEAD


def module_name(layer: int, part: str) -> str:
    """The HF module of a part (its tensors are module_name + .weight, .qweight, ...)."""
    return layer_name(layer, part).removesuffix(".weight")


def buffer_name(field: str, layer: int | None) -> str:
    """The buffer of an FP16 field (a quantized linear's are this + .qweight and .qparams)."""
    return field if layer is None else f"layers.{layer}.{field}"


def device_config(cfg: LlamaConfig, quantized: bool = False) -> LlamaConfig:
    """The shapes the kernels run: intermediate_size rounded up to a multiple of 8 (16-byte FP16 rows), or of 32
    when a linear is quantized (32 4-bit codes are one 16-byte load). The added SwiGLU units compute zero."""
    pad = QUANT_PAD if quantized else FP16_PAD
    ff = -(-cfg.intermediate_size // pad) * pad
    return cfg if ff == cfg.intermediate_size else dataclasses.replace(cfg, intermediate_size=ff)


def int4_group(K: int) -> int:
    """On-load int4's group along K inputs: 128, or where it does not divide K the largest of 96, 64, 32 that does
    (K is a multiple of 32)."""
    return next(g for g in INT4_GROUPS if K % g == 0)


# -- the layout ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Linear:
    """How one fused linear lives on the device."""

    format: quant.QuantFormat | None = None  # None: FP16
    permuted: bool = False  # act-order: its inputs sorted by g_idx (see the module docstring)


FP16_LINEAR = Linear()


@dataclasses.dataclass(frozen=True)
class Layout:
    """A model's device layout: its config, and per layer the format of each linear (LINEARS order)."""

    config: LlamaConfig  # the model as its checkpoint describes it
    linears: tuple[tuple[Linear, ...], ...]  # [layer][LINEARS.index(field)]
    source: str = "float16"  # what the weights came as: "float16", "awq", "gptq", "int8" / "int4" (on load)
    notes: tuple[str, ...] = ()  # what the user should hear once (a partial field dequantized)

    @property
    def quantized(self) -> bool:
        return any(linear.format is not None for layer in self.linears for linear in layer)

    @property
    def device(self) -> LlamaConfig:
        """The config the kernels run (intermediate_size padded)."""
        return device_config(self.config, self.quantized)

    def linear(self, layer: int, field: str) -> Linear:
        return self.linears[layer][LINEARS.index(field)]

    def format_name(self, layer: int, field: str) -> str:
        """"float16", "int4 g128", "int8 per channel" (one group per row: int8's always, int4's past 128 inputs)."""
        fmt = self.linear(layer, field).format
        if fmt is None:
            return "float16"
        per_channel = fmt.group == self.shape(field)[1] and (fmt.bits == 8 or fmt.group > INT4_GROUPS[0])
        return f"int{fmt.bits} {'per channel' if per_channel else f'g{fmt.group}'}"

    def format_counts(self) -> dict[str, int]:
        """Fused linears per format_name."""
        names = [self.format_name(i, field) for i in range(self.config.num_layers) for field in LINEARS]
        return {name: names.count(name) for name in sorted(set(names))}

    def shape(self, field: str) -> tuple[int, ...]:
        """A field's device shape, [M, K] for a linear (padded)."""
        return fused_shapes(self.device)[field]

    # -- buffer names, as the plan passes them to the kernels
    def weight_names(self, layer: int, field: str) -> tuple[str, ...]:
        """A linear's weight buffers: (W,) when FP16, (qweight, qparams) when quantized."""
        name = buffer_name(field, layer)
        return (name,) if self.linear(layer, field).format is None else (f"{name}.qweight", f"{name}.qparams")

    def perm_name(self, layer: int, field: str) -> str | None:
        """The perm buffer the plan gathers a linear's input with, None where there is no gather."""
        gathered = self.linear(layer, field).permuted and field in GATHERED
        return f"{buffer_name(field, layer)}.perm" if gathered else None

    def bias_name(self, layer: int) -> str:
        """The q|k|v bias buffer gemv_qkv_rope and rope_kv_rows add: the layer's own, or NO_BIAS (zeros)."""
        return buffer_name(BIAS, layer) if self.config.qkv_bias else NO_BIAS

    def buffers(self) -> list[Buffer]:
        """Every weight buffer, in load order."""
        d, V = self.device.hidden_size, self.device.vocab_size
        out = [Buffer("embed", (V, d), "float16", "weight"),  # [vocab, d]
               Buffer("final_norm", (d,), "float16", "weight"),  # [d]
               Buffer("lm_head", (V, d), "float16", "weight")]  # [vocab, d]
        for i in range(self.config.num_layers):
            for field in layer_fields(self.config):
                if field not in LINEARS:  # a norm [d], the bias [qkv_dim]
                    out.append(Buffer(buffer_name(field, i), self.shape(field), "float16", "weight"))
                    continue
                out += self._linear_buffers(i, field)
        return out

    def _linear_buffers(self, layer: int, field: str) -> list[Buffer]:
        M, K = self.shape(field)
        fmt = self.linear(layer, field).format
        if fmt is None:
            out = [Buffer(buffer_name(field, layer), (M, K), "float16", "weight")]  # [M, K]
        else:
            shapes = fmt.shapes(M, K)
            qweight, qparams = self.weight_names(layer, field)
            out = [Buffer(qweight, shapes["qweight"], "uint32", "weight"),  # [M, K bits / 32]
                   Buffer(qparams, shapes["qparams"], "float16", "weight")]  # [M, K / group, 2]
        if self.perm_name(layer, field):
            out.append(Buffer(self.perm_name(layer, field), (K,), "int32", "weight"))  # [K] input of column k
        return out

    # -- bytes
    def weight_bytes(self) -> int:
        """Bytes the weights take on the device."""
        return sum(b.nbytes for b in self.buffers())

    def decode_bytes(self) -> int:
        """Bytes of weights a decode step reads: every linear (codes and (scale, zero) pairs where quantized), the
        lm_head and the act-order permutations (the norms, biases and the embedding row are left out, as small)."""
        dev = self.device
        total = 2 * dev.vocab_size * dev.hidden_size
        for i in range(self.config.num_layers):
            for field in LINEARS:
                (M, K), fmt = self.shape(field), self.linear(i, field).format
                total += 2 * M * K if fmt is None else fmt.nbytes(M, K)
                total += 4 * K if self.perm_name(i, field) else 0
        return total

    def describe(self) -> str:
        """What the model runs in, in a few words: "float16", "int4 g128 (quantized on load)", "gptq int4 g128
        act-order", with the FP16 linears counted where some are."""
        counts = self.format_counts()
        fp16 = counts.pop("float16", 0)
        if not counts:
            return "float16"
        text = (f"{' / '.join(counts)} (quantized on load)" if self.source in QUANTIZE
                else self.config.quantization.describe())
        return text + (f", {fp16} of {len(LINEARS) * self.config.num_layers} fused linears float16" if fp16 else "")

    def summary(self) -> dict:
        """What a record says of the weights: the description, fused linears per format, bytes, the floor."""
        decode = self.decode_bytes()
        return {"weights": self.describe(), "source": self.source, "linears": self.format_counts(),
                "intermediate_size": self.device.intermediate_size, "weight_bytes": self.weight_bytes(),
                "decode_bytes": decode, "floor_ms_h200": decode_floor_ms(decode), "notes": list(self.notes)}


def fp16(config: LlamaConfig) -> Layout:
    """The layout of a plain checkpoint: every linear FP16."""
    return Layout(config, ((FP16_LINEAR,) * len(LINEARS),) * config.num_layers)


def as_layout(model: LlamaConfig | Layout) -> Layout:
    """A Layout as it is; a config as its FP16 layout (what every caller that predates quantization passes)."""
    return model if isinstance(model, Layout) else fp16(model)


def on_load(config: LlamaConfig, quantize: str) -> Layout:
    """Quantizing every linear of an FP16 checkpoint on load: int8 per output channel, int4 in int4_group()
    groups. ConfigError where a width the quantized kernels need is not a multiple of 32 (int4) or 16 (int8)."""
    bits = int(quantize.removeprefix("int"))
    dev = device_config(config, quantized=True)
    formats = {}
    for field in LINEARS:
        M, K = fused_shapes(dev)[field]
        if K % quant.VECTOR[bits]:
            width = "hidden_size" if field in NORM_OF else "the attention width (heads x head_dim)"
            raise ConfigError(f"{config.name}: {quantize} needs {width} {K} to be a multiple of "
                              f"{quant.VECTOR[bits]} (a 16-byte vector of {bits}-bit codes)")
        formats[field] = Linear(quant.QuantFormat(bits, K if bits == 8 else int4_group(K)))
    odd = {f"{field} ({fused_shapes(dev)[field][1]} inputs): {linear.format.group}"
           for field, linear in formats.items() if bits == 4 and linear.format.group != INT4_GROUPS[0]}
    notes = (f"int4 groups where 128 does not divide the inputs: {', '.join(sorted(odd))}",) if odd else ()
    return Layout(config, (tuple(formats[f] for f in LINEARS),) * config.num_layers, source=quantize, notes=notes)


def from_checkpoint(config: LlamaConfig, permuted: set[tuple[int, str]] = frozenset()) -> Layout:
    """The layout of an AWQ or GPTQ checkpoint: each fused linear in the checkpoint's format where all its parts
    are quantized, else FP16 (a note names the parts dequantized). `permuted`: the (layer, field)s whose g_idx
    reorders their inputs (act-order). A CheckpointError names a linear whose sizes the format or the quantized
    kernels cannot take (quant_checkpoint.check_sizes)."""
    q = config.quantization
    dev = device_config(config, quantized=True)
    layers, partial = [], {}  # (field, the parts quantized) -> the layers where the field is only partly so
    for i in range(config.num_layers):
        row = []
        for field in LINEARS:
            converted = [q.converts(module_name(i, part)) for part in PARTS[field]]
            for part, stored in zip(PARTS[field], converted):  # the kernels take the format (one line if not)
                if stored:
                    quant_checkpoint.check_sizes(q, module_name(i, part), *expected_shapes(config)[layer_name(i, part)])
            if all(converted):
                M, K = fused_shapes(dev)[field]
                row.append(Linear(quant.QuantFormat(q.bits, K if q.group == -1 else q.group), (i, field) in permuted))
            else:
                row.append(FP16_LINEAR)
                if any(converted):
                    quantized = tuple(p for p, c in zip(PARTS[field], converted) if c)
                    partial.setdefault((field, quantized), []).append(i)
        layers.append(tuple(row))
    notes = tuple(f"{', '.join(quantized)} of layer{'s' if len(where) > 1 else ''} {', '.join(map(str, where))} "
                  f"dequantized to float16 (rounded): modules_to_not_convert keeps the rest of {field} float16"
                  for (field, quantized), where in partial.items())
    return Layout(config, tuple(layers), source=q.method, notes=notes)


# -- the inverse: device tensors -> the model's weights ----------------------------------------------------------
def model_weight(layout: Layout, layer: int, field: str, arrays: dict[str, np.ndarray],
                 down_perm: np.ndarray | None = None) -> np.ndarray:
    """A linear's weights as the model defines them ([M, K] of fused_shapes(layout.config), inputs in the model's
    order) from its device buffers `arrays` (name -> array): FP16 as stored, quantized dequantized exactly
    (float32). down_perm: down_proj's input order under act-order, which w_down's columns and w_gate_up's gate
    and up rows are stored in."""
    linear, names = layout.linear(layer, field), layout.weight_names(layer, field)
    if linear.format is None:
        w = arrays[names[0]]
    else:
        w = quant.dequantize(arrays[names[0]], arrays[names[1]], linear.format.bits)  # [M_dev, K_dev] float32
    perm_name = layout.perm_name(layer, field)
    columns = arrays[perm_name] if perm_name else down_perm if field == "w_down" else None
    if columns is not None:  # column k holds input columns[k]
        unsorted = np.zeros_like(w)
        unsorted[:, columns] = w[:, :len(columns)]
        w = unsorted
    M, K = fused_shapes(layout.config)[field]
    ff, ff_dev = layout.config.intermediate_size, layout.device.intermediate_size
    if field == "w_gate_up":
        gate, up = w[:ff], w[ff_dev:ff_dev + ff]
        if down_perm is not None:  # stored row r is the model's row down_perm[r]
            back = np.argsort(down_perm)
            gate, up = gate[back], up[back]
        return np.concatenate([gate, up]) if ff != ff_dev or down_perm is not None else w
    return w[:M, :K] if w.shape != (M, K) else w


def linear_parts(layout: Layout, layer: int, field: str) -> list[tuple[str, int, int]]:
    """(HF module, first row in the field's device buffer, rows) of each part of a linear (up rows start at ff
    rounded up)."""
    shapes = expected_shapes(layout.config)
    ff_dev, row, out = layout.device.intermediate_size, 0, []
    for k, part in enumerate(PARTS[field]):
        rows = shapes[layer_name(layer, part)][0]
        start = ff_dev if field == "w_gate_up" and k == 1 else row
        out.append((module_name(layer, part), start, rows))
        row = start + rows
    return out


def decode_floor_ms(nbytes: int) -> float:
    """Milliseconds to read `nbytes` at the H200's measured read bandwidth."""
    return nbytes / H200_READ_BYTES_PER_S * 1e3

