"""Start-up checks of the token shards against data_prep's manifest.json and the vocabulary.

The loader's header checks (gpt2/data/shards.py read_header) cannot see a shard of another data_prep run,
a manifest of another run, a flipped bit among the tokens, or token ids the model has no embedding
for. Those trained with exit 0, or crashed the first step (an id >= 50304: IndexError on a CPU, a
device-side assert on a GPU), or gave `loss nan` until --max-bad-steps (ids 50257..50303: the padded
rows, whose logits are -inf).

What is checked (--verify-data; gpt2/train/startup.py runs it before the first step):
  quick  with a manifest: it is complete and of the GPT-2 tokenizer, and every shard the run reads is
         listed under its split with its token count, and every listed one is there (stat calls and
         one small JSON file: `check_listed`, on every rank before the process group).
  auto   (the default) quick, then the sha256 (against the manifest) and the token ids of every shard
         when the run's shards total at most FULL_CHECK_BYTES, else of the val shards only (every
         evaluation reads them anyway): `verify_shards`, on rank 0, which tells every rank.
  full   quick, then every shard's sha256 and token ids, whatever the size.
Shards without a manifest (llm.c's, modded-nanogpt's) get the token-id part only. Whatever the mode,
every training batch is checked as it is loaded (gpt2/data/loader.py TrainLoader), so no id outside the
vocabulary reaches the embedding even where its shard was not read here.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from pathlib import Path

import numpy as np

from gpt2.core.config import EOT_TOKEN, GPT2_VOCAB_SIZE
from gpt2.data.shards import HEADER_BYTES, MANIFEST, PREP_TOKENIZER, TOKEN_DTYPE, ShardError

FULL_CHECK_BYTES = 1 << 30
"""--verify-data auto reads every shard when they total at most this (1 GiB, 512M tokens): ~0.5 s of
sha256 at the 2 GB/s of one core with SHA extensions, plus the reading; the token-id max over the same
bytes is ~10x faster. Above it (FineWeb-10B's 20 GB) only the val shards are read."""
CHUNK_TOKENS = 1 << 23
"""Tokens per read while scanning a shard (16 MiB): memory stays flat whatever the shard size."""


def out_of_vocab(path: str | Path, offset: int, token: int) -> str:
    """The one wording of a token id the model cannot embed, for the scan here and the loader's check."""
    return (
        f"{path}: token id {token} at token offset {offset} is outside the GPT-2 vocabulary "
        f"(0..{GPT2_VOCAB_SIZE - 1}): "
        "the shards were written with another tokenizer; prepare them with this project's "
        "`python -m data_prep`"
    )


VAL_SHARE = 10
"""prep_command's val split takes at most 1/VAL_SHARE of the corpus (data_prep's own cap for its floor)."""


def prep_command(data_dir: str | Path, eval_tokens: int, min_tokens: int) -> tuple[str, Path] | None:
    """The data_prep command (a shell line) that prepares data_dir's corpus again with its settings and
    a val split for an evaluation of eval_tokens (at most a tenth of the corpus, at least min_tokens)
    into a new directory beside it, and that directory; None when data_dir has no readable manifest
    to take the sources from (llm.c's shards)."""
    manifest = _manifest_or_none(data_dir)
    if manifest is None:
        return None
    data_dir = Path(data_dir)
    corpus = int((manifest.get("totals") or {}).get("tokens") or 0)
    val_tokens = max(min_tokens, min(eval_tokens, corpus // VAL_SHARE))
    out = data_dir.with_name(data_dir.name + "-val")
    n = 2
    while out.exists():  # data_prep refuses a directory of another job: a new one
        out, n = data_dir.with_name(f"{data_dir.name}-val{n}"), n + 1
    return shlex.join(_prep_args(manifest, out, val_tokens)), out


def repair_hint(data_dir: str | Path, name: str) -> str:
    """For a damaged shard `name` that data_dir's manifest lists: how to find every damaged shard (`python -m
    data_prep verify DIR`) and rewrite them (the same data_prep command again: a rerun over a finished job
    re-encodes just the missing or damaged shards), as "; ..." to append to the error; "" without a manifest
    listing it (llm.c's shards: their sources are unknown here)."""
    manifest = _manifest_or_none(data_dir)
    if manifest is None or name not in {e["file"] for e in manifest["shards"]}:
        return ""
    data_dir = Path(data_dir)
    val_tokens = (manifest.get("settings") or {}).get("val_tokens")
    rerun = None
    if val_tokens is not None:
        args = _prep_args(manifest, data_dir, val_tokens)
        if "val_select" not in manifest.get("settings", {}) and "files" in manifest.get("sources", {}):
            args += ["--val-select", "first"]  # the job's own rule (its fingerprint leaves first out)
        rerun = shlex.join(args)
    again = f"the same data_prep command again, `{rerun}`," if rerun else "the data_prep command that wrote it again"
    return (
        f"; data_prep wrote it ({data_dir / MANIFEST} lists it), so it is damaged: `python -m data_prep verify "
        f"{shlex.quote(str(data_dir))}` lists every damaged shard, and {again} rewrites them from the sources"
    )


def _manifest_or_none(data_dir: str | Path) -> dict | None:
    """data_dir's manifest, or None where there is none or it cannot be read (the hints then say less)."""
    try:
        return read_manifest(data_dir)
    except ShardError:
        return None


def _prep_args(manifest: dict, out: Path, val_tokens: int) -> list[str]:
    """The data_prep command line for the manifest's sources and settings into out, with val_tokens."""
    sources, settings = manifest.get("sources", {}), manifest.get("settings", {})
    if "files" in sources:
        where = ["--source", *manifest.get("source_args", [f["path"] for f in sources["files"]])]
    else:
        where = ["--hf-dataset", sources.get("hf_dataset")]
        where += ["--hf-config", sources["hf_config"]] if sources.get("hf_config") else []
        where += ["--hf-split", sources.get("hf_split", "train")]
        files = [f["path"] for f in sources.get("hf_data_files", [])]
        where += ["--hf-data-files", *files] if files else []
    flags = {
        "--shard-tokens": settings.get("shard_tokens"),
        "--text-field": settings.get("text_field"),
        "--on-decode-error": settings.get("on_decode_error"),
        "--txt-sample-by": settings.get("txt_sample_by"),
        "--val-select": settings.get("val_select"),
    }
    args = ["python", "-m", "data_prep", *where, "--out", str(out), "--val-tokens", str(val_tokens)]
    for flag, value in flags.items():
        if value is not None:
            args += [flag, str(value)]
    return args


def read_manifest(data_dir: str | Path) -> dict | None:
    """data_dir's manifest.json, or None where there is none (llm.c's shards)."""
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        {e["file"]: (e["split"], int(e["tokens"]), e["sha256"]) for e in manifest["shards"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardError(
            f"{path}: unreadable ({type(e).__name__}: {e}); restore it from the data_prep run that "
            "wrote these shards, or re-run data_prep"
        ) from None
    return manifest


def check_listed(data_dir: str | Path, shard_sets: dict) -> dict[str, dict] | None:
    """The cheap part (quick): the manifest's tokenizer and completeness, and every shard of shard_sets
    ({split: ShardSet}, the ones the run reads) listed under its split with its token count, every
    listed shard of those splits present. Returns the manifest's entries by file name, or None without
    a manifest. Raises ShardError naming the shard and the fix."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    if manifest is None:
        return None
    where = data_dir / MANIFEST
    tokenizer = (manifest.get("tokenizer"), manifest.get("vocab_size"), manifest.get("eot_token"))
    if tokenizer != (PREP_TOKENIZER, GPT2_VOCAB_SIZE, EOT_TOKEN):
        raise ShardError(
            f"{where}: tokenizer {tokenizer[0]!r} with vocab_size {tokenizer[1]} and EOT {tokenizer[2]}, not "
            f"GPT-2's ({GPT2_VOCAB_SIZE}, EOT {EOT_TOKEN}): the shards were written with another "
            "tokenizer; prepare them with this project's `python -m data_prep`"
        )
    if not manifest.get("complete"):
        raise ShardError(
            f"{where}: data_prep has not finished writing {data_dir} (the manifest says incomplete); "
            "rerun the same data_prep command to finish it"
        )
    entries = {e["file"]: e for e in manifest["shards"]}
    for split, shards in shard_sets.items():
        for path, n in zip(shards.paths, shards.sizes):
            entry = entries.get(path.name)
            if entry is None:
                raise ShardError(
                    f"{path}: not listed in {where}: a shard of another data_prep run (or left by "
                    f"an interrupted one); move it out of {data_dir}, or re-run data_prep into an "
                    "empty directory"
                )
            if entry["split"] != split:
                raise ShardError(
                    f"{path}: {where} lists it as a {entry['split']} shard, not {split}; the manifest "
                    "is another data_prep run's: re-run data_prep"
                )
            if int(entry["tokens"]) != n:
                raise ShardError(
                    f"{path}: holds {n:,} tokens, {where} says {int(entry['tokens']):,}: the shard or the "
                    "manifest is another data_prep run's; re-run data_prep into an empty directory"
                )
        found = {p.name for p in shards.paths}
        missing = [e["file"] for e in manifest["shards"] if e["split"] == split and e["file"] not in found]
        if missing:
            raise ShardError(
                f"{data_dir / missing[0]}: listed in {where} but missing ({len(missing)} {split} shard(s) "
                "missing): the directory is incomplete; copy it again or re-run data_prep"
            )
    return entries


def scan_shard(path: Path, n_tokens: int, sha256: str | None) -> str | None:
    """One pass over a shard: its sha256 against the manifest's (when given), and its first token id
    outside the vocabulary. The problem, or None. A sha256 mismatch is reported first: a corrupt
    shard's odd ids are the corruption's, not another tokenizer's."""
    digest = hashlib.sha256() if sha256 else None
    bad = None
    with open(path, "rb") as f:
        header = f.read(HEADER_BYTES)
        if digest:
            digest.update(header)
        for start in range(0, n_tokens, CHUNK_TOKENS):
            raw = f.read(min(CHUNK_TOKENS, n_tokens - start) * TOKEN_DTYPE.itemsize)
            if digest:
                digest.update(raw)
            tokens = np.frombuffer(raw, dtype=TOKEN_DTYPE)
            if bad is None and tokens.size and int(tokens.max()) >= GPT2_VOCAB_SIZE:
                i = int(np.argmax(tokens >= GPT2_VOCAB_SIZE))
                bad = (start + i, int(tokens[i]))
                if not digest:
                    break
    if digest and digest.hexdigest() != sha256:
        return (
            f"{path}: sha256 differs from {path.parent / MANIFEST}'s: the shard is corrupt, or the manifest is "
            f"another data_prep run's (`python -m data_prep verify {path.parent}` checks every shard); re-run "
            "data_prep to rewrite it"
        )
    return out_of_vocab(path, *bad) if bad else None


def verify_shards(data_dir: str | Path, shard_sets: dict, mode: str) -> str:
    """The rule in the module docstring; raises ShardError with the first problem, else returns what
    was checked in words (for the log)."""
    entries = check_listed(data_dir, shard_sets)
    listed = (
        "every shard listed in manifest.json with its split and token count"
        if entries is not None
        else "no manifest.json (llm.c-style shards)"
    )
    total_bytes = sum(n * TOKEN_DTYPE.itemsize for s in shard_sets.values() for n in s.sizes)
    if mode == "quick":
        return f"{listed}; shards not read (--verify-data quick)"
    read = (
        shard_sets
        if mode == "full" or total_bytes <= FULL_CHECK_BYTES
        else {k: v for k, v in shard_sets.items() if k == "val"}
    )
    for shards in read.values():
        for path, n in zip(shards.paths, shards.sizes):
            problem = scan_shard(path, n, entries[path.name]["sha256"] if entries is not None else None)
            if problem:
                raise ShardError(problem)
    what = "sha256 and token ids" if entries is not None else "token ids"
    if read is shard_sets:
        return f"{listed}; {what} of all {sum(len(s.paths) for s in read.values())} shard(s) checked"
    return (
        f"{listed}; {what} of the val shards checked; the train shards ({total_bytes / 2**30:.1f} GiB with val) "
        f"exceed --verify-data auto's {FULL_CHECK_BYTES / 2**30:g} GiB and are not read here (--verify-data "
        "full reads them), their batches' token ids are checked as they load"
    )
