"""One data_prep job: plan sources -> check -> choose val -> write val, then train -> manifest.

Records are read up to three times: once to choose the val documents (tokenizing only candidates),
once for the val shards (reading stops after the last val record), once for the train shards.
Tokenizing dominates the cost, and each document is tokenized for the shards only once (val
candidates twice), so the extra reads cost little; they buy a val split chosen from the whole
corpus while every shard stays restartable from the positions in the manifest.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from data_prep import sources
from data_prep.encode import encode_batches, make_batches
from data_prep.prep_config import PrepConfig, UserError
from data_prep.shard_writer import (
    ShardWriter,
    load_manifest,
    missing_dirs,
    new_manifest,
    open_output,
    remove_unused_output,
    save_manifest,
    val_runs,
)
from data_prep.verify import shard_damage
from gpt2.core.config import TRAIN_PRESETS

SPREAD_OVERSAMPLE = 2
"""Spread: documents whose hash falls in the lowest SPREAD_OVERSAMPLE x budget/estimate of the hash
range are tokenized as candidates; an estimate off by more than that (bytes per token far from 4)
costs one more reading pass at a 4x wider range."""


@dataclass(frozen=True)
class Summary:
    out: Path
    already_complete: bool
    documents: int
    """Records (documents) in the whole corpus."""
    val_tokens: int
    train_tokens: int
    shards: int
    run_tokens: int
    """Tokens tokenized and written by this run (less than the total after a resume)."""
    elapsed_s: float
    resumed_at_record: int = 0
    skipped_files: tuple[str, ...] = ()
    repaired: tuple[str, ...] = ()
    """Shards of a finished job this run wrote again (they were missing or damaged)."""
    val_select: str = ""
    """How the val documents were chosen (PrepConfig.resolved_val_select), said in the summary."""

    @property
    def tokens(self) -> int:
        return self.val_tokens + self.train_tokens

    def lines(self) -> list[str]:
        if self.repaired:
            return [
                f"repaired {self.out}: rewrote {', '.join(self.repaired)}; all {self.shards} shards match "
                f"the manifest ({self.tokens:,} tokens)"
            ]
        if self.already_complete:
            return [
                f"nothing to do: {self.out} already holds the finished job ({self.shards} shards, "
                f"{self.tokens:,} tokens, every shard's size and sha256 as the manifest lists)"
            ]
        rate = self.run_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        out = [
            f"documents {self.documents:,} | tokens {self.tokens:,} (val {self.val_tokens:,}, "
            f"train {self.train_tokens:,}) | shards {self.shards} | elapsed {self.elapsed_s:.1f} s | "
            f"{rate:,.0f} tok/s | {self.out}"
        ]
        if self.resumed_at_record:
            out.append(f"resumed at record {self.resumed_at_record:,}; this run wrote {self.run_tokens:,} tokens")
        if self.skipped_files:
            more = ", ..." if len(self.skipped_files) > 1 else ""
            out.append(
                f"skipped {len(self.skipped_files)} file(s) (manifest.json's skipped_files and skipped_why say "
                f"why): {self.skipped_files[0]}{more}"
            )
        if self.val_tokens == 0:  # only --val-tokens 0 does this (VAL_RULE); the trainer needs to be told too
            out.append("no val split (--val-tokens 0): train on it with --eval-tokens 0")
        elif self.val_select:
            out.append(VAL_SELECTED[self.val_select])
        return out


VAL_SELECTED = {
    "spread": "val split: whole documents chosen by a hash of their text, from all over the corpus (--val-select "
    "first takes the first documents instead)",
    "first": "val split: the first documents in source order (--val-select first, or a streamed --hf-dataset)",
}


def resolve_val_tokens(cfg: PrepConfig, corpus: sources.Corpus) -> tuple[int, str]:
    if cfg.val_tokens is not None:
        return cfg.val_tokens, "--val-tokens"
    return sources.default_val_tokens(corpus)


def job_settings(cfg: PrepConfig, val_tokens: int) -> dict:
    """The settings in the fingerprint. val_select only when spread: a job with the first-documents
    rule keeps the fingerprint earlier versions gave it, so their finished directories stay valid."""
    select = {} if cfg.resolved_val_select == "first" else {"val_select": cfg.resolved_val_select}
    return {**cfg.settings, "val_tokens": val_tokens, **select}


def prepare(cfg: PrepConfig, *, log: Callable[[str], None] = print) -> Summary:
    """Run the job. One that fails before it has done any work leaves no --out behind (an empty
    directory read as "prepared" to a person, and a rerun would start from nothing anyway)."""
    made = missing_dirs(cfg.out)
    try:
        return run_job(cfg, log)
    except BaseException:
        remove_unused_output(cfg.out, made)
        raise


def earlier_select(cfg: PrepConfig, val_tokens: int, log: Callable[[str], None]) -> PrepConfig:
    """cfg, or cfg with --val-select first where --out holds this job begun by an earlier version, when an
    explicit --val-tokens took the first documents: its shards and val split stay valid, and a line says so."""
    if cfg.val_select is not None or cfg.resolved_val_select != "spread":
        return cfg
    try:
        old = load_manifest(cfg.out)
    except UserError:
        return cfg  # open_output names the unreadable manifest
    first = replace(cfg, val_select="first")
    if old is None or old.get("settings") != job_settings(first, val_tokens):
        return cfg
    log(
        f"{cfg.out}: continuing the job as it began, its val split the first documents (--val-select first, "
        "what --val-tokens chose before spread became the rule for local files)"
    )
    return first


def run_job(cfg: PrepConfig, log: Callable[[str], None]) -> Summary:
    start_s = time.perf_counter()
    corpus = sources.plan(cfg)
    val_tokens, rule = resolve_val_tokens(cfg, corpus)
    cfg = earlier_select(cfg, val_tokens, log)
    if cfg.resolved_val_select == "spread":
        rule += "; documents chosen by the blake2b hash of their text (lowest first)"
    manifest = new_manifest(corpus.description, job_settings(cfg, val_tokens), rule)
    if cfg.sources:  # as given (not in the fingerprint): what a command to prepare this corpus again names
        manifest["source_args"] = [str(Path(s).absolute()) for s in cfg.sources]
    manifest = open_output(cfg.out, manifest)
    if manifest["complete"]:
        return check_finished(cfg, corpus, manifest, log, start_s)
    corpus = sources.check(corpus, cfg)
    if val_tokens > 0 and (only := sources.single_document(corpus, cfg)):
        raise one_document(f"{only}: a .txt file is one document")
    manifest["skipped_files"] = list(corpus.skipped_files)
    manifest["skipped_why"] = list(corpus.skipped_why)
    reader = sources.RecordReader(corpus, cfg, manifest["group_records"])
    runs = val_runs(manifest)
    if "val_records" not in manifest:
        if runs is None or not manifest["shards"]:  # a fresh job, or an older version's stopped inside val
            manifest["shards"] = []
            runs = choose_val(reader, cfg, corpus, val_tokens)
        manifest["val_records"] = runs
        manifest["group_records"] = list(reader.group_records)
    save_manifest(cfg.out, manifest)

    shards = manifest["shards"]
    resumed = shards[-1]["next_record"] if shards else 0
    if shards:
        log(f"resuming {cfg.out}: {len(shards)} shard(s) already written, continuing at record {resumed:,}")
    already = sum(s["tokens"] for s in shards)
    val = ShardWriter(cfg.out, manifest, split="val", shard_tokens=cfg.shard_tokens, group_records=reader.group_records)
    if not any(s["split"] == "train" for s in shards):
        write_split(val, reader, cfg, runs)
        val.flush(next_record=runs[-1][1] if runs else 0, carry=0)
    train = ShardWriter(
        cfg.out, manifest, split="train", shard_tokens=cfg.shard_tokens, group_records=reader.group_records
    )
    write_split(train, reader, cfg, runs)
    n_records = sum(reader.group_records)
    if n_records == 0:
        raise UserError("empty corpus: the sources hold no documents")
    try:
        check_split(val.tokens, train.tokens, val_tokens, 0)
    except UserError as e:  # the manifest stays incomplete: the trainer refuses the directory
        raise UserError(f"{e}; delete {cfg.out} first (its shards are this split's)") from None
    totals = {
        "documents": n_records,
        "tokens": val.tokens + train.tokens,
        "val_tokens": val.tokens,
        "train_tokens": train.tokens,
    }
    train.finish(n_records, totals)
    return Summary(
        cfg.out,
        False,
        n_records,
        val.tokens,
        train.tokens,
        len(manifest["shards"]),
        val.tokens + train.tokens - already,
        time.perf_counter() - start_s,
        resumed,
        corpus.skipped_files,
        val_select=cfg.resolved_val_select,
    )


# ---------------------------------------------------------------------------------------------- val choice


def text_hash(text: str) -> int:
    """A document's place in the spread order: depends on its text alone, so not on --workers, on the
    corpus's file order, or on where a run was interrupted."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def choose_val(reader: sources.RecordReader, cfg: PrepConfig, corpus: sources.Corpus, budget: int) -> list[list[int]]:
    """The val records as runs [start, end): whole documents, in hash order (spread) or source order
    (first), until they hold at least `budget` tokens (the one crossing the mark is taken whole)."""
    if budget == 0:
        return []
    if cfg.resolved_val_select == "first":
        return first_val(reader, cfg, budget, corpus)
    rate = min(1.0, SPREAD_OVERSAMPLE * budget / max(1, corpus.estimated_tokens or 1))
    while True:
        counts, n_records = candidate_tokens(reader, cfg, rate)
        chosen, total = spread_choice(sorted(counts), budget)
        if total >= budget or rate == 1.0:
            break
        rate = min(1.0, rate * 4)
    if not chosen and counts:  # every document far larger than the budget: the first in hash order, as before
        _, record, total = min(counts)
        chosen = [record]
    if n_records == 0:
        raise UserError("empty corpus: the sources hold no documents")
    if len(chosen) == n_records:
        raise all_val(n_records, total, budget)
    taken = set(chosen)
    largest = max((n for _, record, n in counts if record in taken), default=0)
    if rate == 1.0:  # every document was counted: the split's sizes are known exactly
        check_split(total, sum(n for _, _, n in counts) - total, budget, largest)
    else:
        check_estimated_split(total, corpus, budget, largest)
    return to_runs(sorted(chosen))


