"""`--quantize` and quantized checkpoints on the command line (CPU): generate and chat in int8 / int4, AWQ and GPTQ
directories as they are, what the model runs in (cullama info --model, --json, bench records), and the refusals
as one line with exit 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from cullama.cli.main import main
from tests.conftest import load_golden
from tests.quant_checkpoints import CONFIG, write
from cullama.model.config import Quantization


def run(*args, input=None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def test_generate_quantized_on_load_says_what_it_runs_in(stories_dir, stories_expected):
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--quantize", "int8", "--prompt-ids", 1,
                 "--max-new-tokens", 12, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["token_ids"] == stories_expected["ids"][:12]  # int8 keeps stories260K's first 61 greedy tokens
    weights = doc["weights"]
    assert weights["weights"] == "int8 per channel (quantized on load)" and weights["source"] == "int8"
    assert weights["linears"] == {"int8 per channel": 20} and weights["intermediate_size"] == 192
    assert 0 < weights["decode_bytes"] < weights["weight_bytes"] and weights["floor_ms_h200"] > 0
    result = run("generate", "--model", stories_dir, "--device", "cpu", "--quantize", "int4", "--max-new-tokens", 8,
                 "")
    assert result.exit_code == 0 and result.stdout.startswith("Once upon a time")
    assert "note: int4 groups where 128 does not divide the inputs: w_down (192 inputs): 96" in result.stderr


def test_chat_takes_quantize(stories_dir):
    result = run("chat", "--model", stories_dir, "--device", "cpu", "--quantize", "int4", "--max-new-tokens", 4,
                 "--json", input="Hello\n")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.splitlines()[0])["weights"]["source"] == "int4"


def test_a_gptq_checkpoint_generates_as_it_is_stored():
    directory, cases, _ = load_golden("tiny-gptq-asym-g128")
    case = cases[0]
    result = run("generate", "--model", directory, "--device", "cpu", "--prompt-ids",
                 ",".join(map(str, case["prompt_ids"])), "--max-new-tokens", 24, "--ignore-eos", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["token_ids"] == case["greedy_ids"] and doc["weights"]["weights"] == "gptq int4 g128"


def test_info_model_says_the_layout_without_loading_the_weights(stories_dir, tmp_path):
    result = run("info", "--model", stories_dir, "--quantize", "int4")
    assert result.exit_code == 0, result.output
    lines = dict(line.split(": ", 1) for line in result.stdout.splitlines())
    assert lines["weights".rjust(18)] == "int4 g64 / int4 g96 (quantized on load)"
    assert lines["linears".rjust(18)] == "15 x int4 g64, 5 x int4 g96"
    assert lines["intermediate size".rjust(18)] == "172 (on the device 192)"
    assert lines["floor on an H200".rjust(18)].endswith("ms per token at 4.44 TB/s")
    assert lines["note 1".rjust(18)].startswith("int4 groups where 128 does not divide the inputs")
    write(tmp_path, CONFIG, Quantization("gptq", 8, 64, "gptq_v2", sym=True, desc_act=True))
    result = run("info", "--model", tmp_path)
    assert result.exit_code == 0 and "weights: gptq int8 g64 act-order" in result.stdout


@pytest.mark.parametrize("args, needle", [
    (("generate", "--quantize", "int3", "--prompt-ids", 1), "Invalid value for '--quantize': 'int3' is not one of"),
    (("generate", "--quantize", "int8", "--prompt-ids", 1), "error: --quantize int8 cannot apply to"),
    (("info", "--quantize", "int4"), "error: --quantize int4 cannot apply to"),
    (("bench", "--quantize", "int4", "--device", "cpu", "--lengths", 3, "--samples", 3),
     "error: --quantize int4 cannot apply to"),
])
def test_quantize_refusals_are_one_line_and_exit_2(args, needle):
    awq, _, _ = load_golden("tiny-awq-g64")
    result = run(*args[:1], "--model", awq, *args[1:])
    assert result.exit_code == 2 and needle in result.output, result.output
    assert "already quantized (awq int4 g64)" in result.output or "int3" in result.output


def test_info_quantize_needs_a_model():
    result = run("info", "--quantize", "int8")
    assert result.exit_code == 2 and "error: --quantize goes with --model" in result.output


def test_bench_quantize_on_the_cpu_records_the_weights(tmp_path):
    record = tmp_path / "bench.json"
    result = run("bench", "--device", "cpu", "--synthetic", "tiny", "--quantize", "int8", "--lengths", 3,
                 "--samples", 3, "--warmup", 0, "--json", record)
    assert result.exit_code == 0, result.output
    assert "cullama bench: tiny (synthetic) in int8 per channel (quantized on load), cpu" in result.stdout
    doc = json.loads(record.read_text())
    assert doc["model"] == "tiny (synthetic)" and doc["options"]["command"]["quantize"] == "int8"
    assert doc["weights"]["weights"] == "int8 per channel (quantized on load)"
    assert doc["decode_weight_bytes"] == doc["weights"]["decode_bytes"] < doc["weights"]["weight_bytes"]
    assert doc["results"][0]["bytes_per_step"] > doc["decode_weight_bytes"]  # + the K and V read


def test_serve_refuses_quantize_on_a_quantized_checkpoint_before_listening():
    pytest.importorskip("fastapi")
    awq, _, _ = load_golden("tiny-awq-g64")
    result = run("serve", "--model", awq, "--quantize", "int8", "--tokenizer", awq / "config.json")
    assert result.exit_code == 2 and "--quantize int8 cannot apply" in result.output, result.output
