"""AWQ and GPTQ checkpoints read as they are (cullama/model/quant_checkpoint.py, the loader and the config): every
format variant loads to exactly the weights the format says, bit for bit, on the device and for the reference; older
dumps' own quantization files; modules_to_not_convert; and every refusal is one line naming the key or tensor, before
any weight reaches the device. The checkpoints are packed by tests/quant_checkpoints.py from the formats'
definitions."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import cullama
from cullama.model import layout as layouts, quant, quant_checkpoint
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint
from cullama.model.config import Quantization, from_pretrained
from cullama.common.errors import CheckpointError, ConfigError, GenerationError, OptionError
from cullama.model.weights import checkpoint_layout, host_weights
from cullama.runtime.load import load_checkpoint
from tests.quant_checkpoints import CONFIG, variants, write

GPTQ_ACT = Quantization("gptq", 4, 64, "gptq", sym=False, desc_act=True)


def name_of(q: Quantization) -> str:
    return q.describe().replace(" ", "-") + ("" if q.method == "awq" else f"-{q.checkpoint_format}-sym{int(q.sym)}")


def expected_device_weights(truth, layer: int, field: str, q: Quantization) -> tuple[np.ndarray, np.ndarray | None]:
    """The device matrix of a fused linear as the layout defines it, built from the truth alone: the parts' rows
    stacked, inputs sorted by g_idx (a stable sort, done here with NumPy), and for w_gate_up the rows in
    down_proj's input order; and the perm buffer expected (None: none)."""
    modules = [layouts.module_name(layer, part) for part in layouts.PARTS[field]]
    w = np.concatenate([truth[m].weight() for m in modules])
    order = np.argsort(truth[modules[0]].g_idx, kind="stable")
    down = np.argsort(truth[layouts.module_name(layer, "mlp.down_proj")].g_idx, kind="stable")
    identity = lambda p: np.array_equal(p, np.arange(len(p)))  # noqa: E731
    if field == "w_gate_up" and not identity(down):
        ff = CONFIG.intermediate_size
        w = np.concatenate([w[:ff][down], w[ff:][down]])
    if identity(order):
        return w, None
    return w[:, order], (None if field == "w_down" else order)


@pytest.mark.parametrize("q", variants(), ids=name_of)
def test_every_format_variant_loads_to_exactly_the_weights_the_format_says(tmp_path, q):
    truth = write(tmp_path, CONFIG, q, seed=len(name_of(q)))
    ckpt = open_checkpoint(tmp_path)
    layout = checkpoint_layout(ckpt)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt, layout=layout)
    for i in range(CONFIG.num_layers):
        for field in layouts.LINEARS:
            qweight, qparams = (backend.arrays[n] for n in layout.weight_names(i, field))
            expected, perm = expected_device_weights(truth, i, field, q)
            got = quant.dequantize(qweight, qparams, q.bits)  # float32, exact
            assert got.dtype == np.float32 and np.array_equal(got, expected), (i, field)
            assert layout.perm_name(i, field) is None if perm is None else \
                np.array_equal(backend.arrays[layout.perm_name(i, field)], perm)
    # the reference's weights: the model's own order and shapes, exactly
    weights = host_weights(ckpt, layout=layout)
    for i, layer in enumerate(weights.layers):
        for field in layouts.LINEARS:
            expected = np.concatenate([truth[layouts.module_name(i, p)].weight() for p in layouts.PARTS[field]])
            assert np.array_equal(getattr(layer, field), expected), (i, field)


def test_the_variants_cover_the_formats_the_issue_lists():
    seen = {(q.method, q.bits, q.group, q.sym, q.desc_act, q.checkpoint_format) for q in variants()}
    assert {("awq", 4, g, False, False, "gptq") for g in (32, 64, 128)} <= seen
    for bits in (4, 8):
        for group in (32, 64, 128, -1):
            for fmt in ("gptq", "gptq_v2"):
                for sym in (False, True):
                    assert ("gptq", bits, group, sym, False, fmt) in seen
                    assert group == -1 or ("gptq", bits, group, sym, True, fmt) in seen