VAL_DOC_LIMIT = 4
"""The spread choice passes over a document of more than this many times the val budget (it stays in train): a
corpus of a few large documents gave val a whole book, or 18.2M of its 18.2M tokens (issue 74)."""


def spread_choice(ordered: list[tuple[int, int, int]], budget: int) -> tuple[list[int], int]:
    """The val records from (hash, record, tokens) in hash order, and their tokens: whole documents until
    the budget is met, passing over those far larger than it (VAL_DOC_LIMIT)."""
    chosen, total = [], 0
    for _, record, n in ordered:
        if total >= budget:
            break
        if n <= VAL_DOC_LIMIT * budget:
            chosen.append(record)
            total += n
    return chosen, total


def candidate_tokens(reader: sources.RecordReader, cfg: PrepConfig, rate: float) -> tuple[list, int]:
    """[(hash, record, tokens)] of the documents whose hash is below rate x the hash range, and the
    number of records in the corpus."""
    limit = int(rate * 2**64)
    hashes: dict[int, int] = {}
    n_records = 0

    def candidates() -> Iterator[tuple[int, str]]:
        nonlocal n_records
        for record, text in enumerate(reader.records(0)):
            n_records = record + 1
            if (h := text_hash(text)) < limit:
                hashes[record] = h
                yield record, text

    tokens: dict[int, int] = {}
    for batch, _, counts in encode_batches(make_batches(candidates()), cfg.workers):
        for record, n in zip(batch.records, counts.tolist()):
            tokens[record] = tokens.get(record, 0) + n
    return [(hashes[r], r, n) for r, n in tokens.items()], n_records


