"""--micro-batch-size auto beside the fixed micro-batches on this CPU: is auto within 10% of the best?

    python bench/micro_batch_cpu.py --data-dir .gpu/data            # three shapes, a few minutes each
    python bench/micro_batch_cpu.py --data-dir D --shapes debug --steps 2

Per shape, real `train_ddp.py` runs (uncompiled, float32, the debug preset's recipe at that shape, no
evaluation, samples or checkpoints) at each fixed micro-batch of the shape's list and at auto; each run's
seconds per step is the median of its steps after the first. auto runs after the fixed ones, its probe's
cache cleared for the shape in the first round (so its start-up measures, as a first run does; the probe's
time is not in the step times). With --rounds N every run is repeated N times, the order reversed each
round, and each keeps its fastest: a machine shared with other work slows one run, not a verdict.
The verdict per shape: auto's s/step at most GOAL x the best fixed one's (issue 54's goal). Prints
one table.
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
sys.path.insert(0, str(REPO))

from gpt2.core.config import train_values  # noqa: E402
from gpt2.plan import matmul_peak  # noqa: E402

GOAL = 1.10
SHAPES = {
    # name: (shape flags, total batch tokens, fixed micro-batches)
    "debug": ([], 4096, [1, 4, 8, 32]),
    "4x256": (["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--block-size", "256"], 4096, [1, 4, 16]),
    "6x384": (["--n-layer", "6", "--n-embd", "384", "--n-head", "6", "--block-size", "256"], 2048, [1, 2, 8]),
}


def step_seconds(metrics: Path) -> float | None:
    recs = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.is_file() else []
    times = [r["step_s"] for r in recs if "step_s" in r]
    return statistics.median(times[1:] or times) if times else None


def one_run(flags: list[str], out: Path) -> tuple[float | None, int | None, float]:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    done = subprocess.run(
        [sys.executable, "train_ddp.py", *flags, "--out-dir", str(out)], cwd=REPO, text=True, capture_output=True
    )
    took = time.time() - t0
    if done.returncode != 0:
        print(done.stderr[-2000:], file=sys.stderr)
        return None, None, took
    conf = train_values(json.loads((out / "config.json").read_text())["config"]["train"])
    return step_seconds(out / "metrics.jsonl"), conf["micro_batch_size"], took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("runs/micro_batch_cpu"))
    ap.add_argument("--md", type=Path)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every run, alternating the order; keep the fastest")
    ap.add_argument("--num-threads", type=int, help="passed to train_ddp.py (issue 54 measured at 1)")
    args = ap.parse_args(argv)
    lines = [
        f"command: `python bench/micro_batch_cpu.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
        "| shape | tokens/step | fixed micro-batches: s/step | best fixed | auto took | auto s/step | auto / best "
        "| verdict |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    ok = True
    for name in args.shapes.split(","):
        shape, total, fixed = SHAPES[name]
        common = [
            "--preset", "debug", *shape, "--data-dir", str(args.data_dir), "--device", "cpu", "--dtype", "float32",
            "--compile", "false", "--total-batch-size", str(total), "--max-steps", str(args.steps),
            "--eval-interval", "0", "--sample-interval", "0", "--ckpt-interval", "0", "--plot", "false",
            "--log-interval", "1", "--warmup-steps", "1",
            *(["--num-threads", str(args.num_threads)] if args.num_threads else []),
        ]  # fmt: skip
        for stale in matmul_peak.peak_cache_dir().glob("micro-batch-*.json"):
            stale.unlink()  # auto measures, as a first run of the shape does
        times: dict = {b: None for b in fixed}
        auto_s, took = None, None
        order = [*fixed, "auto"]
        for r in range(args.rounds):
            for b in order if r % 2 == 0 else reversed(order):
                s, mb, _ = one_run([*common, "--micro-batch-size", str(b)], args.work / f"{name}-{b}")
                print(f"{name} round {r + 1} micro-batch {b}{f' (took {mb})' if b == 'auto' else ''}: {s} s/step")
                if b == "auto":
                    took = took or mb
                    if mb != took:
                        print(f"{name}: auto took {mb} this round, {took} before", file=sys.stderr)
                    auto_s = s if auto_s is None or (s is not None and s < auto_s) else auto_s
                else:
                    times[b] = s if times[b] is None or (s is not None and s < times[b]) else times[b]
        done = {b: t for b, t in times.items() if t is not None}
        best = min(done, key=done.get) if done else None
        ratio = auto_s / done[best] if auto_s is not None and best is not None else None
        good = ratio is not None and ratio <= GOAL
        ok &= good
        shown = ", ".join(f"{b}: {t:.2f}" if t is not None else f"{b}: failed" for b, t in times.items())
        lines.append(
            f"| {name} | {total:,} | {shown} | {best} ({done[best]:.2f} s) | {took} | "
            f"{'-' if auto_s is None else format(auto_s, '.2f')} | {'-' if ratio is None else format(ratio, '.2f')}x | "
            f"{'PASS' if good else 'FAIL'} (goal <= {GOAL:.2f}x) |"
            if best is not None
            else f"| {name} | {total:,} | {shown} | - | {took} | - | - | FAIL |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.md:
        args.md.write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
