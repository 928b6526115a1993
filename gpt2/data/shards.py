"""The one definition of the token shard format, shared by data_prep (writer) and the loader.

Byte-compatible with llm.c and modded-nanogpt: a header of 256 little-endian int32,
`[20240520, 1, n_tokens, 0, ...]`, then n_tokens little-endian uint16 tokens.
"""

from __future__ import annotations

import errno
import os
import weakref
from collections import OrderedDict
from pathlib import Path

import numpy as np

from gpt2.core.atomic import atomic_write

MAGIC = 20240520
VERSION = 1  # uint16 tokens (llm.c's version 2 holds uint32 tokens and is not GPT-2's)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")


MANIFEST = "manifest.json"
"""What data_prep writes beside its shards (data_prep/shard_writer.py): tokenizer, vocab, EOT, every shard's split,
tokens and sha256. The trainer checks the shards against it at start-up (gpt2/data/check.py)."""
PREP_TOKENIZER = "tiktoken gpt2, encode_ordinary, each document = [EOT] + tokens"
"""The manifest's "tokenizer" of data_prep's shards (part of its job fingerprint: never reword it)."""


class ShardError(ValueError):
    """A shard file is missing, truncated, or not in the llm.c format."""


def make_header(n_tokens: int) -> np.ndarray:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, n_tokens)
    return header


