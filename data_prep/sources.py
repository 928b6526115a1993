"""Where documents come from: local files read through `datasets` builders, or a streamed HF dataset.

A *record* is what a builder yields: one .txt file (or one paragraph with --txt-sample-by paragraph),
one .jsonl/.json record, one .parquet row, one row of a Hugging Face dataset. Records are numbered in
source order (the --source order, directories walked in sorted order) and that number is the resume
position: a rerun skips the records already written without tokenizing them again.

Everything is streamed (`load_dataset(..., streaming=True)`): nothing is converted into the Arrow
cache and at most one builder chunk (10 MB) is held at a time. One exception: datasets' text builder
reads a whole .txt file as one string in document mode, so each single .txt file must fit in memory;
very large corpora belong in .jsonl or .parquet files.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import json
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from data_prep.prep_config import (
    DEFAULT_MAX_VAL_SHARE,
    DEFAULT_MAX_VAL_TOKENS,
    DEFAULT_MIN_VAL_TOKENS,
    DEFAULT_VAL_FRACTION,
    PrepConfig,
    UserError,
    is_saved_dataset,
)

KINDS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SAVED = "saved"
"""The kind of a directory that `datasets`' save_to_disk wrote (prep_config.is_saved_dataset): one source,
read with load_from_disk (its split chosen by --hf-split, its text by --text-field, as for parquet)."""
READ_WHAT = ", ".join(KINDS) + " files or datasets' save_to_disk directories"
BYTES_PER_TOKEN = 4
"""GPT-2 BPE averages ~4 bytes of English per token (Shakespeare 3.3, web text ~4.5): the default
val budget is estimated from source bytes with this ratio."""
READ_BATCH_ROWS = 1024
PLAIN_PATH = re.compile(r"[\w./ ,+=@-]*")
"""Paths `datasets` reads as they are. It hands data_files to fsspec, which reads `a::b` as a URL
chain ("Unable to find", for 64 of 3,023 man pages named like Algorithm::Diff.3pm.txt) and `[x]`
as a glob (a .txt file named a[x]b.txt gave no records and no error): a local path with any other
character is read through a link with a plain name (readable_paths)."""


@dataclass(frozen=True)
class SourceFile:
    path: str
    """Absolute path."""
    kind: str
    """The datasets builder that reads it: text, json or parquet; or SAVED (a save_to_disk directory)."""
    bytes: int
    mtime_ns: int

    def describe(self) -> dict:
        return {"path": self.path, "kind": self.kind, "bytes": self.bytes, "mtime_ns": self.mtime_ns}


@dataclass(frozen=True)
class Group:
    """Files read by one load_dataset call (or the HF dataset: files empty)."""

    kind: str
    files: tuple[SourceFile, ...] = ()


@dataclass(frozen=True)
class Corpus:
    groups: tuple[Group, ...]
    description: dict
    """Goes into the manifest and the fingerprint: paths, sizes, mtimes (or the HF dataset spec)."""
    estimated_tokens: int | None
    """From source bytes; None for a streamed HF dataset whose size is unknown up front."""
    skipped_files: tuple[str, ...] = field(default=())
    """Files left out: in a --source directory, of a type data_prep does not read (.gz, .md, ...); .txt
    files that are not valid UTF-8 (--on-decode-error skip). The manifest lists them, with skipped_why."""
    skipped_why: tuple[str, ...] = field(default=())
    """Why each of skipped_files was left out, in the same order."""


def stat_source(path: Path, kind: str) -> SourceFile:
    if kind == SAVED:  # a directory: its files' bytes and newest mtime stand for it in the fingerprint
        try:
            stats = [p.stat() for p in sorted(path.rglob("*")) if p.is_file()]
        except OSError as e:
            raise unreadable(str(path), e) from None
        return SourceFile(str(path.resolve()), kind, sum(s.st_size for s in stats), max(s.st_mtime_ns for s in stats))
    try:
        st = path.stat()
    except OSError as e:  # a dangling link in a source directory, or a file gone since it was listed
        raise unreadable(str(path), e) from None
    return SourceFile(str(path.resolve()), kind, st.st_size, st.st_mtime_ns)


def kind_of(path: Path) -> str:
    """The kind of a path walk_sorted found: a save_to_disk directory, else by its suffix."""
    return SAVED if path.is_dir() else KINDS[path.suffix.lower()]


def unreadable(path: str, e: OSError) -> UserError:
    """A source that cannot be read, in the system's words, with what to do about it."""
    fix = {
        errno.ENOENT: "it was moved or deleted (or is a dangling link): restore it or leave it out",
        errno.EACCES: "make it readable (chmod) or leave it out",
    }.get(e.errno, "fix it or leave it out")
    return UserError(f"{path}: cannot read this source ({e.strerror or e}); {fix}, then rerun the same command")


