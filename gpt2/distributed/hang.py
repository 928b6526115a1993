"""Hang dumps: every rank's Python stacks and last collective in RUN/hang-<time>/rank-<r>.txt.

Written when a collective fails (a timeout: a hung or stopped peer; a closed connection: a dead one)
and whenever a person sends SIGUSR2 to a rank (`kill -USR2 PID`, or to every rank of a node:
`pkill -USR2 -f train_ddp.py`). Each file says which collective the rank entered last (name and
sequence number, gpt2/distributed/group.py's TRACE) and whether it came back; after a short wait for
the other ranks' reports (HANG_GRACE_S), each file is rewritten with the ranks that never arrived,
and rank 0 (or the lowest rank that reported, where rank 0 is the one stuck) prints that as one line.

How the ranks learn who never arrived: through torchrun's store (the TCPStore the process group
was made with, held by the torchrun agent, not by a rank). Each dumping rank writes its last
collective's sequence number there; a rank that is stopped (SIGSTOP), dead, or hung outside a
collective writes nothing, and a rank still computing reports a lower number: both are named. The
store also gives all ranks one folder: the n-th dump of every rank goes to the folder the first
rank to make an n-th dump named. Nothing is written to the store before something goes wrong.

SIGUSR2 when the main thread is blocked in a collective: Python runs signal handlers in the main
thread only, between bytecodes, so a handler would wait for the collective to return. The C-level
handler also writes the signal's number to a wakeup pipe (signal.set_wakeup_fd), which a thread of
ours reads: that thread writes the dump while the main thread stays blocked.

NCCL's Flight Recorder (PyTorch's own ring buffer of collectives, on CUDA) is turned on before the
process group starts (flight_recorder_env) and its dump on a timeout lands in RUN/flight-recorder/;
docs/hangs.md says how to read it with torch's fr_trace tool.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from gpt2.core.atomic import atomic_write_text
from gpt2.core.compat import default_store, flight_recorder_vars
from gpt2.distributed.group import TRACE, Dist

HANG_GRACE_S = 10.0
"""How long a dumping rank waits for the other ranks' reports. Every live rank in the same collective
times out within about a step of the first (they entered it within a step of each other), or fails
at once when the first one's exit closes its connections: seconds. torchrun gives a failed group's
survivors 30 s after SIGTERM before SIGKILL, so the files are complete before anyone is killed."""

FLIGHT_RECORDER_DIR = "flight-recorder"
"""RUN/flight-recorder/: NCCL's Flight Recorder dumps on a collective timeout (one file per rank)."""

FLIGHT_RECORDER_ENTRIES = 2000
"""Collectives kept in NCCL's Flight Recorder ring buffer: torchtitan's default (a few steps of FSDP)."""

_KEY = "gpt2/hang"


def flight_recorder_env(out_dir: str, device_type: str, env=None) -> dict:
    """Turn on NCCL's Flight Recorder (CUDA only, before the process group starts): its trace buffer,
    its dump on a timeout, and the dump's path RUN/flight-recorder/nccl_trace_rank_<r>. A variable the
    user has set is kept. Returns what was set."""
    env = os.environ if env is None else env
    if device_type != "cuda":
        return {}
    folder = Path(out_dir) / FLIGHT_RECORDER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    wanted = flight_recorder_vars(FLIGHT_RECORDER_ENTRIES, str(folder / "nccl_trace_rank_"))
    added = {k: v for k, v in wanted.items() if k not in env}
    env.update(added)
    return added


