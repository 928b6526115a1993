"""Token streams -> val/train shards, with a manifest that makes the job restartable and repairable.

Split rule: the pipeline chooses the val documents first (pipeline.choose_val) and records them in
the manifest as `val_records`, runs of record numbers [start, end). The val shards then hold those
documents and the train shards every other document, each in source order. Within a split, shards
hold exactly --shard-tokens tokens except the last, and a document may continue from one shard into
the next (as llm.c's fineweb.py does).

Restart: after every shard the manifest records the shard's sha256 and its split's resume position:
the next record to read and how many of its tokens (`carry_tokens`) are already in shards. A rerun
skips those records, drops the carried tokens and continues, producing the bytes of an uninterrupted
run. The same positions let a rerun over a finished directory rewrite just the shards that are
missing or damaged: shard i of a split starts where shard i-1's entry says (ShardWriter's `repair`).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np

from data_prep.prep_config import UserError
from gpt2.core.atomic import atomic_write_text
from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE
from gpt2.data.shards import HEADER_BYTES, MAGIC, MANIFEST, PREP_TOKENIZER, VERSION, make_header, write_shard

MANIFEST_VERSION = 1
TOKENIZER = PREP_TOKENIZER  # defined beside the shard format: the trainer checks it too
SHARD_RE = re.compile(r"^(val|train)_\d{6}\.bin$")
TEMP_RE = re.compile(r"^((val|train)_\d{6}\.bin|manifest\.json)\..*\.tmp$")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def fingerprint(sources: dict, settings: dict) -> str:
    """Identifies the output bytes: sources (paths, sizes, mtimes) and settings, not --workers."""
    blob = json.dumps({"sources": sources, "settings": settings, "tokenizer": TOKENIZER}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def new_manifest(sources: dict, settings: dict, val_tokens_rule: str) -> dict:
    return {
        "manifest_version": MANIFEST_VERSION,
        "format": {"magic": MAGIC, "version": VERSION, "header_bytes": HEADER_BYTES, "dtype": "uint16 little-endian"},
        "tokenizer": TOKENIZER,
        "vocab_size": GPT2_VOCAB_SIZE,
        "eot_token": EOT_TOKEN,
        "fingerprint": fingerprint(sources, settings),
        "settings": settings,
        "val_tokens_rule": val_tokens_rule,
        "sources": sources,
        "complete": False,
        "shards": [],
        "group_records": [],
        "totals": None,
    }


def load_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text())
        manifest["fingerprint"], manifest["shards"]
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is unreadable ({e}); delete {out} to start over") from None
    return manifest


def save_manifest(out: Path, manifest: dict) -> None:
    """Atomic: a crash leaves the previous manifest or this one, never half of one."""
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1))


def explain_difference(old: dict, new: dict) -> str:
    """What changed between an existing manifest and this job, for the refusal message."""
    changes = [
        f"{k} {old['settings'].get(k)} -> {v}"
        for k, v in new["settings"].items()
        if old.get("settings", {}).get(k) != v
    ]
    old_src, new_src = old.get("sources", {}), new["sources"]
    if "files" in old_src and "files" in new_src:
        before = {f["path"]: f for f in old_src["files"]}
        after = {f["path"]: f for f in new_src["files"]}
        changes += [f"new source {p}" for p in after if p not in before]
        changes += [f"missing source {p}" for p in before if p not in after]
        changes += [f"{p} changed (size or mtime)" for p in after if p in before and before[p] != after[p]]
        if not changes and list(before) != list(after):
            changes.append("source order")
    elif old_src != new_src:
        changes.append("different sources")
    return "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "") or "tokenizer"


def open_output(out: Path, manifest: dict) -> dict:
    """The manifest to continue from: a fresh one, or the existing one of the same job.

    Refuses directories holding shards of another job. Removes temp files a crash left behind.
    """
    out.mkdir(parents=True, exist_ok=True)
    old = load_manifest(out)
    if old is None:
        stray = sorted(p.name for p in out.iterdir() if SHARD_RE.match(p.name))
        if stray:
            raise UserError(
                f"--out {out} holds shards ({stray[0]}, ...) but no {MANIFEST}: they are not from "
                "this job; use an empty directory or delete them"
            )
        return manifest
    if (
        old["fingerprint"] != manifest["fingerprint"]
        and not old["shards"]
        and not any(SHARD_RE.match(p.name) for p in out.iterdir())
    ):
        return manifest  # an earlier job that wrote nothing (e.g. failed on its input): nothing to protect
    if old["fingerprint"] != manifest["fingerprint"]:
        raise UserError(
            f"--out {out} holds shards made from different sources or settings "
            f"({explain_difference(old, manifest)}); use another --out, or delete {out} to start over"
        )
    for p in out.iterdir():
        if TEMP_RE.match(p.name):
            p.unlink(missing_ok=True)
    return old


def missing_dirs(out: Path) -> list[Path]:
    """out and those of its parents that do not exist yet (what open_output will create), deepest first."""
    out = out.absolute()
    return [p for p in (out, *out.parents) if not p.exists()]


def remove_unused_output(out: Path, made: list[Path]) -> None:
    """After a failed job: remove the directories it created (`made`, from missing_dirs) when they hold
    no work: nothing but a manifest without shards or chosen val documents, and temp files. A
    directory that existed before, or holds a shard or a val choice (a long pass over a large
    corpus), stays for the rerun to continue."""
    out = out.absolute()
    if out not in made or not out.is_dir():
        return
    try:
        manifest = load_manifest(out)
    except UserError:
        return
    if manifest is not None and (manifest["shards"] or manifest.get("val_records")):
        return
    names = [p.name for p in out.iterdir()]
    if any(n != MANIFEST and not TEMP_RE.match(n) for n in names):
        return
    for n in names:
        (out / n).unlink(missing_ok=True)
    for d in made:  # deepest first; one a user filled meanwhile stays
        try:
            d.rmdir()
        except OSError:
            return


def val_runs(manifest: dict) -> list[list[int]] | None:
    """The val records as runs [start, end), or None where the manifest cannot tell (start the job over).

    Manifests written before val_records existed used the first-documents rule: val was records
    [0, next_record of the last val shard) once a train shard was written or the job finished.
    """
    if "val_records" in manifest:
        return manifest["val_records"]
    shards = manifest["shards"]
    val = [s for s in shards if s["split"] == "val"]
    if manifest.get("complete") or any(s["split"] == "train" for s in shards):
        return [[0, val[-1]["next_record"]]] if val else []
    return None if shards else []


class ShardWriter:
    """Writes one split: fills a preallocated shard buffer, writes it out when full, keeps the manifest current.

    repair: indices of the split's listed shards to write again (the others are produced and dropped,
    the manifest is left alone, and a rewritten shard must match its listed sha256); `done` turns
    True once the last of them is written.
    """

    def __init__(
        self,
        out: Path,
        manifest: dict,
        *,
        split: str,
        shard_tokens: int,
        group_records: list[int],
        repair: frozenset[int] = frozenset(),
    ):
        self.out = out
        self.manifest = manifest
        self.split = split
        self.shard_tokens = shard_tokens
        self.group_records = group_records  # the reader's list, copied into the manifest at each shard
        self.repair = repair
        self.done = False
        self.buffer = np.empty(shard_tokens, dtype=np.uint16)
        self.fill = 0
        self.entries = [x for x in manifest["shards"] if x["split"] == split]
        self.index = min(repair) if repair else len(self.entries)
        self.tokens = sum(x["tokens"] for x in self.entries[: self.index])
        before = self.entries[self.index - 1] if self.index else None
        self.start_record = before["next_record"] if before else 0
        self.drop = before["carry_tokens"] if before else 0
        """Tokens of start_record already in earlier shards: dropped."""
        self.record = self.start_record
        self.record_written = 0

    def add(self, tokens: np.ndarray, record: int, first: bool, last: bool) -> None:
        """Append one piece of a document (tokens start with EOT when first)."""
        if first:
            self.record, self.record_written = record, 0
        if self.drop:
            k = min(self.drop, len(tokens))
            tokens, self.drop, self.record_written = tokens[k:], self.drop - k, self.record_written + k
        while len(tokens) and not self.done:
            n = min(self.shard_tokens - self.fill, len(tokens))
            self.buffer[self.fill : self.fill + n] = tokens[:n]
            tokens = tokens[n:]
            self.fill += n
            self.record_written += n
            self.tokens += n
            if self.fill == self.shard_tokens:
                ends_record = last and not len(tokens)
                self.flush(
                    next_record=record + 1 if ends_record else record, carry=0 if ends_record else self.record_written
                )

    def add_batch(
        self, tokens: np.ndarray, counts: np.ndarray, records: list[int], first: list[bool], last: list[bool]
    ) -> None:
        """Append a worker's batch: pieces back to back in `tokens`, piece i holding counts[i] tokens.

        Most batches land inside the current shard, with no resume drop pending: one copy then does
        what add() would do piece by piece (per-piece calls cost ~20 us each, a tenth of the main
        process's time on a 200 MB corpus). Anything else goes through add(), so there is one
        definition of the rules.
        """
        n = len(tokens)
        if self.drop or self.fill + n >= self.shard_tokens:
            start = 0
            for i, end in enumerate(np.cumsum(counts).tolist()):
                self.add(tokens[start:end], records[i], first[i], last[i])
                start = end
            return
        self.buffer[self.fill : self.fill + n] = tokens
        self.fill += n
        self.tokens += n
        # The bookkeeping add() keeps: the last record, and how many of its tokens are written.
        j = len(records) - 1
        while j > 0 and records[j - 1] == records[-1]:
            j -= 1
        written = int(counts[j:].sum())
        self.record = records[-1]
        self.record_written = written if first[j] else self.record_written + written

    def finish(self, n_records: int, totals: dict) -> None:
        self.flush(next_record=n_records, carry=0)
        self.manifest["group_records"] = list(self.group_records)
        self.manifest["complete"] = True
        self.manifest["totals"] = totals
        save_manifest(self.out, self.manifest)

    def flush(self, *, next_record: int, carry: int) -> None:
        if not self.fill or self.done:
            return
        data = self.buffer[: self.fill]
        name = shard_name(self.split, self.index)
        digest = hashlib.sha256(make_header(self.fill).tobytes())
        digest.update(data)
        if self.repair:
            self._rewrite(name, data, digest.hexdigest())
        else:
            write_shard(self.out / name, data)
            self.manifest["shards"].append(
                {
                    "file": name,
                    "split": self.split,
                    "tokens": int(self.fill),
                    "sha256": digest.hexdigest(),
                    "next_record": next_record,
                    "carry_tokens": carry,
                }
            )
            self.manifest["group_records"] = list(self.group_records)
            save_manifest(self.out, self.manifest)
        self.index += 1
        self.fill = 0

    def _rewrite(self, name: str, data: np.ndarray, sha256: str) -> None:
        if self.index in self.repair:
            if sha256 != self.entries[self.index]["sha256"]:
                raise UserError(
                    f"{self.out / name}: re-encoded from the sources, its sha256 still differs from "
                    f"{MANIFEST} (sources edited in place, or another tokenizer version?); delete "
                    f"{self.out} and rerun to start over"
                )
            write_shard(self.out / name, data)
        self.done = self.index >= max(self.repair)