def first_val(
    reader: sources.RecordReader, cfg: PrepConfig, budget: int, corpus: sources.Corpus | None = None
) -> list[list[int]]:
    """The rule of earlier versions: the first documents in source order."""
    total, end, sizes = 0, 0, {}
    for batch, _, counts in encode_batches(make_batches(enumerate(reader.records(0))), cfg.workers):
        for record, first, n in zip(batch.records, batch.first, counts.tolist()):
            if first and total >= budget:
                if corpus is not None:
                    check_estimated_split(total, corpus, budget, max(sizes.values(), default=0))
                return [[0, record]]
            total += n
            sizes[record] = sizes.get(record, 0) + n
            end = record + 1
    raise all_val(end, total, budget)


VAL_RULE = (
    "a val split is whole documents (at least one, unless --val-tokens 0) that leave at least one document for train"
)
"""The one rule for tiny corpora, whatever their size in bytes: said by the refusals below, at prep time."""


def one_document(what: str) -> UserError:
    """The refusal of a corpus of one document (a .txt file, a one-record .jsonl, 3 tokens or 32 KB alike)."""
    return UserError(
        f"the corpus is one document ({what}), and {VAL_RULE}: pass --val-tokens 0 for no val split "
        "(then train with --eval-tokens 0), or split it into documents (.txt: --txt-sample-by paragraph; "
        ".jsonl: one record each)"
    )


