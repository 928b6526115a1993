"""The text corpus of the benchmarks that train or tokenize: --corpus PATH, checked before any work.

The default is tests/data/tinyshakespeare.txt, which ships with the repository (Karpathy's char-rnn
tinyshakespeare input.txt, public domain). Any UTF-8
.txt file works: the numbers in the docs are for tinyshakespeare.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = REPO / "tests" / "data" / "tinyshakespeare.txt"


def add_corpus_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--corpus",
        type=Path,
        default=DEFAULT_CORPUS,
        help=f"a UTF-8 .txt corpus (default: {DEFAULT_CORPUS}, tinyshakespeare's input.txt)",
    )


def require_corpus(path: Path, prog: str) -> None:
    """One line and exit 2 when the corpus is missing: before any measurement, never a traceback."""
    if not path.is_file():
        print(
            f"{prog}: error: corpus {path} not found: pass --corpus PATH (any UTF-8 .txt file; "
            f"docs/data.md says where to get tinyshakespeare)",
            file=sys.stderr,
        )
        sys.exit(2)


def prepare_by_paragraph(corpus: Path, out: Path, prog: str, *, val_tokens: int = 30_000) -> None:
    """Shards of the corpus, one document per paragraph, the first val_tokens as val (data_prep's own
    one-line error and exit 2 if it refuses the file)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "data_prep",
            "--source",
            str(corpus),
            "--out",
            str(out),
            "--txt-sample-by",
            "paragraph",
            "--val-tokens",
            str(val_tokens),
            "--val-select",
            "first",
            "--workers",
            "1",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        last = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        print(f"{prog}: error: data_prep failed on {corpus}: {last}", file=sys.stderr)
        sys.exit(2)
