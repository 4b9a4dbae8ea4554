"""The families beyond LLaMA-2 (issue 18) end to end on the CPU (the numpy backend: the kernels' twins run the
plans): HuggingFace's goldens of Qwen2 (q/k/v biases, tied embeddings, a vocabulary padded past the tokenizer) and
Mistral (a sliding window of 16) from text to text; checkpoints of our own at the edges (a window of 1, of the
whole context, longer than it; Qwen2 quantized on load and as an AWQ checkpoint); speculative greedy equal to plain
greedy; and bad input refused in one line before any weight loads. tiny-llama3 is matched in
test_tokenizer_json.py; the goldens also run through test_reference.py, test_verify.py and test_speculative.py
(conftest.GOLDEN_NAMES), the fake GPU in test_cuda_host.py and the GPU tests in test_gpu_model.py."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

import cullama
from cullama.runtime.backends.numpy_backend import NumpyBackend
from cullama.model.checkpoint import open_checkpoint, write_random
from cullama.model.config import LlamaConfig, Quantization
from cullama.runtime.engine import PlanRunner
from cullama.common.errors import CheckpointError, ConfigError
from cullama.model.reference import ReferenceModel
from cullama.runtime.sampling import SamplingParams
from cullama.model.weights import host_weights
from cullama.runtime.load import load_checkpoint
from tests.conftest import shared_path
from tests.quant_checkpoints import write as write_quantized
from tests.model.test_checkpoint import WEIGHTS, add_tensor, edit_json, read_raw, write_raw
from tests.runtime.test_plan import fp16_close
from tests.runtime.test_plan_quant import runner_for
from tests.runtime.test_verify import speculative_ids

GREEDY = SamplingParams(seed=0)
NEAR_TIE = 0.05  # a top-1 margin of HF's FP32 logits below which FP16 may pick the other token

# Our own: small, odd-sized where the kernels allow, GQA. Mistral with a window set per test; Qwen2 with every
# width a multiple of 128 (on-load int4 groups of 128, AWQ groups of 64) and tied embeddings, as its small sizes.
MISTRAL = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=88, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, max_seq_len=64, architecture="MistralForCausalLM", sliding_window=5,
                      name="mistral-test")
QWEN2 = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
                    num_kv_heads=1, head_dim=32, max_seq_len=96, rope_theta=1e6, tie_word_embeddings=True,
                    architecture="Qwen2ForCausalLM", name="qwen2-test")


def golden(name: str) -> tuple:
    directory = shared_path("golden", name)
    ref = json.loads((directory.parent / f"{name}.golden.json").read_text())
    with np.load(directory.parent / f"{name}.golden.npz") as npz:
        logits = {key: npz[key] for key in npz.files}
    return directory, ref, logits


def numpy_runner(directory, config=None, max_seq=None, chunk=None, sample_vocab=None) -> PlanRunner:
    ckpt = open_checkpoint(directory, config)
    backend = NumpyBackend()
    load_checkpoint(backend, ckpt)
    return PlanRunner(ckpt.config, backend, max_seq or ckpt.config.max_seq_len, prefill_chunk=chunk,
                      sample_vocab=sample_vocab)


def greedy_ids(runner: PlanRunner, prompt, n: int) -> list[int]:
    return [runner.start(prompt, GREEDY)] + [runner.next() for _ in range(n - 1)]


def safe_prefix(case: dict, pieces: int) -> int:
    """The greedy steps FP16 must agree on: those before HF's first near-tie, or its first id past the
    tokenizer's pieces (a padded vocabulary's ids are never sampled)."""
    return next((i for i, (token, margin) in enumerate(zip(case["greedy_ids"], case["greedy_top1_margins"]))
                 if margin < NEAR_TIE or token >= pieces), len(case["greedy_ids"]))


# -- the goldens, text to text ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-mistral"])
def test_golden_family_end_to_end(name):
    directory, ref, logits = golden(name)
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    assert llm.config.model_type == ref["arch"] and llm.eos_ids == tuple(ref["eos_ids"])
    assert [llm.encode(t["text"]) for t in ref["texts"]] == [t["ids"] for t in ref["texts"]]
    assert [llm.chat_ids(c["messages"]) for c in ref["chats"]] == [c["ids"] for c in ref["chats"]]
    compared = 0
    for case in ref["cases"]:
        assert fp16_close(llm.logits(case["prompt_ids"]), logits[case["logits_key"]])
        result = llm.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True)
        agree = safe_prefix(case, llm.tokenizer.vocab_size)
        assert result.token_ids[:agree] == case["greedy_ids"][:agree]
        if result.token_ids == case["greedy_ids"]:  # past the near-ties too (on the CPU they all agree)
            assert result.text == case["greedy_text"]
            compared += 1
    assert compared >= 2  # the texts compared, not only the ids


def test_qwen2_padded_vocabulary_is_never_sampled():
    """tiny-qwen2's model has 512 ids, its tokenizer 453 pieces: HF's greedy picks id 476 in its third case,
    cullama the best of the ids that have text; over the whole vocabulary (no tokenizer) HF's ids exactly."""
    directory, ref, logits = golden("tiny-qwen2")
    llm = cullama.Llama.from_pretrained(directory, device="cpu")
    pieces = llm.tokenizer.vocab_size
    assert (pieces, llm.config.vocab_size) == (453, 512)
    case = ref["cases"][2]
    assert case["greedy_ids"][0] >= pieces  # HF's own pick has no text
    ids = llm.generate(case["prompt_ids"], max_new_tokens=24, ignore_eos=True).token_ids
    assert ids[0] == int(np.argmax(logits[case["logits_key"]][-1][:pieces])) and max(ids) < pieces
    whole = numpy_runner(directory)  # sample_vocab: every id
    assert greedy_ids(whole, case["prompt_ids"], 24) == case["greedy_ids"]


