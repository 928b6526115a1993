"""Checkpoints: atomic writes, a `latest` pointer, retention, and validated loading.

Layout of RUN/checkpoints/:
    step_00001000.pt      torch.save of a plain dict (tensors and primitives only: weights_only loads)
    step_00001000.json    sidecar: step, size and sha256 of the .pt, run id; written after the .pt is complete
    latest                name of the newest complete checkpoint (a hint: --resume auto goes by step)
    step_00002000/        a sharded checkpoint (--parallel fsdp; torch.distributed.checkpoint, gpt2/ckpt/dcp.py):
        __<rank>_0.distcp     each rank's shards of the model and optimizer, written by that rank
        .metadata             DCP's index of the shards (rank 0)
        train.pt              rank 0: config, step, loader, every rank's RNG, scaler (no weights)
    step_00002000.json    its sidecar: bytes and sha256 of every file in the directory (and of them all)
    abandoned-00001000-<UTC time>/   checkpoints past step 1000 that a resume from step 1000 left
                          behind (--resume PATH of an earlier one), with their sidecars: never resumed
A sharded checkpoint is written as step_*.tmp/, every rank's files fsynced and hashed by that rank,
renamed when all are done, and only then given its sidecar: the same rule as a file's.
A checkpoint counts only when its sidecar exists and its bytes match, so a process killed while
writing (or a truncated copy) is never selected: `auto` falls back to the previous one. And only
when it belongs to the directory's run (its run id, gpt2/ckpt/rundir.py): retention and `auto` ignore,
with a warning, a checkpoint another run left here, and retention never deletes one.

Stop signals, RUN/requeue and exit codes: gpt2/distributed/preempt.py.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import warnings
import zipfile
from pathlib import Path

import torch

from gpt2.ckpt.rundir import ANY_RUN, directory_run_id, stamped_dir
from gpt2.core.atomic import atomic_write, atomic_write_bytes, fsync_dir

FORMAT_VERSION = 1
_NAME = re.compile(r"^step_(\d{8,})(\.pt)?$")
TRAIN_FILE = "train.pt"
"""In a sharded checkpoint's directory: what rank 0 alone saves (everything but model and optimizer)."""
ZIP_MAGIC = b"PK\x03\x04"
"""The first bytes of every file torch.save writes (a zip archive): anything else is not a checkpoint."""


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


def save_checkpoint(
    out_dir: str | Path, step: int, state: dict, *, keep: int, run_id: str | None = None, warn=warnings.warn
) -> Path:
    """Write state as step_{step}.pt (temp file, fsync, rename), its sidecar, then `latest`.

    Called by rank 0 only (the single writer). run_id (gpt2/ckpt/rundir.py) goes into the file and its
    sidecar; None writes a checkpoint without one, as before run ids. Then retention, among this
    run's checkpoints only: see prune_checkpoints.
    """
    ckdir = checkpoint_dir(out_dir)
    ckdir.mkdir(parents=True, exist_ok=True)
    remove_stale(ckdir)
    path = ckdir / f"step_{step:08d}.pt"
    _remove(path.with_suffix(""))  # a sharded checkpoint of this step would share the sidecar's name
    with atomic_write(path) as f:
        writer = _HashingWriter(f)
        torch.save({**state, "format": FORMAT_VERSION, "step": step, **_run_id_field(run_id)}, writer)
    write_sidecar(
        path,
        {
            "step": step,
            "file": path.name,
            "bytes": writer.size,
            "sha256": writer.sha.hexdigest(),
            **_run_id_field(run_id),
        },
    )
    atomic_write_bytes(ckdir / "latest", (path.name + "\n").encode())
    fsync_dir(ckdir)
    prune_checkpoints(out_dir, path, keep=keep, run_id=run_id, warn=warn)
    return path


