#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--output_dir DIR] [--parts suite,doctor,paired] [--test_timeout_s S] [--dry_run]
#
# The GPU check (scripts/gpu_check.py says what it runs), from a checkout set up as docs/gpu-check.md
# says: `pip install -r requirements.txt` (after the CUDA build of torch), then
# `pip install -e ".[gpu-check]"` for pytest and pytest-timeout.
set -euo pipefail
PYTHON="${PYTHON:-python3}"  # the interpreter that has torch
# From the caller's folder: a relative --output_dir is the caller's. The parts run in the checkout.
exec "$PYTHON" "$(dirname "$0")/gpu_check.py" "$@"