def stacks_text() -> str:
    """Every thread's Python stack, the main thread's first (where a hung collective is), without the
    dump's own frames (this module's)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sorted(sys._current_frames().items(), key=lambda kv: kv[0] != threading.main_thread().ident)
    return "\n".join(
        f"--- thread {names.get(ident, ident)} ---\n{''.join(traceback.format_list(_outside_dump(frame)))}"
        for ident, frame in frames
    )


def _outside_dump(frame) -> list:
    return [f for f in traceback.extract_stack(frame) if Path(f.filename).resolve() != Path(__file__).resolve()]


def last_collective() -> str:
    state = "returned" if TRACE.done else "still inside it"
    return f"#{TRACE.seq} {TRACE.name or '(none yet)'} ({state})"


def never_arrived(reports: dict[int, int], world_size: int) -> tuple[int, list[int]]:
    """The collective the group is stuck in (the highest sequence number reported) and the ranks not at
    it: those behind (still computing, or stuck elsewhere) and those that reported nothing (stopped,
    dead, hung outside Python's reach). A pure function of the reports {rank: sequence number}."""
    stuck_at = max(reports.values(), default=0)
    return stuck_at, [r for r in range(world_size) if reports.get(r, -1) < stuck_at]


class HangDumps:
    """Installed for a run (`with HangDumps(out_dir, dist):`): dumps on a failing collective and on SIGUSR2."""

    def __init__(self, out_dir: str, dist: Dist, grace_s: float = HANG_GRACE_S) -> None:
        self.out_dir, self.dist, self.grace_s = Path(out_dir), dist, grace_s
        self._lock = (
            threading.RLock()
        )  # a signal's dump and a failure's never interleave (re-entered: the fallback handler)
        self._previous_handler = self._previous_fd = None
        self._pipe: tuple[int, int] | None = None
        self._thread: threading.Thread | None = None
        self._dumped_failure = False

    def __enter__(self) -> HangDumps:
        TRACE.on_failure = self._on_failure
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR2"):
            self._install_signal()
        return self

    def __exit__(self, *exc) -> None:
        TRACE.on_failure = None
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            signal.signal(signal.SIGUSR2, self._previous_handler)
            os.close(self._pipe[1])  # the reader sees the end of the pipe and returns
            self._thread.join(timeout=self.grace_s + 5)
            self._pipe = None

    def _install_signal(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # set_wakeup_fd requires it: a full pipe drops a byte, never blocks
        previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        if previous_fd != -1:  # someone else's wakeup fd (an event loop): keep theirs, dump in the handler
            signal.set_wakeup_fd(previous_fd)
            os.close(read_fd)
            os.close(write_fd)
            self._previous_handler = signal.signal(
                signal.SIGUSR2, lambda *_: self._dump_or_say("SIGUSR2", failure=False)
            )
            return
        # The handler only makes the signal Python's (not the default action, which ends the process):
        # its C part writes the wakeup byte that our thread acts on, even while the main thread waits.
        self._previous_handler = signal.signal(signal.SIGUSR2, lambda *_: None)
        self._previous_fd, self._pipe = previous_fd, (read_fd, write_fd)
        self._thread = threading.Thread(target=self._read_signals, name="gpt2-hang-dump", daemon=True)
        self._thread.start()

    def _read_signals(self) -> None:
        read_fd = self._pipe[0]
        try:
            while chunk := os.read(read_fd, 64):
                if signal.SIGUSR2 in chunk:  # one byte per signal; SIGTERM/SIGUSR1 are preempt's
                    self._dump_or_say("SIGUSR2", failure=False)
        finally:
            os.close(read_fd)

    def _on_failure(self, error: BaseException) -> None:
        """A collective failed on this rank: dump once (the first failure is the one that explains)."""
        if self._dumped_failure:
            return
        self._dumped_failure = True
        first = (str(error).splitlines() or [type(error).__name__])[0]
        self._dump_or_say(f"the collective failed: {type(error).__name__}: {first}", failure=True)

    def _dump_or_say(self, reason: str, *, failure: bool) -> None:
        """dump(), and one line if it fails: it explains a failure, it never replaces the failure's own
        error, and the signal thread lives on for the next signal."""
        try:
            self.dump(reason, failure=failure)
        except Exception as e:
            print(f"rank {self.dist.rank}: hang dump failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def dump(self, reason: str, *, failure: bool) -> Path:
        """Write this rank's file now, then again with the ranks that never arrived. Returns the folder.

        failure: a collective failed here (once per run); else a signal asked (any number of times)."""
        with self._lock:
            store = default_store() if self.dist.is_distributed else None
            folder = self._folder(store, failure)
            seq, head = (
                TRACE.seq,
                (
                    f"rank {self.dist.rank} of {self.dist.world_size}, pid {os.getpid()}\n"
                    f"reason: {reason}\nlast collective: {last_collective()}\n"
                ),
            )
            path = folder / f"rank-{self.dist.rank}.txt"
            stacks = stacks_text()
            atomic_write_text(path, f"{head}\n{stacks}")
            if store is None:
                return folder
            round_key = f"{_KEY}/{folder.name}"
            store.set(f"{round_key}/seq/{self.dist.rank}", str(seq))
            reports = self._reports(store, round_key)
            stuck_at, missing = never_arrived(reports, self.dist.world_size)
            # A signal's dump: a rank may simply not have been signalled, or be between two collectives.
            what = "never arrived at" if failure else f"had not reached (or not dumped within {self.grace_s:g} s)"
            verdict = (
                f"ranks that {what} collective #{stuck_at}: {', '.join(map(str, missing)) or 'none'}"
                f" (reported: {', '.join(f'{r}@#{s}' for r, s in sorted(reports.items()))})\n"
            )
            atomic_write_text(path, f"{head}{verdict}\n{stacks}")
            if self.dist.rank == min(reports):  # rank 0, or the first live rank where rank 0 is the one stopped
                print(
                    f"hang dump: rank {self.dist.rank} {reason}; last collective {last_collective()}; "
                    f"{verdict.strip()}; "
                    f"every rank's stacks in {folder}/",
                    file=sys.stderr,
                    flush=True,
                )
            return folder

    def _folder(self, store, failure: bool) -> Path:
        """RUN/hang-<time>: the first rank to dump names it (the store) and the others follow. A failure's
        dumps (one per rank and run) share one folder; a signal's n-th dump goes where every rank's n-th
        signal dump goes, so a signal to one rank does not split the next failure's dumps."""
        name = "hang-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        if store is not None:
            n = "failure" if failure else store.add(f"{_KEY}/round/{self.dist.rank}", 1)
            name = store.compare_set(f"{_KEY}/dir/{n}", "", name).decode()
        folder = self.out_dir / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _reports(self, store, round_key: str) -> dict[int, int]:
        """The sequence numbers the ranks reported within grace_s (all of them, or those that could).

        A failure path, not a step: polling the store a few times a second costs nothing here."""
        keys = {r: f"{round_key}/seq/{r}" for r in range(self.dist.world_size)}
        deadline = time.monotonic() + self.grace_s
        while not store.check(list(keys.values())) and time.monotonic() < deadline:
            time.sleep(0.2)
        return {r: int(store.get(k)) for r, k in keys.items() if store.check([k])}
