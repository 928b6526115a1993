"""Check a GPU node before queueing a long run: one command, one table, one JSON file.

    python -m gpt2.doctor                   # this node: the table on stdout, ./doctor.json
    python -m gpt2.doctor --out DIR         # DIR/doctor.json, DIR/doctor.txt (the table), DIR/work (every run)
    python -m gpt2.doctor --device cpu      # the same checks at a tiny shape (tests/test_doctor.py runs it)
    python -m gpt2.doctor --only training   # some sections (--skip leaves some out); --full adds the ladder

The default run is sized for a short GPU lease: about 2 minutes on one H100 (docs/tools.md, "Check a GPU
node", gives the estimate per section); the acceleration ladder, 6 compiled GPT-2 124M models, several
minutes more, is opt-in (--full, or --only ladder). doctor.json and doctor.txt are rewritten after every
section, so a run stopped by a time limit leaves what it had checked.

No network and no `datasets`: torch, numpy and tiktoken, and token shards it writes itself
(gpt2/doctor/train_runs.py). Each section runs guarded: one that raises (no C compiler, no Triton, out of
memory) is FAILED with its one-line reason and the rest still run. In order:

  environment  devices, driver, CUDA, cuDNN, torch, NCCL, native bf16, what --dtype auto picks
  attention    which SDPA backends run alone on the model's q/k/v (shape and dtype of the run), how far
               each is from fp32 softmax(QK^T)V, and which one the default dispatch runs (profiled)
  correctness  train_ddp.py for a few steps: fp32 eager (explicit attention, no TF32) against the fast
               defaults (the auto dtype, torch.compile, SDPA, TF32), losses within a stated tolerance
  resume       each of those continued from its mid-run checkpoint with --resume: fp32 eager bitwise
               (losses and every model/optimizer tensor), the fast one within a tenth of that tolerance
  training     `train_ddp.py --preset gpt2` (auto micro-batch, the trainer's own train_step) for 8 steps
               (12 at the CPU shape): tokens/s, MFU against the data-sheet peak, peak memory against the plan
  ranks        the same run under torchrun on every local GPU (DDP over NCCL; n/a on one; on a CPU with
               --ranks 2, 2 gloo ranks): its losses against one rank's, the all-reduce bandwidth, the scaling
  ladder       (opt-in) bench/ladder.py's rungs (gpt2/doctor/acceleration.py) at the GPT-2 124M shape: base
               fp32 -> TF32 -> bf16 -> compile -> flash -> vocab 50304, tokens/s and MFU beside build-nanogpt's A100
The training processes run first (RUN_ORDER in gpt2/doctor/sections.py says why); the table keeps the
order above. resume continues correctness's runs: asking for it alone runs correctness too.

Exit status: 0 every check passed; 1 a check failed (or a correctness/resume/attention section could not
run); 3 another section could not run; 2 bad arguments. The table is printed in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpt2.core.args import OneLineParser
from gpt2.core.atomic import atomic_write_text
from gpt2.doctor import sections
from gpt2.doctor.results import Section, exit_status, format_table, header_line, report_json
from gpt2.plan.measure import KINETO_QUIET_LEVEL


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m gpt2.doctor",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 2)[2],
    )
    ap.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="auto: CUDA when present (then every local GPU), else the CPU at a tiny shape",
    )
    ap.add_argument("--out", type=Path, help="write DIR/doctor.json, DIR/doctor.txt and keep the runs in DIR/work")
    ap.add_argument(
        "--json", type=Path, help="the JSON report (default: DIR/doctor.json with --out, else ./doctor.json)"
    )
    ap.add_argument(
        "--work-dir",
        type=Path,
        help="shards and runs (default: DIR/work with --out, else a temp directory removed at the end)",
    )
    names = ",".join(n for n, _ in sections.SECTIONS)
    ap.add_argument(
        "--only", default="", help=f"comma-separated sections to run, of {names} (resume runs correctness too)"
    )
    ap.add_argument("--skip", default="", help=f"comma-separated sections to leave out, of {names}")
    ap.add_argument(
        "--full",
        action="store_true",
        help=f"also the opt-in sections ({', '.join(sections.OPT_IN)}: minutes more on a GPU)",
    )
    ap.add_argument(
        "--ranks",
        type=int,
        help="processes for the ranks section (default: the local GPUs; 1 on a CPU, where the section "
        "is then n/a: 2 runs two gloo ranks)",
    )
    ap.add_argument("--timeout-s", type=float, default=900, help="longest one training process may run (default 900)")
    return ap


def resolve_args(args: argparse.Namespace) -> tuple[torch.device, dict[str, str]]:
    """The device and the sections not to run, each with why; ValueError with the fix for what a user
    got wrong."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    device = torch.device(
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    names = [n for n, _ in sections.SECTIONS]
    only, skip = ({x for x in flag.split(",") if x} for flag in (args.only, args.skip))
    for flag, asked in (("--only", only), ("--skip", skip)):
        if unknown := sorted(asked - set(names)):
            raise ValueError(f"{flag} {','.join(unknown)}: no such section; choose from {names}")
    if args.ranks is not None and args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks} must be >= 1")
    if only:
        only |= {sections.NEEDS[n] for n in only if n in sections.NEEDS}
        left_out = {n: "not in --only" for n in names if n not in only}
    else:
        left_out = {n: "opt-in: --full or --only " + n for n in sections.OPT_IN if not args.full}
    left_out.update({n: "--skip" for n in skip})
    return device, left_out


@contextlib.contextmanager
def work_dir(args: argparse.Namespace):
    if args.work_dir or args.out:
        path = args.work_dir or args.out / "work"
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="gpt2-doctor-") as tmp:
        yield Path(tmp)


def say(message: str) -> None:
    print(f"doctor: {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        device, left_out = resolve_args(args)
    except ValueError as e:
        print(f"python -m gpt2.doctor: error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)  # before the first profile: no USDT lines
    t0 = time.perf_counter()
    json_path = args.json or (args.out / "doctor.json" if args.out else Path("doctor.json"))
    json_path.parent.mkdir(parents=True, exist_ok=True)

    def write(done: list[Section], *, complete: bool) -> str:
        """doctor.json (and doctor.txt with --out) of the sections so far, each file replaced whole."""
        wall, status = time.perf_counter() - t0, exit_status(done)
        table = format_table(
            done, header_line(device, done, wall, status) + ("" if complete else " | INCOMPLETE: still running")
        )
        report = report_json(done, device=device, argv=argv, wall_s=wall, status=status)
        atomic_write_text(json_path, json.dumps({**report, "complete": complete}, indent=1, default=str) + "\n")
        if args.out:
            atomic_write_text(args.out / "doctor.txt", table + "\n")
        return table

    with work_dir(args) as work:
        done = sections.run_all(
            device,
            left_out,
            work,
            ranks=args.ranks,
            timeout_s=args.timeout_s,
            say=say,
            on_section=lambda so_far: write(so_far, complete=False),
        )
    print(write(done, complete=True), flush=True)
    say(f"wrote {json_path}" + (f" and {args.out / 'doctor.txt'}" if args.out else ""))
    return exit_status(done)


if __name__ == "__main__":
    sys.exit(main())
