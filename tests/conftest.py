"""Shared fixtures: where ../shared is, and skips with a reason when it (or a GPU) is absent."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the repo; CULLAMA_SHARED names another copy (the GPU machine gets one carried in).
SHARED = Path(os.environ.get("CULLAMA_SHARED") or REPO.parent / "shared")
# HF checkpoints with HF's own outputs (../shared/golden/README.md): LLaMA-2-era, sharded GQA, LLaMA-3 (llama3 RoPE,
# tied embeddings), Qwen2 (q/k/v biases, a padded vocabulary), Mistral (a sliding window of 16)
GOLDEN_NAMES = ("tiny-mha", "tiny-gqa-sharded", "tiny-llama3", "tiny-qwen2", "tiny-mistral")


def shared_path(*parts: str) -> Path:
    """A path under ../shared, or a skip that says what is missing."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not found: the shared test data (../shared beside the repo, or $CULLAMA_SHARED) "
                    "is absent")
    return path


def load_golden(name: str) -> tuple[Path, list[dict], dict]:
    """(checkpoint dir, cases, {logits_key: FP32 logits [len(prompt), vocab]}) of a golden checkpoint."""
    directory = shared_path("golden", name)
    cases = json.loads((directory.parent / f"{name}.golden.json").read_text())["cases"]
    with np.load(directory.parent / f"{name}.golden.npz") as npz:
        logits = {key: npz[key] for key in npz.files}
    return directory, cases, logits


@pytest.fixture(params=GOLDEN_NAMES)
def golden(request):
    return load_golden(request.param)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    return shared_path("models", "stories260K")


@pytest.fixture(scope="session")
def stories_expected(stories_dir) -> dict:
    return json.loads((stories_dir / "expected_greedy.json").read_text())


# CULLAMA_FAKE_GPU=1: the tests marked `gpu` run on the CPU against tests/fake_cupy.py, whose kernels are the
# NumPy twins. That proves nothing about the kernels, but it runs every line of the GPU tests' own code
# (arguments, shapes, fixtures), so a lent GPU's few minutes are not lost to a typo in a test.
# CULLAMA_FAKE_GPU=emu: the same fake GPU, whose kernels are the real ones run by the CPU executor
# (cullama.runtime.emu).
FAKE_GPU_MODE = os.environ.get("CULLAMA_FAKE_GPU")
FAKE_GPU = FAKE_GPU_MODE in ("1", "emu")


def _install_fake_gpu() -> None:
    import ctypes
    import sys
    import types

    from tests import fake_cupy
    from cullama.runtime import device
    from cullama.runtime.backends import driver
    from cullama.runtime.registry import KernelLoader

    sys.modules["cupy"], sys.modules["cupyx"] = fake_cupy, fake_cupy.cupyx

    KernelLoader.function = fake_cupy.loader_function
    fake_cupy.EMULATE = FAKE_GPU_MODE == "emu"
    device.cuda_status = lambda: (True, f"1 GPU(s) (fake CuPy: CULLAMA_FAKE_GPU={FAKE_GPU_MODE})")

    # backends/driver.py loads the driver with ctypes.CDLL("libcuda.so.1"): it gets the fake's (cuFuncSetAttribute,
    # cuLaunchKernelEx on the fake streams, cuGetErrorString); every other name is ctypes'.
    def cdll(name, *args, **kwargs):
        return fake_cupy.libcuda if name == "libcuda.so.1" else ctypes.CDLL(name, *args, **kwargs)

    driver_ctypes = types.ModuleType("ctypes")
    driver_ctypes.__dict__.update(vars(ctypes))
    driver_ctypes.CDLL = cdll
    driver.ctypes = driver_ctypes


if FAKE_GPU:
    _install_fake_gpu()