@contextlib.contextmanager
def readable_paths(paths: list[str]) -> Iterator[list[str]]:
    """The paths as datasets can read them: plain ones as they are, others (PLAIN_PATH) through
    symlinks with plain names in a temporary directory, removed on exit."""
    if all(PLAIN_PATH.fullmatch(p) for p in paths):
        yield paths
        return
    with tempfile.TemporaryDirectory(prefix="data_prep-links-") as links:
        out = []
        for i, p in enumerate(paths):
            if not PLAIN_PATH.fullmatch(p):
                link = os.path.join(links, f"{i:06d}{Path(p).suffix.lower()}")
                os.symlink(p, link)
                p = link
            out.append(p)
        yield out


def discover(paths: tuple[str, ...], exclude: Path, unread: list[Path] | None = None) -> list[SourceFile]:
    """The source files in order: arguments in the order given, directories walked sorted. unread:
    gets the files in those directories of a type data_prep does not read."""
    exclude = exclude.resolve()
    found: list[SourceFile] = []
    for arg in paths:
        path = Path(arg)
        if not path.exists():
            raise UserError(f"--source {arg}: no such file or directory")
        if is_saved_dataset(path):
            found.append(stat_source(path, SAVED))
            continue
        if path.is_file():
            kind = KINDS.get(path.suffix.lower())
            if kind is None:
                raise UserError(
                    f"--source {arg}: unsupported file type {path.suffix or '(none)'!r}; use {', '.join(KINDS)} files"
                )
            found.append(stat_source(path, kind))
            continue
        in_dir = [stat_source(p, kind_of(p)) for p in walk_sorted(path, exclude, unread)]
        if not in_dir:
            raise UserError(f"--source {arg}: the directory holds no {READ_WHAT}")
        found.extend(in_dir)
    seen = set()
    for f in found:
        if f.path in seen:
            raise UserError(
                f"--source: {f.path} is listed twice (directly or through a directory); each file may be read once"
            )
        seen.add(f.path)
    return found


def walk_sorted(root: Path, exclude: Path, unread: list[Path] | None = None) -> list[Path]:
    """Supported files under root sorted by relative path (as `sorted(rglob)` would, component-wise), and
    save_to_disk directories (each one source, not walked into); hidden entries and the output directory
    are skipped; unread gets the other files, sorted alike."""
    found, other = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and (here / d).resolve() != exclude]
        found += [here / d for d in dirnames if is_saved_dataset(here / d)]
        dirnames[:] = [d for d in dirnames if not is_saved_dataset(here / d)]
        for n in filenames:
            if not n.startswith("."):
                (found if Path(n).suffix.lower() in KINDS else other).append(here / n)
    if unread is not None:
        unread += sorted(other, key=lambda p: p.relative_to(root).parts)
    return sorted(found, key=lambda p: p.relative_to(root).parts)


def plan_local(cfg: PrepConfig) -> Corpus:
    """Find and stat the local sources (cheap: enough for the fingerprint and the val estimate)."""
    unread: list[Path] = []
    files = discover(cfg.sources, exclude=cfg.out, unread=unread)
    if sum(f.bytes for f in files) == 0:
        raise UserError(f"empty corpus: the {len(files)} source file(s) hold 0 bytes")
    return Corpus(
        groups=group_files(files, cfg.txt_sample_by),
        description={"files": [f.describe() for f in files]},
        estimated_tokens=sum(text_bytes(f, cfg) for f in files) // BYTES_PER_TOKEN,
        skipped_files=tuple(str(p.resolve()) for p in unread),
        skipped_why=tuple(f"not a {', '.join(KINDS)} file" for _ in unread),
    )


