#!/usr/bin/env bash
# Regenerate requirements-lock.txt, the pinned stack of the container image and of anyone who
# wants the exact versions we test (pip install -r requirements-lock.txt):
#
#   bash scripts/lock_requirements.sh            # TORCH_VERSION=2.13.0 by default
#
# Inputs: the ranges in requirements.txt (less its `-e .` line: the package itself is installed
# from the checkout) and docker/requirements-jupyter.txt. torch is pinned to the version the image
# and CI use, without a local build tag (+cpu, +cu128): each torch release pins its own CUDA
# wheels, and the image keeps the base image's build. Needs pip-tools and the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
input=$(mktemp --suffix=.txt)
trap 'rm -f "$input"' EXIT
grep -v '^-e ' requirements.txt >"$input"
CUSTOM_COMPILE_COMMAND="bash scripts/lock_requirements.sh" pip-compile --quiet --no-emit-index-url \
    --no-emit-find-links --strip-extras --upgrade-package "torch==${TORCH_VERSION:-2.13.0}" \
    --output-file requirements-lock.txt "$input" docker/requirements-jupyter.txt
sed -i -e "s|$input|requirements.txt|g" -e 's/^\(torch==[0-9.]*\)+[a-z0-9]*$/\1/' requirements-lock.txt
