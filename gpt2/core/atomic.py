"""Writing files so that readers see the old file or the complete new one, never half of one.

Every file this project writes for others to read (shards, manifests, checkpoints, pointers, logs
rewritten on resume, run info) goes through `atomic_write`: a temp file in the same directory,
fsync, rename over the target, fsync of the directory. The file ends with the mode a plain `open()`
would give it (0666 less the umask): `plain_file_mode`. Files written by other means (safetensors'
own writer) are given that mode with `give_plain_mode`.
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


def current_umask() -> int:
    """The process umask, read without changing it.

    os.umask can only be read by setting it, and between os.umask(x) and the restore another
    thread (the asynchronous checkpoint writer) would create files under the wrong mask. Linux
    (4.7+) reports it in /proc/self/status; elsewhere the set-and-restore pair is the fallback, with
    022 (not 0) as the value held meanwhile so a file made in that window is not world-writable.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def plain_file_mode() -> int:
    """The permissions open(path, "w") gives a new file: 0666 less the umask (0644 under umask 022)."""
    return 0o666 & ~current_umask()


def give_plain_mode(path: str | os.PathLike) -> None:
    """chmod a file some library wrote privately (mkstemp-style 0600) to plain_file_mode()."""
    os.chmod(path, plain_file_mode())


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb"):
    """Yield a temp file next to path; when the block ends without error, it replaces path.

    On an exception (or a kill) the temp file is removed or left as *.tmp, and path is untouched.
    The file gets plain_file_mode(): mkstemp's 0600 would hide shards, checkpoints, exports and
    caches from the other users of a cluster node, and a fixed 0644 would override a user's umask
    (077 to keep a run private, 002 to share it with a group).
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), plain_file_mode())
            os.fsync(f.fileno())
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