def test_a_stored_zero_of_all_ones_in_the_v1_format_is_two_to_the_bits(tmp_path):
    """GPTQ's v1 format stores zero - 1 in a 4-bit field: a stored 15 is a zero of 16 (the packer writes one)."""
    q = Quantization("gptq", 4, 128, "gptq", sym=False)
    truth = write(tmp_path, CONFIG, q)
    module = "model.layers.0.self_attn.q_proj"
    assert truth[module].zeros[0, 0] == 16
    stored = load_file(str(tmp_path / "model.safetensors"))[f"{module}.qzeros"]
    assert stored[0, 0].view(np.uint32) & 0xF == 15
    backend = NumpyBackend()
    ckpt = open_checkpoint(tmp_path)
    load_checkpoint(backend, ckpt, layout=checkpoint_layout(ckpt))
    assert backend.arrays["layers.0.wqkv.qparams"][0, 0, 1] == 16


@pytest.mark.parametrize("quant_file, q", [("quant_config.json", Quantization("awq", 4, 64)),
                                           ("quantize_config.json", GPTQ_ACT)])
def test_older_dumps_keep_the_scheme_in_their_own_file(tmp_path, quant_file, q):
    truth = write(tmp_path, CONFIG, q, quant_file=quant_file)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    config = from_pretrained(tmp_path)
    assert config.quantization == dataclasses.replace(q, not_converted=())
    weights = host_weights(open_checkpoint(tmp_path))
    assert np.array_equal(weights.layers[1].wo, truth["model.layers.1.self_attn.o_proj"].weight())


def test_modules_to_not_convert_stay_fp16_and_a_partly_quantized_field_is_dequantized(tmp_path):
    q = Quantization("gptq", 4, 64, "gptq_v2", sym=False, desc_act=True, not_converted=("k_proj", "o_proj"))
    truth = write(tmp_path, CONFIG, q)
    stored = load_file(str(tmp_path / "model.safetensors"))
    ckpt = open_checkpoint(tmp_path)
    layout = checkpoint_layout(ckpt)
    assert layout.format_counts() == {"float16": 4, "int4 g64": 4}  # wqkv and wo FP16 in both layers
    assert layout.notes == ("self_attn.q_proj, self_attn.v_proj of layers 0, 1 dequantized to float16 (rounded): "
                            "modules_to_not_convert keeps the rest of wqkv float16",)
    weights = host_weights(ckpt, layout=layout)
    layer = weights.layers[0]
    assert np.array_equal(layer.wo, stored["model.layers.0.self_attn.o_proj.weight"])  # as stored
    q_rows = truth["model.layers.0.self_attn.q_proj"].weight().astype(np.float16)  # dequantized, rounded
    assert layer.wqkv.dtype == np.float16 and np.array_equal(layer.wqkv[:CONFIG.q_dim], q_rows)
    assert np.array_equal(layer.wqkv[CONFIG.q_dim:CONFIG.q_dim + CONFIG.kv_dim],
                          stored["model.layers.0.self_attn.k_proj.weight"])
    assert np.array_equal(layer.w_gate_up[:CONFIG.intermediate_size],
                          truth["model.layers.0.mlp.gate_proj"].weight())  # still quantized, still exact


# -- refused in one line, naming the key or tensor, before any weight reaches the device ------------------------
@pytest.fixture
def device_never_used(monkeypatch):
    """Fails a test if a backend is made (nothing may reach a device before a refusal)."""
    from cullama import llama as llama_module

    def refuse(*args, **kwargs):
        raise AssertionError("a device backend was made before the checkpoint was refused")

    monkeypatch.setattr(llama_module, "make_backend", refuse)


