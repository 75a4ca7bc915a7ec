#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--dry_run] [--output_dir DIR] [--steps ...] [--budget_s S]
#
# One-shot GPU validation (see scripts/gpu_check.py for the plan). A GPU image may lack
# datasets/evaluate, and torchao (the fp8 step): wheels fetched beforehand by
# scripts/fetch_gpu_wheels.sh into .whl/ are installed into a private folder, each only where the
# image lacks the package, never over the image's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob

export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s.%N)}"  # the check's budget starts here
PYTHON="${PYTHON:-python3}"  # the interpreter that has torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # amp_recipes without `pip install -e .`
wheels=()
if ! "$PYTHON" -c "import datasets, evaluate" 2>/dev/null; then
    for wheel in .whl/*.whl; do
        [[ "$(basename "$wheel")" == torchao-* ]] || wheels+=("$wheel")
    done
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "error: datasets/evaluate are not installed; run scripts/fetch_gpu_wheels.sh where pip works, carry .whl/" >&2
        exit 1
    fi
fi
if ! "$PYTHON" -c "import torchao" 2>/dev/null; then
    wheels+=(.whl/torchao-*.whl)  # none carried: the fp8 step says torchao is missing and is not run
fi
if [ ${#wheels[@]} -gt 0 ]; then
    site=$(mktemp -d /tmp/amp-site.XXXXXX)
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    export PYTHONPATH="$PYTHONPATH:$site"
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
