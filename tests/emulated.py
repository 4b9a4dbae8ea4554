"""The kernel checks that take a launcher (test_verify.py, test_batch_kernels.py, test_gemv_mma.py, ...) run on
the CPU executor (cullama.runtime.emu), and the seeded bugs that show those checks have teeth: one text of kernels_cu
replaced in a copy of it, after which the check must fail."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cullama.runtime import emu
from cullama.kernels_cu import SOURCE_DIR

SEED = 7  # of the shuffled schedule


def emu_launcher(schedule: str, source_dir: Path | None = None):
    """launch(spec, grid, block, args), as the checks call a GPU's, run by the executor in `schedule`; its
    `source_dir` (None: kernels_cu itself) is where the kernels are compiled from."""
    def launch(spec, grid, block, args):
        emu.launch(spec, grid, block, args, 0, schedule=schedule, seed=SEED, source_dir=source_dir)
    launch.source_dir = source_dir
    return launch


def seeded_copy(directory: Path, file: str, original: str, replacement: str) -> Path:
    """A copy of kernels_cu under `directory` with `original`, which must stand in `file` exactly once (a kernel
    edit that moves it fails here instead of silently testing nothing), replaced."""
    source_dir = directory / "kernels_cu"
    shutil.copytree(SOURCE_DIR, source_dir)
    text = (source_dir / file).read_text()
    assert text.count(original) == 1, f"the mutation's original text is not in {file} exactly once"
    (source_dir / file).write_text(text.replace(original, replacement))
    return source_dir


def check_seeded_bug(directory: Path, mutation) -> None:
    """mutation: (id, file, original text, its replacement, check(launch)); the check, given a launcher of the
    seeded copy in the shuffled schedule, must fail (an AssertionError, or an EmuError naming the fault)."""
    _, file, original, replacement, check = mutation
    launch = emu_launcher("shuffled", seeded_copy(directory, file, original, replacement))
    with pytest.raises((AssertionError, emu.EmuError)):
        check(launch)
