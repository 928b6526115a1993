#!/usr/bin/env bash
# On the GPU machine, the one device call: `bash scripts/gpu_session.sh quick` (bench/gpu_session.py says
# what it runs; results go to $OUT). Needs .gpu/ from scripts/gpu_prepare.sh. Any argument
# bench/gpu_session.py takes works: a single step (resume), --dry-run, --cpu-smoke.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3 || command -v python)}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" bench/gpu_session.py "${@:-quick}"
