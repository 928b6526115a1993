"""Room on the disk for a run's checkpoints, read before its first step: a full disk was said only when the
first save failed, steps in. The start-up (gpt2/train/startup.py check_this_machine) calls check_disk."""

from __future__ import annotations

import shutil

from gpt2.ckpt.checkpoint import belongs, checkpoint_dir, list_checkpoints
from gpt2.core.config import TrainConfig
from gpt2.core.start_point import StartDecision
from gpt2.distributed.group import Dist, rank0_decides


def check_disk(tc: TrainConfig, start: StartDecision, size: int, dist: Dist, warn) -> None:
    """The free space where RUN/checkpoints is (or will be) against size, the plan's bytes of one checkpoint
    (gpt2/plan/budget.py checkpoint_bytes), read by rank 0 before the first step. Not enough for one
    checkpoint is refused (every rank raises alike); enough for one but not for the most this run holds
    at once (--keep-checkpoints, and the new one written before the oldest is deleted) is one warning, to warn
    (the log's)."""

    def verdict() -> tuple[str | None, str | None]:
        ckdir = checkpoint_dir(tc.ckpt.out_dir)
        existing = next(p for p in (ckdir, *ckdir.parents) if p.exists())  # the file system it will be on
        held = 0  # this run's checkpoints already on the disk, which retention replaces rather than adds to
        if start.point is not None and not start.set_aside:
            held = sum(
                1 for c in list_checkpoints(tc.ckpt.out_dir) if c.name not in start.abandon and belongs(c, start.run_id)
            )
        return disk_verdict(
            tc.ckpt.out_dir,
            free=shutil.disk_usage(existing).free,
            size=size,
            keep=tc.ckpt.keep_checkpoints,
            saves=saves_of(tc, 0 if start.point is None else start.point.step),
            held=held,
        )

    problem, warning = rank0_decides(verdict, dist)
    if problem is not None:
        raise ValueError(problem)
    if warning is not None:
        warn(warning)


def saves_of(tc: TrainConfig, step: int) -> int:
    """Checkpoints a run from step to --max-steps writes: one every --ckpt-interval steps, and the final one."""
    end, every = tc.schedule.max_steps, tc.ckpt.ckpt_interval
    if step >= end:
        return 0
    if not every:
        return 1
    return end // every - step // every + (1 if end % every else 0)


def disk_verdict(
    out_dir: str, *, free: int, size: int, keep: int, saves: int, held: int
) -> tuple[str | None, str | None]:
    """(refusal, warning) for a run that writes `saves` checkpoints of ~size bytes into out_dir with `free`
    bytes free and `held` of its own there: a refusal when one does not fit, a warning when the most it adds
    at once does not (each save writes the new checkpoint, then deletes those past --keep-checkpoints)."""
    if not saves:
        return None, None
    need = f"a checkpoint of this model and optimizer is ~{_mb(size)}"
    if free < size:
        return (
            f"--out-dir {out_dir}: {_mb(free)} free on its disk, and {need}: the first save would fail; free "
            "disk space, or pass an --out-dir on a disk with room (--ckpt-interval 0 still writes the final one)"
        ), None
    more = max(1, min(keep + 1 - held, saves))
    if free >= more * size:
        return None, None
    fits = free // size
    fewer = f"--keep-checkpoints {fits - 1}, " if fits > 1 else ""
    return None, (
        f"--out-dir {out_dir}: {_mb(free)} free on its disk holds {fits} checkpoint(s) and {need}; with "
        f"--keep-checkpoints {keep} this run adds up to {more} at once ({_mb(more * size)}; a new one is written "
        f"before the oldest is deleted), so a later save will fail: free disk space, or pass {fewer}"
        "--ckpt-interval 0 (the final checkpoint only) or an --out-dir on a disk with room"
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"
