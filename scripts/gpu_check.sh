#!/usr/bin/env bash
# bash scripts/gpu_check.sh [--output_dir DIR] [--budget_s S] [--steps ...] [--dry_run]
#
# The GPU check (scripts/gpu_check.py says what it runs) from a checkout, without `pip install`.
# On a GPU machine without network, the packages it lacks (often datasets and evaluate, and torchao
# for fp8) can come as wheels fetched elsewhere by scripts/fetch_gpu_wheels.sh into .whl/: each
# wheel whose package the machine does not have is installed into a private folder; a package the
# machine has is never shadowed, so its own torch, transformers and pyarrow stay the ones in use.
set -euo pipefail
cd "$(dirname "$0")/.."
shopt -s nullglob

export GPU_CHECK_STARTED="${GPU_CHECK_STARTED:-$(date +%s.%N)}"  # the check's budget starts here
PYTHON="${PYTHON:-python3}"  # the interpreter that has torch
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # amp_recipes without `pip install -e .`
wheels=()
for wheel in .whl/*.whl; do
    # A wheel's file name starts with its distribution's name ("_" for "-"): installed already?
    name=$(basename "$wheel" | cut -d- -f1)
    if ! "$PYTHON" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$name" 2>/dev/null; then
        wheels+=("$wheel")
    fi
done
if [ ${#wheels[@]} -gt 0 ]; then
    site=$(mktemp -d /tmp/amp-site.XXXXXX)
    echo "installing what this machine lacks, from .whl/: ${wheels[*]##*/}"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    export PYTHONPATH="$PYTHONPATH:$site"  # holds only packages the machine lacks: nothing to shadow
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
