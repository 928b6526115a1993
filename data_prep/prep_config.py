"""What one data_prep job does: a frozen, validated description built from the command line."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SHARD_TOKENS = 100_000_000
DEFAULT_MAX_VAL_TOKENS = 10_000_000
"""Default val budget cap (modded-nanogpt evaluates on a fixed ~10M tokens)."""
DEFAULT_VAL_FRACTION = 0.01
"""Default val budget: 1% of the estimated corpus..."""
DEFAULT_MIN_VAL_TOKENS = 16_384
"""...but at least this many tokens: twice the debug and small presets' --eval-tokens 8192, so a
small corpus's val split holds the evaluation with room to spare..."""
DEFAULT_MAX_VAL_SHARE = 0.1
"""...unless that would be more than 10% of a tiny corpus: the floor never takes more than this share."""
VAL_SELECT = ("spread", "first")
"""spread: val documents chosen by a hash of their text, from all over the corpus; first: the first
documents in source order (the rule before spread existed, kept for splits that must not move)."""
DECODE_ERROR_MODES = ("fail", "skip", "replace")
TXT_SAMPLE_BY = ("document", "paragraph")
MAX_HEADER_INT = 2**31 - 1  # n_tokens lives in an int32 header field


class UserError(ValueError):
    """A problem the user can fix (bad path, bad input line, wrong output directory).

    The CLI prints its message on one line and exits with status 2, without a traceback.
    """


class WorkerDied(UserError):
    """A tokenizer process ended while the job still needed it (killed by the OOM killer, say): one line
    as a UserError, with exit status 1 (an accident of the machine, not of the input; rerun to resume)."""


def is_saved_dataset(path: Path) -> bool:
    """A directory that `datasets`' save_to_disk wrote: a Dataset (state.json beside dataset_info.json) or a
    DatasetDict of splits (dataset_dict.json). Read with load_from_disk, not as the JSON files it holds."""
    return path.is_dir() and (
        (path / "dataset_dict.json").is_file()
        or ((path / "state.json").is_file() and (path / "dataset_info.json").is_file())
    )


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class PrepConfig:
    out: Path
    """Output directory for val_*.bin, train_*.bin and manifest.json."""
    sources: tuple[str, ...] = ()
    """Local files or directories (.txt, .jsonl, .json, .parquet)."""
    hf_dataset: str | None = None
    """A Hugging Face dataset name (or a builder name such as 'json' with hf_data_files), streamed."""
    hf_config: str | None = None
    hf_split: str = "train"
    """The split of a Hugging Face dataset, or of a saved DatasetDict (--source DIR or --hf-dataset DIR)."""
    hf_data_files: tuple[str, ...] = ()
    """data_files passed to load_dataset (lets --hf-dataset json/parquet/text read local files)."""
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    """Tokens per shard; every shard of a split holds exactly this many except the split's last."""
    val_tokens: int | None = None
    """Tokens (whole documents) for val; None: the default budget, see sources.default_val_tokens."""
    val_select: str | None = None
    """spread or first (see VAL_SELECT); None: spread for local files (whatever --val-tokens says: it sets the
    size, not the choice), first for a streamed --hf-dataset, whose size is unknown up front. A job an earlier
    version began with --val-tokens (which then meant first) continues with first (pipeline.earlier_select)."""
    workers: int = 1
    """Tokenizer processes; 1 tokenizes in this process."""
    text_field: str = "text"
    """Field of a .jsonl/.json record or .parquet column holding the document text."""
    on_decode_error: str = "fail"
    """.txt files that are not valid UTF-8: fail, skip the file, or replace bad bytes with U+FFFD."""
    txt_sample_by: str = "document"
    """A .txt file is one document, or one document per blank-line separated paragraph."""
    progress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if self.hf_dataset and not self.sources and is_saved_dataset(Path(self.hf_dataset)):
            # A directory save_to_disk wrote is local data: read it as --source DIR does (load_from_disk), where
            # load_dataset would only say "use load_from_disk".
            object.__setattr__(self, "sources", (self.hf_dataset,))
            object.__setattr__(self, "hf_dataset", None)
        problems = config_problems(self)
        if problems:
            raise UserError("; ".join(problems))

    @property
    def resolved_val_select(self) -> str:
        if self.val_select is not None:
            return self.val_select
        return "spread" if self.sources else "first"

    @property
    def settings(self) -> dict:
        """Everything besides the sources that decides the output bytes (workers and progress do not)."""
        return {
            "shard_tokens": self.shard_tokens,
            "text_field": self.text_field,
            "on_decode_error": self.on_decode_error,
            "txt_sample_by": self.txt_sample_by,
        }


def config_problems(cfg: PrepConfig) -> list[str]:
    p = []
    if bool(cfg.sources) == bool(cfg.hf_dataset):
        p.append("give exactly one of --source PATH [PATH ...] or --hf-dataset NAME")
    if cfg.hf_data_files and not cfg.hf_dataset:
        p.append("--hf-data-files only applies with --hf-dataset (e.g. --hf-dataset json --hf-data-files a.jsonl)")
    if not 1 <= cfg.shard_tokens <= MAX_HEADER_INT:
        p.append(
            f"--shard-tokens must be in 1..{MAX_HEADER_INT} (the shard header stores it as int32), "
            f"got {cfg.shard_tokens}"
        )
    if cfg.val_tokens is not None and cfg.val_tokens < 0:
        p.append(f"--val-tokens must be >= 0 (0 means no val split), got {cfg.val_tokens}")
    if cfg.val_select is not None and cfg.val_select not in VAL_SELECT:
        p.append(f"--val-select must be one of {', '.join(VAL_SELECT)}, got {cfg.val_select!r}")
    if cfg.val_select == "spread" and cfg.hf_dataset:
        p.append(
            "--val-select spread needs local --source files (their size sets the sampling rate); "
            "a streamed --hf-dataset takes its first documents: drop --val-select"
        )
    if cfg.workers < 1:
        p.append(f"--workers must be >= 1, got {cfg.workers}")
    if cfg.on_decode_error not in DECODE_ERROR_MODES:
        p.append(f"--on-decode-error must be one of {', '.join(DECODE_ERROR_MODES)}, got {cfg.on_decode_error!r}")
    if cfg.txt_sample_by not in TXT_SAMPLE_BY:
        p.append(f"--txt-sample-by must be one of {', '.join(TXT_SAMPLE_BY)}, got {cfg.txt_sample_by!r}")
    if not cfg.text_field:
        p.append("--text-field must not be empty")
    if cfg.out.exists() and not cfg.out.is_dir():
        p.append(f"--out {cfg.out} exists and is not a directory")
    return p
