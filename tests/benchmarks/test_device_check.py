"""benchmarks/device_check.sh on the CPU: STEPS runs only the named steps (a rerun of what failed on the device),
each with its line in summary.txt, and the script still ends with its summary and the report's attempt."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_steps_selects_what_runs(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "SKIP_INSTALL": "1", "STEPS": "info",
           "BUDGET_S": "120"}
    env.pop("CULLAMA_SHARED", None)
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "device_check.sh")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert len(summary) == 1 and summary[0].split()[:2] == ["info", "ok"], summary
    log = (out / "steps.log").read_text()
    assert "=== info" in log and "=== bench" not in log and "=== pytest" not in log
    assert "=== summary" in log


# What a lent GPU machine lacks: it has Python with CuPy, numpy, safetensors, sentencepiece, click, pytest, torch and
# transformers (tokenizers, jinja2, huggingface_hub), plus the wheels prepare_device.sh carries (the serve extra,
# llguidance), and no network; the test extra's other packages are not there.
ABSENT_ON_THE_DEVICE = ("jsonschema", "openai", "ray", "httptools")
HIDE = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]))
"""


def test_the_gpu_tests_collect_without_what_the_device_lacks():
    """`pytest -m gpu` (device_check.sh's first step) must not stop at collection where a test module imports a test
    dependency the device does not have: one such module made the whole run collect nothing but errors."""
    done = subprocess.run([sys.executable, "-c", HIDE.format(absent=ABSENT_ON_THE_DEVICE)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.splitlines()[-1], done.stdout[-500:]


def test_rehearsal_says_in_one_line_what_it_lacks(tmp_path):
    """benchmarks/rehearse_device.sh builds a venv of the device's versions: without a Python 3.12 it stops at once
    with one line naming the interpreter it tried, before it removes or installs anything."""
    env = {**os.environ, "PYTHON312": sys.executable if sys.version_info[:2] != (3, 12) else "/bin/false",
           "VENV": str(tmp_path / "venv"), "OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir()
    done = subprocess.run(["bash", str(REPO / "benchmarks" / "rehearse_device.sh")], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.count("\n") == 1 and "no Python 3.12" in done.stderr and env["PYTHON312"] in done.stderr
    assert (tmp_path / "out").is_dir() and not (tmp_path / "venv").exists()