def test_the_goldens_need_their_window_and_their_biases():
    """The tests above have teeth: without its sliding window tiny-mistral's long prompts drift past the FP16
    tolerance from HF's logits, and so does tiny-qwen2 without its biases."""
    directory, ref, logits = golden("tiny-mistral")
    config = dataclasses.replace(cullama.model.config.from_pretrained(directory), sliding_window=None)
    runner = numpy_runner(directory, config)
    long_case = max(ref["cases"], key=lambda c: len(c["prompt_ids"]))
    assert len(long_case["prompt_ids"]) > 16  # longer than the window
    assert not fp16_close(runner.logits(long_case["prompt_ids"]), logits[long_case["logits_key"]])
    directory, ref, logits = golden("tiny-qwen2")
    runner = numpy_runner(directory)
    for i in range(runner.cfg.num_layers):
        runner.backend.set(f"layers.{i}.bqkv", np.zeros(runner.cfg.qkv_dim, np.float16))
    case = ref["cases"][0]
    assert not fp16_close(runner.logits(case["prompt_ids"]), logits[case["logits_key"]])


# -- sliding windows of our own --------------------------------------------------------------------------------------
def check_against_the_reference(runner: PlanRunner, reference: ReferenceModel, prompt, steps=12):
    """Decode steps (following our own tokens) and a multi-chunk prefill within FP16 tolerance of the reference."""
    token = runner.start(prompt, GREEDY)
    ref_logits = reference.forward(prompt)[-1]
    for step in range(steps):
        assert fp16_close(runner.backend.read("logits"), ref_logits), step
        assert token == int(np.argmax(runner.backend.read("logits")))
        ref_logits = reference.forward([token])[-1]
        token = runner.next()
    ids = list(range(3, 3 + 41))  # several prefill chunks: the window's edge crosses them
    reference.reset()
    assert fp16_close(runner.logits(ids), reference.forward(ids))


@pytest.mark.parametrize("window", [1, 5, 64, 1000], ids=["1", "5", "whole-context", "longer-than-context"])
def test_sliding_window_against_the_reference(tmp_path, window):
    config = dataclasses.replace(MISTRAL, sliding_window=window)
    write_random(tmp_path, config, seed=4)
    assert cullama.model.config.from_pretrained(tmp_path).sliding_window == window
    runner = numpy_runner(tmp_path, chunk=8)
    reference = ReferenceModel(host_weights(open_checkpoint(tmp_path)))
    check_against_the_reference(runner, reference, list(range(5, 35)))


def test_a_window_as_long_as_the_context_is_full_attention_bit_for_bit(tmp_path):
    """Mistral v0.1's window of 4096 in a context of 4096 or less, or null (v0.2 on), is LLaMA's attention: the
    same weights as a LlamaForCausalLM give the same bits."""
    results = []
    for architecture, window in (("MistralForCausalLM", 64), ("MistralForCausalLM", None), ("LlamaForCausalLM", None)):
        directory = tmp_path / f"{architecture}-{window}"
        write_random(directory, dataclasses.replace(MISTRAL, architecture=architecture, sliding_window=window), seed=2)
        runner = numpy_runner(directory, chunk=16)
        results.append((runner.logits(list(range(3, 40))), greedy_ids(runner, [1, 7, 9], 30)))
    for logits, ids in results[1:]:
        np.testing.assert_array_equal(logits, results[0][0])
        assert ids == results[0][1]


