"""One data_prep job: plan sources -> check -> read -> tokenize (in order) -> shards + manifest."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from data_prep import sources
from data_prep.config import PrepConfig, UserError
from data_prep.encode import encode_batches, make_batches
from data_prep.writer import ShardWriter, new_manifest, open_output, save_manifest


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

    @property
    def tokens(self) -> int:
        return self.val_tokens + self.train_tokens

    def lines(self) -> list[str]:
        if self.already_complete:
            return [f"nothing to do: {self.out} already holds the finished job ({self.shards} shards, "
                    f"{self.tokens:,} tokens); `python -m data_prep verify {self.out}` checks them"]
        rate = self.run_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        out = [f"documents {self.documents:,} | tokens {self.tokens:,} (val {self.val_tokens:,}, "
               f"train {self.train_tokens:,}) | shards {self.shards} | elapsed {self.elapsed_s:.1f} s | "
               f"{rate:,.0f} tok/s | {self.out}"]
        if self.resumed_at_record:
            out.append(f"resumed at record {self.resumed_at_record:,}; this run wrote {self.run_tokens:,} tokens")
        if self.skipped_files:
            out.append(f"skipped {len(self.skipped_files)} undecodable .txt file(s): {self.skipped_files[0]}, ...")
        return out


def resolve_val_tokens(cfg: PrepConfig, corpus: sources.Corpus) -> tuple[int, str]:
    if cfg.val_tokens is not None:
        return cfg.val_tokens, "--val-tokens"
    return sources.default_val_tokens(corpus)


def prepare(cfg: PrepConfig, *, log: Callable[[str], None] = print) -> Summary:
    start_s = time.perf_counter()
    corpus = sources.plan(cfg)
    val_tokens, rule = resolve_val_tokens(cfg, corpus)
    settings = {**cfg.settings, "val_tokens": val_tokens}
    manifest = open_output(cfg.out, new_manifest(corpus.description, settings, rule))
    shards = manifest["shards"]
    if manifest["complete"]:
        totals = manifest["totals"]
        return Summary(cfg.out, True, totals["documents"], totals["val_tokens"], totals["train_tokens"],
                       len(shards), 0, time.perf_counter() - start_s)
    corpus = sources.check(corpus, cfg)
    if val_tokens > 0 and (only := sources.single_document(corpus, cfg)):
        raise UserError(f"{only} is the corpus's only document (a .txt file is one document), so it cannot be "
                        "split into val and train documents; pass --txt-sample-by paragraph or --val-tokens 0")
    manifest["skipped_files"] = list(corpus.skipped_files)
    save_manifest(cfg.out, manifest)

    reader = sources.RecordReader(corpus, cfg, manifest["group_records"])
    writer = ShardWriter(cfg.out, manifest, shard_tokens=cfg.shard_tokens, val_tokens=val_tokens,
                         group_records=reader.group_records)
    begin = writer.start_record
    if begin or shards:
        log(f"resuming {cfg.out}: {len(shards)} shard(s) already written, continuing at record {begin:,}")
    already = sum(writer.totals.values())
    run_tokens_written(writer, reader, begin, cfg)
    n_records = sum(reader.group_records)
    if n_records == 0:
        raise UserError("empty corpus: the sources hold no documents")
    if writer.totals["train"] == 0:
        raise UserError(f"all {n_records:,} documents ({writer.totals['val']:,} tokens) went to val "
                        f"(--val-tokens {val_tokens:,}): nothing is left for train; lower --val-tokens")
    totals = {"documents": n_records, "tokens": sum(writer.totals.values()), "val_tokens": writer.totals["val"],
              "train_tokens": writer.totals["train"]}
    writer.finish(n_records, totals)
    return Summary(cfg.out, False, n_records, writer.totals["val"], writer.totals["train"],
                   len(manifest["shards"]), sum(writer.totals.values()) - already,
                   time.perf_counter() - start_s, begin, corpus.skipped_files)


def run_tokens_written(writer: ShardWriter, reader: sources.RecordReader, begin: int, cfg: PrepConfig) -> int:
    """Stream records from `begin` through the tokenizer into the writer; return tokens handled."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    bar = tqdm(unit="tok", unit_scale=True, desc="tokenizing", disable=not cfg.progress,
               mininterval=0.5 if interactive else 30, dynamic_ncols=True)
    total = 0
    try:
        batches = make_batches(reader.records(begin), begin)
        for batch, tokens, counts in encode_batches(batches, cfg.workers):
            writer.add_batch(tokens, counts, batch.records, batch.first, batch.last)
            total += len(tokens)
            bar.update(len(tokens))
            bar.set_postfix(docs=f"{batch.records[-1] + 1:,}", shards=len(writer.manifest["shards"]),
                            refresh=False)
    finally:
        bar.close()
    return total