def refused(directory, error=CheckpointError, **kwargs) -> str:
    with pytest.raises(error) as caught:
        cullama.Llama.from_pretrained(directory, device="cpu", **kwargs)
    message = str(caught.value)
    assert "\n" not in message
    return message


def edit_config(directory, **changes) -> None:
    path = directory / "config.json"
    raw = json.loads(path.read_text())
    raw["quantization_config"] |= changes
    path.write_text(json.dumps(raw))


def edit_tensors(directory, change) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize("changes, needle", [
    ({"quant_method": "bitsandbytes"}, 'quantization_config.quant_method "bitsandbytes" is not supported'),
    ({"quant_method": "fp8"}, 'quant_method "fp8"'),
    ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
    ({"bits": 3}, "quantization_config.bits 3 is not supported (gptq: 4 or 8 bits)"),
    ({"bits": "4"}, 'quantization_config.bits must be an integer, got "4"'),
    ({"group_size": 0}, "quantization_config.group_size must be -1"),
    ({"desc_act": "yes"}, "quantization_config.desc_act must be true or false"),
    ({"checkpoint_format": "marlin"}, 'quantization_config.checkpoint_format "marlin" is not supported'),
    ({"is_marlin_format": True}, "is_marlin_format"),
    ({"dynamic": {"layers.0": {"bits": 8}}}, "quantization_config.dynamic is not supported"),
    ({"lm_head": True}, "quantization_config.lm_head = true"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
])
def test_a_scheme_cullama_does_not_read_is_refused_by_its_key(tmp_path, device_never_used, changes, needle):
    write(tmp_path, CONFIG, GPTQ_ACT)
    edit_config(tmp_path, **changes)
    message = refused(tmp_path, ConfigError)
    assert needle in message and str(tmp_path / "config.json") in message, message


@pytest.mark.parametrize("changes, needle", [
    ({"version": "gemv"}, 'quantization_config.version "gemv" is not supported'),
    ({"zero_point": False}, "quantization_config.zero_point = false is not supported"),
    ({"bits": 8}, "quantization_config.bits 8 is not supported (awq: 4 bits)"),
])
def test_an_awq_variant_cullama_does_not_read_is_refused_by_its_key(tmp_path, device_never_used, changes, needle):
    write(tmp_path, CONFIG, Quantization("awq", 4, 64))
    edit_config(tmp_path, **changes)
    assert needle in refused(tmp_path, ConfigError)


def test_a_group_that_does_not_divide_the_inputs_is_refused(tmp_path, device_never_used):
    write(tmp_path, CONFIG, Quantization("gptq", 4, 96, "gptq_v2"))  # 96 divides no K here (128, 256)
    assert "model.layers.0.self_attn.q_proj: quantization_config.group_size 96 does not divide its 128 inputs" \
        in refused(tmp_path)


def test_a_group_the_kernels_cannot_take_is_refused(tmp_path, device_never_used):
    write(tmp_path, CONFIG, Quantization("gptq", 4, 16, "gptq_v2"))  # a 16-byte vector holds 32 4-bit codes
    assert "128 inputs in groups of 16 are not supported (cullama's 4-bit kernels need both to be multiples of " \
           "32)" in refused(tmp_path)


@pytest.mark.parametrize("q, N, K, needle", [
    (Quantization("gptq", 4, -1), 256, 100, "m: 256 outputs and 100 inputs do not pack 8 4-bit codes to a word"),
    (Quantization("gptq", 4, 64), 100, 128, "m: 100 outputs and 128 inputs do not pack 8 4-bit codes to a word"),
    (Quantization("gptq", 8, 64), 130, 128, "m: 130 outputs and 128 inputs do not pack 4 8-bit codes to a word"),
    (Quantization("awq", 4, 64), 100, 128, "m: 100 outputs and 128 inputs do not pack 8 4-bit codes to a word"),
    (Quantization("gptq", 4, 64), 256, 96, "m: quantization_config.group_size 64 does not divide its 96 inputs"),
    (Quantization("awq", 4, -1), 256, 40, "m: 40 inputs in groups of 40 are not supported"),
])
def test_sizes_that_do_not_pack_are_refused_by_what_fails_first(q, N, K, needle):
    # GPTQ packs along the inputs and needs whole words of outputs for its zeros; AWQ packs along the outputs.
    with pytest.raises(CheckpointError) as caught:
        quant_checkpoint.check_sizes(q, "m", N, K)
    assert needle in str(caught.value)


@pytest.mark.parametrize("q, expected", [
    (Quantization("awq", 4, 64), "m.qweight: expected shape [128, 32] for 256 outputs and 128 inputs in 4-bit "
                                 "groups of 64, found [1, 1]"),
    (Quantization("gptq", 8, -1), "m.qweight: expected shape [32, 256] for 256 outputs and 128 inputs in 8-bit "
                                  "groups of 128, found [1, 1]"),
])
def test_a_misshapen_tensor_is_refused_with_the_shape_the_format_stores(q, expected):
    with pytest.raises(CheckpointError) as caught:
        quant_checkpoint.check(q, "m", 256, 128, lambda name: ("I32", (1, 1)), "ckpt")
    assert str(caught.value) == f"ckpt: {expected}"
    # every other tensor as the format stores it: no error
    shapes = quant_checkpoint.shapes(q, 256, 128)
    assert all(type(n) is int for shape in shapes.values() for n in shape)
    quant_checkpoint.check(q, "m", 256, 128, lambda name: (quant_checkpoint.DTYPES[name[2:]], shapes[name[2:]]),
                           "ckpt")


Q = "model.layers.1.mlp.up_proj"


@pytest.mark.parametrize("change, needle", [
    (lambda t: t.pop(f"{Q}.qzeros"), f"missing tensor {Q}.qzeros (gptq stores qweight, qzeros, scales, g_idx"),
    (lambda t: t.pop(f"{Q}.scales"), f"missing tensor {Q}.scales"),
    (lambda t: t.pop(f"{Q}.g_idx"), f"missing tensor {Q}.g_idx"),
    (lambda t: t.pop(f"{Q}.qweight"), f"missing tensor {Q}.qweight"),
    (lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"][:-1]}),
     f"{Q}.qweight: expected shape [16, 256] for 256 outputs and 128 inputs in 4-bit groups of 64, found [15, 256]"),
    (lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].T.copy()}), "expected shape [16, 256]"),
    (lambda t: t.update({f"{Q}.qzeros": t[f"{Q}.qzeros"][:1]}), f"{Q}.qzeros: expected shape [2, 32]"),
    (lambda t: t.update({f"{Q}.scales": t[f"{Q}.scales"].astype(np.float32)}), f"{Q}.scales: dtype F32 is not F16"),
    (lambda t: t.update({f"{Q}.qweight": t[f"{Q}.qweight"].view(np.uint32)}), f"{Q}.qweight: dtype U32 is not I32"),
    (lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"][:64]}), f"{Q}.g_idx: expected shape [128]"),
])
def test_a_missing_or_misshapen_packed_tensor_is_refused_by_name(tmp_path, device_never_used, change, needle):
    write(tmp_path, CONFIG, GPTQ_ACT)
    edit_tensors(tmp_path, change)
    assert needle in refused(tmp_path)


