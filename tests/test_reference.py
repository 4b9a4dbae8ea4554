"""The NumPy FP32 reference against HuggingFace's own FP32 outputs (../shared/golden) and stories260K."""

import numpy as np
import pytest

from cullama.checkpoint import load_weights
from cullama.errors import PromptError
from cullama.reference import ReferenceModel, apply_rope, rope_tables


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