def check(corpus: Corpus, cfg: PrepConfig) -> Corpus:
    """Every check that needs no tokenizing, before any work: JSON lines and parquet schemas, and
    UTF-8 of .txt files (one streaming read each; skipped files leave the corpus)."""
    files = [f for g in corpus.groups for f in g.files]
    skipped = []
    for f in files:
        try:
            skip = check_file(f, cfg)
        except OSError as e:
            raise unreadable(f.path, e) from None
        if skip:
            skipped.append(f.path)
    if not skipped:
        return corpus
    kept = [f for f in files if f.path not in set(skipped)]
    if not kept:
        raise UserError("empty corpus: every source file was skipped as undecodable")
    return replace(
        corpus,
        groups=group_files(kept, cfg.txt_sample_by),
        skipped_files=corpus.skipped_files + tuple(skipped),
        skipped_why=corpus.skipped_why + tuple("not valid UTF-8 (--on-decode-error skip)" for _ in skipped),
    )


def check_file(f: SourceFile, cfg: PrepConfig) -> bool:
    """check()'s look at one file; True: leave it out (not UTF-8, --on-decode-error skip)."""
    if f.kind == "json" and f.path.endswith(".jsonl"):
        check_first_jsonl_record(f.path, cfg.text_field)
    elif f.kind == "parquet":
        check_parquet_schema(f.path, cfg.text_field)
    elif f.kind == SAVED:
        open_saved(f.path, cfg.hf_split, cfg.text_field)
    elif f.kind == "text" and cfg.on_decode_error != "replace" and (bad := first_bad_utf8(f.path)) is not None:
        offset, line = bad
        if cfg.on_decode_error == "fail":
            raise UserError(
                f"{f.path}:{line}: byte offset {offset} is not valid UTF-8; fix the file or pass "
                "--on-decode-error skip (leave such files out) or replace (U+FFFD)"
            )
        return True
    return False


def single_document(corpus: Corpus, cfg: PrepConfig) -> str | None:
    """The path of the corpus's only document, when that is known without reading it."""
    files = [f for g in corpus.groups for f in g.files]
    if len(files) == 1 and files[0].kind == "text" and cfg.txt_sample_by == "document":
        return files[0].path
    return None


def group_files(files: list[SourceFile], txt_sample_by: str) -> tuple[Group, ...]:
    """Consecutive .txt files in document mode share one load_dataset call (record i is file i, and
    a call per file would cost ~15 ms on directories of many small files); other files get one each
    so that errors name the file."""
    groups: list[Group] = []
    for f in files:
        if f.kind == "text" and txt_sample_by == "document" and groups and groups[-1].kind == "text":
            groups[-1] = Group("text", groups[-1].files + (f,))
        else:
            groups.append(Group(f.kind, (f,)))
    return tuple(groups)


def plan_hf(cfg: PrepConfig) -> Corpus:
    data_files = []
    for name in cfg.hf_data_files:
        p = Path(name)
        if p.exists():
            data_files.append(stat_source(p, "hf").describe())
        elif not any(ch in name for ch in "*?[") and "://" not in name:
            raise UserError(f"--hf-data-files {name}: no such file")
        else:
            data_files.append({"path": name})
    return Corpus(
        groups=(Group("hf"),),
        description={
            "hf_dataset": cfg.hf_dataset,
            "hf_config": cfg.hf_config,
            "hf_split": cfg.hf_split,
            "hf_data_files": data_files,
        },
        estimated_tokens=None,
    )


def plan(cfg: PrepConfig) -> Corpus:
    return plan_local(cfg) if cfg.sources else plan_hf(cfg)


