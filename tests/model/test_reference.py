"""The NumPy FP32 reference against HuggingFace's own FP32 outputs (../shared/golden) and stories260K."""

import dataclasses

import numpy as np
import pytest

from cullama.runtime import plan
from cullama.model.checkpoint import write_random
from cullama.model.config import LlamaConfig, RopeScaling
from cullama.common.errors import ConfigError, PromptError
from cullama.model.reference import ReferenceModel, apply_rope, rope_frequencies, rope_tables
from cullama.model.weights import load_weights


def greedy(model: ReferenceModel, prompt: list[int], steps: int) -> list[int]:
    model.reset()
    logits = model.forward(prompt)[-1]
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(logits)))
        logits = model.forward([out[-1]])[-1]
    return out


def test_logits_match_huggingface(golden):
    directory, cases, logits = golden
    model = ReferenceModel(load_weights(directory))
    for case in cases:
        model.reset()
        ours = model.forward(case["prompt_ids"])
        theirs = logits[case["logits_key"]]
        assert ours.shape == theirs.shape
        assert np.max(np.abs(ours - theirs)) <= 1e-3


def test_greedy_continuations_match_huggingface(golden):
    directory, cases, _ = golden
    model = ReferenceModel(load_weights(directory))
    for case in cases:
        assert greedy(model, case["prompt_ids"], len(case["greedy_ids"])) == case["greedy_ids"]


def test_one_token_at_a_time_equals_whole_prompt(golden):
    directory, cases, _ = golden
    model = ReferenceModel(load_weights(directory))
    prompt = cases[1]["prompt_ids"]
    whole = model.forward(prompt)
    model.reset()
    stepwise = np.concatenate([model.forward([t]) for t in prompt])
    np.testing.assert_allclose(stepwise, whole, atol=1e-4)


def test_stories260k_reproduces_its_documented_greedy_output(stories_dir, stories_expected):
    model = ReferenceModel(load_weights(stories_dir))
    ids = stories_expected["ids"]
    assert greedy(model, stories_expected["prompt_ids"], len(ids)) == ids


def test_rope_rotates_pairs_half_a_head_apart():
    cos, sin = rope_tables(8, np.array([0, 3]), 10000.0)
    x = np.random.default_rng(0).standard_normal((2, 1, 8)).astype(np.float32)
    y = apply_rope(x, cos, sin)
    np.testing.assert_allclose(y[0], x[0], atol=1e-7)  # position 0 is the identity
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-6)
    angle = 3.0  # pair (0, 4) turns by pos * theta^0
    expected = x[1, 0, 0] * np.cos(angle) - x[1, 0, 4] * np.sin(angle)
    assert y[1, 0, 0] == pytest.approx(expected, rel=1e-5)


def test_context_overflow_is_a_prompt_error(golden):
    directory, _, _ = golden
    model = ReferenceModel(load_weights(directory), max_seq_len=4)
    with pytest.raises(PromptError, match="exceed the context of 4"):
        model.forward([1, 2, 3, 4, 5])


# -- RoPE scaling against HuggingFace (transformers 5.24, torch 2.13 CPU, FP32) ---------------------------
# Expected values were produced by HF's own code; the last test regenerates them where transformers is
# importable (it is never a dependency of cullama or of its tests).

SCALINGS = {"default": None, "linear": RopeScaling("linear", 2.5, 64), "dynamic": RopeScaling("dynamic", 3.7, 64),
            # low_freq_factor 0.5, original 32: with head_dim 16 each of llama3's three bands holds a frequency
            "llama3": RopeScaling("llama3", 8.0, 32, 0.5, 4.0)}
