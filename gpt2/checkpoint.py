"""Checkpoints: atomic writes, a `latest` pointer, retention, and validated loading.

Layout of RUN/checkpoints/:
    step_00001000.pt      torch.save of a plain dict (tensors and primitives only: weights_only loads)
    step_00001000.json    sidecar: step, size and sha256 of the .pt, run id; written after the .pt is complete
    latest                name of the newest complete checkpoint
A checkpoint counts only when its sidecar exists and its bytes match, so a process killed while
writing (or a truncated copy) is never selected: `auto` falls back to the previous one. And only
when it belongs to the directory's run (its run id, gpt2/rundir.py): retention and `auto` ignore,
with a warning, a checkpoint another run left here, and retention never deletes one.

Stop signals, RUN/requeue and exit codes: gpt2/preempt.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path

import torch

from gpt2.atomic import atomic_write, atomic_write_bytes, fsync_dir
from gpt2.rundir import ANY_RUN, directory_run_id

FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8,})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint cannot be used: missing, corrupt, or incompatible with this run."""


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


class _HashingWriter:
    """File wrapper that hashes what torch.save writes, so nothing is read back to checksum it."""

    def __init__(self, f) -> None:
        self.f, self.sha, self.size = f, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(out_dir: str | Path, step: int, state: dict, *, keep: int, run_id: str | None = None,
                    warn=warnings.warn) -> Path:
    """Write state as step_{step}.pt (temp file, fsync, rename), its sidecar, then `latest`.

    Called by rank 0 only (the single writer). run_id (gpt2/rundir.py) goes into the file and its
    sidecar; None writes a checkpoint without one, as before run ids. Then retention, among this
    run's checkpoints only: see prune_checkpoints.
    """
    ckdir = checkpoint_dir(out_dir)
    ckdir.mkdir(parents=True, exist_ok=True)
    for stale in ckdir.glob("*.tmp"):  # left by a writer that was killed; nobody else writes here
        stale.unlink(missing_ok=True)
    path = ckdir / f"step_{step:08d}.pt"
    with atomic_write(path) as f:
        writer = _HashingWriter(f)
        torch.save({**state, "format": FORMAT_VERSION, "step": step, **_run_id_field(run_id)}, writer)
    meta = {"step": step, "file": path.name, "bytes": writer.size, "sha256": writer.sha.hexdigest(),
            **_run_id_field(run_id)}
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta).encode())
    atomic_write_bytes(ckdir / "latest", (path.name + "\n").encode())
    fsync_dir(ckdir)
    prune_checkpoints(out_dir, path, keep=keep, run_id=run_id, warn=warn)
    return path


def _run_id_field(run_id: str | None) -> dict:
    """{"run_id": ...}, or {} for None: a run without an id writes exactly what was written before ids."""
    assert run_id != ANY_RUN, "ANY_RUN filters checkpoints; no checkpoint is written with it"
    return {} if run_id is None else {"run_id": run_id}


