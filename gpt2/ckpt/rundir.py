"""A run directory's records and the run they belong to: run ids, and moving an earlier run aside.

A run id names one training run from its fresh start through every resume: rank 0 makes one at a
fresh start, a resumed run inherits its checkpoint's. It is stored in RUN/config.json (`run_id`), in
every checkpoint and in its sidecar, so retention and `--resume auto` only ever see the checkpoints
of the directory's current run (gpt2/ckpt/checkpoint.py) and a stray one of another run is ignored.

Checkpoints and config.json written before run ids existed have none (None): such a directory
continues as a run without an id, and its checkpoints match it and only it.

A fresh start in a directory that holds an earlier run's records moves them into
RUN/previous-<UTC time>/ first (renames, never deletes), so the new run's metrics.jsonl, checkpoints
and curves never mix with the old one's (gpt2/ckpt/resume.py decides, rank 0 moves, every rank waits).

One run owns a run directory at a time: rank 0 takes RUN/run.lock (RunLock) before anything in RUN
is touched and removes it when the run ends, however it ends; a second start while it is held is
refused, naming the holder. A holder that died (kill -9, a lost node) leaves the lock behind, and
stale_reason decides when the next start may take it over.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from gpt2.core.atomic import fsync_dir
from gpt2.distributed.group import Dist, rank0_decides

RUN_INFO = "config.json"
"""RUN/config.json: the run's config, versions and hardware, and its run id (written by the trainer)."""

TRAIN_LOG = "train.log"
"""Every line rank 0 printed (the start-up's whole plan too, which the console shows only with --verbose)."""
RUN_RECORDS = ("checkpoints", "metrics.jsonl", TRAIN_LOG, "loss_curve.png", "tb", "wandb", "requeue", RUN_INFO)
"""Everything the trainer writes into RUN, in the order an earlier run's records are moved aside:
checkpoints first, so a start killed halfway through the move can never resume the earlier run from
what is left; config.json (which names the earlier run) last. Other files (an export in RUN/hf, a
user's notes, earlier previous-* folders) are not the trainer's and stay where they are."""

ANY_RUN = "*"
"""The run id of a directory without RUN/config.json (nothing recorded which run it holds, e.g. a
checkpoint copied into a new directory): every checkpoint in it counts. Never a real id."""

PREVIOUS_PREFIX = "previous-"


def new_run_id() -> str:
    """A fresh run's id: its UTC start time (readable in listings) and 32 random bits (unique)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(4)


def directory_run_id(out_dir: str | Path) -> str | None:
    """The run RUN's records belong to: config.json's run_id, None (a config.json from before run
    ids), or ANY_RUN (no config.json). ValueError, naming the fix, when config.json is unreadable."""
    path = Path(out_dir) / RUN_INFO
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return ANY_RUN
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} is unreadable ({type(e).__name__}: {e}), so which run {out_dir} holds is "
            "unknown: repair it, or move it away (every checkpoint then counts), or start fresh "
            "with --resume never (the earlier files are moved to previous-*/)"
        ) from None
    run_id = info.get("run_id") if isinstance(info, dict) else None
    if run_id is not None and not isinstance(run_id, str):
        raise ValueError(f"{path}: run_id {run_id!r} is not a string; repair it or start fresh with --resume never")
    return run_id


def records_present(out_dir: str | Path) -> tuple[str, ...]:
    """The trainer's records in RUN (names from RUN_RECORDS, in moving order) that exist now."""
    out = Path(out_dir)
    return tuple(name for name in RUN_RECORDS if os.path.lexists(out / name))


def move_aside(out_dir: str | Path, names: tuple[str, ...]) -> Path:
    """Rename RUN/<name> for each name into a new RUN/previous-<UTC time>/ and return that folder.

    Rank 0 only, with every other rank waiting (gpt2/ckpt/resume.py). Each rename is atomic and nothing
    is deleted; a start killed halfway leaves the rest in RUN, and the next fresh start moves that
    into a folder of its own. Raises OSError (e.g. no permission) with the folder's files so far kept.
    """
    out = Path(out_dir)
    dest = stamped_dir(out, PREVIOUS_PREFIX)
    for name in names:
        if os.path.lexists(out / name):  # the decision listed it; gone now only if a user moved it
            _move(out / name, dest)
    fsync_dir(dest)
    fsync_dir(out)
    return dest


