"""Writing files so that readers see the old file or the complete new one, never half of one.

Every file this project writes for others to read (shards, manifests, checkpoints, pointers, logs
rewritten on resume, run info) goes through `atomic_write`: a temp file in the same directory,
fsync, rename over the target, fsync of the directory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename in this directory durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Yield a temp file next to path; when the block ends without error, it replaces path.

    On an exception (or a kill) the temp file is removed or left as *.tmp, and path is untouched.
    Files are made 0644: mkstemp's 0600 would hide shards, checkpoints and caches from the other
    users of a cluster node.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_write(path) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode())
