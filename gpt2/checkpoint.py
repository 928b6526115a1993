"""Checkpoints: atomic writes, a `latest` pointer, retention, and validated loading.

Layout of RUN/checkpoints/:
    step_00001000.pt      torch.save of a plain dict (tensors and primitives only: weights_only loads)
    step_00001000.json    sidecar: step, size and sha256 of the .pt; written after the .pt is complete
    latest                name of the newest complete checkpoint
A checkpoint counts only when its sidecar exists and its bytes match, so a process killed while
writing (or a truncated copy) is never selected: `auto` falls back to the previous one.

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


def save_checkpoint(out_dir: str | Path, step: int, state: dict, *, keep: int) -> Path:
    """Write state as step_{step}.pt (temp file, fsync, rename), its sidecar, then `latest`.

    Called by rank 0 only (the single writer). Then retention: see prune_checkpoints.
    """
    ckdir = checkpoint_dir(out_dir)
    ckdir.mkdir(parents=True, exist_ok=True)
    for stale in ckdir.glob("*.tmp"):  # left by a writer that was killed; nobody else writes here
        stale.unlink(missing_ok=True)
    path = ckdir / f"step_{step:08d}.pt"
    with atomic_write(path) as f:
        writer = _HashingWriter(f)
        torch.save({**state, "format": FORMAT_VERSION, "step": step}, writer)
    meta = {"step": step, "file": path.name, "bytes": writer.size, "sha256": writer.sha.hexdigest()}
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta).encode())
    atomic_write_bytes(ckdir / "latest", (path.name + "\n").encode())
    fsync_dir(ckdir)
    prune_checkpoints(out_dir, path, keep=keep)
    return path


def looks_complete(path: Path) -> bool:
    """Sidecar present and size matching: the cheap part of verify_checkpoint (no re-hashing)."""
    try:
        return json.loads(path.with_suffix(".json").read_text()).get("bytes") == path.stat().st_size
    except (OSError, ValueError):
        return False


def prune_checkpoints(out_dir: str | Path, newest: Path, *, keep: int) -> list[Path]:
    """Keep `newest` and the keep-1 most recent complete checkpoints of earlier steps; delete the rest.

    Incomplete ones (no sidecar, wrong size) never count towards `keep`, so a run of failed writes
    cannot push out the last good checkpoint. Checkpoints of later steps than `newest` (left by a run
    that was resumed from an earlier checkpoint) are not touched. Returns the deleted files.
    """
    step = int(_NAME.match(newest.name).group(1))
    kept, deleted = 1, []
    for old in list_checkpoints(out_dir):
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
    meta_path = path.with_suffix(".json")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        raise CheckpointError(f"{path}: its sidecar {meta_path.name} is missing or unreadable; the write "
                              "did not finish") from None
    size = path.stat().st_size
    if size != meta.get("bytes"):
        raise CheckpointError(f"{path}: {size} bytes but {meta.get('bytes')} were written; truncated")
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            sha.update(chunk)
    if sha.hexdigest() != meta.get("sha256"):
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


def latest_valid(out_dir: str | Path, warn=warnings.warn) -> Path | None:
    """The newest checkpoint that verifies, preferring the one `latest` names; bad ones are warned about."""
    candidates = list_checkpoints(out_dir)
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


def resolve_resume(resume: str, out_dir: str | Path, warn=warnings.warn) -> Path | None:
    """--resume auto|never|PATH -> the checkpoint file to load, or None to start fresh.

    A path named explicitly must be valid (CheckpointError otherwise); it may be a file or a run
    directory (its newest valid checkpoint).
    """
    if resume == "never":
        return None
    if resume == "auto":
        return latest_valid(out_dir, warn)
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
