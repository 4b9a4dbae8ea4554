"""Every GPU test's own code runs on the CPU: `pytest -m gpu` with CULLAMA_FAKE_GPU=1 (tests/conftest.py), where
CuPy is tests/fake_cupy.py and the kernels are their NumPy twins. That proves nothing about the kernels, but a
lent GPU's few minutes are not lost to a wrong argument count, shape or name in a test (the GPU tests have
otherwise never run). The GPU tests that need ../shared skip without it, as they do on a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_every_gpu_test_passes_against_the_fake_gpu():
    env = {**os.environ, "CULLAMA_FAKE_GPU": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    tail = "\n".join((done.stdout + done.stderr).splitlines()[-80:])
    assert done.returncode == 0, f"CULLAMA_FAKE_GPU=1 pytest -m gpu exited {done.returncode}:\n{tail}"
    assert " passed" in tail, tail
