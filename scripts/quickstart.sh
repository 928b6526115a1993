#!/usr/bin/env bash
# Quick start without GPU or network: prepare a small real corpus that ships with Python itself
# (the English help texts of pydoc_data, ~110k GPT-2 tokens) and train the `debug` model on CPU
# with 2 processes. Usage: bash scripts/quickstart.sh [RUN_DIR] [extra train_ddp.py flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${1:-runs/quickstart}
shift || true
DATA_DIR=${DATA_DIR:-data/pydoc}
NPROC=${NPROC:-2}

mkdir -p "$DATA_DIR"
python - "$DATA_DIR/pydoc_topics.jsonl" <<'PY'
import json, sys
from pydoc_data.topics import topics
with open(sys.argv[1], "w") as f:
    for name in sorted(topics):
        f.write(json.dumps({"text": topics[name]}) + "\n")
PY
python -m data_prep --source "$DATA_DIR/pydoc_topics.jsonl" --out "$DATA_DIR/shards" --val-tokens 10000
torchrun --standalone --nproc_per_node="$NPROC" train_ddp.py --preset debug \
    --data-dir "$DATA_DIR/shards" --out-dir "$RUN_DIR" --device cpu "$@"