def stamped_dir(parent: Path, prefix: str) -> Path:
    """A new, empty folder parent/<prefix><UTC time>; two within a second: ...T, ...T-2."""
    stamp = prefix + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = parent / stamp
    for n in range(1, 1000):
        try:
            dest.mkdir()
            return dest
        except FileExistsError:
            dest = parent / f"{stamp}-{n + 1}"
    raise FileExistsError(f"{parent}: too many {stamp}* folders")


def _move(src: Path, dest: Path) -> None:
    """src into dest/. A symlinked directory (RUN/checkpoints on a scratch filesystem) keeps its link,
    so the new run's files go to that storage too: its entries move into a folder of the same name
    inside it (a rename cannot cross filesystems), which dest/<name> links to."""
    if not (src.is_symlink() and src.is_dir()):
        os.rename(src, dest / src.name)
        return
    inner = src.resolve() / dest.name
    inner.mkdir()
    for entry in sorted(src.iterdir()):
        if not entry.name.startswith(PREVIOUS_PREFIX):  # earlier fresh starts' folders stay beside it
            os.rename(entry, inner / entry.name)
    fsync_dir(inner)
    fsync_dir(src.resolve())
    os.symlink(inner, dest / src.name)


# ------------------------------------------------------------------ one run per directory

LOCK = "run.lock"
"""RUN/run.lock: the run that owns RUN now (JSON: host, pid, start, nonce, launch); its mtime is the
holder's heartbeat. Rank 0 takes it before anything in RUN is touched and removes it at its exit."""

HEARTBEAT_S = 30.0
"""How often the holder refreshes the lock's mtime (a daemon thread, independent of step length)."""

STALE_AFTER_S = 300.0
"""A lock held from another host counts as abandoned once its heartbeat is this old: 10 missed
heartbeats, well past NFS attribute caching (acregmax, 60 s by default). The age is measured on the
filesystem's own clock (see RunLock.acquire), so clock skew between hosts does not enter."""

LAUNCH_VARS = (("SLURM_JOB_ID", "SLURM_RESTART_COUNT"), ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))
"""(launch id, restart count) pairs: a later restart of the same launch takes over (stale_reason)."""


class RunDirBusy(ValueError):
    """Another training run holds the run directory (a user error: exit 2, nothing touched)."""


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """When process pid started (clock ticks since boot, /proc/PID/stat field 22), -1 where there is no
    /proc but the pid exists (start unknown), or None when there is no such process: with the boot id
    and pid namespace, it tells a live holder from a new process that reuses its pid."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is not None:
        fields = stat.rsplit(")", 1)[-1].split()  # after "(comm)", which may hold spaces
        return None if fields[0] == "Z" else int(fields[19])  # a zombie has exited
    if os.path.isdir("/proc"):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # it exists, under another user
        pass
    return -1


def pid_space() -> str:
    """Where a pid means one process: this host's hostname, boot and pid namespace. Two processes see
    each other's pids only when their pid_space is equal (a rebooted node, or a container with its own
    pid namespace, is another space, judged by heartbeat)."""
    boot = _read("/proc/sys/kernel/random/boot_id") or ""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return f"{socket.gethostname()}/{boot}/{ns}"


def launch_of(env=None) -> dict:
    """This process's launch ids and restart counts (SLURM job, torchrun group): who may take over."""
    env = os.environ if env is None else env
    return {name: env[name] for pair in LAUNCH_VARS for name in pair if name in env}


def holder_record(env=None) -> dict:
    """What this process writes into the lock it takes."""
    pid = os.getpid()
    return {
        "host": socket.gethostname(),
        "pid": pid,
        "pid_start": process_start(pid),
        "pid_space": pid_space(),
        "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "nonce": secrets.token_hex(8),
        "launch": launch_of(env),
    }


def describe_holder(holder: dict | None) -> str:
    if not isinstance(holder, dict):
        return "an unreadable lock"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"


