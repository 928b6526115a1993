"""Exact resume after kill -9: the continuation of a killed and resumed run against an uninterrupted one.

    python bench/resume_check.py --device cuda --data-dir .gpu/data --steps 128 --ckpt-step 8   # GPT-2 124M, bf16,
    compiled
    python bench/resume_check.py --device cpu --shape tiny --steps 6 --ckpt-step 2 --data-dir D   # seconds

Every run is a real `python train_ddp.py` process with the same flags (the shape's defaults otherwise:
bf16 and compiled on a GPU, whatever auto picks on a CPU; --shape gpt2 is the gpt2 preset at
micro-batch 12 and 2 micro-steps per step, with a 10-step warmup so that the steps compared move).
Two rows (--rows), each of these runs:
  A  uninterrupted: --max-steps N (--steps), a checkpoint every K steps (--ckpt-step; background
     writes, the default)
  C  the same, killed with SIGKILL (its whole process group, compile workers too) as soon as step K's
     checkpoint is complete (its sidecar exists), then started again with --resume auto, to step N
  B  (default row, --repeat) A again: the noise floor, what two uninterrupted runs differ by here
Compared: the losses of steps K+1..N in C's metrics.jsonl (a resume truncates it to step K, then the
resumed run appends) against A's. The resumed run must also say `resumed from ... at step K` (a fresh
start would reproduce A's losses as well).
  deterministic  every run with --deterministic true (gpt2/core/determinism.py): C must equal A bit
                 for bit. The exact check: a resume that restores anything wrongly (data position,
                 optimizer moments, RNG, the schedule) changes the losses. C's own steps 1..K, run
                 before the kill, against A's say whether the uninterrupted runs themselves repeat.
  default        the trainer's defaults, whose GPU kernels are not deterministic (flash attention's and
                 inductor's embedding backward accumulate with atomics): C may differ from A by what B
                 does. Tolerance max(--tolerance, NOISE_FACTOR x max|B - A|): NOISE_FACTOR says why.
The median seconds per step of each row's A (after its first SETTLE_STEPS steps) give what the
deterministic switch costs here. Runs' checkpoints are deleted once read (a gpt2 run's are 1.5 GB each).
Exit status: 0 when every row run passes, 1 when one fails or a run could not be made, 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from emit import emit  # bench/emit.py (a script's directory is on sys.path)

from gpt2.train.session import read_metrics

REPO = Path(__file__).resolve().parent.parent

SHAPES = {
    "gpt2": ["--preset", "gpt2", "--micro-batch-size", "12", "--total-batch-size", "24576", "--warmup-steps", "10"],
    "tiny": (
        "--n-layer 2 --n-head 2 --n-embd 64 --block-size 64 --micro-batch-size 2 --total-batch-size 256 "
        "--warmup-steps 2 --compile false"
    ).split(),
}
QUIET = (
    "--eval-interval 0 --eval-tokens 0 --sample-interval 0 --plot false --log-interval 1 --seed 1337 "
    "--keep-checkpoints 2"
).split()
TABLE_MAX_ROWS = 24
"""Longer runs' tables show some steps only (shown_steps); the JSON holds every loss."""
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
ROWS = {"deterministic": ["--deterministic", "true"], "default": []}
"""Each row's train_ddp.py flags beyond the shape's, in the order the rows run (the exact check first)."""
NOISE_FACTOR = 20.0
"""The default row's tolerance is NOISE_FACTOR x max|B - A| (and at least --tolerance). With a right
resume A, B and C are three draws of the same run, so C - A and B - A (sharing A) are like two normal
draws correlated 0.5: their ratio is Cauchy-distributed (location 0.5, scale 0.87), and P(|C - A| >
k |B - A|) is about 0.55 / k for large k: 27% at the k = 2 of earlier versions (the chance failures of
healthy runs issue 39 saw on a GPU), 2.7% at 20. A wrong restore (data position, moments, schedule)
moves the losses by a step's own change or the batch-to-batch spread, which is the size of the signal
training has, not of bf16 rounding: still seen at 20x the rounding noise. The deterministic row is the
exact check; this one only guards the default kernels against a gross error (the report prints both
differences, so the first GPU lease shows the margin)."""
SETTLE_STEPS = 2
"""Steps left out of a row's s/step: compilation and allocator warm-up."""


