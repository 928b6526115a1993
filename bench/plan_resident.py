"""The start-up's CPU `plan` line against the resident peak of the real run it plans: `train_ddp.py` processes.

    python bench/plan_resident.py --data-dir data/mine                     # every row below (10-35 min on 2 cores)
    python bench/plan_resident.py --data-dir D --rows debug-8,debug-32      # some rows, by name
    python bench/plan_resident.py --data-dir D --first-run                  # each row's first run of its shape

Each row runs `train_ddp.py --preset debug` (fp32, uncompiled; 3 steps, evaluation at the start and the end as
every run evaluates; the quickstart rows are the README's commands, 50 steps with the preset's evaluation and
checkpoint) in a fresh process and reads two numbers: the resident total its `plan` line prints (what the
process held when it planned, plus training's growth and the heap's slack, or the loss probe's growth:
gpt2.plan.memory.resident_total) and the process's measured peak, its maximum resident set from the kernel's
accounting of that one process (os.wait4's rusage, what `/usr/bin/time -v` prints). The 2-rank row starts
`python -m gpt2.launch --standalone --nproc_per_node=2` with a wrapper as the script: each rank's wrapper runs
train_ddp.py as its child and wait4s it, so each rank's own peak is read, and each is compared with its own
total from rank 0's plan line (rank 0's apart where its loss probe ran). The goal (issue 54): peak <= plan <=
1.25 x peak in every row. The plan's parts are as the line prints them, to 0.01 GiB.

--first-run points the trainer's cache (XDG_CACHE_HOME) at an empty directory for each row, so each start
measures its matmul peak and its loss probe again (the probe's memory is in the plan line where it is above
training's); without it the user's cache is used, and a shape seen before starts without the probe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from emit import emit  # bench/emit.py (a script's directory is on sys.path)

REPO = Path(__file__).resolve().parents[1]

GOAL = 1.25
"""The plan's resident total may be at most this many times the measured peak (and never below it)."""


@dataclass(frozen=True)
class Row:
    name: str
    model: tuple[str, ...]
    """Model flags over the debug preset's 4 layers, 128 wide, block 128."""
    micro_batch: int
    accum: int = 1
    """Micro-steps per optimizer step (total batch = micro-batch x block x accum x ranks)."""
    loss: str = "auto"
    steps: int = 3
    ranks: int = 1
    quickstart: bool = False
    """The README's quick start as it is typed: the debug preset's own batch, evaluation, checkpoints, 50 steps."""

    @property
    def block(self) -> int:
        return int(self.model[self.model.index("--block-size") + 1]) if "--block-size" in self.model else 128

    def shape(self) -> str:
        flags = dict(zip(self.model[::2], self.model[1::2]))
        layers, width = flags.get("--n-layer", "4"), flags.get("--n-embd", "128")
        return f"{layers}L {width}w T{self.block}" + (f", {self.ranks} ranks" if self.ranks > 1 else "")


W256 = ("--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--block-size", "256")
W384 = ("--n-layer", "6", "--n-embd", "384", "--n-head", "6", "--block-size", "256")
ROWS = [  # the loss auto takes (the loss probe's choice on this CPU), and each path forced where both fit
    Row("debug-8", (), 8, accum=2),
    Row("debug-8-full", (), 8, accum=2, loss="full"),
    Row("debug-32", (), 32),
    Row("debug-32-full", (), 32, loss="full"),
    Row("w256-8-chunked", W256, 8, accum=2, loss="chunked"),
    Row("w256-8-full", W256, 8, accum=2, loss="full"),
    Row("w256-32", W256, 32),
    Row("w384-8-chunked", W384, 8, accum=2, loss="chunked"),
    Row("w384-8-full", W384, 8, accum=2, loss="full"),
    Row("debug-1024", (), 1024, steps=2),
    Row("quickstart", (), 8, accum=2, steps=50, quickstart=True),
    Row("quickstart-2-ranks", (), 8, steps=50, ranks=2, quickstart=True),
]

RANK_WRAPPER = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, *sys.argv[1:]])
_, status, usage = os.wait4(child.pid, 0)
with open(os.path.join(os.environ["PEAK_DIR"], "rank%s.json" % os.environ["RANK"]), "w") as f:
    f.write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""
"""torchrun's script for each rank: train_ddp.py as its child, whose own maximum resident set it writes down."""

PLAN = re.compile(
    r"^plan\s+([\d.]+) GiB resident per rank(?:, ([\d.]+) GiB on rank 0)? \(([\d.]+) GiB to train \+ ([\d.]+) GiB "
    r"the heap keeps, .*?\+ ([\d.]+) GiB held before it[^;)]*(?:; [^;)]*?probes' ([\d.]+) GiB)?",
    re.M,
)