def stale_reason(holder: dict | None, *, age_s: float, me: dict, pid_start: int | None) -> str | None:
    """Why the run recorded in a lock no longer holds its directory, or None when it may still: a pure
    function of the lock's contents (holder; None when unreadable), its heartbeat's age on the
    filesystem's clock (age_s), the process asking (me: its holder_record) and the start time of the
    holder's pid as this process sees it now (pid_start: process_start, None when no such process).

      1. the same launch restarted: holder and me share a SLURM job id (or a torchrun run id) and
         my restart count is higher. SLURM starts a requeued job only after its earlier run ended
         (or its node was declared dead), and torchrun restarts a group only after stopping the old one.
      2. the same pid space (host, boot, pid namespace): the holder's process is gone, or its pid now
         belongs to a process started at another time. A live one holds the directory however old
         its heartbeat (a long stall is not a death).
      3. another host (or an unreadable lock): its heartbeat is older than STALE_AFTER_S.
    """
    if isinstance(holder, dict) and isinstance(holder.get("launch"), dict):
        theirs = holder["launch"]
        for job, count in LAUNCH_VARS:
            if job in me["launch"] and theirs.get(job) == me["launch"][job]:
                if _count(me["launch"], count) > _count(theirs, count):
                    return (
                        f"it is an earlier run of this launch ({job}={theirs[job]}, restart "
                        f"{_count(theirs, count)}; this is restart {_count(me['launch'], count)})"
                    )
    if isinstance(holder, dict) and holder.get("pid_space") == me["pid_space"]:
        if pid_start is None:
            return f"its process (pid {holder.get('pid')}) has exited"
        if pid_start != holder.get("pid_start") and -1 not in (pid_start, holder.get("pid_start")):
            return f"its pid {holder.get('pid')} now belongs to another process"
        return None
    if age_s > STALE_AFTER_S:
        return f"its heartbeat stopped {age_s:.0f} s ago (a live holder refreshes it every {HEARTBEAT_S:.0f} s)"
    return None


def live_holder(out_dir: str | Path, env=None) -> str | None:
    """The holder of RUN/run.lock (describe_holder) when a start now would be refused, else None;
    reads the lock and takes nothing (--dry-run). Unlike RunLock.acquire, which writes a file to read
    the filesystem's clock, the heartbeat's age is measured on this host's clock."""
    lock = Path(out_dir) / LOCK
    try:
        raw, mtime = lock.read_bytes(), lock.stat().st_mtime
    except FileNotFoundError:
        return None
    holder = _parse(raw)
    pid = holder.get("pid") if isinstance(holder, dict) else None
    reason = stale_reason(
        holder,
        age_s=time.time() - mtime,
        me=holder_record(env),
        pid_start=process_start(pid) if isinstance(pid, int) else None,
    )
    return describe_holder(holder) if reason is None else None


def _count(launch: dict, name: str) -> int:
    """A restart count: absent (a launch's first run) or not a number counts as 0."""
    try:
        return int(launch.get(name, 0))
    except (TypeError, ValueError):
        return 0


