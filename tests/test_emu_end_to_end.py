"""The GPU tests end to end on the real kernels: with CULLAMA_FAKE_GPU=emu (tests/conftest.py) the fake CuPy's
kernels are kernels_cu compiled for the CPU by cullama.emu, so these GPU tests run every kernel of a plan, through
the CUDA backend, its captured graphs, programmatic launches and all, on the CPU. CI runs those it can afford:
stories260K's 256 greedy ids (its documented output) and the golden checkpoints' logits against HuggingFace's
(prefill plans), about two minutes on 2 cores, in the fastest schedule (forward). The rest need a GPU's speed.
They skip, with the GPU tests' own reason, where ../shared is absent."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SELECTED = ["tests/test_gpu_model.py::test_stories260k_greedy_ids",
            "tests/test_gpu_model.py::test_logits_within_fp16_tolerance_of_huggingface"]


@pytest.mark.emu
@pytest.mark.slow
def test_gpu_tests_pass_on_the_emulated_kernels():
    env = {**os.environ, "CULLAMA_FAKE_GPU": "emu"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-p", "no:cacheprovider",
                           *SELECTED], cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    out = done.stdout + done.stderr
    tail = "\n".join(out.splitlines()[-40:])
    assert done.returncode == 0, f"CULLAMA_FAKE_GPU=emu pytest -m gpu exited {done.returncode}:\n{tail}"
    assert "kernels_cu on the CPU executor" in out, "the fake GPU did not run the emulated kernels"
    if " passed" not in tail:
        pytest.skip(f"the GPU tests skipped: {tail}")
    assert " skipped" not in tail, tail