def _set(tensors, name, index, value):
    tensors[name] = tensors[name].copy()
    tensors[name][index] = value


@pytest.mark.parametrize("change, needle", [
    (lambda t: _set(t, f"{Q}.scales", (1, 3), np.inf), f"{Q}.scales holds inf at [1, 3] (NaN and inf scales"),
    (lambda t: _set(t, f"{Q}.scales", (0, 7), np.nan), f"{Q}.scales holds nan at [0, 7]"),
    (lambda t: _set(t, f"{Q}.g_idx", 5, 2), f"{Q}.g_idx is not a valid grouping of 128 inputs into 2 groups of 64 "
                                            "(values 0 to 2)"),
    (lambda t: _set(t, f"{Q}.g_idx", slice(0, 128), 0), f"{Q}.g_idx is not a valid grouping"),  # one group of 128
    (lambda t: _set(t, f"{Q}.g_idx", 5, -1), "values -1 to 1"),
    # a -1 in place of a 0 leaves every group's count as it was: only the range check sees it
    (lambda t: _set(t, f"{Q}.g_idx", int(np.flatnonzero(t[f"{Q}.g_idx"] == 0)[0]), -1), "values -1 to 1"),
    (lambda t: [_set(t, f"{Q}.scales", (0, 7), np.nan), _set(t, f"{Q}.scales", (1, 3), np.inf)],
     f"{Q}.scales holds nan at [0, 7]"),  # the first bad scale is named
    (lambda t: t.update({f"{Q}.g_idx": t[f"{Q}.g_idx"][::-1].copy()}),
     f"model.layers.1.mlp.gate_proj.g_idx and {Q}.g_idx differ, but the parts of w_gate_up share one input"),
])
def test_bad_scales_and_groupings_are_refused_before_any_weight_reaches_the_device(tmp_path, device_never_used,
                                                                                  change, needle):
    write(tmp_path, CONFIG, GPTQ_ACT)
    edit_tensors(tmp_path, change)
    assert needle in refused(tmp_path)


