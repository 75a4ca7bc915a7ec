#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--dry_run] [--output_dir DIR]
#
# One-shot GPU validation (see scripts/gpu_check.py for the plan). A GPU image may lack
# datasets/evaluate: wheels fetched beforehand by scripts/fetch_gpu_wheels.sh into .whl/ are
# installed into a private folder, never over the image's own packages.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"  # the interpreter that has torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # amp_recipes without `pip install -e .`
if ! "$PYTHON" -c "import datasets, evaluate" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        site=$(mktemp -d /tmp/amp-site.XXXXXX)
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
        export PYTHONPATH="$PYTHONPATH:$site"
    else
        echo "error: datasets/evaluate are not installed; run scripts/fetch_gpu_wheels.sh where pip works, carry .whl/" >&2
        exit 1
    fi
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
