"""A run directory's records and the run they belong to: run ids, and moving an earlier run aside.

A run id names one training run from its fresh start through every resume: rank 0 makes one at a
fresh start, a resumed run inherits its checkpoint's. It is stored in RUN/config.json (`run_id`), in
every checkpoint and in its sidecar, so retention and `--resume auto` only ever see the checkpoints
of the directory's current run (gpt2/checkpoint.py) and a stray one of another run is ignored.

Checkpoints and config.json written before run ids existed have none (None): such a directory
continues as a run without an id, and its checkpoints match it and only it.

A fresh start in a directory that holds an earlier run's records moves them into
RUN/previous-<UTC time>/ first (renames, never deletes), so the new run's metrics.jsonl, checkpoints
and curves never mix with the old one's (gpt2/resume.py decides, rank 0 moves, every rank waits).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path

from gpt2.atomic import fsync_dir

RUN_INFO = "config.json"
"""RUN/config.json: the run's config, versions and hardware, and its run id (written by the trainer)."""

RUN_RECORDS = ("checkpoints", "metrics.jsonl", "loss_curve.png", "tb", "wandb", "requeue", RUN_INFO)
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
        raise ValueError(f"{path} is unreadable ({type(e).__name__}: {e}), so which run {out_dir} holds is "
                         "unknown: repair it, or move it away (every checkpoint then counts), or start fresh "
                         "with --resume never (the earlier files are moved to previous-*/)") from None
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

    Rank 0 only, with every other rank waiting (gpt2/resume.py). Each rename is atomic and nothing
    is deleted; a start killed halfway leaves the rest in RUN, and the next fresh start moves that
    into a folder of its own. Raises OSError (e.g. no permission) with the folder's files so far kept.
    """
    out = Path(out_dir)
    stamp = PREVIOUS_PREFIX + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = out / stamp
    for n in range(1, 1000):  # two fresh starts within a second: previous-T, previous-T-2
        try:
            dest.mkdir()
            break
        except FileExistsError:
            dest = out / f"{stamp}-{n + 1}"
    else:
        raise FileExistsError(f"{out}: too many {stamp}* folders")
    for name in names:
        if os.path.lexists(out / name):  # the decision listed it; gone now only if a user moved it
            _move(out / name, dest)
    fsync_dir(dest)
    fsync_dir(out)
    return dest


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
