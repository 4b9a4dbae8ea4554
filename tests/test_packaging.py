"""A non-editable install carries the CUDA sources and the CLI: build the wheel, install it, run it."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(REPO)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return next(out.glob("cullama-*.whl"))


def test_wheel_holds_the_kernels_and_the_cli(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    sources = {p.name for p in (REPO / "kernels_cu").glob("*.cu*")}
    assert sources and sources <= {Path(n).name for n in names if n.startswith("cullama/kernels_cu/")}
    assert "cullama/cli/main.py" in names
    assert not any(n.startswith(("cli/", "kernels_cu/", "tests/")) for n in names)  # nothing at the top level


def test_installed_wheel_runs_outside_the_source_tree(wheel, tmp_path):
    target = tmp_path / "site"  # the wheel alone; its dependencies come from this environment
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = "import cullama, cullama.registry as r; print(cullama.__file__); print(sorted(r.sources()))"
    shown = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    location, sources = shown.stdout.splitlines()
    assert location.startswith(str(target)) and "gemv.cu" in sources
    cli = subprocess.run([sys.executable, str(target / "bin" / "cullama"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert cli.returncode == 0 and "generate" in cli.stdout
