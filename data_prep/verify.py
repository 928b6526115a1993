"""`python -m data_prep verify DIR`: are the shards on disk the ones the manifest describes?"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from data_prep.prep_config import UserError
from data_prep.shard_writer import MANIFEST, SHARD_RE, load_manifest
from gpt2.core.config import GPT2_VOCAB_SIZE
from gpt2.data.shards import HEADER_BYTES, ShardError, read_header

CHUNK_BYTES = 1 << 24
RERUN = (
    "rerun the data_prep command that wrote this directory (same --source and flags): it re-encodes missing "
    "or damaged shards"
)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def shard_damage(path: Path, entry: dict) -> str | None:
    """'missing' or 'damaged (...)' for a listed shard that is not what the manifest lists, else None.

    Size first (free), then the sha256 of the whole file: a flipped bit keeps the size, and hashing
    runs at ~1 GB/s, so a rerun over a finished 10B-token job spends ~20 s on it, against hours of
    tokenizing; checking less would leave exactly the corruption verify reports unrepaired.
    """
    if not path.is_file():
        return "missing"
    size, want = path.stat().st_size, HEADER_BYTES + 2 * entry["tokens"]
    if size != want:
        return f"damaged ({size} bytes, the manifest's {entry['tokens']} tokens make {want})"
    if file_sha256(path) != entry["sha256"]:
        return "damaged (sha256 differs from the manifest)"
    return None


def check_shard(path: Path, entry: dict) -> str | None:
    """The problem with one shard, or None. Reads the file once (sha256 and token range together)."""
    if not path.is_file():
        return f"{path}: missing; {RERUN}"
    try:
        n_tokens = read_header(path)
    except ShardError as e:
        return str(e)  # its own words already say to re-run data_prep, which rewrites it
    if n_tokens != entry["tokens"]:
        return f"{path}: holds {n_tokens} tokens, the manifest says {entry['tokens']}; {RERUN}"
    digest = hashlib.sha256()
    top = 0
    with open(path, "rb") as f:
        digest.update(f.read(HEADER_BYTES))
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            tokens = np.frombuffer(chunk[: len(chunk) // 2 * 2], dtype="<u2")
            top = max(top, int(tokens.max())) if tokens.size else top
    if digest.hexdigest() != entry["sha256"]:
        return f"{path}: sha256 differs from the manifest: the shard is corrupt; {RERUN}"
    if top >= GPT2_VOCAB_SIZE:
        return f"{path}: token id {top} is outside the GPT-2 vocabulary (< {GPT2_VOCAB_SIZE})"
    return None


def verify(out: Path) -> list[str]:
    """Every problem found (empty when the directory is good); raises UserError if there is no job."""
    out = Path(out)
    if not out.is_dir():
        raise UserError(f"{out}: no such directory")
    manifest = load_manifest(out)
    if manifest is None:
        raise UserError(f"{out}: no {MANIFEST}; this is not a data_prep output directory")
    problems = []
    listed = set()
    for entry in manifest["shards"]:
        listed.add(entry["file"])
        problem = check_shard(out / entry["file"], entry)
        if problem:
            problems.append(f"BAD {problem}")
    for path in sorted(out.iterdir()):
        if SHARD_RE.match(path.name) and path.name not in listed:
            problems.append(f"BAD {path}: not listed in {MANIFEST} (left by an interrupted run, or foreign)")
    if not manifest.get("complete"):
        problems.append(f"INCOMPLETE: the job in {out} has not finished; rerun the same data_prep command to resume")
    elif manifest.get("totals") and manifest["totals"]["tokens"] != sum(e["tokens"] for e in manifest["shards"]):
        problems.append(f"BAD {MANIFEST}: totals.tokens does not match the sum of shard tokens")
    return problems
