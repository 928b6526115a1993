"""torchrun without its tracebacks: `python -m gpt2.launch TORCHRUN_ARGS...`.

torchrun's agent turns SIGTERM (and SIGINT, SIGHUP, SIGQUIT) into a SignalException, shuts its
workers down (forwarding the signal, then SIGKILL after TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and
re-raises it out of torch.distributed.run.main as a 30-line traceback. The slurm/ scripts stop every
preempted or timed-out job that way, so each checkpointed stop would read like a crash in the job
log. This prints one line instead and exits with the status torchrun exits with when signalled (1,
the status of an uncaught exception; see gpt2/distributed/preempt.py), so nothing that goes by the status
changes.

A failed worker (a rank that printed `train_ddp.py: error: ...` and exited 2, or crashed) makes torchrun
stop the others with SIGTERM and raise ChildFailedError: a traceback and a table of every rank, the
stopped ones listed as failures with exit code -15, in which the rank's own error line is line 5 of
50. This prints instead which rank(s) failed first and with which exit code, that the others were
stopped by torchrun, and that the failing rank's own message is above; then exits 1, as torchrun
does for any failed worker (the slurm/ scripts and --max-restarts go by that; the worker's code is
in the summary). Everything else (arguments, output, torchrun's log lines) is torchrun's.
"""

from __future__ import annotations

import os
import signal
import sys

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

EXIT_SIGNALLED = 1
"""torchrun's exit status when it is the process signalled: the scripts go by OUT_DIR/requeue instead."""
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


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        out_dir = os.environ.get("OUT_DIR", "OUT_DIR")
        print(
            f"torchrun: stopped by {name}; its workers were asked to stop and have exited "
            f"(a checkpointed stop leaves {out_dir}/requeue)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_SIGNALLED
    except ChildFailedError as e:
        print("\n".join(failure_summary(e)), file=sys.stderr, flush=True)
        return EXIT_CHILD_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
