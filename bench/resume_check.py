"""Exact resume after kill -9: the continuation of a killed and resumed run against an uninterrupted one.

    python bench/resume_check.py --device cuda --data-dir .gpu/data --steps 40   # GPT-2 124M, bf16, compiled
    python bench/resume_check.py --device cpu --shape tiny --steps 12 --ckpt-step 4 --data-dir D   # seconds

Every run is a real `python train_ddp.py` process with the same flags (the shape's defaults otherwise:
bf16 and compiled on a GPU, whatever auto picks on a CPU; --shape gpt2 is the gpt2 preset at
micro-batch 12 and 2 micro-steps per step, with a 10-step warmup so that the steps compared move):
  A  uninterrupted: --max-steps N (--steps), a checkpoint every K steps (--ckpt-step; background
     writes, the default)
  C  the same, killed with SIGKILL (its whole process group, compile workers too) as soon as step K's
     checkpoint is complete (its sidecar exists), then started again with --resume auto, to step N
  B  (--repeat, default on) A again: the noise floor, what two uninterrupted runs differ by on this
     device (non-deterministic kernels: atomics in backward passes)
Compared: the losses of steps K+1..N in C's metrics.jsonl (a resume truncates it to step K, then the
resumed run appends) against A's. The tolerance is 2 x max|B - A| over the same steps, and at least
--tolerance (default 1e-6): a resume that restored something wrongly (data position, optimizer moments,
RNG, the schedule) differs by more than two uninterrupted runs do. The resumed run must also say
`resumed from ... at step K`: a fresh start would reproduce A's losses as well.
Exit status: 0 when the check passes, 1 when it fails or a run could not be made.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from report import emit  # bench/report.py (a script's directory is on sys.path)

from gpt2.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent

SHAPES = {
    "gpt2": ["--preset", "gpt2", "--micro-batch-size", "12", "--total-batch-size", "24576", "--warmup-steps", "10"],
    "tiny": ["--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "64", "--micro-batch-size", "2",
             "--total-batch-size", "256", "--warmup-steps", "2", "--compile", "false"],
}
QUIET = ["--eval-interval", "0", "--eval-tokens", "0", "--sample-interval", "0", "--plot", "false",
         "--log-interval", "1", "--seed", "1337", "--keep-checkpoints", "2"]
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")


@dataclass
class Check:
    """What the runs gave; filled in as they finish, so a report after a failure shows what there is."""
    ckpt_step: int
    steps: int
    a: dict[int, float] = field(default_factory=dict)
    b: dict[int, float] = field(default_factory=dict)
    c: dict[int, float] = field(default_factory=dict)
    killed_at: int | None = None
    """The last step C's first run had logged when it was killed."""
    resumed_step: int | None = None
    problems: list[str] = field(default_factory=list)

    def compared(self) -> list[int]:
        return list(range(self.ckpt_step + 1, self.steps + 1))


def train_flags(shape: str, device: str, data: Path, out: Path, steps: int, ckpt_step: int,
                extra: list[str]) -> list[str]:
    return [*SHAPES[shape], *QUIET, "--device", device, "--data-dir", str(data), "--out-dir", str(out),
            "--max-steps", str(steps), "--ckpt-interval", str(ckpt_step), *extra]


def losses(out: Path) -> dict[int, float]:
    """step -> training loss, from a run directory's metrics.jsonl."""
    return {r["step"]: r["loss"] for r in read_metrics(out / "metrics.jsonl") if "step_s" in r}


def sidecar(out: Path, step: int) -> Path:
    """The file whose existence makes step's checkpoint complete (gpt2/ckpt/checkpoint.py)."""
    return out / "checkpoints" / f"step_{step:08d}.json"


