"""How a run begins, decided once for every rank: which checkpoint it resumes from, or a fresh start
(with the run id it records and the earlier run's files it moves aside first).

With several nodes the global rank 0 (the only writer) can land on any node, and a run directory
that is node-local, or a shared filesystem that shows one node an older `latest`, would let ranks
resume from different steps. DDP copies rank 0's weights, so nothing would fail loudly: optimizer
moments, lr and data position would differ, and ranks would run different numbers of steps. So:

  1. rank 0 resolves --resume (hashing the file it picks) and broadcasts path, step and sha256;
  2. every rank checks that it sees that file with that sha256 in its sidecar: the first rank of
     each node re-hashes it (once per node, not once per rank), the others compare size and
     sidecar; under --resume auto every rank also reports the newest checkpoint it sees itself;
  3. any problem on any rank becomes the same CheckpointError on every rank, naming the host,
     before anything is trained.
After loading, `agree_on_step` checks that every rank holds the same step.

A fresh start in a directory that holds another run's records (gpt2/ckpt/rundir.py) moves them into
RUN/previous-<UTC time>/ (`set_aside_earlier_run`): rank 0 renames them after every rank has
finished reading the directory for the decision, and every rank waits for the renames before
anything is written, so the new run's records never mix with the old one's. Likewise a resume of an
explicit, earlier checkpoint of RUN's own run (a rollback past a loss spike) moves that run's later
checkpoints into RUN/checkpoints/abandoned-*/ (`set_aside_abandoned`): else a requeue with --resume
auto would take the newest, of the branch the rollback left.

A resumed run keeps its own `auto` decisions (KEPT_ON_RESUME, `keep_decisions`): the precision, micro-batch,
loss path and activation checkpointing its RUN/config.json records, so it continues bit for bit.

Every step is a collective that every rank reaches, even when it failed locally: one rank raising
alone would leave the others waiting in the next collective until the timeout.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt import rundir
from gpt2.core.atomic import atomic_write_bytes
from gpt2.core.config import TrainConfig, train_values
from gpt2.core.start_point import ResumePoint, StartDecision
from gpt2.distributed.group import Dist, all_gather_object, rank0_decides

SHARED_DIR_HINT = (
    "Every rank must see the same run directory: put --out-dir on a filesystem every node "
    "mounts (docs/multinode.md), or start fresh with --resume never"
)


def _point(path: Path) -> ResumePoint:
    meta = ckpt.checkpoint_meta(path)  # its sidecar, or the verified fields of a .pt that lost it
    return ResumePoint(
        str(path),
        int(meta["step"]),
        meta["sha256"],
        int(meta["bytes"]),
        ckpt.run_id_of(meta),
        sidecar=ckpt.sidecar(path) is not None,
    )


def newest_seen(out_dir: str | Path, run_id: str | None = rundir.ANY_RUN) -> str | None:
    """Name of run_id's newest checkpoint here that looks complete (sidecar and size; no hashing)."""
    return next(
        (p.name for p in ckpt.list_checkpoints(out_dir) if ckpt.belongs(p, run_id) and ckpt.looks_complete(p)), None
    )


def check_visible(point: ResumePoint, *, rehash: bool) -> str | None:
    """None if this process can use `point`'s file, else what is wrong with it here."""
    path = Path(point.path)
    if not point.sidecar:  # a .pt that lost its sidecar: its size here, and its bytes where rehash
        try:
            size = path.stat().st_size
            same = size == point.bytes and (not rehash or ckpt.file_sha256(path) == point.sha256)
        except OSError as e:
            return f"cannot read {path} ({type(e).__name__}: {e})"
        return None if same else f"sees a different {path.name} ({size} bytes; rank 0's: {point.bytes} bytes)"
    try:
        meta = ckpt.read_sidecar(path)
        size = ckpt.checkpoint_size(path)  # a sharded checkpoint: the files its sidecar lists
    except FileNotFoundError as e:
        return f"cannot see {e.filename}"
    except (OSError, ValueError) as e:
        return f"cannot read {path} or its sidecar ({type(e).__name__}: {e})"
    if meta.get("sha256") != point.sha256 or size != point.bytes:
        return (
            f"sees a different {path.name} (sha256 {str(meta.get('sha256'))[:12]}..., {size} bytes; "
            f"rank 0's: {point.sha256[:12]}..., {point.bytes} bytes)"
        )
    if rehash:
        try:
            ckpt.verify_checkpoint(path)
        except ckpt.CheckpointError as e:
            return str(e)
    return None


def _raise_problems(reports: list[tuple], what: str) -> None:
    bad = [(rank, host, problem) for rank, host, problem in reports if problem]
    if bad:
        listed = "; ".join(f"rank {rank} on {host}: {problem}" for rank, host, problem in bad[:4])
        more = f" (and {len(bad) - 4} more ranks)" if len(bad) > 4 else ""
        raise ckpt.CheckpointError(f"{what}, but {listed}{more}. {SHARED_DIR_HINT}")