def pytest_report_header(config):
    if FAKE_GPU_MODE == "emu":
        return "CULLAMA_FAKE_GPU=emu: the fake GPU runs kernels_cu on the CPU executor (cullama.runtime.emu)"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` are skipped, with the reason, where CuPy sees no GPU; tests marked `emu` where there is
    no host C++ compiler for the CUDA emulator."""
    if any(item.get_closest_marker("emu") for item in items):
        from cullama.runtime.emu import build
        from cullama.common.errors import KernelError

        try:
            build.compiler()
        except KernelError as exc:
            for item in items:
                if item.get_closest_marker("emu"):
                    item.add_marker(pytest.mark.skip(reason=str(exc)))
    if FAKE_GPU or not any(item.get_closest_marker("gpu") for item in items):
        return
    from cullama.runtime.device import cuda_status

    ok, why = cuda_status()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs an NVIDIA GPU: {why}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernels():
    """Loads kernels onto the GPU: kernels.function(KernelSpec) -> a CuPy RawKernel (gpu tests only)."""
    from cullama.runtime.registry import KernelLoader

    return KernelLoader()


def host_layout_library(source: Path, fn_macro: str, wrappers: str, defines, directory: Path,
                        headers=("stddef.h", "stdint.h")):
    """The block of a .cu between `// ---- layout: begin` and `// ---- layout: end` (a kernel's index math in
    plain C++, its functions declared with `fn_macro`), plus `wrappers`, compiled with the host C++ compiler
    and loaded with ctypes: the tests call the kernel's own index code on the CPU. Skips without a compiler."""
    import ctypes
    import shutil
    import subprocess

    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++, c++ or clang++) to build the layout block with")
    text = source.read_text()
    block = text[text.index("// ---- layout: begin"):text.index("// ---- layout: end")]
    assert "__device__" not in block.replace(f"#define {fn_macro} __device__ __forceinline__", "")  # host-compilable
    src, lib = directory / "layout.cpp", directory / "layout.so"
    src.write_text("".join(f"#include <{h}>\n" for h in headers) + f"#define {fn_macro} static inline\n" + block
                   + wrappers)
    flags = [f"-D{k}={v}" for k, v in defines]
    done = subprocess.run([compiler, "-std=c++17", "-O1", "-shared", "-fPIC", *flags, str(src), "-o", str(lib)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(lib))


def poisoned(cp, shape, dtype):
    """A device array full of NaN (or 0xFF bytes for integers): outputs are never tested on zeros."""
    dtype = np.dtype(dtype)
    if dtype.kind == "f":
        return cp.full(shape, np.nan, dtype=dtype)
    return cp.full(shape, np.iinfo(dtype).max, dtype=dtype)


# -- the test process's own signal state ------------------------------------------------------------------------
# A child process inherits its parent's blocked signals and ignored ones across exec (a handler does not survive
# exec; SIG_IGN and the mask do). A test that leaves SIGINT blocked or ignored in this process makes every later
# child deaf to Ctrl-C (tests/cli/test_cli_process.py's SIGINT test saw exactly that in whole-suite runs only): the
# test that does it fails here, by name, at its teardown.
def _sigint_deafness() -> str | None:
    """How SIGINT is kept from this thread ('blocked', 'ignored'), or None when it would arrive."""
    import signal

    if not hasattr(signal, "pthread_sigmask"):
        return None
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        return "blocked"
    ignored = 0
    try:
        with open("/proc/self/status") as status:  # the disposition as the kernel has it (C code may set it)
            ignored = next((int(line.split()[1], 16) for line in status if line.startswith("SigIgn:")), 0)
    except OSError:
        pass
    if ignored >> (signal.SIGINT - 1) & 1 or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        return "ignored"
    return None


@pytest.fixture(autouse=True)
def _keeps_sigint_as_it_found_it():
    before = _sigint_deafness()
    yield
    after = _sigint_deafness()
    if after != before:
        pytest.fail(f"this test left SIGINT {after or 'deliverable'} in the test process (it was "
                    f"{before or 'deliverable'}): every later child process inherits that", pytrace=False)
