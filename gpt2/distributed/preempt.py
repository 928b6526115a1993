"""Stopping on a signal and asking to be requeued: the contract slurm/* relies on.

SIGTERM or SIGUSR1 (what SLURM sends before a time limit or a preemption) to any trainer process
makes every rank stop at the same step boundary (`StopRequest` records the signal; the trainer's
per-step all-reduce carries the vote). Rank 0 waits for a background checkpoint write in flight
(gpt2/ckpt/writer.py), writes the stop's checkpoint synchronously, then RUN/requeue (JSON: step,
signal, checkpoint). Signal torchrun with SIGTERM: it forwards that to every worker and waits
TORCH_ELASTIC_SHUTDOWN_TIMEOUT (default 30 s) before SIGKILL. SIGUSR1 kills torchrun at once
(exit 138), as SIGKILL does: its workers then get SIGTERM from the kernel (stop_with_launcher)
and stop as above, rather than train on as orphans no one waits for.
RUN/requeue exists exactly when the last run in RUN ended on a stop signal after a complete
checkpoint: every run deletes it when it starts.
Exit codes of train_ddp.py after such a stop (`stop_exit_code`):
  - plain `python train_ddp.py`: 3 (EXIT_REQUEUE).
  - under torchrun: 0. torchrun cannot pass a worker's code on (any failed worker makes it exit 1),
    and with --max-restarts N a non-zero exit would restart the group into a new run instead of
    stopping. torchrun itself exits 1 when it was the process signalled (it re-raises the signal
    as an error after its workers exit), 0 when only the workers were signalled; run as
    `python -m gpt2.launch` it exits 3 instead when RUN/requeue confirms the stop (gpt2/launch.py).
So a batch script decides "requeue" by `[[ -f $OUT_DIR/requeue ]]` (or exit code 3 without
torchrun), never by torchrun's exit code; the requeued run passes --resume auto.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from gpt2.core.atomic import atomic_write_bytes, fsync_dir

EXIT_REQUEUE = 3
"""Exit code of a run stopped by SIGTERM/SIGUSR1 after writing a checkpoint: "please requeue"."""
REQUEUE_MARKER = "requeue"
"""File in the run directory written after the checkpoint of a signal stop (see the module docstring)."""


class StopRequest:
    """Records SIGTERM / SIGUSR1 while in its `with` block, and restores the previous handlers after.

    The handler only sets a flag, so a second signal during a checkpoint write changes nothing;
    ranks agree on stopping at the next step boundary through the per-step all-reduce.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum

    @property
    def name(self) -> str | None:
        """SIGTERM / SIGUSR1, or None when the stop came from another rank's signal."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def __enter__(self) -> StopRequest:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)


def write_requeue_marker(out_dir: str | Path, info: dict) -> Path:
    """RUN/requeue: this run stopped on a signal after writing a complete checkpoint (rank 0 only)."""
    path = Path(out_dir) / REQUEUE_MARKER
    atomic_write_bytes(path, (json.dumps(info) + "\n").encode())
    fsync_dir(path.parent)
    return path


def clear_requeue_marker(out_dir: str | Path) -> None:
    (Path(out_dir) / REQUEUE_MARKER).unlink(missing_ok=True)


def under_torchrun(env=None) -> bool:
    """True in a worker started by torchrun (its elastic agent sets TORCHELASTIC_RUN_ID)."""
    env = os.environ if env is None else env
    return "TORCHELASTIC_RUN_ID" in env


def stop_exit_code(env=None) -> int:
    """Exit code of a run stopped by a signal: EXIT_REQUEUE, or 0 under torchrun (see the docstring)."""
    return 0 if under_torchrun(env) else EXIT_REQUEUE


PR_SET_PDEATHSIG = 1
"""prctl(2): the signal this process gets when the thread that forked it exits (linux/prctl.h)."""


def stop_with_launcher(launcher: int, env=None) -> bool:
    """Under torchrun on Linux: SIGTERM this worker when its launcher dies, so that a torchrun killed
    with SIGKILL (or SIGUSR1, or a lost agent) does not leave its workers training on as orphans:
    the signal takes the StopRequest path, a checkpoint and RUN/requeue, as a forwarded SIGTERM does.
    torchrun starts its workers in sessions of their own, so no terminal or process-group signal
    reaches them otherwise.

    launcher: os.getppid() read first thing at start-up: torchrun's agent, which forks every worker
    itself from its main thread (PDEATHSIG fires when the forking *thread* exits). If it died before
    the prctl, nobody would send the signal: the worker was already reparented, so a parent other
    than `launcher` now means "gone", and the worker signals itself. (Dead even before `launcher`
    was read: the worker cannot join the process group, whose store lived in the agent, and fails.)
    Returns whether the signal is armed; a no-op (False) outside torchrun, where the parent is a
    shell or batch script a run may outlive (nohup), and where prctl does not exist.
    """
    if not under_torchrun(env) or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # no libc with prctl: leave things as they were
        return False
    if os.getppid() != launcher or launcher == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return True