def all_val(n_records: int, tokens: int, budget: int) -> UserError:
    if n_records == 0:
        return UserError("empty corpus: the sources hold no documents")
    if n_records == 1:
        return one_document(f"{tokens:,} tokens")
    return UserError(
        f"all {n_records:,} documents ({tokens:,} tokens) would go to val (val budget {budget:,} "
        f"tokens), and {VAL_RULE}: pass a smaller --val-tokens (or 0 for no val split)"
    )


MIN_TRAIN_TOKENS = min(p["total_batch_size"] for p in TRAIN_PRESETS.values()) + 1
"""A train split must hold one optimizer step of the smallest preset (speed's 1,024 tokens, and the token after)."""
ESTIMATE_MARGIN = 2
"""Before tokenizing the train split its size is estimated from source bytes (bytes / 4: code is nearer 2.3,
so an estimate may be half the truth): refused then only when val exceeds this many times the estimate; the
exact check follows once the train split is written (check_split in run_job)."""


def lopsided(val: int, train: int, budget: int, largest: int, *, estimated: bool = False) -> str:
    """Why a split is refused and the ways out."""
    about = "about " if estimated else ""
    why = (
        f"val would be larger than train ({about}{val:,} against {about}{train:,} tokens)"
        if train < val
        else f"train would hold {about}{train:,} tokens, less than one optimizer step of the smallest preset "
        f"({MIN_TRAIN_TOKENS:,})"
    )
    big = (
        f"; a document of {largest:,} tokens crossed the val target of {budget:,} and went to val whole: split it "
        "(.jsonl: several records; .txt: --txt-sample-by paragraph)"
        if largest > 2 * max(budget, 1)
        else ""
    )
    return (
        f"{why}{big}. Pass a smaller --val-tokens (or 0 for no val split), or --val-select first (the first "
        "documents in source order) to choose other documents"
    )


def check_split(val: int, train: int, budget: int, largest: int) -> None:
    """The split's exact sizes: train at least as large as val and one optimizer step; else UserError."""
    if val and (train < val or train < MIN_TRAIN_TOKENS):
        raise UserError(lopsided(val, train, budget, largest))


def check_estimated_split(val: int, corpus: sources.Corpus, budget: int, largest: int) -> None:
    """Before the train split is tokenized: refused when the estimate leaves no doubt (ESTIMATE_MARGIN)."""
    if corpus.estimated_tokens is None:  # a streamed dataset of unknown size: the exact check after writing
        return
    train = corpus.estimated_tokens - val
    if val > ESTIMATE_MARGIN * max(train, 0):
        raise UserError(lopsided(val, max(train, 0), budget, largest, estimated=True))