def plan_of(log: str) -> dict:
    """The plan line's numbers (bytes, from GiB as printed: to 0.01 GiB) from a run's console output: each
    rank's resident total, rank 0's where its loss probe ran (the probe's peak above training's), and parts."""
    m = PLAN.search(log)
    if m is None:
        raise RuntimeError(f"no CPU plan line in the run's output:\n{log[-3000:]}")
    each, rank0, train, heap, held, probe = (float(x) * 2**30 if x else None for x in m.groups())
    return {"each": each, "rank0": rank0 or each, "train": train, "heap": heap, "held": held, "probe": probe}


def loss_path(out_dir: Path) -> str:
    """The loss the run took, from its config.json (auto's choice or the flag's)."""
    info = json.loads((out_dir / "config.json").read_text())
    return info["loss"]["impl"]


def command(row: Row, data_dir: str, out_dir: Path) -> list[str]:
    where = ("--dtype", "float32", "--device", "cpu", "--data-dir", data_dir, "--out-dir", str(out_dir))
    if row.quickstart:  # micro-batch 8, 2,048 tokens a step, evaluation and a checkpoint at steps 0/50 and 50
        return [str(REPO / "train_ddp.py"), "--preset", "debug", *where, "--max-steps", str(row.steps)]
    total = row.micro_batch * row.block * row.accum * row.ranks
    flags = [
        *("--preset", "debug", *row.model, "--micro-batch-size", str(row.micro_batch)),
        *("--total-batch-size", str(total), "--max-steps", str(row.steps), "--loss-impl", row.loss, *where),
        *("--compile", "false", "--sample-interval", "0", "--ckpt-interval", "0", "--log-interval", "1"),
    ]
    return [str(REPO / "train_ddp.py"), *flags]


def run_row(row: Row, data_dir: str, work: Path, first_run: bool) -> list[tuple[str, int]]:
    """Runs the row; returns (who, peak bytes) per process and fills the row's log and out dir under work."""
    out_dir, env = work / row.name, dict(os.environ)
    if first_run:
        env["XDG_CACHE_HOME"] = str(work / f"cache-{row.name}")
    args = command(row, data_dir, out_dir)
    if row.ranks == 1:
        with open(work / f"{row.name}.log", "w") as log:
            child = subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            _, status, usage = os.wait4(child.pid, 0)
        peaks = [("rank 0", usage.ru_maxrss * 1024)]
    else:
        wrapper, peak_dir = work / "rank_wrapper.py", work / f"peaks-{row.name}"
        wrapper.write_text(RANK_WRAPPER)
        peak_dir.mkdir(exist_ok=True)
        env["PEAK_DIR"] = str(peak_dir)
        launch = [sys.executable, "-m", "gpt2.launch", "--standalone", f"--nproc_per_node={row.ranks}", str(wrapper)]
        with open(work / f"{row.name}.log", "w") as log:
            status = subprocess.run([*launch, *args], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            status = status.returncode
        peaks = [(f"rank {r}", int((peak_dir / f"rank{r}.json").read_text())) for r in range(row.ranks)]
    if status != 0:
        raise RuntimeError(f"{row.name} failed:\n{(work / f'{row.name}.log').read_text()[-3000:]}")
    return peaks


def verdict(plan: float, peak: int) -> str:
    if plan < peak:
        return "LOW"
    return "ok" if plan <= GOAL * peak else "HIGH"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", required=True, help="token shards (train_ddp.py --data-dir)")
    ap.add_argument("--rows", default=",".join(r.name for r in ROWS), help="comma-separated row names")
    ap.add_argument("--first-run", action="store_true", help="an empty trainer cache per row: the loss probe runs")
    ap.add_argument("--md", help="also write the table to this file")
    args = ap.parse_args(argv)
    names = args.rows.split(",")
    unknown = set(names) - {r.name for r in ROWS}
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; the rows are {[r.name for r in ROWS]}")
    lines = [
        "| row | shape | micro-batch x accum | loss | plan MiB (held + train + heap, or + loss probe) | peak MiB "
        "| plan/peak | verdict |",
        "|---|---|---|---|---:|---:|---:|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="plan_resident-") as tmp:
        work = Path(tmp)
        for row in (r for r in ROWS if r.name in names):
            peaks = run_row(row, args.data_dir, work, args.first_run)
            plan = plan_of((work / f"{row.name}.log").read_text())
            for who, peak in peaks:
                probe = plan["probe"] is not None and who == "rank 0"  # the line names it where it is counted
                total = plan["rank0"] if who == "rank 0" else plan["each"]
                grows = (
                    f"probe {plan['probe'] / 2**20:,.0f}"
                    if probe
                    else f"{plan['train'] / 2**20:,.0f} + {plan['heap'] / 2**20:,.0f}"
                )
                line = (
                    f"| {row.name} | {row.shape()} ({who}) | {row.micro_batch} x {row.accum} | "
                    f"{loss_path(work / row.name)} | {total / 2**20:,.0f} "
                    f"({plan['held'] / 2**20:,.0f} + {grows}) | {peak / 2**20:,.0f} | {total / peak:.2f} | "
                    f"{verdict(total, peak)} |"
                )
                lines.append(line)
                print(line, flush=True)
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