@pytest.mark.parametrize("q", [GPTQ_ACT, Quantization("awq", 4, 64)])
def test_a_scale_whose_weight_fp16_cannot_hold_is_refused_naming_it(tmp_path, q):
    # issue 30 item 6: every scale 65504 passed the checks; generation then failed with "no token can be drawn"
    # after four NumPy warnings. The bound is exact: the group's code farthest from its zero, times the scale.
    truth = write(tmp_path, CONFIG, q)[Q]
    group, n = 1, 3
    members = np.flatnonzero(truth.g_idx == group)  # the inputs of group 1, in the model's order
    offsets = truth.codes[n, members].astype(np.float32) - truth.zeros[group, n]
    j = int(np.argmax(np.abs(offsets)))
    far, k = float(abs(offsets[j])), int(members[j])
    fits = np.float16(65519 / far)  # rounded down to FP16 below: far * fits < 65520 still rounds to 65504
    fits = fits if far * float(fits) < 65520 else np.nextafter(fits, np.float16(0))
    past = np.nextafter(fits, np.float16(np.inf))  # the next FP16 scale: far * past rounds to inf
    assert far * float(past) >= 65520
    edit_tensors(tmp_path, lambda t: _set(t, f"{Q}.scales", (group, n), fits))
    cullama.Llama.from_pretrained(tmp_path, device="cpu")
    edit_tensors(tmp_path, lambda t: _set(t, f"{Q}.scales", (group, n), past))
    weight = offsets[j] * np.float32(past)
    assert refused(tmp_path) == f"{tmp_path}: {Q}.scales[{group}, {n}] is {float(past):g}: the weight [{n}, {k}] " \
                                f"dequantizes to {weight:g}, past FP16's largest value (65504)"
    edit_tensors(tmp_path, lambda t: t.update({f"{Q}.scales": np.full_like(t[f"{Q}.scales"], 65504)}))
    assert refused(tmp_path).startswith(f"{tmp_path}: {Q}.scales[0, 0] is 65504: the weight [0, ")