@dataclass
class Check:
    """What a row's runs gave; filled in as they finish, so a report after a failure shows what there is."""

    ckpt_step: int
    steps: int
    row: str = "default"
    a: dict[int, float] = field(default_factory=dict)
    b: dict[int, float] = field(default_factory=dict)
    c: dict[int, float] = field(default_factory=dict)
    killed_at: int | None = None
    """The last step C's first run had logged when it was killed."""
    resumed_step: int | None = None
    step_s: float | None = None
    """A's median seconds per step after SETTLE_STEPS."""
    problems: list[str] = field(default_factory=list)

    def compared(self) -> list[int]:
        return list(range(self.ckpt_step + 1, self.steps + 1))

    @property
    def exact(self) -> bool:
        return self.row == "deterministic"


def train_flags(
    shape: str, device: str, data: Path, out: Path, steps: int, ckpt_step: int, extra: list[str]
) -> list[str]:
    return [
        *SHAPES[shape],
        *QUIET,
        "--device",
        device,
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--ckpt-interval",
        str(ckpt_step),
        *extra,
    ]


def records(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "step_s" in r]


def losses(out: Path) -> dict[int, float]:
    """step -> training loss, from a run directory's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in records(out)}


def median_step_s(out: Path) -> float | None:
    times = [r["step_s"] for r in sorted(records(out), key=lambda r: r["step"])[SETTLE_STEPS:]]
    return statistics.median(times) if times else None


def sidecar(out: Path, step: int) -> Path:
    """The file whose existence makes step's checkpoint complete (gpt2/ckpt/checkpoint.py)."""
    return out / "checkpoints" / f"step_{step:08d}.json"


def drop_checkpoints(out: Path) -> None:
    """A finished run's checkpoints: read by nobody after it (the losses are in metrics.jsonl)."""
    shutil.rmtree(out / "checkpoints", ignore_errors=True)


def run_to_end(flags: list[str], log: Path, timeout: float) -> str:
    """train_ddp.py FLAGS to its end; its output (also written to log). Raises RuntimeError on failure."""
    with open(log, "w") as f:
        done = subprocess.run(
            [sys.executable, "train_ddp.py", *flags], cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
        )
    text = log.read_text()
    if done.returncode:
        raise RuntimeError(f"train_ddp.py exited {done.returncode}: {text.strip()[-1500:]}")
    return text


def run_and_kill(flags: list[str], out: Path, step: int, log: Path, timeout: float) -> int:
    """train_ddp.py FLAGS, killed with SIGKILL (its process group) once step's checkpoint is complete;
    the last step it had logged then. Raises RuntimeError when it ends (or times out) first."""
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [sys.executable, "train_ddp.py", *flags],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    try:
        while not sidecar(out, step).exists():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"the run ended (exit {proc.returncode}) before step {step}'s checkpoint was "
                    f"seen complete: raise --steps. {log.read_text().strip()[-1500:]}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"no complete checkpoint of step {step} within {timeout:.0f} s")
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the run was not killed: it ended with exit {proc.returncode} first; raise --steps")
    return killed_before_the_end(max(losses(out), default=0), steps_of(flags), step)


def steps_of(flags: list[str]) -> int:
    """--max-steps N of a run's flags."""
    return int(flags[flags.index("--max-steps") + 1])


def killed_before_the_end(last: int, steps: int, ckpt_step: int) -> int:
    """last, the step the killed run had logged, when the kill came before its last step. A run that had
    logged all its steps was killed in its final save, not during training: a resume from ckpt_step still
    re-runs the steps after it, but nothing was interrupted mid-step, and until the resumed run ends the
    row holds only the killed run's own, uninterrupted losses. On an H200 (2026-11-28) step 8's 1.5 GB
    checkpoint was still being written in the background when the 16-step run logged its last step (steps
    of 55 ms); the default row's resumed run then ran out of the call's time."""
    if last >= steps:
        raise RuntimeError(
            f"the run had logged all {steps} steps before step {ckpt_step}'s checkpoint was complete (its "
            f"background write outlasted the {steps - ckpt_step} steps after it), so it was not killed mid-run: "
            "raise --steps"
        )
    return last


def run_row(args, extra: list[str], work: Path, check: Check, progress) -> None:
    """A, then C (killed, resumed), then B (default row, --repeat); progress() after each run, so a time
    limit keeps what was done."""
    flags = {
        name: train_flags(
            args.shape, args.device, args.data_dir, work / name, args.steps, args.ckpt_step, [*ROWS[check.row], *extra]
        )
        for name in ("A", "B", "C")
    }
    run_to_end(flags["A"], work / "A.log", args.run_timeout)
    check.a, check.step_s = losses(work / "A"), median_step_s(work / "A")
    drop_checkpoints(work / "A")
    progress()
    check.killed_at = run_and_kill(flags["C"], work / "C", args.ckpt_step, work / "C-killed.log", args.run_timeout)
    check.c = losses(work / "C")  # its steps 1..killed_at, before the resume truncates them to K
    progress()
    text = run_to_end(flags["C"] + ["--resume", "auto"], work / "C-resumed.log", args.run_timeout)
    m = RESUMED.search(text)
    check.resumed_step = int(m[2]) if m else None
    if check.resumed_step != args.ckpt_step:
        check.problems.append(
            f"the resumed run did not say 'resumed from ... at step {args.ckpt_step}' "
            f"(it said: {m[0] if m else 'nothing'})"
        )
    check.c = losses(work / "C")
    drop_checkpoints(work / "C")
    progress()
    if args.repeat and not check.exact:
        run_to_end(flags["B"], work / "B.log", args.run_timeout)
        check.b = losses(work / "B")
        drop_checkpoints(work / "B")
        progress()


