#!/usr/bin/env bash
# rehearse_device.sh: the lent GPU machine's software, here on the CPU, before spending its 15 minutes.
#
#   bash benchmarks/prepare_device.sh && bash benchmarks/rehearse_device.sh      (in the repo root; needs the network)
#
# The device runs Python 3.12 with numpy 2.5, cupy-cuda13x and NVRTC 13.0, while CI runs Python 3.11 with
# numpy 2.4, cupy-cuda12x and NVRTC 12.9; what only the device's versions break (a numpy change, PTX that NVRTC 13
# writes differently, a wheel missing from .whl) would otherwise show first on the device. This builds a venv of
# the device's versions (read off one, as the device tool's KINDS.md lists them for 2026-11), leaves out what the
# device lacks (the server's extra, llguidance, jsonschema: device_check.sh installs those from .whl, offline,
# and that install is rehearsed too), then runs device_check.sh's first steps with the GPU tests on the fake GPU
# (CULLAMA_FAKE_GPU=1: the kernels' NumPy twins stand in for the GPU), and the CPU executor's tests, whose PTX here
# comes from NVRTC 13.0 as on the device.
#
# Environment: PYTHON312 (a Python 3.12; default pyenv's), VENV (default /tmp/cullama-device-venv, rebuilt),
# OUT (default /tmp/cullama-rehearsal: device_check.sh's steps.log and summary.txt). Exit status: non-zero when a
# step failed; the summary names it.
set -u
cd "$(dirname "$0")/.." || exit 1
VENV=${VENV:-/tmp/cullama-device-venv}
OUT=${OUT:-/tmp/cullama-rehearsal}
is_312() { "$1" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; }
if [ -z "${PYTHON312:-}" ]; then  # the first Python 3.12 found: on PATH, then pyenv's (a shim may name another)
    for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python; do
        if is_312 "$candidate"; then PYTHON312=$candidate; break; fi
    done
fi
if [ -z "${PYTHON312:-}" ] || ! is_312 "$PYTHON312"; then
    echo "rehearse_device.sh: no Python 3.12 found${PYTHON312:+ at $PYTHON312} (set PYTHON312)" >&2
    exit 2
fi
if [ ! -d .whl ]; then
    echo "rehearse_device.sh: no .whl here: run benchmarks/prepare_device.sh first" >&2
    exit 2
fi
set -e
rm -rf "$VENV" "$OUT"
"$PYTHON312" -m venv "$VENV"
# The device's packages that cullama uses (its torch, used only by compare_hf.py, is left out: a CUDA build of GBs)
"$VENV/bin/pip" install -q numpy==2.5.2 cupy-cuda13x==14.2.0 'nvidia-cuda-nvrtc==13.0.*' safetensors==0.8.0 \
    sentencepiece==0.2.2 tokenizers==0.23.2 transformers==5.17.0 jinja2 click pytest httpx setuptools wheel
set +e
# device_check.sh's install steps (the package, then .whl offline), `cullama info` and `cullama kernels` (NVRTC 13.0)
OUT=$OUT PYTHON=$VENV/bin/python STEPS=install,serve-deps,grammar-deps,info,kernels \
    bash benchmarks/device_check.sh >/dev/null
status=0
grep -qvE '^[a-z0-9-]+ +ok ' "$OUT/summary.txt" && status=1
grep -q '^kernels ' "$OUT/summary.txt" || status=1
# Its `pytest -m gpu` on the fake GPU, with no time cap (the twins on this CPU are slower than the device's GPU),
# then the CPU executor on NVRTC 13.0's PTX (test_emu_vs_gpu.py, which needs the GPU, ran in the first)
run_tests() {  # LABEL PYTEST-ARGS...: appended to steps.log; its last line shown and kept for the summary
    echo "=== $1" >>"$OUT/steps.log"
    "$VENV/bin/python" -m pytest -q -rfE -p no:cacheprovider "${@:2}" >>"$OUT/steps.log" 2>&1
    local rc=$?
    printf '%-22s %s\n' "$1" "$(tail -1 "$OUT/steps.log")" >>"$OUT/rehearsal.txt"
    return $rc
}
CULLAMA_FAKE_GPU=1 run_tests "pytest -m gpu (fake)" -m gpu || status=1
run_tests "emu (NVRTC 13.0 PTX)" tests/runtime/emu || status=1
echo "=== rehearsal: $("$VENV/bin/python" -c 'import numpy, cupy; print("numpy", numpy.__version__, "cupy", cupy.__version__)')"
grep -E '^ +(python|nvrtc):|compiled for' "$OUT/steps.log"
cat "$OUT/summary.txt" "$OUT/rehearsal.txt"
exit $status