@pytest.mark.parametrize("window", [1, 6])
def test_verify_rows_each_see_their_own_window(tmp_path, window):
    """Speculative greedy equals plain greedy with a sliding window: each of a verify step's k + 1 rows attends to
    its own last `window` keys, exactly as a plain step at its position."""
    write_random(tmp_path, dataclasses.replace(MISTRAL, sliding_window=window), seed=6)
    prompt = list(range(10, 30))
    expected = greedy_ids(numpy_runner(tmp_path), prompt, 30)
    for k in (2, 5, 8):
        assert speculative_ids(numpy_runner(tmp_path), prompt, GREEDY, expected, k, 30) == expected


# -- Qwen2 of our own: FP16, quantized on load, AWQ ---------------------------------------------------------------
def test_qwen2_biases_against_the_reference(tmp_path):
    write_random(tmp_path, QWEN2, seed=3)
    runner = numpy_runner(tmp_path, chunk=16)
    weights = host_weights(open_checkpoint(tmp_path))
    assert weights.layers[0].bqkv.shape == (QWEN2.qkv_dim,) and np.abs(weights.layers[0].bqkv).max() > 1
    check_against_the_reference(runner, ReferenceModel(weights), [1, 5, 9, 33, 77, 100, 42])


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_qwen2_quantized_on_load(tmp_path, quantize):
    """The linears quantized, the biases FP16: against the reference on the dequantized weights."""
    write_random(tmp_path, QWEN2, seed=3)
    runner, reference = runner_for(tmp_path, quantize, chunk=16)
    assert runner.layout.quantized and runner.layout.buffers()[-1].name == f"layers.{QWEN2.num_layers - 1}.bqkv"
    check_against_the_reference(runner, reference, [1, 5, 9, 33, 77, 100, 42])


def test_qwen2_awq_checkpoint(tmp_path):
    """An AutoAWQ Qwen2 (4 bits, groups of 64) keeps its biases FP16 beside qweight: read, run against the reference
    on the dequantized weights, and its speculative greedy is its plain greedy."""
    write_quantized(tmp_path, QWEN2, Quantization("awq", 4, 64), seed=5)
    assert "model.layers.1.self_attn.v_proj.bias" in read_raw(tmp_path / WEIGHTS)[0]
    runner, reference = runner_for(tmp_path, chunk=16)
    assert runner.layout.describe() == "awq int4 g64"
    check_against_the_reference(runner, reference, [1, 5, 9, 33, 77, 100, 42])
    prompt = [1, 5, 9, 33, 77, 100, 42]
    expected = greedy_ids(runner_for(tmp_path)[0], prompt, 24)
    assert speculative_ids(runner_for(tmp_path)[0], prompt, GREEDY, expected, 4, 24) == expected


# -- bad input: one line, before any weight loads -------------------------------------------------------------------
def replace_tensor(file, name, array=None) -> None:
    """Drop tensor `name` from a safetensors file, or with `array` store it in its place."""
    header, data = read_raw(file)
    del header[name]
    write_raw(file, header, data)
    if array is not None:
        add_tensor(file, name, array)


@pytest.mark.parametrize("change, error, needle", [
    (lambda f: replace_tensor(f, "model.layers.1.self_attn.k_proj.bias", np.zeros(31, np.float16)), CheckpointError,
     "model.layers.1.self_attn.k_proj.bias: expected shape [32], found [31]"),
    (lambda f: replace_tensor(f, "model.layers.0.self_attn.q_proj.bias", np.zeros(128, np.int32)), CheckpointError,
     "model.layers.0.self_attn.q_proj.bias: dtype I32 is not supported (only F16, BF16, F32)"),
    (lambda f: replace_tensor(f, "model.layers.0.self_attn.v_proj.bias"), CheckpointError,
     "missing tensor model.layers.0.self_attn.v_proj.bias"),
    (lambda f: add_tensor(f, "model.layers.0.self_attn.o_proj.bias", np.zeros(128, np.float16)), CheckpointError,
     "model.layers.0.self_attn.o_proj.bias: bias tensors are not supported (Qwen2's are on q_proj, k_proj and "
     "v_proj only)"),
    (lambda f: add_tensor(f, "model.layers.1.mlp.down_proj.bias", np.zeros(128, np.float16)), CheckpointError,
     "model.layers.1.mlp.down_proj.bias: bias tensors are not supported"),
    (lambda f: edit_json(f.parent / "config.json", use_sliding_window=True), ConfigError,
     "use_sliding_window = true is not supported (Qwen2's sliding window on the layers from max_window_layers on)"),
    (lambda f: edit_json(f.parent / "config.json", layer_types=["full_attention", "sliding_attention"]), ConfigError,
     'layer_types ["full_attention", "sliding_attention"] is not supported'),
], ids=["bias-shape", "bias-dtype", "bias-missing", "o_proj-bias", "mlp-bias", "use_sliding_window", "layer_types"])
def test_bad_qwen2_checkpoints_are_one_line(tmp_path, change, error, needle):
    write_random(tmp_path, QWEN2, seed=1)
    change(tmp_path / WEIGHTS)
    with pytest.raises(error) as info:
        cullama.Llama.from_pretrained(tmp_path, device="cpu")
    assert needle in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("changes, needle", [
    ({"sliding_window": 0}, "sliding_window must be null (full attention) or a window of 1 to 2147483647 keys, got 0"),
    ({"sliding_window": -4096}, "sliding_window must be null (full attention) or a window of 1"),
    ({"sliding_window": "4096"}, 'got "4096"'),
    ({"sliding_window": 4096.0}, "got 4096.0"),
    ({"sliding_window": True}, "got true"),
    ({"layer_types": ["full_attention", "full_attention"]}, 'is not supported (cullama runs "sliding_attention"'),
    ({"architectures": ["MistralForSequenceClassification"]}, "MistralForSequenceClassification"),
    ({"architectures": ["Qwen2ForCausalLM"]}, 'is not model_type "mistral"\'s architecture'),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}, '["MixtralForCausalLM"] is not supported '
                                                                         "(cullama runs LlamaForCausalLM, "
                                                                         "MistralForCausalLM, Qwen2ForCausalLM)"),
])
def test_bad_configs_are_one_line_before_the_weights(tmp_path, changes, needle):
    """Refused from config.json alone: the weights file is not even a safetensors file."""
    write_random(tmp_path, MISTRAL)
    (tmp_path / WEIGHTS).write_bytes(b"never read")
    edit_json(tmp_path / "config.json", **changes)
    with pytest.raises(ConfigError) as info:
        cullama.Llama.from_pretrained(tmp_path, device="cpu")
    message = str(info.value)
    assert needle in message and str(tmp_path / "config.json") in message and "\n" not in message