def _decide(resume: str, out_dir: str | Path, warn) -> tuple[StartDecision, str | None]:
    """Rank 0's decision (reads the directory, writes nothing), and the run id whose checkpoints
    count in out_dir (rundir.ANY_RUN where nothing records it)."""
    out = Path(out_dir)
    counted = rundir.ANY_RUN if resume == "never" else rundir.directory_run_id(out)
    path = ckpt.resolve_resume(resume, out, warn=warn, run_id=counted)  # verifies the sha256 of what it picks
    if path is None:  # everything of an earlier run goes aside, whatever its id: a fresh start shares nothing
        return StartDecision(None, rundir.new_run_id(), rundir.records_present(out)), counted
    point = _point(path)
    if counted in (rundir.ANY_RUN, point.run_id):  # RUN's own run (or nothing recorded): it continues
        explicit = resume != "auto" and ckpt.is_checkpoint(resume)  # a run directory, like auto, takes the newest
        abandon = ckpt.later_checkpoints(out, point.step, point.run_id) if explicit else ()
        return StartDecision(point, point.run_id, abandon=abandon), counted
    # --resume PATH of another run into a directory that holds its own: the directory becomes the
    # resumed run's, and its earlier records go aside as at a fresh start.
    if out.resolve() in path.resolve().parents:
        raise ckpt.CheckpointError(
            f"--resume {resume}: {path} belongs to run {point.run_id or '(no run id)'}, but {out} holds run "
            f"{counted or '(no run id)'} (its {rundir.RUN_INFO}); copy the checkpoint and its .json sidecar to a "
            "new --out-dir and resume there"
        )
    return StartDecision(point, point.run_id, rundir.records_present(out)), counted


def choose_start(resume: str, out_dir: str | Path, dist: Dist, warn) -> StartDecision:
    """--resume auto|never|PATH -> how every rank begins: the checkpoint to load (or a fresh start),
    the run id, and which earlier records rank 0 moves aside (set_aside_earlier_run does that).

    Reads only, so a one-process Dist may call it to report what a run would do. Raises the same
    CheckpointError on every rank when rank 0's choice is not usable everywhere.
    """
    host = socket.gethostname()

    def decide() -> tuple[StartDecision, str | None, str, str | None]:
        try:
            start, counted = _decide(resume, out_dir, warn)
            return start, newest_seen(out_dir, counted), host, counted
        except (OSError, ValueError) as e:
            if isinstance(e, ckpt.CheckpointError):
                raise
            raise ckpt.CheckpointError(f"--resume {resume}: {e}") from None

    start, rank0_newest, rank0_host, counted = rank0_decides(decide, dist, errors=(ckpt.CheckpointError,))
    if not dist.is_distributed:
        return start
    point = start.point

    problem = None
    if point is not None:  # rank 0 has hashed it; the first rank of every other node hashes it once
        problem = check_visible(point, rehash=dist.local_rank == 0 and not dist.is_main)
    if problem is None and resume == "auto" and not dist.is_main:
        seen = newest_seen(out_dir, counted)
        if seen != rank0_newest:
            problem = f"sees {seen or 'no checkpoint'} as the newest in {out_dir}, rank 0 sees {rank0_newest or 'none'}"
    chosen = (
        f"rank 0 on {rank0_host} chose {point.path} (step {point.step}) to resume from"
        if point is not None
        else f"rank 0 on {rank0_host} found no checkpoint in {out_dir} and would start fresh"
    )
    _raise_problems(all_gather_object((dist.rank, host, problem), dist), chosen)
    return start


def choose_resume(resume: str, out_dir: str | Path, dist: Dist, warn) -> ResumePoint | None:
    """The checkpoint every rank loads, or None (all start fresh): choose_start's point."""
    return choose_start(resume, out_dir, dist, warn).point


def set_aside_earlier_run(start: StartDecision, out_dir: str | Path, dist: Dist) -> Path | None:
    """Rank 0 moves start.set_aside into RUN/previous-<UTC time>/ (returned on rank 0); every rank waits.

    Called after choose_start, whose closing collective means no rank still reads the directory,
    and before anything is written into it. The gather below is the barrier that holds every rank
    until the renames are done, and it carries rank 0's failure to every rank (one rank raising
    alone would leave the others waiting in their next collective).
    """
    if not start.set_aside:
        return None
    return _rank0_moves(
        lambda: rundir.move_aside(out_dir, start.set_aside),
        dist,
        f"cannot move the earlier run's {', '.join(start.set_aside)} in {out_dir} into a "
        f"{rundir.PREVIOUS_PREFIX}* folder",
    )