def os_error_of(e: BaseException) -> OSError | None:
    """The OSError with an errno behind e, following __cause__ and __context__: torch.save reports a
    failed write (ENOSPC) as RuntimeError "[enforce fail at inline_container.cc:...] unexpected pos",
    with the OSError only in its context."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError) and e.errno:
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def write_failure(e: BaseException, directory: str | Path) -> str:
    """A failed checkpoint write in words, one line naming the directory: the OS error where there is
    one (e.g. "No space left on device in RUN/checkpoints (0 B free)"), else the exception's first line."""
    found = os_error_of(e)
    if found is not None:
        what = os.strerror(found.errno)  # the system's own words, as ls or cp would say it
    else:
        what = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
    existing = next((p for p in (Path(directory), *Path(directory).parents) if p.exists()), Path("."))
    try:  # the file system the directory is (or would be) on
        free = f" ({_size(shutil.disk_usage(existing).free)} free)"
    except OSError:
        free = ""
    return f"{what} in {directory}{free}"


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _remove(path: Path) -> None:
    """Delete a checkpoint file or directory, or a temp one; nothing if it is not there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_stale(ckdir: Path) -> None:
    """Temp files and directories left by a writer that was killed (rank 0 alone writes here)."""
    for stale in ckdir.glob("*.tmp"):
        _remove(stale)


# ------------------------------------------------------------------ sharded checkpoints (DCP)


def is_sharded_checkpoint(path: str | Path) -> bool:
    """True for a sharded checkpoint's directory (step_XXXXXXXX/, what --parallel fsdp writes)."""
    path = Path(path)
    return path.is_dir() and _NAME.match(path.name) is not None and not path.name.endswith(".pt")


def is_checkpoint(path: str | Path) -> bool:
    """A checkpoint file or a sharded checkpoint's directory (not a run directory)."""
    return Path(path).is_file() or is_sharded_checkpoint(path)


def sharded_temp_dir(out_dir: str | Path, step: int) -> Path:
    """Where every rank writes step's sharded checkpoint before it is complete."""
    return checkpoint_dir(out_dir) / f"step_{step:08d}.tmp"


def begin_sharded(out_dir: str | Path, step: int) -> Path:
    """Rank 0, before any rank writes: an empty temp directory for step (stale temps removed)."""
    ckdir = checkpoint_dir(out_dir)
    ckdir.mkdir(parents=True, exist_ok=True)
    remove_stale(ckdir)
    tmp = sharded_temp_dir(out_dir, step)
    tmp.mkdir()
    return tmp


def write_train_state(directory: Path, step: int, state: dict, run_id: str | None) -> None:
    """Rank 0: the small part of a sharded checkpoint (train.pt), with the fields a .pt file has."""
    with atomic_write(directory / TRAIN_FILE) as f:
        torch.save({**state, "format": FORMAT_VERSION, "step": step, **_run_id_field(run_id)}, f)


def own_files(directory: Path, rank: int) -> list[str]:
    """The files of a sharded checkpoint that `rank` wrote: DCP's __<rank>_*.distcp; rank 0 also the
    rest (.metadata, train.pt)."""
    names = sorted(p.name for p in directory.iterdir() if p.is_file())
    return [n for n in names if n.startswith(f"__{rank}_") or (rank == 0 and not n.startswith("__"))]