def max_diff(x: dict[int, float], y: dict[int, float], steps: list[int]) -> float | None:
    """max |x - y| over steps, None when either lacks one of them."""
    if not steps or any(s not in x or s not in y for s in steps):
        return None
    return max(abs(x[s] - y[s]) for s in steps)


def verdict(check: Check, floor: float) -> tuple[bool, list[str]]:
    """(passed, the summary lines) of one row, from whatever runs finished."""
    steps = check.compared()
    resumed = max_diff(check.c, check.a, steps)
    lines = [
        f"- killed at step {check.killed_at} (SIGKILL once step {check.ckpt_step}'s checkpoint was complete); "
        f"resumed at step {check.resumed_step}"
        if check.killed_at is not None
        else "- the killed run: not made"
    ]
    if resumed is None:
        lines.append(f"- continuation: no losses of steps {steps[0]}..{steps[-1]} in both A and C")
    else:
        first = abs(check.c[steps[0]] - check.a[steps[0]])
        lines.append(
            f"- max |loss(C resumed) - loss(A uninterrupted)| over steps {steps[0]}..{steps[-1]}: "
            f"**{resumed:.3g}** (first resumed step {steps[0]}: {first:.3g}; "
            + ("bit for bit the same losses)" if resumed == 0 else "not bit for bit)")
        )
    before = list(range(1, check.ckpt_step + 1))
    repeat = max_diff(check.c, check.a, before)
    if repeat is not None:
        lines.append(
            f"- uninterrupted runs repeat: max |C - A| over steps 1..{check.ckpt_step} (C before the kill): "
            f"{repeat:.3g}" + (" (bit for bit)" if repeat == 0 else "")
        )
    if check.exact:
        passed = resumed == 0 and not check.problems
        lines.append("- deterministic algorithms (--deterministic true): the continuation must be bit for bit")
        if resumed and repeat:
            lines.append(
                "- the uninterrupted runs differ too: a kernel is not deterministic under --deterministic "
                "(a resume fault would show only after the kill)"
            )
    else:
        noise = max_diff(check.b, check.a, steps)
        tol = max(floor, NOISE_FACTOR * noise) if noise is not None else floor
        lines.append(
            f"- noise floor, max |loss(B) - loss(A)| of two uninterrupted runs: {noise:.3g}"
            if noise is not None
            else "- noise floor: not measured (B not run)"
        )
        lines.append(
            f"- tolerance: max(--tolerance {floor:g}, {NOISE_FACTOR:g} x noise floor) = {tol:.3g} "
            "(resume_check.NOISE_FACTOR says why)"
        )
        if noise is None and resumed is not None and resumed > floor and not check.problems:
            lines.append(
                "- exact resume after kill -9: **UNDECIDED**: not bit for bit, and without B's noise floor "
                "a difference cannot be told from non-deterministic kernels (run with --repeat)"
            )
            return False, lines
        passed = resumed is not None and resumed <= tol and not check.problems
    lines += [f"- problem: {p}" for p in check.problems]
    lines.append(f"- exact resume after kill -9: **{'PASS' if passed else 'FAIL'}**")
    return passed, lines


