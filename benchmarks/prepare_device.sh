#!/usr/bin/env bash
# prepare_device.sh: what a lent GPU machine needs that it cannot fetch (it has no network), made here, in the repo
# root, before the one device call (`device` tool: run with carry [".shared", ".whl"], command
# `bash benchmarks/device_check.sh`):
#   .shared  a copy of ../shared (the golden checkpoints, stories260K, the LLaMA-2 tokenizer; 16 MB on 2026-12-07)
#   .whl     wheels of the server's extra for the device's Python 3.12 (fastapi, uvicorn, pydantic; ~4 MB), of
#            constrained decoding's llguidance (~3 MB) and of jsonschema (with its dependencies; ~1 MB), which the GPU
#            test of constrained generation validates with
# Both are git-ignored and together stay well under the 64 MiB that a run may carry.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .shared .whl
cp -r ../shared .shared
rm -rf .shared/hooks
# pip takes a wheel only for a platform tag named here (it does not count 2_17 in for 2_35): llguidance >= 1.7 is
# manylinux_2_31 only, and with 2_17 alone pip took 1.6, which rejects a list of EOS ids. The device's Python 3.12.3
# looks like Ubuntu 24.04's (glibc 2.39, not read off the device): tags up to 2_35 keep a margin.
pip download -q -d .whl --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    'fastapi>=0.115' 'uvicorn>=0.30' 'pydantic>=2.8' 'llguidance>=1.7' 'jsonschema>=4'
du -sh .shared .whl