def set_aside_abandoned(start: StartDecision, out_dir: str | Path, dist: Dist) -> Path | None:
    """Rank 0 moves start.abandon (the resumed run's checkpoints past start.point) into
    RUN/checkpoints/abandoned-<step>-<UTC time>/ (returned on rank 0) and copies RUN/metrics.jsonl
    there whole, the abandoned branch's log (restore then cuts RUN's back to the resumed step); every
    rank waits. Called where set_aside_earlier_run is, for the same reasons."""
    if not start.abandon:
        return None

    def move() -> Path:
        dest = ckpt.abandon_checkpoints(out_dir, start.abandon, start.point.step)
        log = Path(out_dir) / "metrics.jsonl"
        if log.is_file():
            atomic_write_bytes(dest / log.name, log.read_bytes())
        return dest

    return _rank0_moves(
        move,
        dist,
        f"cannot move {', '.join(start.abandon)} in {ckpt.checkpoint_dir(out_dir)} "
        f"into an {ckpt.ABANDONED_PREFIX}* folder",
    )


def restore_sidecar(start: StartDecision, out_dir: str | Path, dist: Dist) -> Path | None:
    """Rank 0 writes the sidecar of the resumed checkpoint again when it was lost (start.point.sidecar
    False) and the checkpoint is in this run directory: retention counts only checkpoints with one,
    and would otherwise delete it at the next save. Returns the sidecar written; a failure to write
    it changes nothing else (the resume goes on)."""
    point = start.point
    if not dist.is_main or point is None or point.sidecar:
        return None
    path = Path(point.path)
    if path.parent.resolve() != ckpt.checkpoint_dir(out_dir).resolve():
        return None
    return ckpt.write_sidecar(
        path,
        {
            "step": point.step,
            "file": path.name,
            "bytes": point.bytes,
            "sha256": point.sha256,
            **({} if point.run_id is None else {"run_id": point.run_id}),
        },
    )


def _rank0_moves(move, dist: Dist, failure: str) -> Path | None:
    """move() on rank 0 (its result returned there); the gather holds every rank until it is done and
    carries rank 0's failure to every rank (one rank raising alone would leave the others waiting in
    their next collective)."""
    dest, problem = None, None
    if dist.is_main:
        try:
            dest = move()
        except OSError as e:
            problem = (
                f"{failure} ({type(e).__name__}: {e}); nothing was deleted. Fix the directory's "
                "permissions, or pass another --out-dir"
            )
    reports = all_gather_object(problem, dist)
    if any(reports):
        raise ckpt.CheckpointError(next(p for p in reports if p))
    return dest


def agree_on_step(step: int, problem: str | None, dist: Dist) -> None:
    """After loading: every rank holds the same step, and none failed to load; else the same error everywhere.

    A problem every rank shares (another model shape, say) is raised as it is; one that only some
    ranks have points at the run directory.
    """
    reports = all_gather_object((dist.rank, socket.gethostname(), problem, step), dist)
    problems = {p for _, _, p, _ in reports}
    if len(problems) == 1 and problem is not None:
        raise ckpt.CheckpointError(problem)
    _raise_problems([(r, h, p) for r, h, p, _ in reports], "resuming failed on some ranks")
    steps = {s for *_, s in reports}
    if len(steps) > 1:
        by_step = ", ".join(f"rank {r} on {h}: step {s}" for r, h, _, s in reports)
        raise ckpt.CheckpointError(f"ranks resumed at different steps ({by_step}). {SHARED_DIR_HINT}")


KEPT_ON_RESUME = ("dtype", "activation_checkpointing", "micro_batch_size", "loss_impl")
"""--FLAG auto decisions a resumed run takes from the run it continues instead of deciding afresh: a
timing probe or a free-memory reading can decide otherwise on a busy machine, and another loss path or
precision changes the numbers (the resume would not continue bit for bit)."""


def keep_decisions(tc: TrainConfig, start: StartDecision, dist: Dist, say) -> TrainConfig:
    """tc with each KEPT_ON_RESUME field left at auto set to the value the continued run decided (its
    RUN/config.json, of the same run id, on as many ranks), each said in one line by say (the log's info);
    a flag given now wins."""
    kept = {}
    if start.point is not None:
        info = Path(tc.ckpt.out_dir) / rundir.RUN_INFO
        kept = rank0_decides(lambda: decided_before(info, start.run_id, dist.world_size), dist) or {}
    now = tc.flat()
    changes = {k: v for k, v in kept.items() if now[k] == "auto" and v != "auto"}
    for k, v in changes.items():
        flag = "--" + k.replace("_", "-")
        say(f"resume: {flag} auto keeps {v!r}, the run's own choice (pass {flag} to decide otherwise)")
    return tc.replace(**changes) if changes else tc


def decided_before(info_path: Path, run_id: str | None, world_size: int) -> dict | None:
    """KEPT_ON_RESUME's values in the continued run's config.json, or None: no such file, another run's,
    unreadable, or another world size (the micro-batch and memory were decided per rank)."""
    try:
        info = json.loads(info_path.read_text())
        train = train_values(info["config"]["train"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if info.get("run_id") != run_id or info.get("world_size") != world_size:
        return None
    return {k: train[k] for k in KEPT_ON_RESUME if k in train}