def default_val_tokens(corpus: Corpus) -> tuple[int, str]:
    """The --val-tokens default and the rule that produced it (recorded in the manifest).

    min(10M, max(1% of E, min(16,384, 10% of E), 1)) for E tokens estimated from source bytes: 1% of a
    large corpus, never below the 16,384 tokens a small preset's evaluation needs, never above 10% of
    a tiny corpus for the sake of that floor, and never 0: every corpus gets a val split of at least one
    whole document unless --val-tokens 0 says otherwise (a 3-token corpus used to get none, silently,
    while a 32 KB one-document corpus was refused; now both meet the same rule, pipeline.VAL_RULE).
    """
    if corpus.estimated_tokens is None:
        return DEFAULT_MAX_VAL_TOKENS, f"default for a streamed dataset of unknown size: {DEFAULT_MAX_VAL_TOKENS}"
    est = corpus.estimated_tokens
    val = min(
        DEFAULT_MAX_VAL_TOKENS,
        max(int(est * DEFAULT_VAL_FRACTION), min(DEFAULT_MIN_VAL_TOKENS, int(est * DEFAULT_MAX_VAL_SHARE)), 1),
    )
    return val, (
        f"min({DEFAULT_MAX_VAL_TOKENS}, max(1% of ~{est} tokens, min({DEFAULT_MIN_VAL_TOKENS}, 10% of "
        f"them), 1)), estimated as source bytes / {BYTES_PER_TOKEN}"
    )


def text_bytes(f: SourceFile, cfg: PrepConfig) -> int:
    """Bytes of text a file holds; for parquet the uncompressed size of the text column, for a saved dataset
    its text column's Arrow bytes (memory-mapped: nothing is read)."""
    if f.kind == SAVED:
        return open_saved(f.path, cfg.hf_split, cfg.text_field).data.nbytes
    if f.kind != "parquet":
        return f.bytes
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(f.path).metadata
    except Exception:  # not parquet: check() reports it with a clear message
        return f.bytes
    total = 0
    for rg in range(meta.num_row_groups):
        group = meta.row_group(rg)
        for c in range(group.num_columns):
            if group.column(c).path_in_schema == cfg.text_field:
                total += group.column(c).total_uncompressed_size
    return total


# ---------------------------------------------------------------------------------------------
# Checks that run before any tokenizing


def first_bad_utf8(path: str, chunk_bytes: int = 1 << 24) -> tuple[int, int] | None:
    """(byte offset, line number) of the first invalid UTF-8 byte, or None; reads in bounded chunks."""
    offset = lines = 0
    pending = b""
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_bytes)
            data = pending + chunk
            try:
                _, used = codecs.utf_8_decode(data, "strict", not chunk)
            except UnicodeDecodeError as e:
                return offset + e.start, lines + data.count(b"\n", 0, e.start) + 1
            lines += data.count(b"\n", 0, used)
            offset += used
            pending = data[used:]
            if not chunk:
                return None


def check_first_jsonl_record(path: str, text_field: str) -> None:
    """Catch the common mistakes (not JSON lines, wrong --text-field) before any work."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                problem = jsonl_line_problem(raw, text_field)
                if problem:
                    raise UserError(f"{path}:{lineno}: {problem}")
                return


def is_text_type(kind) -> bool:
    """Whether an Arrow column of this type holds text as it is (or nothing: all nulls, refused record by
    record), not JSON text made from mixed types."""
    import pyarrow as pa

    return (
        pa.types.is_string(kind)
        or pa.types.is_large_string(kind)
        or pa.types.is_null(kind)
        or (hasattr(pa.types, "is_string_view") and pa.types.is_string_view(kind))
    )


def jsonl_line_problem(raw: bytes, text_field: str) -> str | None:
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"byte {e.start} of the line is not valid UTF-8 (JSON must be UTF-8)"
    except json.JSONDecodeError as e:
        return f"not valid JSON ({e.msg} at column {e.colno})"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object with a {text_field!r} field"
    if text_field not in record:
        keys = ", ".join(list(record)[:8])
        return f"record has no {text_field!r} field (fields: {keys}); choose one with --text-field"
    if not isinstance(record[text_field], str):
        return f"field {text_field!r} is {type(record[text_field]).__name__}, not a string"
    return None


JSON_EXPECTED = "a .json/.jsonl source holds JSON lines (one object a line) or one JSON array of objects"


def locate_json_problem(path: str, text_field: str) -> str | None:
    """'file:line: problem' for the first bad line of a JSON-lines file, or None if none is found."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip() and (problem := jsonl_line_problem(raw, text_field)):
                if lineno == 1 and raw.lstrip().startswith(b"["):
                    return None  # a JSON array file: line numbers mean nothing
                if lineno == 1 and raw.lstrip().startswith(b"{") and (whole := json_object_problem(path, text_field)):
                    return whole
                return f"{path}:{lineno}: {problem}"
    return None


