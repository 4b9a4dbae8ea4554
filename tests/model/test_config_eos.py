"""EOS ids: config.json's, then those only generation_config.json lists, then the tokenizer's; generation stops at
any of them. Bad generation_config.json files are one line naming it."""

from __future__ import annotations

import json
import shutil

import pytest

import cullama
from cullama.model.config import from_pretrained
from cullama.common.errors import ConfigError
from tests.conftest import load_golden, shared_path


@pytest.fixture
def model(tmp_path):
    """tiny-mha (config.json: EOS 2) without its generation_config.json."""
    for file in ("config.json", "model.safetensors"):
        shutil.copy(shared_path("golden", "tiny-mha", file), tmp_path / file)
    return tmp_path


def test_eos_listed_only_in_generation_config_stops_generation(model):
    _, cases, _ = load_golden("tiny-mha")
    greedy = cases[0]["greedy_ids"]
    assert from_pretrained(model).eos_token_ids == (2,)
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, greedy[4], 2]}))
    assert from_pretrained(model).eos_token_ids == (2, greedy[4])  # in order, once each
    llm = cullama.Llama.from_pretrained(model, device="cpu")
    stopped = llm.generate(cases[0]["prompt_ids"], max_new_tokens=24)
    assert stopped.finish_reason == "eos" and stopped.token_ids == greedy[:4]


def test_llama3_stops_on_either_eos_and_the_tokenizers():
    directory = shared_path("golden", "tiny-llama3")
    assert from_pretrained(directory).eos_token_ids == (501, 504)
    assert cullama.Llama.from_pretrained(directory, device="cpu").eos_ids == (501, 504)


@pytest.mark.parametrize("content, why", [
    ({"eos_token_id": 512}, "eos_token_id 512 is outside the vocabulary (vocab_size 512)"),
    ({"eos_token_id": "2"}, 'eos_token_id must be an integer or a list of integers, got "2"'),
    ({"eos_token_id": [2, 2.0]}, "eos_token_id must be an integer or a list of integers, got [2, 2.0]"),
    ([2], "expected a JSON object, got list"),
])
def test_bad_generation_config_is_one_line(model, content, why):
    (model / "generation_config.json").write_text(json.dumps(content))
    with pytest.raises(ConfigError) as info:
        from_pretrained(model)
    assert str(info.value) == f"{model / 'generation_config.json'}: {why}"


def test_null_or_absent_eos_in_generation_config_changes_nothing(model):
    for content in ({"eos_token_id": None}, {"bos_token_id": 1}):
        (model / "generation_config.json").write_text(json.dumps(content))
        assert from_pretrained(model).eos_token_ids == (2,)
