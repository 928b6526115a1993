"""Which checkpoint a run resumes from, decided once for every rank.

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

Every step is a collective that every rank reaches, even when it failed locally: one rank raising
alone would leave the others waiting in the next collective until the timeout.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from gpt2 import checkpoint as ckpt
from gpt2.dist import Dist, all_gather_object, broadcast_object

SHARED_DIR_HINT = ("Every rank must see the same run directory: put --out-dir on a filesystem every node "
                   "mounts (README: \"Several nodes\"), or start fresh with --resume never")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint rank 0 chose: every rank loads exactly this file."""
    path: str
    step: int
    sha256: str
    bytes: int


def _sidecar(path: Path) -> dict:
    return json.loads(path.with_suffix(".json").read_text())


def _point(path: Path) -> ResumePoint:
    meta = _sidecar(path)
    return ResumePoint(str(path), int(meta["step"]), meta["sha256"], int(meta["bytes"]))


def newest_seen(out_dir: str | Path) -> str | None:
    """Name of the newest checkpoint here that looks complete (sidecar and size; no hashing)."""
    return next((p.name for p in ckpt.list_checkpoints(out_dir) if ckpt.looks_complete(p)), None)


def check_visible(point: ResumePoint, *, rehash: bool) -> str | None:
    """None if this process can use `point`'s file, else what is wrong with it here."""
    path = Path(point.path)
    try:
        size = path.stat().st_size
        meta = _sidecar(path)
    except FileNotFoundError as e:
        return f"cannot see {e.filename}"
    except (OSError, ValueError) as e:
        return f"cannot read {path} or its sidecar ({type(e).__name__}: {e})"
    if meta.get("sha256") != point.sha256 or size != point.bytes:
        return (f"sees a different {path.name} (sha256 {str(meta.get('sha256'))[:12]}..., {size} bytes; "
                f"rank 0's: {point.sha256[:12]}..., {point.bytes} bytes)")
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


def choose_resume(resume: str, out_dir: str | Path, dist: Dist, warn) -> ResumePoint | None:
    """--resume auto|never|PATH -> the checkpoint every rank loads, or None (all start fresh).

    Raises the same CheckpointError on every rank when rank 0's choice is not usable everywhere.
    """
    host = socket.gethostname()
    decision = None
    if dist.is_main:
        try:
            path = ckpt.resolve_resume(resume, out_dir, warn=warn)  # verifies the sha256 of what it picks
            decision = ("ok", None if path is None else _point(path), newest_seen(out_dir), host)
        except (ckpt.CheckpointError, OSError, ValueError) as e:
            decision = ("error", f"--resume {resume}: {e}" if not isinstance(e, ckpt.CheckpointError) else str(e),
                        None, host)
    kind, point, rank0_newest, rank0_host = broadcast_object(decision, dist)
    if kind == "error":
        raise ckpt.CheckpointError(point)
    if not dist.is_distributed:
        return point

    problem = None
    if point is not None:  # rank 0 has hashed it; the first rank of every other node hashes it once
        problem = check_visible(point, rehash=dist.local_rank == 0 and not dist.is_main)
    if problem is None and resume == "auto" and not dist.is_main:
        seen = newest_seen(out_dir)
        if seen != rank0_newest:
            problem = (f"sees {seen or 'no checkpoint'} as the newest in {out_dir}, rank 0 sees "
                       f"{rank0_newest or 'none'}")
    chosen = (f"rank 0 on {rank0_host} chose {point.path} (step {point.step}) to resume from"
              if point is not None else f"rank 0 on {rank0_host} found no checkpoint in {out_dir} and would start fresh")
    _raise_problems(all_gather_object((dist.rank, host, problem), dist), chosen)
    return point


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
