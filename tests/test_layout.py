"""The device weight layout (cullama/layout.py): buffers, formats, padding, bytes and the floor they imply, for FP16,
on-load int8 / int4 and act-order layouts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cullama import layout as layouts, quant
from cullama.backends.numpy_backend import NumpyBackend
from cullama.checkpoint import open_checkpoint
from cullama.config import preset
from cullama.errors import ConfigError
from cullama.weights import checkpoint_layout, config_layout, host_weights, load_checkpoint

LLAMA_7B = preset("llama-2-7b")


def test_the_fp16_layout_reads_what_the_config_says_a_step_reads():
    layout = layouts.fp16(LLAMA_7B)
    assert layout.decode_bytes() == LLAMA_7B.decode_weight_bytes()  # 13.21 GB
    assert [b.name for b in layout.buffers()][:5] == ["embed", "final_norm", "lm_head", "layers.0.attn_norm",
                                                      "layers.0.wqkv"]
    assert {b.dtype for b in layout.buffers()} == {"float16"} and layout.describe() == "float16"
    assert layout.summary()["floor_ms_h200"] == pytest.approx(2.976, abs=1e-3)


@pytest.mark.parametrize("quantize, bytes_, floor_ms, groups", [
    ("int8", 6.744e9, 1.519, {"int8 per channel": 128}),
    ("int4", 3.703e9, 0.834, {"int4 g128": 128}),  # (scale, zero) as two FP16 per group: 4 bytes per 128 weights
])
def test_on_load_layouts_of_the_7b_and_their_floors(quantize, bytes_, floor_ms, groups):
    layout = layouts.on_load(LLAMA_7B, quantize)
    summary = layout.summary()
    assert summary["decode_bytes"] == pytest.approx(bytes_, rel=1e-3)
    assert summary["floor_ms_h200"] == pytest.approx(floor_ms, abs=1e-3)
    assert summary["linears"] == groups and layout.notes == ()
    assert summary["weights"] == f"{next(iter(groups))} (quantized on load)"
    bits = int(quantize[3:])
    qkv = {b.name: b for b in layout.buffers() if b.name.startswith("layers.0.wqkv")}
    assert qkv["layers.0.wqkv.qweight"].shape == (12288, 4096 * bits // 32)
    assert qkv["layers.0.wqkv.qweight"].dtype == "uint32" and qkv["layers.0.wqkv.qparams"].dtype == "float16"
    assert qkv["layers.0.wqkv.qparams"].shape == (12288, 1 if bits == 8 else 32, 2)


def test_int4_groups_where_128_does_not_divide_the_inputs_and_the_padded_intermediate_size(stories_dir):
    config = open_checkpoint(stories_dir).config  # d 64, intermediate 172
    layout = layouts.on_load(config, "int4")
    assert layout.device.intermediate_size == 192  # a multiple of 32 (FP16 pads to 176)
    assert layouts.fp16(config).device.intermediate_size == 176
    assert {f: layout.linear(0, f).format.group for f in layouts.LINEARS} == \
        {"wqkv": 64, "wo": 64, "w_gate_up": 64, "w_down": 96}
    assert layout.notes == ("int4 groups where 128 does not divide the inputs: w_down (192 inputs): 96, "
                            "w_gate_up (64 inputs): 64, wo (64 inputs): 64, wqkv (64 inputs): 64",)
    assert [layouts.int4_group(k) for k in (4096, 11008, 192, 160, 96, 32)] == [128, 128, 96, 32, 96, 32]


def test_padded_units_are_exact_zeros_after_quantizing_on_load(stories_dir):
    ckpt = open_checkpoint(stories_dir)
    for quantize in layouts.QUANTIZE:
        layout = checkpoint_layout(ckpt, quantize)
        backend = NumpyBackend()
        load_checkpoint(backend, ckpt, layout=layout)
        ff, ff_dev = 172, 192
        for i in range(ckpt.config.num_layers):
            bits = layout.linear(i, "w_gate_up").format.bits
            gate_up = quant.dequantize(*(backend.arrays[n] for n in layout.weight_names(i, "w_gate_up")), bits)
            down = quant.dequantize(*(backend.arrays[n] for n in layout.weight_names(i, "w_down")), bits)
            assert not gate_up[ff:ff_dev].any() and not gate_up[ff_dev + ff:].any() and not down[:, ff:].any()


def test_a_width_the_quantized_kernels_cannot_take_is_a_config_error():
    odd = dataclasses.replace(preset("tiny"), hidden_size=200, num_heads=5, num_kv_heads=5, head_dim=40,
                              name="odd")  # 200 inputs: a multiple of 8, not of 16 or 32
    for quantize, vector in (("int4", 32), ("int8", 16)):
        with pytest.raises(ConfigError, match=f"odd: {quantize} needs hidden_size 200 to be a multiple of {vector}"):
            layouts.on_load(odd, quantize)
    with pytest.raises(ConfigError, match="int4 needs the attention width"):
        layouts.on_load(dataclasses.replace(preset("tiny"), num_heads=2, num_kv_heads=2, head_dim=8, name="odd"),
                        "int4")  # 2 x 8 = 16 inputs to o_proj


def test_a_config_is_its_fp16_layout_everywhere():
    tiny = preset("tiny")
    assert layouts.as_layout(tiny) == layouts.fp16(tiny) == config_layout(tiny)
    assert layouts.as_layout(layouts.fp16(tiny)) is not None
    assert layouts.fp16(tiny).weight_bytes() == sum(b.nbytes for b in layouts.fp16(tiny).buffers())


def test_the_reference_reads_the_weights_the_device_holds(stories_dir):
    """host_weights is model_weight of the loader's device buffers: for int4 the exact dequantized values, in
    the model's shapes (unpadded)."""
    ckpt = open_checkpoint(stories_dir)
    layout = checkpoint_layout(ckpt, "int4")
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt, layout=layout)
    weights = host_weights(ckpt, layout=layout)
    w_down = weights.layers[2].w_down
    assert w_down.dtype == np.float32 and w_down.shape == (64, 172)
    stored = quant.dequantize(backend.arrays["layers.2.w_down.qweight"], backend.arrays["layers.2.w_down.qparams"], 4)
    assert np.array_equal(w_down, stored[:, :172])
    fp16 = host_weights(ckpt).layers[2].w_down.astype(np.float32)
    scale = backend.arrays["layers.2.w_down.qparams"][..., 0].astype(np.float32)  # [64, 2]
    assert np.all(np.abs(w_down - fp16) <= np.repeat(scale, 96, axis=1)[:, :172] / 2 * 1.001)  # half a step
