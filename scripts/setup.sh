#!/usr/bin/env bash
# Makes .venv and installs the project into it; a second run only checks and returns at once.
# Usage: bash scripts/setup.sh [EXTRAS]   (EXTRAS: "dev" for the test suite, "plot" for loss curves; none for training)
# Needs only python3 (>= 3.10). TORCH_SPEC chooses the torch to install when .venv has none: the
# default, torch==2.13.0, is the version this project is tested with (on a GPU machine pick the
# build that matches your CUDA, e.g. TORCH_SPEC="torch==2.13.0 --index-url https://...").
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${1:-}
PY=.venv/bin/python
quiet() {  # pip's output only when it fails
  "$@" > .venv/setup.log 2>&1 || { cat .venv/setup.log >&2; echo "setup: failed: $*" >&2; exit 1; }
}
[ -x "$PY" ] || python3 -m venv .venv
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch into .venv (once)"
  quiet "$PY" -m pip install --upgrade pip
  # torch first: the project's "torch>=2.5" would otherwise pull the newest (CUDA) build.
  # shellcheck disable=SC2086
  quiet "$PY" -m pip install ${TORCH_SPEC:-torch==2.13.0}
fi
# Reinstall when pyproject.toml or the extras change (an editable install picks up code changes itself).
# No extras asked for: any install of this pyproject.toml will do.
stamp=".venv/.gpt2-ddp-installed"
hash=$(sha256sum pyproject.toml | cut -d' ' -f1)
want="$hash extras=${EXTRAS}"
if [ ! -f "$stamp" ] || ! { grep -qxF -- "$want" "$stamp" || { [ -z "$EXTRAS" ] && grep -q "^$hash " "$stamp"; }; }; then
  echo "setup: installing this project into .venv${EXTRAS:+ with [$EXTRAS]}"
  quiet "$PY" -m pip install -e ".${EXTRAS:+[$EXTRAS]}"
  # One line per extras installed from this pyproject.toml: `setup.sh plot` after `setup.sh dev`
  # must not make the next `setup.sh dev` reinstall.
  { grep "^$hash " "$stamp" 2>/dev/null || true; echo "$want"; } > "$stamp.new" && mv "$stamp.new" "$stamp"
fi
