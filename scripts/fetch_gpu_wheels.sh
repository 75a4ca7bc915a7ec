#!/usr/bin/env bash
# bash scripts/fetch_gpu_wheels.sh [EXTRA_REQUIREMENT ...]
#
# The prepare step of the GPU check, run where pip can reach a package index: downloads into
# .whl/ (git-ignored) the wheels that scripts/gpu_check.sh needs on a GPU machine that has torch,
# transformers, accelerate, pyarrow and pandas but no datasets/evaluate and no network (Python 3.12,
# manylinux x86-64). Versions are those of requirements-lock.txt, the ones our tests pass on;
# their dependencies the GPU image lacks come with them; and torchao, for the fp8 step, at the
# version the fp8 tests pass on (TORCHAO_VERSION; one wheel for every Python 3.10+, 3.4 MB). Extra
# requirements, such as `pyarrow==26.0.1` when the image's pyarrow is older than datasets needs,
# can be added.
set -euo pipefail
cd "$(dirname "$0")/.."
pins=$(grep -E '^(datasets|evaluate|dill|multiprocess|xxhash)==' requirements-lock.txt)
[ "$(echo "$pins" | wc -l)" -eq 5 ] || { echo "requirements-lock.txt lacks one of the pins: $pins" >&2; exit 1; }
mkdir -p .whl
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $pins "torchao==${TORCHAO_VERSION:-0.18.0}" "$@"
ls -la .whl
total=$(du -cb .whl/*.whl | tail -n 1 | cut -f1)
echo "wheels to carry: $((total / 1024 / 1024)) MiB of the 64 MiB that may travel with the checkout"
[ "$total" -le $((64 * 1024 * 1024)) ] || { echo "error: .whl/ is over 64 MiB; remove what the GPU image has" >&2; exit 1; }
