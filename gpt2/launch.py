"""torchrun without its tracebacks: `python -m gpt2.launch TORCHRUN_ARGS...`.

torchrun's agent turns SIGTERM (and SIGINT, SIGHUP, SIGQUIT) into a SignalException, shuts its
workers down (forwarding the signal, then SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and
re-raises it out of torch.distributed.run.main as a 30-line traceback, exit status 1. The slurm/ scripts
stop every preempted or timed-out job that way, so each checkpointed stop would read like a crash in the
job log. This prints one line instead. Its status: 3 (EXIT_REQUEUE, what train_ddp.py exits with after a
checkpointed stop without torchrun) when the trainer confirmed a clean stop by writing RUN/requeue during
this launch (RUN: --out-dir of the command, or $OUT_DIR); else 1, torchrun's own (the stop was not
confirmed: a crash in it, or workers that were not the trainer).

A failed worker (a rank that printed `train_ddp.py: error: ...` and exited 2, or crashed) makes torchrun
stop the others with SIGTERM and raise ChildFailedError: a traceback and a table of every rank, the
stopped ones listed as failures with exit code -15, in which the rank's own error line is line 5 of
50. This prints instead which rank(s) failed first and with which exit code, that the others were
stopped by torchrun, and that the failing rank's own message is above; then exits 1, as torchrun
does for any failed worker (the slurm/ scripts and --max-restarts go by that; the worker's code is
in the summary). Everything else (arguments, output, torchrun's log lines) is torchrun's, but for one
block: with several workers per node and no OMP_NUM_THREADS, torchrun sets it to 1 for them under a
5-line "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default" banner; this
sets the same 1 itself first, so the banner never prints (on a CPU the trainer sets each rank's torch threads
anyway: gpt2/distributed/group.py set_cpu_threads). An OMP_NUM_THREADS of the user's is left as it is.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import determine_local_world_size, get_args_parser
from torch.distributed.run import main as torchrun_main

EXIT_SIGNALLED = 1
"""torchrun's exit status when it is the process signalled and no clean stop was confirmed."""
EXIT_REQUEUE = 3
"""A checkpointed stop confirmed by RUN/requeue: train_ddp.py's own code for it (gpt2/distributed/preempt.py)."""
EXIT_CHILD_FAILED = 1
"""torchrun's exit status when a worker failed, whatever the worker's own code (the summary gives it)."""


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _exit(failure) -> str:
    return f"killed by {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"


def failure_summary(e: ChildFailedError) -> list[str]:
    """A few lines for torchrun's ChildFailedError: the rank(s) that failed and how, and the ranks torchrun
    stopped itself (SIGTERM after a failure), which are not failures of their own. torchrun's own "first
    observed failure" goes by timestamps in whole seconds, so it often names a rank it stopped; a rank
    that exited other than by SIGTERM failed first. Only when every rank got SIGTERM are all listed."""

    def terminated(rank: int) -> bool:
        return e.failures[rank].exitcode == -signal.SIGTERM

    failed = sorted(r for r in e.failures if not terminated(r)) or sorted(e.failures)
    stopped = sorted(r for r in e.failures if r not in failed)
    how = ", ".join(sorted({_exit(e.failures[r]) for r in failed}))
    lines = [f"torchrun: {_ranks(failed)} failed ({how})"]
    if stopped:
        lines.append(
            f"torchrun: {_ranks(stopped)} did not fail: torchrun stopped "
            f"{'it' if len(stopped) == 1 else 'them'} (SIGTERM) when {_ranks(failed)} failed"
        )
    lines.append(
        f"torchrun: what went wrong is in the failing rank's own output above (e.g. its "
        f"'train_ddp.py: error:' line); exiting {EXIT_CHILD_FAILED}, as torchrun does"
    )
    return lines


def out_dir_of(argv: list[str], env=None) -> str | None:
    """The run directory of the launched command: its last --out-dir, else $OUT_DIR (the slurm/ scripts
    set it), else None."""
    found = None
    for i, arg in enumerate(argv):
        if arg == "--out-dir" and i + 1 < len(argv):
            found = argv[i + 1]
        elif arg.startswith("--out-dir="):
            found = arg.split("=", 1)[1]
    return found or (os.environ if env is None else env).get("OUT_DIR") or None


def confirmed_stop(out_dir: str | None, since: float) -> Path | None:
    """RUN/requeue, if the trainer wrote it after `since` (this launch): its clean stop, with a checkpoint."""
    if out_dir is None:
        return None
    marker = Path(out_dir) / "requeue"
    try:
        return marker if marker.stat().st_mtime >= since else None
    except OSError:
        return None


def local_workers(argv: list[str]) -> int | None:
    """Workers per node of the torchrun command argv (--nproc-per-node: a number, or gpu, cpu, auto), or None
    where torchrun would refuse the arguments (it says why itself)."""
    parser = get_args_parser()
    parser.error = _refuse  # argparse would print and exit; torchrun_main reports its own argument errors
    try:
        return determine_local_world_size(parser.parse_args(argv).nproc_per_node)
    except (ValueError, RuntimeError):
        return None


def _refuse(message: str):
    raise ValueError(message)


def set_omp_threads(argv: list[str], env=None) -> None:
    """OMP_NUM_THREADS=1 for several workers per node where it is unset: what torchrun sets, without its banner."""
    env = os.environ if env is None else env
    if "OMP_NUM_THREADS" not in env and (local_workers(argv) or 0) > 1:
        env["OMP_NUM_THREADS"] = "1"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    started = time.time() - 1.0  # mtimes have coarse clocks on some filesystems
    set_omp_threads(argv)  # torchrun's own default, set before torchrun prints a 5-line banner to say so
    try:
        torchrun_main(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        out_dir = out_dir_of(argv)
        marker = confirmed_stop(out_dir, started)
        said = (
            f"the trainer confirmed a clean stop after its checkpoint ({marker}): exiting {EXIT_REQUEUE}, "
            "requeue and resume with --resume auto"
            if marker is not None
            else f"no clean stop was confirmed ({out_dir or 'RUN'}/requeue was not written): exiting {EXIT_SIGNALLED}"
        )
        print(
            f"torchrun: stopped by {name}; its workers were asked to stop and have exited; {said}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_REQUEUE if marker is not None else EXIT_SIGNALLED
    except ChildFailedError as e:
        print("\n".join(failure_summary(e)), file=sys.stderr, flush=True)
        return EXIT_CHILD_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
