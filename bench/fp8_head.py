"""--fp8-head against the plain head: the same run twice on the same tokens, the losses side by side.

    python bench/fp8_head.py --device cuda --data-dir .gpu/data --work runs/fp8_head --md fp8_head.md

Two real `train_ddp.py` runs (a 6-layer, 384-wide model, block 256, 8 x 256 tokens per step, the debug
preset's recipe, --steps steps, the same seed and data order; evaluation at the last step only), one with
--fp8-head: each one's last train loss (the mean of its last 10 logged steps), its validation loss (the exact
head in both: only training's loss takes the FP8 path) and its median step time. The verdict: the FP8 run's
validation loss within --tolerance (0.02) of the plain run's. On a CPU (--device cpu --dtype float32 --steps
N) the same comparison runs at its own speed: `_scaled_mm` there is slow, the losses are what count.
Flags after the options go to both runs (e.g. --compile true).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE = ["--preset", "debug", "--n-layer", "6", "--n-embd", "384", "--n-head", "6", "--block-size", "256"]
BATCH = ["--micro-batch-size", "8", "--total-batch-size", "2048"]


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def summarize(records: list[dict], steps: int) -> dict:
    """The last 10 steps' mean loss, the validation loss at the last step, the median step time."""
    train = [r for r in records if "loss" in r and "step_s" in r]
    val = [r for r in records if "val_loss" in r and r.get("step") == steps]
    return {
        "steps": len(train),
        "train_loss": statistics.fmean(r["loss"] for r in train[-10:]) if train else None,
        "val_loss": val[-1]["val_loss"] if val else None,
        "step_ms": 1000 * statistics.median(r["step_s"] for r in train[1:] or train) if train else None,
    }


def run(name: str, flags: list[str], work: Path, steps: int) -> dict:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "train_ddp.py", *flags, "--out-dir", str(out)]
    print("$ python " + " ".join(cmd[1:]), flush=True)
    t0 = time.time()
    done = subprocess.run(cmd, cwd=REPO)
    row = summarize(read_jsonl(out / "metrics.jsonl"), steps)
    row["run_s"], row["rc"] = round(time.time() - t0, 1), done.returncode
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return row


def report(rows: dict[str, dict], command: str, tolerance: float) -> tuple[str, bool]:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        f"command: `{command}`",
        "",
        "| head | exit | steps | train loss (last 10) | val loss | median ms/step | run s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {r['rc']} | {r['steps']} | {f(r['train_loss'], '.4f')} | {f(r['val_loss'], '.4f')} "
            f"| {f(r['step_ms'], '.1f')} | {f(r['run_s'], '.0f')} |"
        )
    plain, fp8 = rows.get("plain", {}), rows.get("fp8", {})
    ok = False
    if plain.get("val_loss") is not None and fp8.get("val_loss") is not None:
        diff = fp8["val_loss"] - plain["val_loss"]
        ok = abs(diff) <= tolerance
        lines += ["", f"val loss fp8 - plain: {diff:+.4f} (goal within {tolerance}): {'PASS' if ok else 'FAIL'}"]
    else:
        lines += ["", "val loss fp8 - plain: not measured (a run failed): FAIL"]
    return "\n".join(lines) + "\n", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="the two runs' directories")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--tolerance", type=float, default=0.02)
    ap.add_argument("--md", type=Path)
    args, extra = ap.parse_known_args(argv)
    command = "python bench/fp8_head.py " + " ".join(sys.argv[1:] if argv is None else argv)
    common = [
        *SHAPE,
        *BATCH,
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--data-dir",
        str(args.data_dir),
        "--max-steps",
        str(args.steps),
        "--eval-interval",
        str(args.steps),
        "--eval-tokens",
        str(args.eval_tokens),
        "--sample-interval",
        "0",
        "--ckpt-interval",
        "0",
        "--plot",
        "false",
        "--log-interval",
        "1",
        "--loss-impl",
        "full",
        "--compile",
        "false",
        *extra,  # after the defaults: a flag given here wins (argparse keeps the last)
    ]
    rows: dict[str, dict] = {}
    for name, flags in (("plain", common), ("fp8", [*common, "--fp8-head"])):
        rows[name] = run(name, flags, args.work, args.steps)
        text, ok = report(rows, command, args.tolerance)
        if args.md:
            args.md.write_text(text)
    print(text)
    return 0 if ok and all(r["rc"] == 0 for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
