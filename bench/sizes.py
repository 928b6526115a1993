"""The larger GPT-2 sizes at their presets' defaults, a few steps each: what the planner chose and what
the device did (bench/gpu_session.py's `sizes` step, run alone by name: the lease's second call).

    python bench/sizes.py --device cuda --data-dir .gpu/data --work runs/sizes --md sizes.md

Per size (--sizes: presets, or PRESET:N_LAYER, the CPU smoke test's stand-ins) one real `train_ddp.py
--preset NAME` run (--nproc N: N ranks on this machine, through python -m gpt2.launch) with no evaluation,
samples or checkpoints (it is given more steps than it runs and killed with SIGKILL once --steps steps are
logged: gpt2-xl's save alone is ~19 GB), read back from its train.log and metrics.jsonl: the micro-batch
auto took, the loss path, activation checkpointing, tokens/s and MFU of the last step, the peak memory
(mem_mb: the largest torch.cuda.max_memory_allocated of rank 0's steps) beside the start-up plan's total,
and their ratio. A size
that would not finish before the deadline (--deadline-s, default bench/gpu_session.py's
GPU_SESSION_DEADLINE) is skipped and recorded; the sizes run smallest first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from flags import QUIET_RUN  # bench/flags.py (a script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent
DEADLINE_ENV = "GPU_SESSION_DEADLINE"
SIZES = "gpt2-medium,gpt2-large,gpt2-xl"
STEPS = {"gpt2-xl": 2}
"""Steps per size where not --steps: a gpt2-xl step of 524,288 tokens is ~10 s or more on an H100."""
GROWTH = 1.5
"""A size's expected duration: the slowest finished size's times this (each size is larger than the last)."""
PLAN_LINE = re.compile(r"^plan\s+([\d.]+) (GiB|MiB) (?:of [\d.]+ (?:GiB|MiB) usable|resident per rank)", re.M)
"""The start-up's plan line: a GPU's `plan X of Y usable per rank`, a CPU's `plan X resident per rank (...)`
(X the whole process there: what max RSS, a CPU's mem_mb, measures)."""
AUTO_LINE = re.compile(r"micro-batch auto:\s*(\d+)\s+sequences?")
LOSS_LINE = re.compile(r"^loss\s{2,}([^:(]+)", re.M)
AC_LINE = re.compile(r"^activation checkpointing (\S+?)[:\s]", re.M)


def flat_train(train: dict) -> dict:
    """config.json's training fields by name: its sections merged (a config from before the sections is
    flat already). gpt2.core.config.train_values's rule, here without importing the library: this script
    only drives train_ddp.py."""
    return {k: v for section in train.values() if isinstance(section, dict) for k, v in section.items()} | {
        k: v for k, v in train.items() if not isinstance(v, dict)
    }


def mib(value: str, unit: str) -> float:
    return float(value) * (1024 if unit == "GiB" else 1)


def parse_run(log: str, records: list[dict], train: dict) -> dict:
    """One size's row from its train.log text, metrics.jsonl records and config.json's train section."""
    steps = sorted((r for r in records if "step_s" in r), key=lambda r: r["step"])
    last = steps[-1] if steps else {}
    plan = PLAN_LINE.search(log)
    auto = AUTO_LINE.search(log)
    loss = LOSS_LINE.search(log)
    ac = AC_LINE.search(log)
    first = steps[0] if steps else {}
    peak = max((r["mem_mb"] for r in steps if r.get("mem_mb") is not None), default=None)
    plan_mib = mib(plan[1], plan[2]) if plan else None
    mb = train.get("micro_batch_size")
    return {
        "micro_batch": mb,
        "auto": int(auto[1]) if auto else None,
        "accum": (train["total_batch_size"] // (mb * train["block_size"]))
        if isinstance(mb, int) and train.get("block_size")
        else None,
        "loss": loss[1].strip() if loss else train.get("loss_impl"),
        "ac": ac[1] if ac else train.get("activation_checkpointing"),
        "steps": len(steps),
        "first_step_s": first.get("step_s") if first.get("step") == 1 else None,
        "step_s": last.get("step_s"),
        "tok_per_s": last.get("tok_per_s"),
        "mfu": last.get("mfu"),
        "peak_mib": peak,
        "plan_mib": plan_mib,
        "peak_over_plan": peak / plan_mib if peak is not None and plan_mib else None,
    }


def read_jsonl(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def logged_steps(metrics: Path) -> int:
    return sum(1 for r in read_jsonl(metrics) if "step_s" in r)


def launch_cmd(nproc: int) -> list[str]:
    """train_ddp.py alone, or nproc ranks on this machine (python -m gpt2.launch: torchrun, its tracebacks aside)."""
    if nproc <= 1:
        return [sys.executable, "train_ddp.py"]
    return [sys.executable, "-m", "gpt2.launch", "--standalone", f"--nproc_per_node={nproc}", "train_ddp.py"]


def run_steps(
    flags: list[str], metrics: Path, steps: int, deadline: float | None, poll_s: float = 0.5, *, nproc: int = 1
):
    """train_ddp.py with flags (nproc ranks: launch_cmd) until `steps` steps are in its metrics.jsonl, then
    SIGKILL to its process group (no save, no stop checkpoint): 0; its own exit status if it ended first (a
    failure: it was given more steps); "timeout" past the deadline."""
    proc = subprocess.Popen([*launch_cmd(nproc), *flags], cwd=REPO, start_new_session=True)
    try:
        while proc.poll() is None:
            if logged_steps(metrics) >= steps:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return 0
            if deadline is not None and time.time() > deadline:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "timeout"
            time.sleep(poll_s)
        return 0 if logged_steps(metrics) >= steps else proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def spec_flags(spec: str) -> list[str]:
    """gpt2-xl -> --preset gpt2-xl; debug:3 -> --preset debug --n-layer 3."""
    preset, _, layers = spec.partition(":")
    return ["--preset", preset] + (["--n-layer", layers] if layers else [])


def size_fits(now: float, deadline: float | None, finished_s: list[float]) -> tuple[bool, str]:
    if deadline is None or not finished_s:
        return True, ""
    expected, left = max(finished_s) * GROWTH, deadline - now
    if expected <= left:
        return True, ""
    return False, f"skipped: time ({left:.0f} s left before the deadline, a size is expected to take ~{expected:.0f} s)"


def report(rows: dict[str, dict], command: str) -> str:
    lines = [
        f"command: `{command}`",
        "",
        "| size | micro-batch x accum | auto took | loss | act. ckpt | steps | s/step (last) | tok/s (last) "
        "| MFU (last) | peak MiB | plan MiB | peak / plan | step 1 s (compile) | run s |",
        "|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    for name, r in rows.items():
        if "why" in r:
            lines.append(f"| {name} | {r['why']} |  |  |  |  |  |  |  |  |  |  |  |  |")
            continue
        batch = f"{r['micro_batch']} x {r['accum']}" if r["accum"] else str(r["micro_batch"])
        cells = [
            name,
            batch,
            f(r["auto"], "d"),
            r["loss"],
            r["ac"],
            r["steps"],
            f(r["step_s"], ".3f"),
            f(r["tok_per_s"], ",.0f"),
            f(r["mfu"], ".1%"),
            f(r["peak_mib"], ",.0f"),
            f(r["plan_mib"], ",.0f"),
            f(r["peak_over_plan"], ".2f"),
            f(r.get("first_step_s"), ".1f"),
            f(r.get("run_s"), ".0f"),
        ]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines += [
        "",
        "- peak MiB: the largest mem_mb of the run's steps (torch.cuda.max_memory_allocated; a CPU's max RSS); "
        "plan MiB: the start-up line `plan X GiB of Y GiB usable` (gpt2/plan/)",
        "- step 1 s: the first step's time, torch.compile's cold compile included (each run has its own cache); "
        "run s: the whole process, start-up to the last step logged",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=SIZES, help=f"comma-separated presets or PRESET:N_LAYER (default {SIZES})")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="the runs' directories")
    ap.add_argument("--steps", type=int, default=None, help="steps per size (default 3; gpt2-xl 2)")
    ap.add_argument("--deadline-s", type=float, default=None, help=f"seconds from now (default ${DEADLINE_ENV})")
    ap.add_argument(
        "--label", default="", help="a suffix for every row's name (an A/B's variant: the flags after the options)"
    )
    ap.add_argument(
        "--nproc", type=int, default=1, help="ranks per run on this machine (python -m gpt2.launch; default 1)"
    )
    ap.add_argument("--md", type=Path)
    ap.add_argument("--json", type=Path)
    args, extra = ap.parse_known_args(argv)  # the rest goes to every train_ddp.py (e.g. --compile false)
    deadline = time.time() + args.deadline_s if args.deadline_s is not None else None
    if deadline is None and os.environ.get(DEADLINE_ENV):
        deadline = float(os.environ[DEADLINE_ENV])
    command = "python bench/sizes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rows: dict[str, dict] = {}
    finished: list[float] = []

    def write() -> None:
        text = report(rows, command)
        if args.md:
            args.md.write_text(text)
        if args.json:
            args.json.write_text(json.dumps({"command": command, "sizes": rows}, indent=1) + "\n")

    failed = False
    for spec in args.sizes.split(","):
        fits, why = size_fits(time.time(), deadline, finished)
        if not fits:
            rows[spec + (f" {args.label}" if args.label else "")] = {"why": why}
            print(f"{spec}: {why}", flush=True)
            write()
            continue
        name = spec + (f" {args.label}" if args.label else "")
        out = args.work / (
            spec.replace(":", "-") + (f"-{re.sub(r'[^A-Za-z0-9]+', '-', args.label)}" if args.label else "")
        )
        shutil.rmtree(out, ignore_errors=True)
        steps = args.steps or STEPS.get(spec, 3)
        flags = [
            *spec_flags(spec),
            "--device",
            args.device,
            "--data-dir",
            str(args.data_dir),
            "--out-dir",
            str(out),
            "--max-steps",
            str(steps + 1000),  # never reached: the run is killed once `steps` are logged, before any save
            *QUIET_RUN,
            "--log-interval",
            "1",
            *extra,
        ]
        print("$ " + " ".join([*launch_cmd(args.nproc)[1:], *flags]), flush=True)
        t0 = time.time()
        rc = run_steps(flags, out / "metrics.jsonl", steps, None if deadline is None else deadline, nproc=args.nproc)
        took = time.time() - t0
        log = (out / "train.log").read_text(errors="replace") if (out / "train.log").is_file() else ""
        conf = json.loads((out / "config.json").read_text())["config"] if (out / "config.json").is_file() else {}
        train = {**flat_train(conf.get("train", {})), "block_size": conf.get("model", {}).get("block_size")}
        row = parse_run(log, read_jsonl(out / "metrics.jsonl"), train)
        row["run_s"] = round(took, 1)
        if rc != 0:
            failed = True
            row = {"why": f"FAILED (exit {rc}) after {took:.0f} s; its log: {out / 'train.log'}"} | row
        else:
            finished.append(took)
        rows[name] = row
        shutil.rmtree(out / "checkpoints", ignore_errors=True)  # none expected (killed before any save)
        write()
    text = report(rows, command)
    print(text)
    write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
