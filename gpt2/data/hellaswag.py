"""The HellaSwag validation set as data: its jsonl schema, the file, its download.

One line of hellaswag_val.jsonl (github.com/rowanz/hellaswag) holds a context, 4 candidate endings
and the index of the right one; `prepare_hellaswag` is what the trainer (--hellaswag-interval) and
`python -m gpt2.eval hellaswag` call to get them. Scoring them is gpt2/train/scoring.py's job.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gpt2.core.atomic import atomic_write
from gpt2.distributed.group import Dist, rank0_decides

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
N_ENDINGS = 4


@dataclass(frozen=True)
class Example:
    """One HellaSwag item: a context, 4 candidate endings, and the index of the right one."""

    ctx: str
    endings: tuple[str, ...]
    label: int


def parse_example(line: str, where: str) -> Example:
    """One jsonl line of the official schema (ctx, endings, label; other fields ignored)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with ctx, endings, label; got {type(obj).__name__}")
    missing = [k for k in ("ctx", "endings", "label") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)} (HellaSwag lines hold ctx, endings, label)")
    ctx, endings, label = obj["ctx"], obj["endings"], obj["label"]
    if not isinstance(ctx, str):
        raise ValueError(f"{where}: ctx must be a string, got {type(ctx).__name__}")
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS and all(isinstance(e, str) for e in endings)):
        raise ValueError(f"{where}: endings must be a list of {N_ENDINGS} strings")
    if isinstance(label, str) and label.isdigit():  # some re-distributions store the label as text
        label = int(label)
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < N_ENDINGS):
        raise ValueError(f"{where}: label must be an integer in 0..{N_ENDINGS - 1}, got {label!r}")
    return Example(ctx, tuple(endings), label)


def load_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """Every example of a HellaSwag jsonl file; a bad line raises ValueError naming file:line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such HellaSwag file")
    examples = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            examples.append(parse_example(line, f"{path}:{lineno}"))
            if limit is not None and len(examples) >= limit:
                break
    if not examples:
        raise ValueError(f"{path}: holds no examples")
    return examples


def default_data_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "gpt2-ddp" / "hellaswag_val.jsonl"


def download(url: str, dest: Path, timeout_s: float = 60.0) -> Path:
    """Fetch url into dest atomically (temp file + rename); ValueError with a fix if it fails."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_write(dest) as out, urllib.request.urlopen(url, timeout=timeout_s) as resp:
            while chunk := resp.read(1 << 20):
                out.write(chunk)
    except OSError as e:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
        raise ValueError(
            f"could not download {url} to {dest} ({e}); fetch the file where the network "
            f"allows and pass its path (--data FILE; train_ddp.py: --hellaswag-file FILE)"
        ) from None
    return dest


def prepare_hellaswag(
    path: str | Path | None, dist: Dist, *, url: str = HELLASWAG_URL, limit: int | None = None
) -> list[Example]:
    """The examples of path (default: the user cache), downloaded by rank 0 first if missing.

    Collective under torchrun: every rank must call it. Rank 0 alone reads (and if need be
    downloads) the file and sends the examples to the others, so the path need only exist on rank
    0's node: other nodes may not see rank 0's cache. A failure raises on every rank.
    """
    path = Path(path) if path else default_data_path()

    def read() -> list[Example]:
        if not path.is_file():
            print(f"{path} not found: downloading {url}", file=sys.stderr, flush=True)
            download(url, path)
        return load_examples(path, limit)

    return rank0_decides(read, dist, errors=(ValueError,))
