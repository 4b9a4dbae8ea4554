"""LlamaConfig: both HF config.json spellings, presets, derived sizes, and every ConfigError."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from cullama.model.config import PRESETS, LlamaConfig, RopeScaling, from_hf_dict, from_pretrained, preset
from cullama.common.errors import ConfigError

GOLDEN = Path(__file__).resolve().parents[2].parent / "shared" / "golden"
needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"shared test data {GOLDEN} is absent")

# The smallest config.json cullama accepts, in the LLaMA-2 era spelling.
MINIMAL = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 2, "num_attention_heads": 4}


def fields(config: LlamaConfig) -> dict:
    return dataclasses.asdict(config) | {"name": None}


@needs_golden
def test_llama2_era_config():
    # torch_dtype, no rope_theta, no head_dim: defaults and hidden / heads fill them in.
    config = from_pretrained(GOLDEN / "tiny-mha")
    assert fields(config) == fields(LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=344, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=32, max_seq_len=256, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,), dtype="float16"))
    assert config.name.endswith("config.json")


@needs_golden
def test_current_config_with_gqa():
    # dtype, rope_parameters, head_dim: the current transformers spelling.
    config = from_pretrained(GOLDEN / "tiny-gqa-sharded")
    assert fields(config) == fields(LlamaConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=688, num_layers=3, num_heads=8, num_kv_heads=2,
        head_dim=32, max_seq_len=256, dtype="float16"))
    assert (config.q_dim, config.kv_dim, config.qkv_dim, config.group_size) == (256, 64, 384, 4)


def test_missing_num_key_value_heads_means_multi_head():
    config = from_hf_dict(MINIMAL)
    assert config.num_kv_heads == config.num_heads == 4
    assert config.head_dim == 8


def test_rope_theta_from_rope_parameters():
    raw = MINIMAL | {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}
    assert from_hf_dict(raw).rope_theta == 500000.0
    assert from_hf_dict(MINIMAL | {"rope_theta": 1e6}).rope_theta == 1e6
    assert from_hf_dict(MINIMAL).rope_theta == 10000.0


def test_eos_token_list_and_dtype_spellings():
    config = from_hf_dict(MINIMAL | {"eos_token_id": [2, 7], "torch_dtype": "bfloat16"})
    assert config.eos_token_ids == (2, 7)
    assert config.dtype == "bfloat16"
    assert from_hf_dict(MINIMAL | {"dtype": "float32", "torch_dtype": "float16"}).dtype == "float32"


def test_to_hf_dict_round_trips():
    for config in PRESETS.values():
        assert fields(from_hf_dict(config.to_hf_dict())) == fields(config)


@pytest.mark.parametrize("name, shape", [
    ("llama-2-7b", (32000, 4096, 11008, 32, 32, 32, 128)),
    ("llama-2-13b", (32000, 5120, 13824, 40, 40, 40, 128)),
    ("tiny", (1024, 256, 688, 4, 8, 2, 32)),
])
def test_presets(name, shape):
    config = preset(name)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers,
            config.num_heads, config.num_kv_heads, config.head_dim) == shape
    assert config.name == name and config.max_seq_len >= 1024 and config.dtype == "float16"


def test_llama_2_7b_sizes():
    config = preset("llama-2-7b")
    # DESIGN.md section 1: a decode step reads 13.21 GB (all linear weights + lm_head).
    assert config.decode_weight_bytes() == pytest.approx(13.21e9, abs=0.01e9)
    assert config.param_count() == pytest.approx(6.74e9, abs=0.01e9)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ConfigError, match="llama-2-7b"):
        preset("llama-2-70b")


def write_config(directory: Path, content) -> Path:
    file = directory / "config.json"
    file.write_text(content if isinstance(content, str) else json.dumps(content))
    return directory


@pytest.mark.parametrize("content, needle", [
    (MINIMAL | {"model_type": "gemma"}, "model_type"),
    (MINIMAL | {"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling.type"),
    (MINIMAL | {"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}, "rope_parameters.rope_type"),
    (MINIMAL | {"attention_bias": True}, "attention_bias"),
    (MINIMAL | {"mlp_bias": True}, "mlp_bias"),
    (MINIMAL | {"hidden_act": "gelu"}, "hidden_act"),
    ({k: v for k, v in MINIMAL.items() if k != "hidden_size"}, "hidden_size"),
    ({k: v for k, v in MINIMAL.items() if k != "vocab_size"}, "vocab_size"),
    (MINIMAL | {"num_key_value_heads": 3}, "num_key_value_heads"),
    (MINIMAL | {"intermediate_size": "48"}, "intermediate_size"),
    ('{"model_type": "llama", ', "not valid JSON"),
    ("[1, 2]", "JSON object"),
], ids=["model_type", "rope_scaling", "rope_type", "attention_bias", "mlp_bias", "hidden_act",
        "missing_hidden_size", "missing_vocab_size", "kv_heads_not_divisor", "string_size", "malformed",
        "not_object"])
def test_config_errors_name_file_and_option(tmp_path, content, needle):
    with pytest.raises(ConfigError) as info:
        from_pretrained(write_config(tmp_path, content))
    message = str(info.value)
    assert "\n" not in message
    assert str(tmp_path / "config.json") in message and needle in message


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(info.value) and "\n" not in str(info.value)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such model directory"):
        from_pretrained(tmp_path / "nowhere")


def test_config_json_that_is_not_a_file(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'config.json'}: a directory (")):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").rmdir()
    (tmp_path / "config.json").symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(ConfigError, match="config.json: a broken symbolic link"):
        from_pretrained(tmp_path)


def test_model_path_that_is_a_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ConfigError, match="no such model directory"):
        from_pretrained(tmp_path / "model.safetensors")


# -- types and ranges: a wrong value names its key in one line --------------------------------------


@pytest.mark.parametrize("change, needle", [
    ({"eos_token_id": "494"}, "eos_token_id"),
    ({"eos_token_id": ["494"]}, "eos_token_id"),
    ({"eos_token_id": [[494]]}, "eos_token_id"),
    ({"eos_token_id": True}, "eos_token_id"),
    ({"eos_token_id": 64}, "eos_token_id 64 is outside the vocabulary"),
    ({"eos_token_id": [2, -1]}, "eos_token_id -1 is outside"),
    ({"eos_token_id": "494"}, 'eos_token_id must be an integer or a list of integers, got "494"'),
    ({"head_dim": "8"}, 'head_dim must be an integer, got "8"'),
    ({"bos_token_id": "1"}, 'bos_token_id must be an integer, got "1"'),
    ({"bos_token_id": 64}, "bos_token_id 64 is outside the vocabulary (vocab_size 64)"),
    ({"pretraining_tp": "1"}, 'pretraining_tp must be an integer, got "1"'),
    ({"pretraining_tp": 0}, "pretraining_tp must be from 1"),
    ({"pretraining_tp": None}, "pretraining_tp must be an integer, got null"),
    ({"attention_dropout": "x"}, 'attention_dropout must be a number, got "x"'),
    ({"attention_dropout": 1.5}, "attention_dropout must be a finite number from 0 to 1, got 1.5"),
    ({"initializer_range": "x"}, 'initializer_range must be a number, got "x"'),
    ({"initializer_range": -0.02}, "initializer_range must be a finite number >= 0"),
    ({"use_cache": "yes"}, 'use_cache must be true or false, got "yes"'),
    ({"pad_token_id": "0"}, 'pad_token_id must be an integer or null, got "0"'),
    ({"pad_token_id": 1.0}, "pad_token_id must be an integer or null, got 1.0"),
    ({"architectures": "LlamaForCausalLM"}, 'architectures must be a list of strings, got "LlamaForCausalLM"'),
    ({"architectures": [7]}, "architectures must be a list of strings"),
    ({"architectures": ["MistralForCausalLM"]},
     'architectures ["MistralForCausalLM"] is not model_type "llama"\'s architecture'),
    ({"architectures": ["GemmaForCausalLM"]}, 'architectures ["GemmaForCausalLM"] is not supported (cullama runs '
                                             'LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)'),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"tie_word_embeddings": 0}, "tie_word_embeddings"),
    ({"attention_bias": "false"}, "attention_bias must be true or false"),
    ({"max_position_embeddings": 1e9}, "max_position_embeddings must be an integer"),
    ({"max_position_embeddings": 4096.0}, "max_position_embeddings must be an integer"),
    ({"hidden_size": True}, "hidden_size must be an integer"),
    ({"vocab_size": 0}, "vocab_size must be from 1"),
    ({"vocab_size": 2**31}, "vocab_size must be from 1 to 2147483647"),
    ({"num_hidden_layers": -2}, "num_hidden_layers"),
    ({"head_dim": 0}, "head_dim"),
    ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"rms_norm_eps": "abc"}, "rms_norm_eps must be a number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0"),
    ({"rms_norm_eps": None}, "rms_norm_eps must be a number"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"rope_theta": 10**400}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta"),
    ({"rope_parameters": "default"}, "rope_parameters must be a JSON object"),
    ({"hidden_act": ["silu"]}, "hidden_act must be a string"),
    ({"model_type": None}, "model_type must be a string"),
    ({"dtype": "float64"}, 'dtype "float64" is not supported'),
    ({"torch_dtype": 16}, "torch_dtype must be a string"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "linear"}}, "missing required key 'rope_scaling.factor'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, "rope_scaling.factor must be a number"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 0.0}}, "rope_scaling.factor must be a finite number > 0"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     "rope_scaling.high_freq_factor (4) must exceed low_freq_factor (4)"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192.0}}, "original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.25}},
     "rope_scaling.partial_rotary_factor"),
])
def test_wrong_types_and_ranges_name_the_key(tmp_path, change, needle):
    with pytest.raises(ConfigError) as info:
        from_pretrained(write_config(tmp_path, MINIMAL | change))
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message
    assert needle in message, message


def test_a_huge_or_unprintable_value_is_shown_short_and_escaped(tmp_path):
    for value in ["x" * 100_000, "llama\n\x1b[31mred", list(range(100_000))]:
        with pytest.raises(ConfigError) as info:
            from_pretrained(write_config(tmp_path, MINIMAL | {"model_type": value}))
        message = str(info.value)
        assert len(message) < len(str(tmp_path)) + 150 and "\x1b" not in message and "\n" not in message


@pytest.mark.parametrize("content, needle", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model_type": "ll\xffama"}', "invalid UTF-8 at byte 18"),
    (b"\xef\xbb\xbf" + json.dumps(MINIMAL).encode(), None),  # a UTF-8 byte order mark is fine
    (b'"llama"', "expected a JSON object, got str"),
    (b"", "not valid JSON"),
])
def test_unparseable_config_is_one_line(tmp_path, content, needle):
    (tmp_path / "config.json").write_bytes(content)
    if needle is None:
        assert from_pretrained(tmp_path).vocab_size == MINIMAL["vocab_size"]
        return
    with pytest.raises(ConfigError) as info:
        from_pretrained(tmp_path)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message and needle in message
    assert "\\xff" not in message and "0xff" not in message  # positions, never the file's bytes


def test_json_types_that_are_honoured():
    config = from_hf_dict(MINIMAL | {"eos_token_id": [2, 7], "tie_word_embeddings": True, "rope_theta": 500000,
                                     "num_key_value_heads": None, "head_dim": None, "bos_token_id": None,
                                     "dtype": None, "torch_dtype": "float32", "rms_norm_eps": 1e-6})
    assert config.eos_token_ids == (2, 7) and config.tie_word_embeddings is True
    assert config.rope_theta == 500000.0 and isinstance(config.rope_theta, float)
    assert (config.num_kv_heads, config.head_dim, config.bos_token_id, config.dtype) == (4, 8, 1, "float32")
    assert from_hf_dict(MINIMAL | {"eos_token_id": None}).eos_token_ids == ()
    assert from_hf_dict(MINIMAL | {"tie_word_embeddings": False}).tie_word_embeddings is False


@pytest.mark.parametrize("change", [
    {"pretraining_tp": 2},  # HF computes the same matmuls in slices
    {"pad_token_id": None}, {"pad_token_id": 0}, {"pad_token_id": -1}, {"pad_token_id": 64},  # never used
    {"attention_dropout": None}, {"attention_dropout": 0}, {"attention_dropout": 0.1},
    {"initializer_range": None}, {"initializer_range": 0.02}, {"use_cache": None}, {"use_cache": False},
    {"architectures": None}, {"architectures": []}, {"architectures": ["LlamaForCausalLM"]},
    {"architectures": ["LLaMAForCausalLM"]},  # early conversions' spelling
    {"bos_token_id": 63},
], ids=str)
def test_keys_that_do_not_change_the_math_are_accepted_when_well_typed(change):
    assert from_hf_dict(MINIMAL | change).vocab_size == MINIMAL["vocab_size"]


# -- RoPE scaling: the LLaMA variants are read (reference.rope_frequencies applies them) ---------------


@pytest.mark.parametrize("raw, expected", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, RopeScaling("linear", 2.0, 128)),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4}}, RopeScaling("dynamic", 4.0, 128)),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
     RopeScaling("llama3", 8.0, 64, 1.0, 4.0)),
    # HF 5: original_max_position_embeddings defaults to max_position_embeddings
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
     RopeScaling("llama3", 8.0, 128, 1.0, 4.0)),
    ({"rope_scaling": {}, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, None),
    ({"rope_scaling": None}, None),
], ids=["legacy_type_key", "dynamic", "llama3", "llama3_default_original", "empty_scaling", "null_scaling"])
def test_rope_scaling_variants(raw, expected):
    config = from_hf_dict(MINIMAL | {"max_position_embeddings": 128} | raw)
    assert config.rope_scaling == expected
    assert fields(from_hf_dict(config.to_hf_dict())) == fields(config)  # written back as rope_parameters


def test_rope_scaling_wins_over_rope_parameters_as_in_hf():
    raw = MINIMAL | {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
                     "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    config = from_hf_dict(raw)
    assert (config.rope_scaling.kind, config.rope_theta) == ("linear", 1e6)
    raw["rope_scaling"]["rope_theta"] = 2e6
    assert from_hf_dict(raw).rope_theta == 2e6