# LlamaRotaryEmbedding(config).inv_freq, head_dim 16, rope_theta 10000, max_position_embeddings 64.
HF_INV_FREQ = {
    "default": [1.0, 0.3162277638912201, 0.10000000149011612, 0.03162277862429619, 0.009999999776482582,
                0.003162277862429619, 0.0010000000474974513, 0.0003162277862429619],
    "linear": [0.4000000059604645, 0.12649109959602356, 0.03999999910593033, 0.012649111449718475,
               0.003999999724328518, 0.0012649111449718475, 0.0004000000189989805, 0.0001264911115868017],
    # dynamic keeps the default frequencies up to max_position_embeddings
    "dynamic": [1.0, 0.3162277638912201, 0.10000000149011612, 0.03162277862429619, 0.009999999776482582,
                0.003162277862429619, 0.0010000000474974513, 0.0003162277862429619],
    "llama3": [1.0, 0.1273239552974701, 0.012732395902276039, 0.0039528473280370235, 0.0012499999720603228,
               0.00039528473280370235, 0.0001250000059371814, 3.9528473280370235e-05],
}
# LlamaForCausalLM (FP32) logits[59, :12] for PROMPT, on write_random(ROPE_MODEL with the scaling, seed=1,
# std=0.5) (std 0.5 makes attention peaky enough that the variants differ by several units).
ROPE_MODEL = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_seq_len=64, name="rope")
PROMPT = [int(i) for i in (np.arange(60) * 7 + 3) % 64]
HF_LOGITS = {
    "default": [2.96325, 1.18907, 0.34367, 2.36272, -0.93406, -0.95336, 1.81351, 6.18438, -0.41797, -2.19590,
                -5.37629, 3.55851],
    "linear": [0.88871, -5.24989, -0.40566, -5.36088, -2.87749, 3.76357, 6.05568, 0.48723, 4.37468, 0.60971,
               4.22897, 1.38496],
    "dynamic": [2.96325, 1.18907, 0.34367, 2.36272, -0.93406, -0.95336, 1.81351, 6.18438, -0.41797, -2.19590,
                -5.37629, 3.55851],
    "llama3": [2.95289, 0.84286, -0.85027, -1.42780, -1.63385, 1.23327, 7.51491, 1.32910, 1.66553, -2.28155,
               -2.05485, 1.45148],
}


@pytest.mark.parametrize("kind", SCALINGS)
def test_rope_frequencies_match_huggingface(kind):
    ours = rope_frequencies(16, 10000.0, SCALINGS[kind], positions=64)
    assert ours.dtype == np.float32
    # float32 powers (numpy's here, torch's there) are within an ulp of the exact value, not correctly rounded, and
    # their SIMD loops differ by CPU and version: two ulps (2**-22) apart at most, which rtol 1e-7 did not allow
    np.testing.assert_allclose(ours, np.float32(HF_INV_FREQ[kind]), rtol=2 ** -22)


@pytest.mark.parametrize("kind", SCALINGS)
def test_scaled_rope_logits_match_huggingface(tmp_path, kind):
    directory = write_random(tmp_path, dataclasses.replace(ROPE_MODEL, rope_scaling=SCALINGS[kind]), seed=1, std=0.5)
    logits = ReferenceModel(load_weights(directory)).forward(PROMPT)
    np.testing.assert_allclose(logits[59, :12], HF_LOGITS[kind], atol=2e-4)


@pytest.mark.parametrize("kind", SCALINGS)
def test_the_kernels_rope_table_is_the_scaled_one(kind):
    cfg = dataclasses.replace(ROPE_MODEL, head_dim=16, rope_scaling=SCALINGS[kind])
    table = plan.rope_table(cfg, 64)  # [64, hd/2, (cos, sin)]
    angles = np.arange(64, dtype=np.float32)[:, None] * np.float32(HF_INV_FREQ[kind])[None, :]
    np.testing.assert_allclose(table[..., 0], np.cos(angles), atol=1e-6)
    np.testing.assert_allclose(table[..., 1], np.sin(angles), atol=1e-6)


def test_dynamic_scaling_is_refused_past_max_position_embeddings(tmp_path):
    # HF re-derives every frequency from the sequence length past max_position_embeddings (64 here), so its
    # result depends on how the tokens were fed: cullama runs dynamic scaling only where it is exact.
    cfg = dataclasses.replace(ROPE_MODEL, rope_scaling=SCALINGS["dynamic"])
    assert plan.rope_table(cfg, 64).shape == (64, 4, 2)
    with pytest.raises(ConfigError, match=r"rope_scaling 'dynamic' .* at most 64 tokens, not 65"):
        plan.rope_table(cfg, 65)
    model = ReferenceModel(load_weights(write_random(tmp_path, cfg)), max_seq_len=80)
    model.forward(list(range(64)))
    with pytest.raises(ConfigError, match="dynamic"):
        model.forward([1])


def test_stored_expectations_are_what_huggingface_computes(tmp_path):
    """Regenerates HF_INV_FREQ and HF_LOGITS with transformers (skipped where it is not installed)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for kind, scaling in SCALINGS.items():
        cfg = dataclasses.replace(ROPE_MODEL, rope_scaling=scaling)
        hf = transformers.LlamaConfig(**(cfg.to_hf_dict() | {"head_dim": 16}))
        np.testing.assert_array_equal(LlamaRotaryEmbedding(hf).inv_freq.numpy(), np.float32(HF_INV_FREQ[kind]))
        directory = write_random(tmp_path / kind, cfg, seed=1, std=0.5)
        model = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT])).logits[0].numpy()
        np.testing.assert_allclose(logits[59, :12], HF_LOGITS[kind], atol=1e-5)
