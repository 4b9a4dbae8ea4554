"""A non-editable install carries the CUDA sources and the CLI: build the wheel, install it, run it."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a clean copy: leftovers of earlier builds (build/, *.egg-info) must not fill gaps."""
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src") / "cullama"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns("build", "dist", "*.egg-info", ".venv", ".git",
                                                             "__pycache__", ".pytest_cache"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(out), str(src)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return next(out.glob("cullama-*.whl"))


def test_wheel_holds_every_module_the_kernels_and_the_cli(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"cullama/{p.relative_to(REPO / 'cullama')}" for p in (REPO / "cullama").rglob("*.py")}
    expected |= {f"cullama/cli/{p.name}" for p in (REPO / "cli").glob("*.py")}
    expected |= {f"cullama/kernels_cu/{p.name}" for p in (REPO / "kernels_cu").glob("*.cu*")}
    expected |= {f"cullama/runtime/emu/{p.name}" for ext in ("h", "cpp") for p in
                 (REPO / "cullama" / "runtime" / "emu").glob(f"*.{ext}")}
    assert expected - names == set()
    assert not any(n.startswith(("cli/", "kernels_cu/", "tests/")) for n in names)  # nothing at the top level


def test_installed_wheel_runs_outside_the_source_tree(wheel, tmp_path):
    target = tmp_path / "site"  # the wheel alone; its dependencies come from this environment
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True)
    assert install.returncode == 0, install.stderr
    env = {**os.environ, "PYTHONPATH": str(target)}
    probe = ("import cullama, cullama.runtime.registry as r, cullama.runtime.backends.numpy_backend as b, "
             "cullama.runtime.ops.gemv_mma as g; "
             "assert all(m.__file__.startswith(cullama.__path__[0]) for m in (r, b, g)), 'mixed install'; "
             "print(cullama.__file__); print(sorted(r.sources()))")
    shown = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert shown.returncode == 0, shown.stderr
    location, sources = shown.stdout.splitlines()
    assert location.startswith(str(target)) and "gemv_mma.cu" in sources
    cli = subprocess.run([sys.executable, str(target / "bin" / "cullama"), "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True)
    assert cli.returncode == 0 and "generate" in cli.stdout
