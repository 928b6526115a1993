#!/usr/bin/env bash
# Line coverage of gpt2/, data_prep/ and train_ddp.py by what CI runs: the default suite, the long checks
# (README's two pytest commands) and the torch range's end-to-end test (tests/test_torch_range.py, which CI runs
# on torch 2.5.1 and 2.15.0; here on this venv's torch), every Python process they start included (torchrun's ranks, data_prep, the
# bench scripts: coverage's `patch = subprocess`, pyproject.toml [tool.coverage]). A rank that leaves by
# os._exit or SIGKILL writes no data, as before any change: the figure is comparable from run to run, not a
# census. docs/testing.md, "Coverage", keeps the figures before and after each change to the suite.
# Usage: bash scripts/coverage.sh [OUT_DIR]   (default runs/coverage; needs `bash scripts/setup.sh dev`)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${1:-runs/coverage}")
mkdir -p "$OUT"
PY=.venv/bin/python
export GPT2_COVERAGE_DIR="$OUT" GPT2_COVERAGE_SOURCE="$PWD"  # absolute: subprocesses run in other directories
"$PY" -m coverage erase
# Each pass may fail (a test that races coverage's slower start-up): its figure still counts what ran.
"$PY" -m coverage run -m pytest -q -n auto -p no:cacheprovider || echo "coverage: the default suite failed (exit $?)"
"$PY" -m coverage run -m pytest -q -n auto -p no:cacheprovider -m "slurm or slow" || echo "coverage: the long checks failed (exit $?)"
"$PY" -m coverage run -m pytest -q -n auto -p no:cacheprovider -m torch_range || echo "coverage: the torch range's runs failed (exit $?)"
"$PY" -m coverage combine -q
"$PY" -m coverage report --include="$PWD/gpt2/*,$PWD/data_prep/*,$PWD/train_ddp.py" --precision 1 | tee "$OUT/report.txt" | tail -1
