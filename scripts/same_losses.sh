#!/usr/bin/env bash
# A refactor's check: fixed-seed losses of this checkout against another revision's, bitwise.
#   bash scripts/same_losses.sh REV [WORK_DIR]
# Trains the debug preset on one CPU process (8 steps, val every 4) and the same under FSDP on 2 gloo ranks
# (6 steps, val every 3) with each tree, on the same shards (tinyshakespeare, tests/data), and compares
# every train and val loss of metrics.jsonl exactly. Prints one line per run; exits 1 on any difference.
# REV's tree is a `git archive` in WORK_DIR, run with this checkout's .venv (torch, tiktoken, numpy).
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: bash scripts/same_losses.sh REV [WORK_DIR]}
WORK=${2:-$(mktemp -d)}
PY=${PYTHON:-$PWD/.venv/bin/python}
CORPUS=${CORPUS:-tests/data/tinyshakespeare.txt}
[ -f "$CORPUS" ] || { echo "same_losses: no corpus at $CORPUS (set CORPUS=FILE.txt)" >&2; exit 2; }
mkdir -p "$WORK/old" "$WORK/runs"
git archive "$REV" | tar -x -C "$WORK/old"
"$PY" -m data_prep --source "$CORPUS" --out "$WORK/shards" --txt-sample-by paragraph --val-tokens 20000 --val-select first \
  --shard-tokens 160000 --workers 1 > "$WORK/prep.log" 2>&1
common=(--preset debug --device cpu --log-interval 1 --sample-interval 0 --plot false --resume never
        --data-dir "$WORK/shards")
run() {  # TREE NAME NPROC FLAGS...
  local tree=$1 name=$2 nproc=$3
  shift 3
  if [ "$nproc" = 1 ]; then
    (cd "$tree" && "$PY" train_ddp.py "${common[@]}" --out-dir "$WORK/runs/$name" "$@") > "$WORK/runs/$name.log" 2>&1
  else
    (cd "$tree" && "$PY" -m torch.distributed.run --standalone --nproc_per_node="$nproc" train_ddp.py \
      "${common[@]}" --out-dir "$WORK/runs/$name" "$@") > "$WORK/runs/$name.log" 2>&1
  fi || { echo "same_losses: $name failed; its log: $WORK/runs/$name.log" >&2; tail -5 "$WORK/runs/$name.log" >&2; exit 1; }
}
status=0
for spec in "ddp 1 --max-steps 8 --eval-interval 4" "fsdp 2 --parallel fsdp --max-steps 6 --eval-interval 3"; do
  read -r name nproc flags <<< "$spec"
  # shellcheck disable=SC2086
  run "$WORK/old" "old-$name" "$nproc" $flags
  # shellcheck disable=SC2086
  run "$PWD" "new-$name" "$nproc" $flags
  "$PY" - "$WORK/runs/old-$name/metrics.jsonl" "$WORK/runs/new-$name/metrics.jsonl" "$name" "$REV" <<'EOF' || status=1
import json, sys
def losses(path):
    rows = [json.loads(line) for line in open(path)]
    return [(r["step"], k, r[k]) for r in rows for k in ("loss", "val_loss") if k in r]
old, new = losses(sys.argv[1]), losses(sys.argv[2])
same = old == new and len(old) > 0
print(f"{sys.argv[3]}: {len(old)} losses of {sys.argv[4]}, {len(new)} of this checkout: "
      f"{'bitwise the same' if same else 'DIFFERENT'}")
if not same:
    for a, b in zip(old, new):
        if a != b:
            print(f"  first difference: {a} vs {b}")
            break
sys.exit(0 if same else 1)
EOF
done
exit $status