def to_runs(records: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for r in records:
        if runs and runs[-1][1] == r:
            runs[-1][1] = r + 1
        else:
            runs.append([r, r + 1])
    return runs


def in_runs(runs: list[list[int]], record: int) -> bool:
    i = bisect.bisect_right(runs, [record, float("inf")]) - 1
    return i >= 0 and runs[i][0] <= record < runs[i][1]


# ---------------------------------------------------------------------------------------------- writing


def split_records(
    reader: sources.RecordReader, start: int, split: str, runs: list[list[int]]
) -> Iterator[tuple[int, str]]:
    """(record, text) of the split's records from `start`; val reading stops after its last record."""
    records = enumerate(reader.records(start), start)
    if split == "val":
        end = runs[-1][1] if runs else 0
        return ((r, t) for r, t in itertools.takewhile(lambda rt: rt[0] < end, records) if in_runs(runs, r))
    return ((r, t) for r, t in records if not in_runs(runs, r))


def write_split(writer: ShardWriter, reader: sources.RecordReader, cfg: PrepConfig, runs: list[list[int]]) -> None:
    """Stream the split's records from the writer's resume position through the tokenizer into it."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    bar = tqdm(
        unit="tok",
        unit_scale=True,
        desc=f"tokenizing {writer.split}",
        disable=not cfg.progress,
        mininterval=0.5 if interactive else 30,
        dynamic_ncols=True,
    )
    try:
        batches = make_batches(split_records(reader, writer.start_record, writer.split, runs))
        for batch, tokens, counts in encode_batches(batches, cfg.workers):
            writer.add_batch(tokens, counts, batch.records, batch.first, batch.last)
            bar.update(len(tokens))
            if writer.done:
                return
    finally:
        bar.close()


# ---------------------------------------------------------------------------------------------- rerun of a finished job


def check_finished(
    cfg: PrepConfig, corpus: sources.Corpus, manifest: dict, log: Callable[[str], None], start_s: float
) -> Summary:
    """A rerun over a finished job: every shard is checked (presence and size, then sha256; see
    verify.shard_damage) and the missing or damaged ones are re-encoded from the sources."""
    totals = manifest["totals"]
    damage = {e["file"]: why for e in manifest["shards"] if (why := shard_damage(cfg.out / e["file"], e))}
    summary = Summary(
        cfg.out,
        True,
        totals["documents"],
        totals["val_tokens"],
        totals["train_tokens"],
        len(manifest["shards"]),
        0,
        time.perf_counter() - start_s,
    )
    if not damage:
        return summary
    log(
        ", ".join(f"{name} was {why}" for name, why in damage.items())
        + ": re-encoding "
        + ("it" if len(damage) == 1 else "them")
        + f" from the sources into {cfg.out}"
    )
    corpus = sources.check(corpus, cfg)
    reader = sources.RecordReader(corpus, cfg, manifest["group_records"])
    runs = val_runs(manifest)
    for split in ("val", "train"):
        entries = [e["file"] for e in manifest["shards"] if e["split"] == split]
        repair = frozenset(i for i, name in enumerate(entries) if name in damage)
        if not repair:
            continue
        writer = ShardWriter(
            cfg.out,
            manifest,
            split=split,
            shard_tokens=cfg.shard_tokens,
            group_records=reader.group_records,
            repair=repair,
        )
        write_split(writer, reader, cfg, runs)
        end = (runs[-1][1] if runs else 0) if split == "val" else totals["documents"]
        writer.flush(next_record=end, carry=0)
        if not writer.done:
            raise UserError(
                f"{cfg.out}: the sources gave fewer tokens than {entries[max(repair)]} held; "
                f"delete {cfg.out} and rerun to start over"
            )
    return Summary(
        cfg.out,
        False,
        totals["documents"],
        totals["val_tokens"],
        totals["train_tokens"],
        len(manifest["shards"]),
        0,
        time.perf_counter() - start_s,
        repaired=tuple(damage),
    )
