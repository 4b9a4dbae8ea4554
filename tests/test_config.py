"""LlamaConfig: both HF config.json spellings, presets, derived sizes, and every ConfigError."""

import dataclasses
import json
from pathlib import Path

import pytest

from cullama.config import PRESETS, LlamaConfig, from_hf_dict, from_pretrained, preset
from cullama.errors import ConfigError

GOLDEN = Path(__file__).resolve().parents[1].parent / "shared" / "golden"
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
    (MINIMAL | {"model_type": "mistral"}, "model_type"),
    (MINIMAL | {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    (MINIMAL | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_type"),
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