def test_numbers_that_overflow_in_generation_give_no_numpy_warning(tmp_path):
    # weights FP16 holds, large enough that the activations overflow: the one error, and no RuntimeWarning
    write(tmp_path, CONFIG, Quantization("awq", 4, 64))
    edit_tensors(tmp_path, lambda t: t.update({name: np.full_like(t[name], 4000) for name in t
                                               if name.endswith(".scales")}))
    llm = cullama.Llama.from_pretrained(tmp_path, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(GenerationError, match="no token can be drawn"):
            llm.generate([1, 2, 3], max_new_tokens=2)
        assert np.isnan(llm.logits([1, 2, 3])).all()


@pytest.mark.parametrize("q", [GPTQ_ACT, Quantization("awq", 4, 64)])
def test_a_stray_fp16_weight_beside_a_quantized_linear_is_refused_naming_both(tmp_path, device_never_used, q):
    # issue 30 item 7: q_proj.weight next to q_proj.qweight / qzeros / scales was ignored without a word
    module = "model.layers.0.self_attn.q_proj"
    write(tmp_path, CONFIG, q)
    edit_tensors(tmp_path, lambda t: t.update({f"{module}.weight": np.zeros((128, 128), np.float16)}))
    assert refused(tmp_path) == f"{tmp_path / 'model.safetensors'}: {module}.weight and {module}.qweight are both " \
                                "stored: a linear is either FP16 or quantized, not both (which one is meant?)"


def test_a_packed_linear_beside_its_fp16_weight_is_refused_where_the_config_keeps_it_fp16(tmp_path,
                                                                                          device_never_used):
    # the other way round: modules_to_not_convert keeps down_proj FP16, and a qweight of it is there too
    write(tmp_path, CONFIG, Quantization("gptq", 4, 64, not_converted=("down_proj",)))
    module = "model.layers.1.mlp.down_proj"
    edit_tensors(tmp_path, lambda t: t.update({f"{module}.qweight": np.zeros((32, 128), np.int32)}))
    assert f"{module}.weight and {module}.qweight are both stored" in refused(tmp_path)


def test_non_quantized_tensors_of_an_unsupported_dtype_are_refused(tmp_path, device_never_used):
    write(tmp_path, CONFIG, GPTQ_ACT)
    edit_tensors(tmp_path, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].astype(np.float64)}))
    assert "model.norm.weight: dtype F64 is not supported (only F16, BF16, F32)" in refused(tmp_path)


def test_quantize_on_a_quantized_checkpoint_and_unknown_quantizations_are_refused(tmp_path, monkeypatch):
    from cullama import llama as llama_module

    write(tmp_path, CONFIG, GPTQ_ACT)
    monkeypatch.setattr(llama_module.checkpoint, "open_checkpoint", lambda *a, **k: pytest.fail("weights opened"))
    with pytest.raises(OptionError) as caught:
        cullama.Llama.from_pretrained(tmp_path, device="cpu", quantize="int4")
    assert "int4 cannot apply" in str(caught.value) and "already quantized (gptq int4 g64 act-order)" in \
        caught.value.for_cli()
    assert caught.value.for_cli().startswith("--quantize ")
    for bad in ("int3", "fp8", 4, "INT4"):
        with pytest.raises(OptionError, match="quantize must be one of int8, int4"):
            cullama.Llama.from_pretrained(tmp_path, device="cpu", quantize=bad)


def test_a_draft_quantized_differently_from_the_target_is_fine(tmp_path):
    target, draft = tmp_path / "target", tmp_path / "draft"
    write(target, CONFIG, Quantization("awq", 4, 64))
    write(draft, dataclasses.replace(CONFIG, num_layers=1), GPTQ_ACT)
    llm = cullama.Llama.from_pretrained(target, device="cpu", draft_model=draft, quantize=None)
    assert llm.layout.describe() == "awq int4 g64" and llm.draft.layout.describe() == "gptq int4 g64 act-order"
    out = llm.generate([1, 2, 3], max_new_tokens=6, speculative="draft", draft_tokens=3, ignore_eos=True)
    assert out.token_ids == llm.generate([1, 2, 3], max_new_tokens=6, ignore_eos=True).token_ids
