"""What every benchmark does with its finished report: print it, and write it to --md if given."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, md: str | Path | None) -> None:
    print(text)
    if md:
        Path(md).write_text(text + "\n")
