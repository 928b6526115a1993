"""Where a run begins, as values: the checkpoint every rank resumes from, or a fresh start. Decided by
gpt2/ckpt/resume.py (choose_start, rank 0's choice checked by every rank); kept here, below the planner,
because the start-up's record of its decisions (gpt2/plan/resolve.py Resolved) holds it beside the others.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint rank 0 chose: every rank loads exactly this file."""

    path: str
    step: int
    sha256: str
    bytes: int
    run_id: str | None = None
    """The run the checkpoint belongs to (its sidecar's run_id; None from before run ids)."""
    sidecar: bool = True
    """False: a .pt whose sidecar was lost, verified by rank 0 through its zip checksums and contents
    (gpt2/ckpt/checkpoint.py checkpoint_meta); the other ranks compare its size and hash instead."""


@dataclass(frozen=True)
class StartDecision:
    """How this run begins, the same on every rank (choose_start)."""

    point: ResumePoint | None
    """The checkpoint every rank loads; None: a fresh start at step 0."""
    run_id: str | None
    """The run RUN's records belong to from now on: a new id at a fresh start, the checkpoint's on a
    resume (None for a checkpoint from before run ids: the run goes on without one)."""
    set_aside: tuple[str, ...] = ()
    """RUN's records of another run (names in RUN), moved into RUN/previous-*/ before anything is written."""
    abandon: tuple[str, ...] = ()
    """--resume PATH of an earlier checkpoint of RUN's run: its later checkpoints there (names in
    RUN/checkpoints), a branch this run leaves, moved into RUN/checkpoints/abandoned-*/ before anything
    is written, so `auto` never returns to them."""