def run_to_end(flags: list[str], log: Path, timeout: float) -> str:
    """train_ddp.py FLAGS to its end; its output (also written to log). Raises RuntimeError on failure."""
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "train_ddp.py", *flags], cwd=REPO, stdout=f,
                              stderr=subprocess.STDOUT, timeout=timeout)
    text = log.read_text()
    if done.returncode:
        raise RuntimeError(f"train_ddp.py exited {done.returncode}: {text.strip()[-1500:]}")
    return text


def run_and_kill(flags: list[str], out: Path, step: int, log: Path, timeout: float) -> int:
    """train_ddp.py FLAGS, killed with SIGKILL (its process group) once step's checkpoint is complete;
    the last step it had logged then. Raises RuntimeError when it ends (or times out) first."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "train_ddp.py", *flags], cwd=REPO, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not sidecar(out, step).exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended (exit {proc.returncode}) before step {step}'s checkpoint was "
                                   f"seen complete: raise --steps. {log.read_text().strip()[-1500:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no complete checkpoint of step {step} within {timeout:.0f} s")
            time.sleep(0.005)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise RuntimeError(f"the run was not killed: it ended with exit {proc.returncode} first; raise --steps")
    return max(losses(out), default=0)


def run_check(args, extra: list[str], work: Path, check: Check, progress) -> None:
    """A, then C (killed, resumed), then B; progress() after each, so a time limit keeps what was done."""
    flags = {name: train_flags(args.shape, args.device, args.data_dir, work / name, args.steps, args.ckpt_step,
                               extra) for name in ("A", "B", "C")}
    run_to_end(flags["A"], work / "A.log", args.run_timeout)
    check.a = losses(work / "A")
    progress()
    check.killed_at = run_and_kill(flags["C"], work / "C", args.ckpt_step, work / "C-killed.log", args.run_timeout)
    text = run_to_end(flags["C"] + ["--resume", "auto"], work / "C-resumed.log", args.run_timeout)
    m = RESUMED.search(text)
    check.resumed_step = int(m[2]) if m else None
    if check.resumed_step != args.ckpt_step:
        check.problems.append(f"the resumed run did not say 'resumed from ... at step {args.ckpt_step}' "
                              f"(it said: {m[0] if m else 'nothing'})")
    check.c = losses(work / "C")
    progress()
    if args.repeat:
        run_to_end(flags["B"], work / "B.log", args.run_timeout)
        check.b = losses(work / "B")
        progress()


def max_diff(x: dict[int, float], y: dict[int, float], steps: list[int]) -> float | None:
    """max |x - y| over steps, None when either lacks one of them."""
    if not steps or any(s not in x or s not in y for s in steps):
        return None
    return max(abs(x[s] - y[s]) for s in steps)


def verdict(check: Check, floor: float) -> tuple[bool, list[str]]:
    """(passed, the summary lines) of the comparison, from whatever runs finished."""
    steps = check.compared()
    resumed = max_diff(check.c, check.a, steps)
    noise = max_diff(check.b, check.a, steps)
    tol = max(floor, 2 * noise) if noise is not None else floor
    lines = [f"- killed at step {check.killed_at} (SIGKILL once step {check.ckpt_step}'s checkpoint was complete); "
             f"resumed at step {check.resumed_step}" if check.killed_at is not None else "- the killed run: not made"]
    if resumed is None:
        lines.append(f"- continuation: no losses of steps {steps[0]}..{steps[-1]} in both A and C")
    else:
        first = abs(check.c[steps[0]] - check.a[steps[0]])
        lines.append(f"- max |loss(C resumed) - loss(A uninterrupted)| over steps {steps[0]}..{steps[-1]}: "
                     f"**{resumed:.3g}** (first resumed step {steps[0]}: {first:.3g}; "
                     + ("bit for bit the same losses)" if resumed == 0 else "not bit for bit)"))
    lines.append(f"- noise floor, max |loss(B) - loss(A)| of two uninterrupted runs: {noise:.3g}" if noise is not None
                 else "- noise floor: not measured (B not run)")
    lines.append(f"- tolerance: max(--tolerance {floor:g}, 2 x noise floor) = {tol:.3g}")
    passed = resumed is not None and resumed <= tol and not check.problems
    lines += [f"- problem: {p}" for p in check.problems]
    if not passed and not check.problems and resumed is not None and noise is None:
        lines.append("- exact resume after kill -9: **UNDECIDED**: not bit for bit, and without B's noise floor "
                     "a difference cannot be told from non-deterministic kernels (run with --repeat)")
    else:
        lines.append(f"- exact resume after kill -9: **{'PASS' if passed else 'FAIL'}**")
    return passed, lines


def loss_table(check: Check) -> list[str]:
    rows = ["| step | A uninterrupted | C killed + resumed | C - A | B repeat | B - A |", "|---:|---:|---:|---:|---:|---:|"]
    for s in sorted(set(check.a) | set(check.c)):
        a, c, b = check.a.get(s), check.c.get(s), check.b.get(s)
        rows.append("| " + " | ".join([str(s), *(f"{v:.6f}" if v is not None else "-" for v in (a, c)),
                                       f"{c - a:+.2e}" if a is not None and c is not None else "-",
                                       f"{b:.6f}" if b is not None else "-",
                                       f"{b - a:+.2e}" if a is not None and b is not None else "-"]) + " |")
    return rows


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt2")
    ap.add_argument("--data-dir", type=Path, required=True, help="token shards (e.g. .gpu/data)")
    ap.add_argument("--steps", type=int, default=40, help="N: steps of every run")
    ap.add_argument("--ckpt-step", type=int, default=20, help="K: the checkpoint interval; C is killed after step K's")
    ap.add_argument("--repeat", action=argparse.BooleanOptionalAction, default=True,
                    help="run A twice (B) for the noise floor")
    ap.add_argument("--tolerance", type=float, default=1e-6, help="the least tolerance (see the module docstring)")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds for any one run")
    ap.add_argument("--work", type=Path, default=REPO / "runs" / "resume_check",
                    help="the runs' directories and logs (emptied first)")
    ap.add_argument("--md", type=Path, help="also write the report here")
    ap.add_argument("--json", type=Path, help="also write the losses and the verdict here, after every run")
    ap.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: more train_ddp.py flags for every run")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    extra = [f for f in args.train_flags if f != "--"]
    if not 1 <= args.ckpt_step < args.steps:
        print("resume_check.py: error: --ckpt-step must be at least 1 and below --steps", file=sys.stderr)
        return 2
    if not any(args.data_dir.glob("*train*.bin")):
        print(f"resume_check.py: error: --data-dir {args.data_dir} holds no *train*.bin shards (bash "
              "scripts/gpu_prepare.sh makes .gpu/data)", file=sys.stderr)
        return 2
    subprocess.run(["rm", "-rf", str(args.work)], check=True)
    args.work.mkdir(parents=True)
    check = Check(args.ckpt_step, args.steps)
    command = "python bench/resume_check.py " + " ".join(sys.argv[1:] if argv is None else argv)

    def report() -> tuple[bool, str]:
        passed, summary = verdict(check, args.tolerance)
        text = "\n".join([f"command: `{command}`", f"runs: {' '.join(train_flags(args.shape, args.device, args.data_dir, Path('RUN'), args.steps, args.ckpt_step, extra))}", ""]
                         + summary + [""] + loss_table(check))
        if args.json:
            args.json.write_text(json.dumps({"command": command, "passed": passed, "summary": summary,
                                             "ckpt_step": check.ckpt_step, "steps": check.steps,
                                             "killed_at": check.killed_at, "resumed_step": check.resumed_step,
                                             "A": check.a, "B": check.b, "C": check.c}, indent=1) + "\n")
        return passed, text

    try:
        run_check(args, extra, args.work, check, report)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        check.problems.append(str(e).strip()[-1500:])
    passed, text = report()
    emit(text, args.md)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