def read_sidecar(path: str | Path) -> dict:
    """The sidecar of checkpoint path (step, file, bytes, sha256, run_id): the one reader of the format.
    Raises OSError (FileNotFoundError when it is missing) or ValueError (not a JSON object)."""
    meta = json.loads(Path(path).with_suffix(".json").read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{Path(path).with_suffix('.json')} holds no JSON object")
    return meta


def sidecar(path: Path) -> dict | None:
    """path's sidecar as a dict, or None when it is missing or unreadable (an unfinished write)."""
    try:
        return read_sidecar(path)
    except (OSError, ValueError):
        return None


def file_sha256(path: str | Path) -> str:
    """The sha256 of a checkpoint file, read in 16 MiB chunks: the only place a checkpoint is hashed
    after it was written (tests count the passes)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            sha.update(chunk)
    return sha.hexdigest()


def run_id_of(meta: dict) -> str | None:
    """The run id a sidecar records; None for a checkpoint written before run ids."""
    return meta.get("run_id")


def belongs(path: Path, run_id: str | None) -> bool:
    """True if the checkpoint is run_id's (any checkpoint, for ANY_RUN). Without a readable sidecar its
    run is unknown: True, so it is treated as this run's unfinished write (never selected anyway)."""
    meta = sidecar(path)
    return run_id == ANY_RUN or meta is None or run_id_of(meta) == run_id


def stray_warning(path: Path, run_id: str | None) -> str:
    other = run_id_of(sidecar(path) or {})
    return (f"ignoring checkpoint {path}: it belongs to run {other or '(no run id)'}, not to this directory's "
            f"run {run_id or '(no run id)'}; move it out of {path.parent} if it is not wanted here")


def looks_complete(path: Path) -> bool:
    """Sidecar present and size matching: the cheap part of verify_checkpoint (no re-hashing)."""
    meta = sidecar(path)
    try:
        return meta is not None and meta.get("bytes") == path.stat().st_size
    except OSError:
        return False


def prune_checkpoints(out_dir: str | Path, newest: Path, *, keep: int, run_id: str | None = None,
                      warn=warnings.warn) -> list[Path]:
    """Keep `newest` and the keep-1 most recent complete checkpoints of earlier steps; delete the rest.

    Only run_id's checkpoints are considered: another run's are warned about and never deleted or
    counted (whatever their step). Incomplete ones (no sidecar, wrong size) never count towards
    `keep`, so a run of failed writes cannot push out the last good checkpoint. Checkpoints of later
    steps than `newest` (left by a run that was resumed from an earlier checkpoint) are not touched.
    Returns the deleted files.
    """
    step = int(_NAME.match(newest.name).group(1))
    kept, deleted = 1, []
    for old in list_checkpoints(out_dir):
        if old == newest:
            continue
        if not belongs(old, run_id):
            warn(stray_warning(old, run_id))
            continue
        if int(_NAME.match(old.name).group(1)) >= step:
            continue
        if kept < keep and looks_complete(old):
            kept += 1
            continue
        old.with_suffix(".json").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
        deleted.append(old)
    return deleted


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoint files in RUN/checkpoints, newest step first (valid or not)."""
    ckdir = checkpoint_dir(out_dir)
    if not ckdir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckdir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def verify_checkpoint(path: str | Path) -> None:
    """Raise CheckpointError unless path is complete and matches its sidecar's size and sha256."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    meta = sidecar(path)
    if meta is None:
        raise CheckpointError(f"{path}: its sidecar {path.with_suffix('.json').name} is missing or unreadable; "
                              "the write did not finish")
    size = path.stat().st_size
    if size != meta.get("bytes"):
        raise CheckpointError(f"{path}: {size} bytes but {meta.get('bytes')} were written; truncated")
    if file_sha256(path) != meta.get("sha256"):
        raise CheckpointError(f"{path}: sha256 does not match its sidecar; the file is corrupt")


def load_checkpoint(path: str | Path, *, verify: bool = True, mmap: bool = True) -> dict:
    """Load a checkpoint dict on the CPU (tensors and primitives only).

    mmap (the default): tensors are mapped from the file, copy-on-write, and read on first use, so
    processes on one host share the page cache instead of each holding a copy.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises several types for a damaged zip
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a checkpoint of this program (format {FORMAT_VERSION})")
    return state


_DIRECTORY_RUN = object()


def latest_valid(out_dir: str | Path, warn=warnings.warn, *, run_id=_DIRECTORY_RUN) -> Path | None:
    """The newest checkpoint of run_id (default: the directory's run, gpt2/rundir.py) that verifies,
    preferring the one `latest` names; bad ones and other runs' are warned about and skipped."""
    if run_id is _DIRECTORY_RUN:
        try:
            run_id = directory_run_id(out_dir)
        except ValueError as e:  # config.json unreadable: which checkpoints are this run's is unknown
            raise CheckpointError(str(e)) from None
    candidates = []
    for path in list_checkpoints(out_dir):
        if belongs(path, run_id):
            candidates.append(path)
        else:
            warn(stray_warning(path, run_id))
    pointer = checkpoint_dir(out_dir) / "latest"
    if pointer.is_file():
        named = checkpoint_dir(out_dir) / pointer.read_text().strip()
        if named in candidates:  # newest first anyway; the pointer only breaks ties with strays
            candidates.remove(named)
            candidates.insert(0, named)
    for path in candidates:
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as e:
            warn(f"skipping checkpoint: {e}")
    return None


def resolve_resume(resume: str, out_dir: str | Path, warn=warnings.warn, *, run_id=_DIRECTORY_RUN) -> Path | None:
    """--resume auto|never|PATH -> the checkpoint file to load, or None to start fresh.

    auto: the newest valid checkpoint of run_id (default: out_dir's run). A path named explicitly
    must be valid (CheckpointError otherwise); it may be a file (of any run) or a run directory (the
    newest valid checkpoint of that directory's run).
    """
    if resume == "never":
        return None
    if resume == "auto":
        return latest_valid(out_dir, warn, run_id=run_id)
    path = Path(resume)
    if path.is_dir():
        found = latest_valid(path if (path / "checkpoints").is_dir() else path.parent, warn)
        if found is None:
            raise CheckpointError(f"--resume {resume}: no valid checkpoint in that directory")
        return found
    if not path.exists():
        raise CheckpointError(f"--resume {resume}: no such checkpoint file; pass a step_*.pt that exists, a run "
                              "directory (its newest valid checkpoint), auto or never")
    verify_checkpoint(path)
    return path