def hash_files(directory: Path, names: list[str]) -> dict[str, dict]:
    """{name: {bytes, sha256}} of files in directory, each fsynced on the way (durable before the
    rename that publishes them). Every rank hashes its own, in parallel."""
    out = {}
    for name in names:
        path = directory / name
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        out[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return out


def _digest(files: dict[str, dict]) -> str:
    """One sha256 for a sharded checkpoint: of its files' names, sizes and hashes (compared across ranks)."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def publish_sharded(
    out_dir: str | Path, step: int, files: dict[str, dict], *, keep: int, run_id: str | None = None, warn=warnings.warn
) -> Path:
    """Rank 0, after every rank has written, fsynced and hashed its files (`files`, all of them):
    rename the temp directory to step_XXXXXXXX/, then its sidecar, then `latest`, then retention."""
    ckdir = checkpoint_dir(out_dir)
    tmp = sharded_temp_dir(out_dir, step)
    present = {p.name for p in tmp.iterdir()}
    if present != set(files):
        raise OSError(f"{tmp} holds {sorted(present)} but the ranks hashed {sorted(files)}")
    fsync_dir(tmp)
    path = ckdir / f"step_{step:08d}"
    for old in (path.with_suffix(".json"), path.with_suffix(".pt"), path):  # a rewrite of this step
        _remove(old)
    os.replace(tmp, path)
    fsync_dir(ckdir)
    meta = {
        "step": step,
        "file": path.name,
        "format": "dcp",
        "files": files,
        "bytes": sum(f["bytes"] for f in files.values()),
        "sha256": _digest(files),
        **_run_id_field(run_id),
    }
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta).encode())
    atomic_write_bytes(ckdir / "latest", (path.name + "\n").encode())
    fsync_dir(ckdir)
    prune_checkpoints(out_dir, path, keep=keep, run_id=run_id, warn=warn)
    return path


def checkpoint_size(path: str | Path) -> int:
    """Bytes of a checkpoint file, or of the files its sidecar lists for a sharded one (what the
    sidecar's "bytes" records). Raises OSError when a file is missing."""
    path = Path(path)
    if not is_sharded_checkpoint(path):
        return path.stat().st_size
    meta = read_sidecar(path)
    return sum((path / name).stat().st_size for name in meta.get("files", {}))


def _verify_sharded(path: Path, meta: dict) -> None:
    files = meta.get("files")
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{path}: its sidecar lists no files; it is not a complete sharded checkpoint")
    fix = "copy the complete checkpoint directory again, or resume from an earlier one (--resume auto skips it)"
    for name, want in files.items():
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing from the sharded checkpoint (its sidecar lists it); {fix}")
        if file.stat().st_size != want.get("bytes"):
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes but {want.get('bytes')} were written; truncated; {fix}"
            )
        if file_sha256(file) != want.get("sha256"):
            raise CheckpointError(
                f"{file}: sha256 does not match the sidecar {path.with_suffix('.json').name}; "
                f"the file is corrupt; {fix}"
            )
    if _digest(files) != meta.get("sha256"):
        raise CheckpointError(
            f"{path.with_suffix('.json')}: its files' hashes do not add up to its sha256; the sidecar is corrupt"
        )


def _run_id_field(run_id: str | None) -> dict:
    """{"run_id": ...}, or {} for None: a run without an id writes exactly what was written before ids."""
    assert run_id != ANY_RUN, "ANY_RUN filters checkpoints; no checkpoint is written with it"
    return {} if run_id is None else {"run_id": run_id}


def write_sidecar(path: Path, meta: dict) -> Path:
    """path's sidecar (atomic; returned): written after the checkpoint is complete, or again for one
    whose sidecar was lost (gpt2/ckpt/resume.py restore_sidecar)."""
    atomic_write_bytes(path.with_suffix(".json"), json.dumps(meta).encode())
    return path.with_suffix(".json")


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
    return (
        f"ignoring checkpoint {path}: it belongs to run {other or '(no run id)'}, not to this directory's "
        f"run {run_id or '(no run id)'}; move it out of {path.parent} if it is not wanted here"
    )


def looks_complete(path: Path) -> bool:
    """Sidecar present and size matching: the cheap part of verify_checkpoint (no re-hashing)."""
    meta = sidecar(path)
    try:
        return meta is not None and meta.get("bytes") == checkpoint_size(path)
    except (OSError, ValueError):
        return False


def prune_checkpoints(
    out_dir: str | Path, newest: Path, *, keep: int, run_id: str | None = None, warn=warnings.warn
) -> list[Path]:
    """Keep `newest` and the keep-1 most recent complete checkpoints of earlier steps; delete the rest.

    Only run_id's checkpoints are considered: another run's are warned about and never deleted or
    counted (whatever their step). Incomplete ones (no sidecar, wrong size) never count towards
    `keep`, so a run of failed writes cannot push out the last good checkpoint. Checkpoints of later
    steps than `newest` are not touched (a resume from an earlier checkpoint moves its run's later ones
    into abandoned-*/ first: abandon_checkpoints).
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
        old.with_suffix(".json").unlink(missing_ok=True)  # first: a half-deleted one is never valid
        _remove(old)
        deleted.append(old)
    return deleted


ABANDONED_PREFIX = "abandoned-"
"""RUN/checkpoints/abandoned-<step>-<UTC time>/: checkpoints of a branch a run left when it resumed
an earlier checkpoint of itself (abandon_checkpoints). Not a checkpoint's name, so `auto` and
retention never see what is in it."""


def later_checkpoints(out_dir: str | Path, step: int, run_id: str | None) -> tuple[str, ...]:
    """Names in RUN/checkpoints of run_id's checkpoints (valid or not) past step, oldest first: what a
    resume of run_id's step would leave behind for `auto` to return to."""
    later = [p for p in list_checkpoints(out_dir) if int(_NAME.match(p.name).group(1)) > step and belongs(p, run_id)]
    return tuple(p.name for p in reversed(later))


def abandon_checkpoints(out_dir: str | Path, names: tuple[str, ...], step: int) -> Path:
    """Move the checkpoints `names` (later_checkpoints of a resume from step) and their sidecars into a
    new RUN/checkpoints/abandoned-<step>-<UTC time>/ and return it; nothing is deleted.

    Rank 0 only, every other rank waiting (gpt2/ckpt/resume.py). Every sidecar goes first: a start killed
    halfway leaves checkpoints that no longer verify, so `auto` never resumes one, and the next start
    from step moves them too. `latest`, when it names a moved one, is removed (the next save writes it).
    """
    ckdir = checkpoint_dir(out_dir)
    dest = stamped_dir(ckdir, f"{ABANDONED_PREFIX}{step:08d}-")
    for name in names:
        sidecar_path = (ckdir / name).with_suffix(".json")
        if sidecar_path.exists():
            os.rename(sidecar_path, dest / sidecar_path.name)
    for name in names:
        if os.path.lexists(ckdir / name):  # the decision listed it; gone now only if a user moved it
            os.rename(ckdir / name, dest / name)
    named = latest_named(out_dir)
    if named is not None and named.name in names:
        (ckdir / "latest").unlink(missing_ok=True)
    fsync_dir(dest)
    fsync_dir(ckdir)
    return dest


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Checkpoints (files and sharded directories) in RUN/checkpoints, newest step first (valid or not)."""
    ckdir = checkpoint_dir(out_dir)
    if not ckdir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckdir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def verify_checkpoint(path: str | Path, warn=warnings.warn) -> None:
    """Raise CheckpointError unless path is complete and matches its sidecar's size and sha256.

    A .pt file whose sidecar is gone (a copy tool that skips .json files, a person tidying up, a
    writer killed between the file's rename and its sidecar) is checked without it instead
    (checkpoint_meta): usable, with a warning, when every record's zip checksum matches and it
    loads as a checkpoint of the step its name says.
    """
    path = Path(path)
    if path.suffix == ".json" and _NAME.match(path.stem):  # read as its own sidecar it looked "truncated"
        target = path.with_suffix("") if is_sharded_checkpoint(path.with_suffix("")) else path.with_suffix(".pt")
        raise CheckpointError(
            f"{path}: this is a checkpoint's sidecar (its size, sha256 and run id), not the checkpoint; pass {target}"
        )
    if not is_checkpoint(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.is_file():
        not_zip = not_a_checkpoint(path)
        if not_zip:
            raise CheckpointError(not_zip)
    meta = sidecar(path)
    if meta is None:
        if path.is_file() and not path.with_suffix(".json").exists():
            meta = checkpoint_meta(path)
            warn(
                f"checkpoint {path} has lost its sidecar {path.with_suffix('.json').name} (size and sha256): "
                f"using it, as every record's zip checksum matches and it loads as step {meta['step']}; a run "
                "that resumes from it writes the sidecar again"
            )
            return
        raise CheckpointError(
            f"{path}: its sidecar {path.with_suffix('.json').name} is missing or unreadable; the write did not finish"
        )
    if path.is_dir():
        _verify_sharded(path, meta)
        return
    size = path.stat().st_size
    if size != meta.get("bytes"):
        raise CheckpointError(f"{path}: {size} bytes but {meta.get('bytes')} were written; truncated")
    if file_sha256(path) != meta.get("sha256"):
        raise CheckpointError(f"{path}: sha256 does not match its sidecar; the file is corrupt")


def not_a_checkpoint(path: Path) -> str | None:
    """Why file `path` is not a checkpoint at all (not a zip archive, as torch.save writes), or None.
    `--resume data/DIR/manifest.json` was read as its own sidecar and called "truncated"."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(ZIP_MAGIC))
    except OSError as e:
        return f"{path}: cannot be read ({e.strerror or e})"
    if head == ZIP_MAGIC or head == b"":
        return None  # an empty file is a truncated checkpoint: the sidecar check says so
    what = "not a checkpoint (a checkpoint is a step_*.pt file that torch.save wrote)"
    try:  # a manifest is a few KB to MB; a shard or other large file is not read whole to find out
        doc = json.loads(path.read_bytes()) if path.stat().st_size < (64 << 20) else None
    except (OSError, ValueError):
        doc = None
    if isinstance(doc, dict) and "shards" in doc and "fingerprint" in doc:
        what = (
            f"data_prep's manifest of the token shards in {path.parent}, not a checkpoint: pass that "
            "directory as --data-dir"
        )
    return f"{path}: {what}; pass a step_*.pt file or step_*/ directory, or a run directory"


def checkpoint_meta(path: Path) -> dict:
    """The sidecar's fields of checkpoint path ({step, file, bytes, sha256, run_id}): its sidecar, or
    for a .pt file without one, what the file itself shows (verified: CheckpointError otherwise)."""
    meta = sidecar(path)
    if meta is not None:
        return meta
    st = path.stat()
    return dict(_meta_from_file(str(path), st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _meta_from_file(path_str: str, size: int, mtime_ns: int) -> tuple:
    """A sidecar-less .pt's fields, once per version of the file (size and mtime in the key): its
    zip records' CRC-32s checked (one read), its step compared with its name, its sha256 (one read)."""
    path = Path(path_str)
    fix = "resume an earlier checkpoint, or copy this one again with its .json sidecar"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(
            f"{path}: its sidecar is missing and the file is not a complete zip archive ({e}): "
            f"truncated or damaged; {fix}"
        ) from None
    if bad is not None:
        raise CheckpointError(
            f"{path}: its sidecar is missing and its record {bad} fails its zip checksum: the file is corrupt; {fix}"
        )
    state = load_checkpoint(path, verify=False)
    step, named = state.get("step"), _NAME.match(path.name)
    if not isinstance(step, int) or (named is not None and int(named.group(1)) != step):
        raise CheckpointError(
            f"{path}: its sidecar is missing and it holds step {step!r}, not the step its name says; {fix}"
        )
    meta = {
        "step": step,
        "file": path.name,
        "bytes": size,
        "sha256": file_sha256(path),
        **_run_id_field(state.get("run_id")),
    }
    return tuple(meta.items())


def load_checkpoint(path: str | Path, *, verify: bool = True, mmap: bool = True) -> dict:
    """Load a checkpoint dict on the CPU (tensors and primitives only).

    mmap (the default): tensors are mapped from the file, copy-on-write, and read on first use, so
    processes on one host share the page cache instead of each holding a copy.
    A sharded checkpoint's directory gives its train.pt (no "model" or "optimizer": gpt2/ckpt/dcp.py
    reads those) with "sharded": True.
    """
    path = Path(path)
    if verify:
        verify_checkpoint(path)
    sharded = is_sharded_checkpoint(path)
    try:
        state = torch.load(path / TRAIN_FILE if sharded else path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # torch raises several types for a damaged zip
        raise CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: not a checkpoint of this program (format {FORMAT_VERSION})")
    return {**state, "sharded": True} if sharded else state


_DIRECTORY_RUN = object()


def latest_valid(out_dir: str | Path, warn=warnings.warn, *, run_id=_DIRECTORY_RUN) -> Path | None:
    """The checkpoint of run_id (default: the directory's run, gpt2/ckpt/rundir.py) with the highest step
    that verifies; bad ones and other runs' are warned about and skipped.

    `latest` plays no part in the choice: it is written last, so it can lag (a writer killed after
    the sidecar, a copy or a filesystem that shows an older one), and taking an older checkpoint
    because it names one would overwrite the newer ones with a repeat of their steps. When it names
    an older valid checkpoint than the one chosen, a warning says so.
    """
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
    for path in candidates:  # newest step first
        try:
            verify_checkpoint(path, warn)
        except CheckpointError as e:
            warn(f"skipping checkpoint: {e}")
            continue
        warn_vanished(out_dir, run_id, int(_NAME.match(path.name).group(1)), warn)
        named = latest_named(out_dir)
        if named in candidates and candidates.index(named) > candidates.index(path):
            warn(
                f"{checkpoint_dir(out_dir) / 'latest'} names {named.name}, but {path.name} is a later step and "
                f"verifies: resuming from {path.name} (--resume auto takes the newest valid checkpoint; pass "
                "--resume PATH for another)"
            )
        return path
    return None


def vanished(out_dir: str | Path, run_id=ANY_RUN) -> list[Path]:
    """run_id's checkpoints that this directory still names but that are gone: a sidecar left without
    its checkpoint, or the one `latest` names (a scratch purge, a person tidying up, a copy that left the
    .pt behind). Newest step first."""
    ckdir = checkpoint_dir(out_dir)
    if not ckdir.is_dir():
        return []
    gone = {}
    for side in ckdir.glob("step_*.json"):
        path = side.with_suffix(".pt")
        if _NAME.match(path.name) and not path.exists() and not path.with_suffix("").exists():
            meta = sidecar(path)
            if meta is not None and (run_id == ANY_RUN or run_id_of(meta) == run_id):
                gone[path.name] = path
    named = latest_named(out_dir)
    if named is not None and not named.exists() and named.name not in gone:
        gone[named.name] = named  # `latest` is written after the sidecar: of the directory's run
    return sorted(gone.values(), key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def warn_vanished(out_dir: str | Path, run_id, step: int, warn) -> None:
    """A warning when checkpoints of run_id newer than `step` (the one resumed from) are gone: the
    steps after `step` are lost and will be trained again."""
    lost = [p for p in vanished(out_dir, run_id) if int(_NAME.match(p.name).group(1)) > step]
    if lost:
        newest = int(_NAME.match(lost[0].name).group(1))
        warn(
            f"{', '.join(p.name for p in lost[:3])}{', ...' if len(lost) > 3 else ''} of this run "
            f"{'is' if len(lost) == 1 else 'are'} gone from {checkpoint_dir(out_dir)} (named by "
            f"{'its sidecar' if lost[0].with_suffix('.json').exists() else 'latest'}): resuming from step {step}, so "
            f"{f'step {newest} is' if newest == step + 1 else f'steps {step + 1}-{newest} are'} lost and trained "
            f"again; restore {lost[0].name} and rerun to keep them"
        )


def latest_named(out_dir: str | Path) -> Path | None:
    """The checkpoint path `latest` names, or None when it is missing or not a name (empty, several
    lines, not UTF-8): a hint for people and tools, never needed to resume."""
    pointer = checkpoint_dir(out_dir) / "latest"
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not _NAME.match(name):
        return None
    return checkpoint_dir(out_dir) / name


def resolve_resume(resume: str, out_dir: str | Path, warn=warnings.warn, *, run_id=_DIRECTORY_RUN) -> Path | None:
    """--resume auto|never|PATH -> the checkpoint file to load, or None to start fresh.

    auto: the newest valid checkpoint of run_id (default: out_dir's run). A path named explicitly
    must be valid (CheckpointError otherwise); it may be a file (of any run) or a run directory (the
    newest valid checkpoint of that directory's run).
    """
    if resume == "never":
        return None
    if resume == "auto":
        found = latest_valid(out_dir, warn, run_id=run_id)
        if found is None:
            refuse_unverified(out_dir, run_id)
        return found
    path = Path(resume)
    if path.is_dir() and not is_sharded_checkpoint(path):
        found = latest_valid(path if (path / "checkpoints").is_dir() else path.parent, warn)
        if found is None:
            raise CheckpointError(f"--resume {resume}: no valid checkpoint in that directory")
        return found
    if not path.exists():
        raise CheckpointError(
            f"--resume {resume}: no such checkpoint file; pass a step_*.pt file or directory that "
            "exists, a run directory (its newest valid checkpoint), auto or never"
        )
    verify_checkpoint(path, warn)
    return path


def refuse_unverified(out_dir: str | Path, run_id=_DIRECTORY_RUN) -> None:
    """--resume auto found no checkpoint of the directory's run that verifies: a CheckpointError when
    there are some (each skipped with a warning), rather than a fresh start that moves them aside and
    trains from step 0 with exit 0."""
    if run_id is _DIRECTORY_RUN:
        run_id = directory_run_id(out_dir)
    unverified = [p.name for p in list_checkpoints(out_dir) if belongs(p, run_id)]
    gone = vanished(out_dir, run_id)
    if gone and not unverified:
        raise CheckpointError(
            f"--resume auto: this run's checkpoint(s) {', '.join(p.name for p in gone[:3])}"
            f"{', ...' if len(gone) > 3 else ''} are gone from {checkpoint_dir(out_dir)} (their sidecars or latest "
            "still name them), so the run would start over from step 0: restore them (with their .json sidecars), "
            "pass --resume PATH of another checkpoint, or --resume never to start fresh (this run's files move "
            "into a previous-* folder)"
        )
    if unverified:
        raise CheckpointError(
            f"--resume auto: none of this run's {len(unverified)} checkpoint(s) in {checkpoint_dir(out_dir)} "
            f"verifies ({', '.join(unverified[:3])}{', ...' if len(unverified) > 3 else ''}; the warnings above say "
            "why), so the run would start over: restore them (with their .json sidecars), pass --resume PATH of "
            "another checkpoint, or --resume never to start fresh (this run's files move into a previous-* folder)"
        )
