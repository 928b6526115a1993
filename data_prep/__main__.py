"""Command line: `python -m data_prep --source ... --out DIR` and `python -m data_prep verify DIR`.

A rerun over a finished job checks every shard (size, sha256) and re-encodes just the missing or
damaged ones. Exit status: 0 done (or nothing to do), 1 verify found bad shards, or writing failed
(a full disk) or a tokenizer process died (the OOM killer): one line, rerun to resume; 2 user error
(message, no traceback), 130 interrupted (rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from pathlib import Path

from data_prep.prep_config import (
    DECODE_ERROR_MODES,
    DEFAULT_SHARD_TOKENS,
    TXT_SAMPLE_BY,
    VAL_SELECT,
    PrepConfig,
    UserError,
    WorkerDied,
    default_workers,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Tokenize a corpus with GPT-2's BPE into llm.c-format uint16 shards (val_*.bin, train_*.bin, "
        "manifest.json). Deterministic for any --workers; rerun the same command to resume an interrupted "
        "job or to rewrite missing or damaged shards of a finished one. "
        "`python -m data_prep verify DIR` checks a finished directory.",
    )
    src = p.add_argument_group("sources (one of)")
    src.add_argument(
        "--source",
        nargs="+",
        metavar="PATH",
        default=[],
        help=".txt (one document per file), .jsonl/.json (one per record), .parquet (one per row) "
        "files or directories of them (walked in sorted order)",
    )
    src.add_argument(
        "--hf-dataset",
        metavar="NAME",
        help="a Hugging Face dataset, streamed (e.g. "
        "HuggingFaceFW/fineweb-edu), or a builder name (json, parquet, text) with --hf-data-files",
    )
    src.add_argument("--hf-config", metavar="CONFIG", help="dataset config, e.g. sample-10BT")
    src.add_argument("--hf-split", default="train", help="split to read (default: train)")
    src.add_argument("--hf-data-files", nargs="+", metavar="PATH", default=[], help="data_files for load_dataset")
    p.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory")
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS:,})",
    )
    p.add_argument(
        "--val-tokens",
        type=int,
        default=None,
        help="tokens of whole documents for val_*.bin (the document crossing the mark goes whole); "
        "default min(10M, max(1%% of the corpus, min(16,384, 10%% of the corpus))) with the corpus "
        "estimated as source bytes / 4, 10M for --hf-dataset; 0: no val split",
    )
    p.add_argument(
        "--val-select",
        choices=VAL_SELECT,
        default=None,
        help="which documents go to val: spread (documents in the order of a hash of their text, so "
        "from all over the corpus, the same for any --workers or file order) or first (the first "
        "documents in source order); default spread, but first with an explicit --val-tokens "
        "(the split earlier versions made) or --hf-dataset (read once, size unknown)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="tokenizer processes (default: all cores); the output does not depend on it",
    )
    p.add_argument("--text-field", default="text", help="JSON field / parquet column with the text (default: text)")
    p.add_argument(
        "--on-decode-error",
        choices=DECODE_ERROR_MODES,
        default="fail",
        help=".txt files that are not UTF-8: fail (default), skip the file, or replace bad bytes",
    )
    p.add_argument(
        "--txt-sample-by",
        choices=TXT_SAMPLE_BY,
        default="document",
        help="a .txt file is one document (default), or one per blank-line separated paragraph",
    )
    p.add_argument("--verify", action="store_true", help="verify the shards after writing them")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def run_verify(out: Path) -> int:
    from data_prep.verify import verify

    problems = verify(out)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"verify: {len(problems)} problem(s) in {out}", file=sys.stderr)
        return 1
    print(f"verify: {out} OK")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = None
    try:
        if argv[:1] == ["verify"]:
            vp = argparse.ArgumentParser(
                prog="python -m data_prep verify",
                description="Check shard headers, sizes and sha256 against manifest.json.",
            )
            vp.add_argument("out", type=Path, metavar="DIR")
            return run_verify(vp.parse_args(argv[1:]).out)
        args = build_parser().parse_args(argv)
        cfg = PrepConfig(
            out=args.out,
            sources=tuple(args.source),
            hf_dataset=args.hf_dataset,
            hf_config=args.hf_config,
            hf_split=args.hf_split,
            hf_data_files=tuple(args.hf_data_files),
            shard_tokens=args.shard_tokens,
            val_tokens=args.val_tokens,
            val_select=args.val_select,
            workers=args.workers,
            text_field=args.text_field,
            on_decode_error=args.on_decode_error,
            txt_sample_by=args.txt_sample_by,
            progress=not args.no_progress,
        )
        quiet_datasets()
        from data_prep.pipeline import prepare

        summary = prepare(cfg, log=lambda m: print(m, file=sys.stderr))
        for line in summary.lines():
            print(line)
        return run_verify(cfg.out) if args.verify else 0
    except WorkerDied as e:  # the machine's doing, not the input's: 1, as a full disk
        print(f"error: {e}", file=sys.stderr)
        return 1
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk (ENOSPC), a read-only --out (EROFS), no permission: the system's
        # word for it, with the file, instead of a traceback; finished shards are kept
        print(f"error: {write_failure(e, args.out if args is not None else None)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: completed shards are kept; rerun the same command to resume", file=sys.stderr)
        return 130


def write_failure(e: OSError, out: Path | None) -> str:
    """An OSError that reached the command, in one line that names its cause: only a full disk asks
    for free space (sources that cannot be read are UserErrors of data_prep/sources.py)."""
    where = e.filename or out or "--out"
    rerun = "then rerun the same command: it continues after the last complete shard"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"writing {where} failed: {e.strerror}; free space, {rerun}"
    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        where_to = out or "the directory"
        return f"writing {where} failed: {e.strerror}; make {where_to} writable or pass another --out, {rerun}"
    return f"{where}: {e.strerror or e}; {rerun}"


def quiet_datasets() -> None:
    """datasets logs builder errors we report ourselves, and draws its own progress bars.

    Importing datasets here would make a user error found before any reading (a wrong path) wait for a
    multi-second import: where it is not imported yet (main() called in a process of its own, or a
    test's), the environment datasets reads at its import says the same (COMMAND_ENV's settings),
    else its "Failed to load JSON" log line came before our own one-line error.
    """
    if "datasets" not in sys.modules:
        os.environ.setdefault("DATASETS_VERBOSITY", "critical")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    else:
        import datasets

        datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
        datasets.disable_progress_bars()


COMMAND_ENV = {
    "DATASETS_VERBOSITY": "critical",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    # datasets imports torch when it creates a streaming dataset, only to share an epoch counter with
    # DataLoader workers; nothing here uses torch. Measured on a tiny .jsonl: 3.2 s and 322 MB peak
    # RSS to the first batch with torch, 1.1 s and 142 MB without.
    "USE_TORCH": "0",
    "USE_TF": "0",
}
"""Set (unless the user set them) by `python -m data_prep` in its own process, before datasets is imported
(it reads them at import). main() leaves the environment of the process calling it alone."""


if __name__ == "__main__":
    for name, value in COMMAND_ENV.items():
        os.environ.setdefault(name, value)
    sys.exit(main())
