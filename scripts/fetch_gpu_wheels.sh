#!/usr/bin/env bash
# bash scripts/fetch_gpu_wheels.sh [EXTRA_REQUIREMENT ...]
#
# Downloads, where pip can reach a package index, the wheels scripts/gpu_check.sh needs on a
# GPU machine that has torch, transformers and accelerate but no datasets/evaluate and no
# network: Python 3.12, manylinux x86-64, into .whl/ (git-ignored). Extra requirements, such as
# `pyarrow==24.0.0` when the GPU image's pyarrow is older than datasets needs, can be added.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "datasets>=3.0" "evaluate>=0.4.3" "dill<0.4.2" "multiprocess<0.70.20" "$@"
ls -la .whl
