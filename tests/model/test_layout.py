"""The device weight layout (cullama/model/layout.py): buffers, formats, padding, bytes and the floor they imply, for
FP16, on-load int8 / int4 and act-order layouts."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cullama.model import layout as layouts, quant
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.model.config import Quantization, preset
from cullama.common.errors import ConfigError
from cullama.model.weights import checkpoint_layout, config_layout, host_weights
from cullama.runtime.load import load_checkpoint

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


# -- formats, names and buffers of each kind of layout, from configs alone ------------------------------------
TINY = preset("tiny")  # d 256, q_dim 256, kv_dim 64, ff 688 (704 when quantized), 4 layers


def test_buffers_layouts_and_linears_are_values():
    buffer = layouts.Buffer("x", (3, 5), "float16", "weight")
    assert buffer.nbytes == 30 and type(buffer.nbytes) is int and layouts.fp16(TINY).weight_bytes() % 2 == 0
    layout = layouts.on_load(TINY, "int4")
    assert hash(layout) == hash(layouts.on_load(TINY, "int4")) and hash(buffer) == hash(dataclasses.replace(buffer))
    for value, field in ((buffer, "name"), (layout, "source"), (layout.linear(0, "wo"), "permuted")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)


def test_the_device_config_pads_for_fp16_unless_told_a_linear_is_quantized():
    odd = dataclasses.replace(TINY, intermediate_size=172)
    assert layouts.device_config(odd).intermediate_size == 176
    assert layouts.device_config(odd, quantized=True).intermediate_size == 192
    assert layouts.device_config(TINY) is TINY  # 688: already a multiple of 8


@pytest.mark.parametrize("make, counts", [
    # int8 is per channel whatever its width; int4 is per channel only past 128 inputs
    (lambda: layouts.on_load(dataclasses.replace(TINY, hidden_size=64, num_heads=2, num_kv_heads=2), "int8"),
     {"int8 per channel": 16}),
    (lambda: layouts.on_load(dataclasses.replace(TINY, hidden_size=128, num_heads=4, num_kv_heads=4), "int4"),
     {"int4 g128": 12, "int4 g64": 4}),  # w_down: 704 inputs, groups of 64
    (lambda: layouts.from_checkpoint(dataclasses.replace(TINY, intermediate_size=768,
                                                         quantization=Quantization("gptq", 8, 128))),
     {"int8 g128": 16}),
    (lambda: layouts.from_checkpoint(dataclasses.replace(TINY, intermediate_size=768,
                                                         quantization=Quantization("gptq", 4, -1))),
     {"int4 per channel": 16}),
])
def test_format_names(make, counts):
    assert make().format_counts() == counts


def test_an_act_order_checkpoints_layout_gathers_and_permutes_what_it_says():
    config = dataclasses.replace(TINY, intermediate_size=768, quantization=Quantization("gptq", 4, 128, desc_act=True))
    permuted = {(0, "wqkv"), (0, "w_down"), (1, "w_gate_up")}
    layout, plain = layouts.from_checkpoint(config, permuted), layouts.from_checkpoint(config)
    assert layout.linear(0, "wqkv") == layouts.Linear(quant.QuantFormat(4, 128), permuted=True)
    assert [layout.linear(i, f).permuted for i in (0, 1) for f in layouts.LINEARS] == \
        [True, False, False, True, False, False, True, False]
    assert [layout.perm_name(0, f) for f in layouts.LINEARS] == ["layers.0.wqkv.perm", None, None, None]
    assert layout.perm_name(1, "w_gate_up") == "layers.1.w_gate_up.perm"  # w_down's order is absorbed instead
    extra = {b.name: (b.shape, b.dtype) for b in layout.buffers()}.items() - \
        {b.name: (b.shape, b.dtype) for b in plain.buffers()}.items()
    # only the perms: the norms stay in the model's order (the plan gathers the input they prepared)
    assert dict(extra) == {"layers.0.wqkv.perm": ((256,), "int32"), "layers.1.w_gate_up.perm": ((256,), "int32")}
    assert layout.decode_bytes() - plain.decode_bytes() == 2 * 4 * 256  # the two gathers' perms, int32
    assert layout.weight_bytes() - plain.weight_bytes() == 2 * 4 * 256
    whole_rows = layouts.from_checkpoint(dataclasses.replace(config, quantization=Quantization("gptq", 8, -1)))
    assert [whole_rows.linear(0, f).format.group for f in layouts.LINEARS] == [256, 256, 256, 768]
    # int8 takes ff 688 (a multiple of 16) as it is stored; on the device it is padded to 704 like every quantized ff
    padded = layouts.from_checkpoint(dataclasses.replace(TINY, quantization=Quantization("gptq", 8, -1)))
    assert padded.linear(0, "w_down").format.group == padded.shape("w_down")[1] == 704
    assert padded.format_counts() == {"int8 per channel": 16}


def test_linear_parts_start_where_the_device_buffer_holds_them():
    layout = layouts.on_load(TINY, "int4")  # ff 688 -> 704
    assert layouts.linear_parts(layout, 0, "wqkv") == [("model.layers.0.self_attn.q_proj", 0, 256),
                                                       ("model.layers.0.self_attn.k_proj", 256, 64),
                                                       ("model.layers.0.self_attn.v_proj", 320, 64)]
    assert layouts.linear_parts(layout, 3, "w_gate_up") == [("model.layers.3.mlp.gate_proj", 0, 688),
                                                            ("model.layers.3.mlp.up_proj", 704, 688)]


@pytest.mark.parametrize("ff", [688, 684])  # 684: padded to 688 on the device
def test_model_weight_undoes_the_padding_and_down_projs_order(ff):
    config = dataclasses.replace(TINY, intermediate_size=ff)
    layout, ff_dev = layouts.fp16(config), 688
    rng = np.random.default_rng(ff)
    gate, up, down = rng.standard_normal((ff, 256)), rng.standard_normal((ff, 256)), rng.standard_normal((256, ff))
    wo = rng.standard_normal((256, 256)).astype(np.float16)
    for order in (None, rng.permutation(ff)):
        p = np.arange(ff) if order is None else order
        stored_gate_up = np.zeros((2 * ff_dev, 256))  # [2 ff_dev, d]: row r holds the model's row p[r]
        stored_gate_up[:ff], stored_gate_up[ff_dev:ff_dev + ff] = gate[p], up[p]
        stored_down = np.zeros((256, ff_dev))  # [d, ff_dev]: column k holds input p[k]
        stored_down[:, :ff] = down[:, p]
        arrays = {"layers.1.w_gate_up": stored_gate_up, "layers.1.w_down": stored_down, "layers.1.wo": wo}
        assert np.array_equal(layouts.model_weight(layout, 1, "w_gate_up", arrays, order), np.concatenate([gate, up]))
        assert np.array_equal(layouts.model_weight(layout, 1, "w_down", arrays, order), down)
        assert layouts.model_weight(layout, 1, "wo", arrays, order) is wo  # not padded, not permuted: as stored