class RunLock:
    """RUN/run.lock, held by this process (rank 0) from acquire() to release(); a daemon thread
    refreshes its mtime every HEARTBEAT_S.

    Taken without flock, which NFS and Lustre do not always honour: the record is written and
    fsynced to a temp file, then hard-linked to RUN/run.lock. link() fails if the name exists,
    atomically, on NFS too (O_EXCL is not atomic on NFSv2); when its reply is lost, the temp file's
    link count says whether it happened (open(2)'s recipe). A stale lock is renamed away, then read
    back: only if it is still the one judged stale is it removed, else it is put back.
    """

    def __init__(self, path: Path, record: dict, taken_over: str | None) -> None:
        self.path, self.record, self.taken_over = path, record, taken_over
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="run-dir-heartbeat", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, out_dir: str | Path, env=None) -> RunLock:
        """Take RUN/run.lock, or raise RunDirBusy naming the live holder (RUN untouched). A stale one
        (stale_reason) is taken over; RunLock.taken_over then says whose and why."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        lock, me = out / LOCK, holder_record(env)
        tmp = out / f".{LOCK}.{me['nonce']}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, json.dumps(me).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        taken_over = None
        try:
            for _ in range(5):  # each pass: try to link; else judge the holder, remove it if stale
                if _link(tmp, lock):
                    fsync_dir(out)
                    return cls(lock, me, taken_over)
                os.utime(tmp)  # "now" on the filesystem's clock, the one the holder's heartbeat is on
                try:
                    raw, mtime = lock.read_bytes(), lock.stat().st_mtime
                except FileNotFoundError:  # released meanwhile: try again
                    continue
                holder = _parse(raw)
                pid = holder.get("pid") if isinstance(holder, dict) else None
                reason = stale_reason(
                    holder,
                    age_s=tmp.stat().st_mtime - mtime,
                    me=me,
                    pid_start=process_start(pid) if isinstance(pid, int) else None,
                )
                if reason is None:
                    raise RunDirBusy(
                        f"{out} is in use by another training run ({describe_holder(holder)}; {lock}): one run "
                        "owns a run directory at a time. Wait for it to end or stop it, or pass another --out-dir "
                        f"(a holder on another host that died is taken over once its heartbeat is "
                        f"{STALE_AFTER_S:.0f} s old; delete {lock} only if no run uses {out})"
                    )
                if _remove_if_unchanged(lock, raw, out / f".{LOCK}.stale.{me['nonce']}"):
                    taken_over = f"{describe_holder(holder)}: {reason}"
            raise RunDirBusy(f"{out}: could not take {lock}: other starts keep taking it; start one run at a time")
        finally:
            tmp.unlink(missing_ok=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # gone (deleted by hand) or the filesystem is away: the next beat tries again
                pass

    def release(self) -> None:
        """Stop the heartbeat and remove the lock, if it is still ours (never another run's). Never
        raises: it runs while an error of the run itself may be on its way out."""
        self._stop.set()
        self._thread.join()
        if (_parse(_read_bytes(self.path)) or {}).get("nonce") == self.record["nonce"]:
            try:
                self.path.unlink(missing_ok=True)
                fsync_dir(self.path.parent)
            except OSError:  # RUN turned read-only (or went away) under the run: the lock stays, its
                pass  # holder (this process) is about to exit, and the next start takes it over (stale_reason)


def _read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def _parse(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _link(tmp: Path, lock: Path) -> bool:
    """Hard-link tmp to lock: True if that made lock ours, False if lock existed."""
    try:
        os.link(tmp, lock)
        return True
    except FileExistsError:
        return False
    except OSError:
        if tmp.stat().st_nlink == 2:  # NFS: the link was made, its reply lost
            return True
        raise


def _remove_if_unchanged(lock: Path, raw: bytes, aside: Path) -> bool:
    """Remove lock if it still holds raw (the stale holder judged); True if removed. Renamed first,
    so another start cannot slip a fresh lock in between the check and the removal."""
    try:
        os.rename(lock, aside)
    except FileNotFoundError:
        return False
    if _read_bytes(aside) == raw:
        aside.unlink()
        return True
    try:  # a fresh lock taken after we read the stale one: give it back
        os.link(aside, lock)
    except FileExistsError:
        pass
    aside.unlink()
    return False


@contextlib.contextmanager
def own_run_dir(out_dir: str | Path, dist: Dist, info=print):
    """Hold RUN/run.lock (gpt2/ckpt/rundir.py) for the block, on rank 0, and release it however the block
    ends. Rank 0 takes it before anything in RUN is touched; every rank takes its answer from the
    broadcast, so a refusal (RunDirBusy, exit 2) is every rank's and none trains into a held directory.
    Held by one process, so --dry-run (which never enters the block) and the other ranks take nothing."""
    held: list[RunLock] = []  # rank 0's, once taken

    def take() -> str | None:
        try:
            held.append(RunLock.acquire(out_dir))
        except RunDirBusy:
            raise
        except (ValueError, OSError) as e:
            raise RunDirBusy(
                f"cannot take {Path(out_dir) / LOCK} ({type(e).__name__}: {e}); check --out-dir and its permissions"
            ) from None
        return held[0].taken_over

    try:  # from here the lock, if taken, is released whatever fails (the broadcast too)
        taken_over = rank0_decides(take, dist, errors=(RunDirBusy,))
        if taken_over is not None and dist.is_main:
            info(f"run dir    took over {out_dir} from {taken_over}")
        yield
    finally:
        if held:
            held[0].release()