def read_header(path: str | os.PathLike) -> int:
    """Validate a shard's header against its size; return its token count."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except FileNotFoundError:
        raise ShardError(f"{path}: no such shard file") from None
    if len(raw) < HEADER_BYTES:
        raise ShardError(
            f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header; "
            "the file is truncated or not a token shard"
        )
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ShardError(
            f"{path}: bad magic number {header[0]} (expected {MAGIC}); not an llm.c/modded-nanogpt token shard, or its "
            "header is damaged"
        )
    if header[1] != VERSION:
        raise ShardError(
            f"{path}: shard version {header[1]} is not supported (expected {VERSION}: uint16 GPT-2 tokens)"
        )
    n_tokens = int(header[2])
    expected = HEADER_BYTES + n_tokens * TOKEN_DTYPE.itemsize
    if n_tokens < 0 or size != expected:
        raise ShardError(
            f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file has "
            f"{size} bytes; the shard is truncated or corrupt, re-run data_prep"
        )
    return n_tokens


def read_tokens(path: str | os.PathLike, count: int) -> np.ndarray:
    """The first `count` tokens of a shard (fewer if it holds fewer), its header validated."""
    n = min(count, read_header(path))
    return np.fromfile(path, dtype=TOKEN_DTYPE, count=n, offset=HEADER_BYTES)


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens atomically: temp file in the same directory, fsync, rename.

    A crash at any point leaves either no file or the complete one, never half a shard.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError(f"{path}: token ids must fit in uint16 (0..65535); got range [{tokens.min()}, {tokens.max()}]")
    data = tokens.astype(TOKEN_DTYPE, copy=False)
    with atomic_write(path) as f:
        f.write(make_header(len(data)).tobytes())
        f.write(data.tobytes())


def default_max_open() -> int:
    """How many shard files a loader keeps open: a quarter of this process's descriptor limit, at
    most 1024. Under the common soft limit of 1024 that is 256, enough to keep every one of
    FineWeb-10B's 103 train shards open (a shuffled batch touches about half of them: with a bound
    of 64, a third of those reads would reopen a shard); the other three quarters stay for sockets,
    CUDA and checkpoint files."""
    import resource  # POSIX only, like os.pread

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1024 if soft == resource.RLIM_INFINITY else max(1, min(1024, soft // 4))


class ShardFiles:
    """Read-only descriptors of shard files, kept open between reads: at most `max_open`
    (default_max_open() unless given), least recently used closed first.

    A loader reads rows from dozens of shards every micro-step. Opening and closing each one per
    read is two metadata operations per shard on the file server (Lustre, NFS), thousands per second
    per node at GPU speed; a kept descriptor costs none. The bound keeps a corpus of thousands of
    shards inside the process's descriptor limit. Reads are os.pread into the caller's buffer: no file
    position is shared (threads may read one descriptor at once) and nothing stays mapped, so memory
    does not grow with the corpus (nanoGPT recreates its memmap every batch for that reason).

    Headers are validated once, by the shard set's constructor (data.find_shards); opening checks
    only that the file still has the size they promised. Only the thread that calls `acquire`
    opens or closes descriptors; reads on descriptors it returned may run in other threads until the
    next `acquire`. Closed by `close()`, at the end of a `with`, or when garbage-collected.
    Descriptors are not inherited by exec'd children (Python opens them close-on-exec).
    """

    def __init__(self, paths: tuple[Path, ...], sizes: tuple[int, ...], max_open: int | None = None) -> None:
        max_open = default_max_open() if max_open is None else max_open
        if max_open < 1:
            raise ValueError(f"max_open={max_open}: at least one shard must stay open to read")
        self.paths, self.sizes, self.max_open = paths, sizes, max_open
        self._fds: OrderedDict[int, int] = OrderedDict()  # shard index -> fd, least recently used first
        self._finalizer = weakref.finalize(self, _close_fds, self._fds)
        self._nowait = hasattr(os, "preadv") and hasattr(os, "RWF_NOWAIT")  # read_cached can ask the page cache

    def acquire(self, shards) -> dict[int, int]:
        """Descriptors of these shards (at most max_open), opening the missing ones."""
        shards = list(dict.fromkeys(shards))
        assert len(shards) <= self.max_open, "callers read in groups of at most max_open shards"
        if not self._finalizer.alive:
            raise ValueError("the shard files were closed; make a new loader to read again")
        for shard in shards:
            if shard in self._fds:
                self._fds.move_to_end(shard)
        wanted = set(shards)
        for shard in shards:
            if shard not in self._fds:
                while len(self._fds) >= self.max_open:
                    victim = next(s for s in self._fds if s not in wanted)
                    os.close(self._fds.pop(victim))
                self._fds[shard] = self._open(shard)
        return {shard: self._fds[shard] for shard in shards}

    def _open(self, shard: int) -> int:
        path = self.paths[shard]
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise ShardError(f"{path}: the shard disappeared after it was validated; restore it") from None
        size = os.fstat(fd).st_size
        expected = HEADER_BYTES + self.sizes[shard] * TOKEN_DTYPE.itemsize
        if size != expected:
            os.close(fd)
            raise ShardError(
                f"{path}: now {size} bytes, {expected} when it was validated; the shard was "
                "changed during the run, restore it"
            )
        return fd

    def read_cached(self, fd: int, begin: int, take: int, out: np.ndarray) -> bool:
        """read_into, only where no disk must be waited for: True when all `take` tokens from `begin`
        were in the page cache and are now in out, else False (out is then unspecified). Linux's
        RWF_NOWAIT; a system or filesystem without it answers False from then on."""
        if not self._nowait:
            return False
        try:
            got = os.preadv(fd, [out], HEADER_BYTES + begin * TOKEN_DTYPE.itemsize, os.RWF_NOWAIT)
        except BlockingIOError:  # not (all) cached: the caller reads it the waiting way
            return False
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # this file system cannot say
                self._nowait = False
            return False  # anything else (EIO): the waiting read meets it again and reports it
        return got == take * TOKEN_DTYPE.itemsize

    def read_into(self, fd: int, shard: int, begin: int, out: np.ndarray) -> None:
        """Tokens [begin, begin + len(out)) of a shard into out (a contiguous uint16 array)."""
        data = os.pread(fd, out.nbytes, HEADER_BYTES + begin * TOKEN_DTYPE.itemsize)
        if len(data) != out.nbytes:
            raise ShardError(f"{self.paths[shard]}: shorter than its header says; re-run data_prep")
        out[:] = np.frombuffer(data, dtype=TOKEN_DTYPE)

    @property
    def open_count(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ShardFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_fds(fds: OrderedDict[int, int]) -> None:
    while fds:
        os.close(fds.popitem()[1])
