#!/usr/bin/env bash
# bash scripts/fetch_gpu_wheels.sh [EXTRA_REQUIREMENT ...]
#
# For a GPU machine without network access: run this where pip can reach a package index, then
# bring the .whl/ folder (git-ignored) along with the checkout; scripts/gpu_check.sh installs from
# it the packages that machine lacks. It downloads the datasets/evaluate wheels and their own
# dependencies (dill, multiprocess, xxhash) at the versions of requirements-lock.txt, the ones our
# tests pass on, and torchao for the fp8 series at the version the fp8 tests pass on
# (TORCHAO_VERSION; one wheel for every Python 3.10+). The wheels are for CPython $WHEEL_PYTHON
# (default 3.12) on x86-64 Linux: set it to the GPU machine's Python. Extra requirements, such as
# `pyarrow==26.0.1` when that machine's pyarrow is older than datasets needs, can be added.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(grep -E '^(datasets|evaluate|dill|multiprocess|xxhash)==' requirements-lock.txt)
[ "$(echo "$pins" | wc -l)" -eq 5 ] || { echo "requirements-lock.txt lacks one of the pins: $pins" >&2; exit 1; }
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $pins "torchao==${TORCHAO_VERSION:-0.18.0}" "$@"
ls -la .whl
total=$(du -cb .whl/*.whl | tail -n 1 | cut -f1)
echo "wheels to bring along with the checkout: $((total / 1024 / 1024)) MiB in .whl/"
