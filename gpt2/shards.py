"""The one definition of the token shard format, shared by data_prep (writer) and the loader.

Byte-compatible with llm.c and modded-nanogpt: a header of 256 little-endian int32,
`[20240520, 1, n_tokens, 0, ...]`, then n_tokens little-endian uint16 tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from gpt2.atomic import atomic_write

MAGIC = 20240520
VERSION = 1  # uint16 tokens (llm.c's version 2 holds uint32 tokens and is not GPT-2's)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")


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
        raise ShardError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte shard header; "
                         "the file is truncated or not a token shard")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != MAGIC:
        raise ShardError(f"{path}: bad magic number {header[0]} (expected {MAGIC}); "
                         "not an llm.c/modded-nanogpt token shard")
    if header[1] != VERSION:
        raise ShardError(f"{path}: shard version {header[1]} is not supported (expected {VERSION}: "
                         "uint16 GPT-2 tokens)")
    n_tokens = int(header[2])
    expected = HEADER_BYTES + n_tokens * TOKEN_DTYPE.itemsize
    if n_tokens < 0 or size != expected:
        raise ShardError(f"{path}: header says {n_tokens} tokens ({expected} bytes) but the file has "
                         f"{size} bytes; the shard is truncated or corrupt, re-run data_prep")
    return n_tokens


def load_tokens(path: str | os.PathLike) -> np.ndarray:
    """The shard's tokens as a read-only uint16 memmap (validated first)."""
    n_tokens = read_header(path)
    if n_tokens == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(n_tokens,))


def write_shard(path: str | os.PathLike, tokens: np.ndarray) -> None:
    """Write tokens atomically: temp file in the same directory, fsync, rename.

    A crash at any point leaves either no file or the complete one, never half a shard.
    """
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError(f"{path}: token ids must fit in uint16 (0..65535); got range "
                         f"[{tokens.min()}, {tokens.max()}]")
    data = tokens.astype(TOKEN_DTYPE, copy=False)
    with atomic_write(path) as f:
        f.write(make_header(len(data)).tobytes())
        f.write(data.tobytes())