def test_the_goldens_configs_are_read_as_their_families():
    configs = {name: cullama.model.config.from_pretrained(shared_path("golden", name))
               for name in ("tiny-llama3", "tiny-qwen2", "tiny-mistral")}
    assert [(c.architecture, c.sliding_window, c.qkv_bias) for c in configs.values()] == [
        ("LlamaForCausalLM", None, False), ("Qwen2ForCausalLM", None, True), ("MistralForCausalLM", 16, False)]
    assert configs["tiny-qwen2"].rope_theta == 1e6 and configs["tiny-qwen2"].tie_word_embeddings


def test_the_cli_refuses_a_qwen2_sliding_window_in_one_line(tmp_path):
    from click.testing import CliRunner
    from cullama.cli.main import main

    directory = shutil.copytree(shared_path("golden", "tiny-qwen2"), tmp_path / "qwen2")
    edit_json(directory / "config.json", use_sliding_window=True)
    result = CliRunner().invoke(main, ["generate", "--model", str(directory), "--device", "cpu", "--prompt-ids",
                                       "1,2,3"])
    assert result.exit_code == 2 and "use_sliding_window" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


# -- the presets `cullama bench --synthetic NAME` runs ------------------------------------------------------------
# (preset, FP16 bytes a decode step reads in GB, the floor in ms at the H200's 4.44 TB/s, int8 GB, int4 GB): the
# docs/models.md's table. LLaMA-3-8B's lm_head alone is 128,256 x 4096 x 2 bytes = 1.05 GB of its 15.01.
PRESET_FLOORS = [("llama3-8b", 15.01, 3.38, 8.04, 4.76), ("llama3.2-1b", 2.47, 0.56, 1.50, 1.04),
                 ("mistral-7b", 14.22, 3.20, 7.25, 3.97), ("qwen2.5-7b", 14.14, 3.18, 7.62, 4.56)]


@pytest.mark.parametrize("name,gb,floor_ms,int8_gb,int4_gb", PRESET_FLOORS, ids=[p[0] for p in PRESET_FLOORS])
def test_presets_bytes_per_step_and_floors(name, gb, floor_ms, int8_gb, int4_gb):
    from cullama.model import layout
    from cullama.model.config import preset

    config = preset(name)
    fp16 = layout.fp16(config).summary()
    assert round(fp16["decode_bytes"] / 1e9, 2) == gb and round(fp16["floor_ms_h200"], 2) == floor_ms
    assert [round(layout.on_load(config, q).decode_bytes() / 1e9, 2) for q in ("int8", "int4")] == [int8_gb, int4_gb]
    if name == "llama3-8b":
        assert round(2 * config.vocab_size * config.hidden_size / 1e9, 2) == 1.05
    families = {"llama3-8b": ("LlamaForCausalLM", None, False), "llama3.2-1b": ("LlamaForCausalLM", None, False),
                "mistral-7b": ("MistralForCausalLM", 4096, False), "qwen2.5-7b": ("Qwen2ForCausalLM", None, True)}
    assert (config.architecture, config.sliding_window, config.qkv_bias) == families[name]