def loss_table(check: Check) -> list[str]:
    rows = [
        "| step | A uninterrupted | C killed + resumed | C - A | B repeat | B - A |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in shown_steps(check):
        a, c, b = check.a.get(s), check.c.get(s), check.b.get(s)
        rows.append(
            "| "
            + " | ".join(
                [
                    str(s),
                    *(f"{v:.6f}" if v is not None else "-" for v in (a, c)),
                    f"{c - a:+.2e}" if a is not None and c is not None else "-",
                    f"{b:.6f}" if b is not None else "-",
                    f"{b - a:+.2e}" if a is not None and b is not None else "-",
                ]
            )
            + " |"
        )
    return rows


def shown_steps(check: Check) -> list[int]:
    """The table's steps: all of a short run; of a long one (a GPU's 128 steps), those up to 4 past the
    checkpoint, the last 4, and where C and A differ most."""
    steps = sorted(set(check.a) | set(check.c))
    if len(steps) <= TABLE_MAX_ROWS:
        return steps
    diffs = {s: abs(check.c[s] - check.a[s]) for s in steps if s in check.a and s in check.c}
    worst = [max(diffs, key=diffs.get)] if diffs else []
    return sorted({*steps[: check.ckpt_step + 4], *steps[-4:], *worst})


def cost_line(checks: list[Check]) -> list[str]:
    """What --deterministic costs here: the two rows' A, median s/step."""
    times = {c.row: c.step_s for c in checks if c.step_s}
    if len(times) < 2:
        return []
    det, default = times["deterministic"], times["default"]
    return [
        f"- step time, median of A's steps after the first {SETTLE_STEPS}: deterministic {det:.4g} s, default "
        f"{default:.4g} s: --deterministic costs **{det / default - 1:+.1%}** here (one run each)"
    ]


def report(command: str, runs_line: str, checks: list[Check], floor: float) -> tuple[bool, str, dict]:
    """(every row run passed, the Markdown, the JSON) of the rows so far."""
    lines = [f"command: `{command}`", f"runs: {runs_line}", ""]
    rows, passed = {}, bool(checks)
    for check in checks:
        ok, summary = verdict(check, floor)
        passed = passed and ok
        lines += [
            f"**{check.row}**" + (" (--deterministic true)" if check.exact else " (the trainer's defaults)"),
            "",
            *summary,
            "",
            *loss_table(check),
            "",
        ]
        rows[check.row] = {
            "passed": ok,
            "summary": summary,
            "ckpt_step": check.ckpt_step,
            "steps": check.steps,
            "killed_at": check.killed_at,
            "resumed_step": check.resumed_step,
            "step_s": check.step_s,
            "A": check.a,
            "B": check.b,
            "C": check.c,
        }
    lines += cost_line(checks)
    lines.append(f"- all rows: **{'PASS' if passed else 'FAIL'}**")
    return passed, "\n".join(lines), {"command": command, "passed": passed, "rows": rows}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    ap.add_argument("--data-dir", type=Path, required=True, help="token shards (e.g. .gpu/data)")
    ap.add_argument(
        "--steps",
        type=int,
        default=128,
        help="N: steps of every run (enough after K for the checkpoint's background write: killed_before_the_end)",
    )
    ap.add_argument("--ckpt-step", type=int, default=8, help="K: the checkpoint interval; C is killed after step K's")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}, run in that order")
    ap.add_argument(
        "--repeat",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the default row: run A twice (B) for the noise floor",
    )
    ap.add_argument("--tolerance", type=float, default=1e-6, help="the default row's least tolerance")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds for any one run")
    ap.add_argument(
        "--work",
        type=Path,
        default=REPO / "runs" / "resume_check",
        help="the runs' directories and logs (emptied first)",
    )
    ap.add_argument("--md", type=Path, help="also write the report here, after every run")
    ap.add_argument("--json", type=Path, help="also write the losses and the verdicts here, after every run")
    ap.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: more train_ddp.py flags for every run")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = [f for f in args.train_flags if f != "--"]
    rows = [r for r in args.rows.split(",") if r]
    problem = (
        f"--rows {args.rows!r}: choose from {list(ROWS)}"
        if not rows or set(rows) - set(ROWS)
        else "--ckpt-step must be at least 1 and below --steps"
        if not 1 <= args.ckpt_step < args.steps
        else f"--data-dir {args.data_dir} holds no *train*.bin shards (bash scripts/gpu_prepare.sh makes .gpu/data)"
        if not any(args.data_dir.glob("*train*.bin"))
        else None
    )
    if problem:
        print(f"resume_check.py: error: {problem}", file=sys.stderr)
        return 2
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    command = "python bench/resume_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    runs_line = (
        " ".join(train_flags(args.shape, args.device, args.data_dir, Path("RUN"), args.steps, args.ckpt_step, extra))
        + " (deterministic row: + --deterministic true)"
    )
    checks: list[Check] = []

    def progress() -> tuple[bool, str]:
        passed, text, data = report(command, runs_line, checks, args.tolerance)
        if args.json:
            args.json.write_text(json.dumps(data, indent=1) + "\n")
        if args.md:
            args.md.write_text(text + "\n")
        return passed, text

    for row in rows:
        check = Check(args.ckpt_step, args.steps, row=row)
        checks.append(check)
        (args.work / row).mkdir()
        try:
            run_row(args, extra, args.work / row, check, progress)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            check.problems.append(" ".join(str(e).split())[-1500:])
    passed, text = progress()
    emit(text, None)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
