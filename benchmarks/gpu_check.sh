#!/usr/bin/env bash
# The GPU check in one run, on a GPU machine (benchmarks/gpu_check.py says what it measures):
#   where pip reaches its registries, once:  python benchmarks/gpu_prepare.py
#   then, on the GPU machine:               OUT=results bash benchmarks/gpu_check.sh
# Installs the wheels in .gpu_wheels/ into the machine's Python (for one without internet access),
# then runs the stages within BUDGET_S seconds (default 440); $OUT/summary.json and $OUT/log.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$(mktemp -d)}"
PYTHON="${PYTHON:-python3}"
mkdir -p "$OUT"
if [ -d .gpu_wheels ] && ! "$PYTHON" -c "import ray" 2>/dev/null; then  # a bare image: install what it lacks
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile .gpu_wheels/*.whl >"$OUT/log.txt" 2>&1 \
        || { echo "installing the carried wheels failed:"; tail -20 "$OUT/log.txt"; exit 1; }
fi
# The checkout's code before the carried wheel of it (built when the wheels were prepared): Ray's
# workers inherit this from the local instances the stages start.
export PYTHONPATH="$PWD/platform${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" benchmarks/gpu_check.py --out "$OUT" --budget "${BUDGET_S:-440}" "$@"
