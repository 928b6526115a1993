#!/usr/bin/env bash
# Quick start without GPU or network: prepare a small real corpus that ships with Python itself
# (the English help texts of pydoc_data, ~139k GPT-2 tokens) and train the `debug` model on CPU
# with 2 processes.
#   bash scripts/quickstart.sh [RUN_DIR] [extra train_ddp.py flags...]
# Safe to run again: the data is reused, and a finished run says so (or continues with a larger
# --max-steps). PYTHON chooses the interpreter (default: .venv/bin/python, set up on first use
# by scripts/setup.sh with the plot extra).
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/quickstart}
shift || true
DATA_DIR=${DATA_DIR:-data/pydoc}
NPROC=${NPROC:-2}
if [ -z "${PYTHON:-}" ]; then
  # The plot extra: the run ends by drawing RUN_DIR/loss_curve.png with matplotlib (which the dev
  # extra installs too, so a test environment is not reinstalled).
  if .venv/bin/python -c "import matplotlib" 2>/dev/null; then
    bash scripts/setup.sh
  else
    bash scripts/setup.sh plot
  fi
  PYTHON=.venv/bin/python
elif ! "$PYTHON" -c "import matplotlib" 2>/dev/null; then
  echo "quickstart: $PYTHON has no matplotlib, so there will be no loss_curve.png: pip install -e \".[plot]\"" >&2
fi

mkdir -p "$DATA_DIR"
# Written once: data_prep remembers its sources' sizes and mtimes and refuses to mix a changed
# source into finished shards, so a rewrite would make the second run fail.
if [ ! -f "$DATA_DIR/pydoc_topics.jsonl" ]; then
  "$PYTHON" - "$DATA_DIR/pydoc_topics.jsonl" <<'PY'
import json, os, sys
from pydoc_data.topics import topics
tmp = sys.argv[1] + ".tmp"
with open(tmp, "w") as f:
    for name in sorted(topics):
        f.write(json.dumps({"text": topics[name]}) + "\n")
os.replace(tmp, sys.argv[1])
PY
fi
"$PYTHON" -m data_prep --source "$DATA_DIR/pydoc_topics.jsonl" --out "$DATA_DIR/shards"
# gpt2.launch is torchrun, except that a failing rank's own error line is not buried under torchrun's block
"$PYTHON" -m gpt2.launch --standalone --nproc_per_node="$NPROC" train_ddp.py --preset debug \
    --data-dir "$DATA_DIR/shards" --out-dir "$RUN_DIR" --device cpu "$@"
