#!/usr/bin/env bash
# On the GPU machine, one device call each: `bash scripts/gpu_session.sh part1`, then `... part2`
# (bench/gpu_session.py says what each runs; results go to $OUT). Needs .gpu/ from scripts/gpu_prepare.sh.
# Any argument bench/gpu_session.py takes works: a single step (resume), --dry-run, --cpu-smoke.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" bench/gpu_session.py "${@:-part1}"
