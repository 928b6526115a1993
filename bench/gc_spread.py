"""Step-time spread with Python's garbage collector on its own timing against at the same step on every rank.

    python bench/gc_spread.py --data-dir DIR                # 2 gloo ranks on the CPU, minutes
    python bench/gc_spread.py --data-dir DIR --nproc 1 --steps 100

Each row is a train_ddp.py run (torchrun for --nproc > 1) of the same small model on DIR's shards, with
--gc-interval 0 (Python collects when its counters say, at a different moment on each rank) or N
(gpt2/train/gc_steps.py: frozen after start-up, every rank collects at every N-th step). Runs
alternate between the settings (--rounds times each), so both see the same machine load. The columns
are rank 0's step times (metrics.jsonl's step_s, which on a synchronous step includes waiting for
the slowest rank) after the first 10 steps: median, 90th and 99th percentile, the largest, and the
spread p99 / median. A collection that lands on one rank shows as a long step on all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from emit import emit

REPO = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 10
"""Steps left out of the statistics: the first steps allocate (and on gloo, connect)."""


def run(data_dir: Path, out_dir: Path, nproc: int, steps: int, gc_interval: int) -> list[float]:
    """Rank 0's step times of one run after the warm-up steps."""
    # A small model: short steps, where a collection's tens of milliseconds show (it does not scale with the model).
    args = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "64",
        "--block-size",
        "64",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--compile",
        "false",
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        str(256 * nproc),
        "--max-steps",
        str(steps),
        "--eval-interval",
        "0",
        "--eval-tokens",
        "1024",
        "--ckpt-interval",
        "0",
        "--sample-interval",
        "0",
        "--log-interval",
        "1",
        "--plot",
        "false",
        "--resume",
        "never",
        "--gc-interval",
        str(gc_interval),
    ]
    launcher = (
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        if nproc > 1
        else [sys.executable]
    )
    done = subprocess.run(
        [*launcher, str(REPO / "train_ddp.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if done.returncode != 0:
        raise SystemExit(
            f"gc_spread.py: error: train_ddp.py failed (exit {done.returncode}): "
            f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_s"] for r in records if "step_s" in r and r["step"] > WARMUP_STEPS]


def row(label: str, times: list[float]) -> str:
    q = statistics.quantiles(times, n=100)
    med = statistics.median(times)
    return (
        f"| {label} | {len(times)} | {med * 1000:.1f} | {q[89] * 1000:.1f} | {q[98] * 1000:.1f} | "
        f"{max(times) * 1000:.1f} | {q[98] / med:.2f}x |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", required=True, help="shards prepared by data_prep (e.g. tinyshakespeare's)")
    p.add_argument("--nproc", type=int, default=2, help="gloo ranks (torchrun) per run")
    p.add_argument("--steps", type=int, default=200, help="steps per run")
    p.add_argument("--interval", type=int, default=50, help="--gc-interval of the synchronised rows")
    p.add_argument("--rounds", type=int, default=2, help="runs per setting, alternating")
    p.add_argument("--md", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    if not (Path(a.data_dir) / "manifest.json").is_file():
        print(
            f"gc_spread.py: error: {a.data_dir} has no manifest.json: prepare shards with python -m data_prep",
            file=sys.stderr,
        )
        return 2
    times: dict[int, list[float]] = {0: [], a.interval: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for interval in times:
                times[interval] += run(Path(a.data_dir), Path(tmp) / f"r{r}-gc{interval}", a.nproc, a.steps, interval)
    lines = [
        f"rank 0's step time (ms), {a.nproc} rank(s) on the CPU, {a.rounds} x {a.steps} steps per setting",
        "",
        "| garbage collection | steps | median | p90 | p99 | max | p99 / median |",
        "|---|---|---|---|---|---|---|",
        row("Python's own timing (--gc-interval 0)", times[0]),
        row(f"every rank at every {a.interval}th step (--gc-interval {a.interval})", times[a.interval]),
    ]
    emit("\n".join(lines), a.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