def json_object_problem(path: str, text_field: str) -> str | None:
    """What is wrong with a file that is one JSON object written over several lines (pretty-printed), or None
    when it is not one: valid JSON, but a single object is not a list of records."""
    try:
        with open(path, "rb") as f:
            whole = json.load(f)
    except (ValueError, OSError):
        return None
    if not isinstance(whole, dict):
        return None
    keys = ", ".join(list(whole)[:8])
    lists = [k for k, v in whole.items() if isinstance(v, list)]
    hint = f"; its list field {lists[0]!r} may hold the records: write them one a line" if lists else ""
    return (
        f"{path}: valid JSON, but one object written over several lines (fields: {keys}), where "
        f"{JSON_EXPECTED}, each with a {text_field!r} field{hint}"
    )


def check_parquet_schema(path: str, text_field: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable parquet file ({e})") from None
    if text_field not in schema.names:
        raise UserError(
            f"{path}: no column {text_field!r} (columns: {', '.join(schema.names[:8])}); choose one with --text-field"
        )
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"{path}: column {text_field!r} has type {kind}, not string")


# ---------------------------------------------------------------------------------------------
# Reading


class RecordReader:
    """Yields record texts in source order from a given record number.

    `group_records` holds the record count of every group read to its end (and those known from an
    earlier run), so that a resumed run skips whole groups without opening them.
    """

    def __init__(self, corpus: Corpus, cfg: PrepConfig, group_records: list[int] | None = None):
        self.corpus = corpus
        self.cfg = cfg
        self.group_records = list(group_records or [])

    def records(self, start: int = 0) -> Iterator[str]:
        first = 0  # record number of the group's first record
        for gi, group in enumerate(self.corpus.groups):
            if gi < len(self.group_records) and first + self.group_records[gi] <= start:
                first += self.group_records[gi]
                continue
            n = yield from self.read_group(group, skip=max(0, start - first))
            if gi == len(self.group_records):
                self.group_records.append(n)
            first += n

    def read_group(self, group: Group, skip: int) -> Iterator[str]:
        """Yield the group's records after the first `skip`; return the group's record count."""
        if group.kind == "text" and self.cfg.txt_sample_by == "document":
            # record i is file i: skip by leaving files out rather than reading them
            files = group.files[skip:]
            yield from self.read_builder(Group("text", files), 0) if files else ()
            return len(group.files)
        n = yield from self.read_builder(group, skip)
        return n

    def read_builder(self, group: Group, skip: int) -> Iterator[str]:
        import pyarrow as pa

        n = 0
        name = self.field(group)
        try:
            with readable_paths([f.path for f in group.files]) as paths:
                # Arrow tables, not the default Python format: unformatted, IterableDataset.iter
                # builds a dict per example and then regroups them into a batch, which cost about
                # as much CPU as tokenizing (all of it in the main process, so it also capped the
                # parallel speedup).
                ds = self.load(group, paths).with_format("arrow")
                # In document mode a .txt row is a whole file: one at a time, or a batch would hold
                # READ_BATCH_ROWS files in memory at once.
                rows = 1 if group.kind == "text" and self.cfg.txt_sample_by == "document" else READ_BATCH_ROWS
                for table in ds.iter(batch_size=rows):
                    if n + table.num_rows <= skip:  # resuming: whole tables before the start are not converted
                        n += table.num_rows
                        continue
                    if name not in table.column_names:
                        raise self.bad_record(group, n, f"no {self.cfg.text_field!r} field")
                    column = table.column(name)
                    if not is_text_type(column.type):
                        # datasets' JSON builder turns a field of mixed types (a string here, a number or
                        # true there) into JSON text for every record: the training tokens would hold
                        # quotes and escapes. Refused, naming the record that is not a string.
                        raise self.bad_record(group, n, f"{self.cfg.text_field!r} is not a string in every record")
                    for text in column.to_pylist():
                        if n >= skip:
                            if not isinstance(text, str):
                                raise self.bad_record(group, n, f"{self.cfg.text_field!r} is missing or not a string")
                            yield text
                        n += 1
        except OSError as e:  # a source gone or unreadable since the plan: name it (not --out)
            raise self.read_failure(group, e) from None
        except (pa.ArrowException, UnicodeDecodeError, ValueError) as e:
            if isinstance(e, UserError):
                raise
            raise self.bad_record(group, n, f"cannot be read: {str(e).splitlines()[0]}") from None
        return n

    def read_failure(self, group: Group, e: OSError) -> UserError:
        """The source behind an OSError while reading: the first of the group's files that cannot be
        opened now, else the error's own words."""
        for f in group.files:
            try:
                open(f.path, "rb").close()
            except OSError as found:
                return unreadable(f.path, found)
        where = group.files[0].path if len(group.files) == 1 else f"{group.files[0].path} (or a file after it)"
        return unreadable(where, e)

    def field(self, group: Group) -> str:
        return "text" if group.kind == "text" else self.cfg.text_field

    def bad_record(self, group: Group, record: int, problem: str) -> UserError:
        """The clearest message available: file:line for JSON lines, else the record number."""
        if group.kind == "json":
            located = locate_json_problem(group.files[0].path, self.cfg.text_field)
            if located:
                return UserError(located)
        where = group.files[min(record, len(group.files) - 1)].path if group.files else self.cfg.hf_dataset
        return UserError(f"{where}: record {record + 1}: {problem}")

    def load(self, group: Group, paths: list[str] = ()):
        """The streaming dataset of group: the HF dataset, or `paths` (group's files as
        readable_paths gives them) through the builder of their kind; a saved dataset memory-mapped."""
        import datasets

        cfg = self.cfg
        if group.kind == SAVED:
            return open_saved(paths[0], cfg.hf_split, cfg.text_field)
        if group.kind == "hf":
            try:
                ds = datasets.load_dataset(
                    cfg.hf_dataset,
                    cfg.hf_config,
                    split=cfg.hf_split,
                    streaming=True,
                    data_files=list(cfg.hf_data_files) or None,
                )
            except Exception as e:  # hub, network and builder errors alike: the user must act
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise UserError(f"--hf-dataset {cfg.hf_dataset}: cannot open it: {first}") from None
            if ds.column_names is not None and cfg.text_field not in ds.column_names:
                raise UserError(
                    f"--hf-dataset {cfg.hf_dataset}: no column {cfg.text_field!r} "
                    f"(columns: {', '.join(ds.column_names[:8])}); choose one with --text-field"
                )
            if ds.column_names is not None:
                ds = ds.select_columns([cfg.text_field])
            return ds
        kwargs: dict = {}
        if group.kind == "text":
            kwargs = {
                "sample_by": cfg.txt_sample_by,
                "encoding_errors": "replace" if cfg.on_decode_error == "replace" else "strict",
            }
        elif group.kind == "parquet":
            kwargs = {"columns": [cfg.text_field]}
        return datasets.load_dataset(group.kind, data_files=list(paths), split="train", streaming=True, **kwargs)


def open_saved(path: str, split: str, text_field: str):
    """A save_to_disk directory as a Dataset of its text column alone (memory-mapped), a DatasetDict's `split`
    of it. Any problem (not loadable, no such split, no such column, a column that
    is not text) is one UserError naming the fix."""
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # a damaged directory: datasets' own words, first line
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: a datasets save_to_disk directory that cannot be loaded ({first})") from None
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if split not in ds:
            raise UserError(
                f"{path}: the saved DatasetDict has no split {split!r} (splits: {', '.join(splits)}); choose one "
                "with --hf-split"
            )
        ds = ds[split]
    if text_field not in ds.column_names:
        raise UserError(
            f"{path}: no column {text_field!r} (columns: {', '.join(ds.column_names[:8])}); "
            "choose one with --text-field"
        )
    kind = ds.data.schema.field(text_field).type
    if not is_text_type(kind):
        raise UserError(f"{path}: column {text_field!r} has type {kind}, not string")
    return ds.select_columns([text_field])
