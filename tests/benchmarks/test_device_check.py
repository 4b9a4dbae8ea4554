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
