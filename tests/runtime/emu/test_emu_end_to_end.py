"""The GPU tests end to end on the real kernels: with CULLAMA_FAKE_GPU=emu (tests/conftest.py) the fake CuPy's
kernels are kernels_cu compiled for the CPU by cullama.runtime.emu, so these GPU tests run every kernel of a plan,
through the CUDA backend, its captured graphs and all, on the CPU, in the fastest schedule (forward). CI runs those it
can afford (about two and a half minutes of CPU): stories260K's 256 greedy ids (its documented output), the golden
checkpoints' logits against HuggingFace's, graph replay against eager launches and the NumPy backend, prefix
reuse and the prefix cache, a two-layer model against the reference, verify steps and batched steps against plain
steps (bit for bit, through their graphs; a prompt of several chunks joining a batch), and the kernel tests at their
GPU shapes (LLaMA-2-7B's among them) but the sampling ones that draw thousands of times and the 7B-sized GEMMs. The
others need a GPU's speed (tens of minutes here). They skip, with the GPU tests' own reason, where ../shared is
absent."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SHARED

REPO = Path(__file__).resolve().parents[3]
SHARED_ABSENT = "not found: the shared test data (../shared beside the repo, or $CULLAMA_SHARED) is absent"
MODEL = "tests/api/test_gpu_model.py::"
SELECTED = [f"{MODEL}test_stories260k_greedy_ids", f"{MODEL}test_logits_within_fp16_tolerance_of_huggingface",
            f"{MODEL}test_graph_replay_equals_eager_launches_and_the_numpy_backend",
            f"{MODEL}test_prefix_reuse_matches_a_fresh_prefill",
            f"{MODEL}test_prefix_cache_is_a_fresh_prefill_bit_for_bit",
            f"{MODEL}test_two_layers_of_llama2_7b_shape_match_the_reference",
            "tests/runtime/ops/test_fill.py", "tests/runtime/ops/test_prefill.py",
            "tests/runtime/ops/test_attention.py", "tests/runtime/ops/test_attention_mma.py",
            "tests/runtime/ops/test_gemv_mma.py", "tests/bench/test_bench.py",
            "tests/runtime/ops/test_sampling_kernel.py::test_greedy_kernel_is_exact",
            "tests/runtime/ops/test_sampling_kernel.py::test_non_finite_logits_as_the_twin",
            "tests/runtime/ops/test_sampling_kernel.py::test_uniform_probe_is_bit_exact",
            "tests/runtime/test_verify.py::test_gpu_stories260k_verify_is_the_plain_steps_bit_for_bit[penalty]",
            "tests/runtime/backends/test_batch_cuda_host.py::test_gpu_batched_steps_equal_solo_steps",
            "tests/runtime/backends/test_batch_cuda_host.py::"
            "test_gpu_a_prompt_of_several_chunks_joining_gets_its_solo_tokens"]
DESELECTED: list[str] = []  # node ids too slow on the executor (none since the 7B-shaped CUDA-core GEMV checks went)


@pytest.mark.emu
@pytest.mark.slow
def test_gpu_tests_pass_on_the_emulated_kernels():
    env = {**os.environ, "CULLAMA_FAKE_GPU": "emu", "COLUMNS": "1000"}  # -rs's reasons whole
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *SELECTED,
                           *(f"--deselect={node}" for node in DESELECTED)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=3600)
    out = done.stdout + done.stderr
    tail = "\n".join(out.splitlines()[-40:])
    assert done.returncode == 0, f"CULLAMA_FAKE_GPU=emu pytest -m gpu exited {done.returncode}:\n{tail}"
    assert "kernels_cu on the CPU executor" in out, "the fake GPU did not run the emulated kernels"
    if " passed" not in tail:
        pytest.skip(f"the GPU tests skipped: {tail}")
    # Every test ran, but those that need ../shared where it is absent: they skip, as the README promises (a clone
    # with nothing beside it passes); any other skip hides a test that should have run.
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    unexplained = [line for line in skipped if SHARED.exists() or SHARED_ABSENT not in line]
    assert not unexplained, "\n".join(unexplained)
