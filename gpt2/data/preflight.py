"""A run's data sources as the start-up's pre-flight checks them, before its first step: each source's val
shards (a run evaluates at step 0 and at the end), one tokenizer across a mixture's sources, and
--verify-data's reading of the shards (gpt2/data/check.py verify_shards) on rank 0 alone.
gpt2/train/startup.py check_data and decide_run call these; each error is one line naming the fix."""

from __future__ import annotations

from pathlib import Path

from gpt2.core.config import DataConfig
from gpt2.data.check import prep_command, read_manifest, verify_shards
from gpt2.data.loader import ShardSet, find_shards
from gpt2.data.mixture import MixedShards
from gpt2.data.shards import ShardError
from gpt2.distributed.group import Dist, rank0_decides


def find_val_shards(data_dir: str, block: int, eval_tokens: int) -> ShardSet:
    """data_dir's val shards (one source of --data-dir), which a run with --eval-tokens > 0 needs even with
    --eval-interval 0 (it still evaluates at step 0 and at the end), holding at least one sequence: fewer than
    block_size + 1 tokens gave `val loss nan` (0 / 0) at every evaluation and exit 0. A mixture evaluates
    every source (val_loss/NAME), so each needs its own."""
    try:
        val = find_shards(data_dir, "val")
    except ShardError as e:
        if not Path(data_dir).is_dir() or any(Path(data_dir).glob("*val*.bin")):
            raise  # no directory, or a damaged val shard: its own line says how to find and repair it
        raise ShardError(
            f"{str(e).split(';')[0]}. The run evaluates on them at step 0 and at the end (--eval-interval "
            f"0 leaves out only the evaluations in between): {prepare_val(data_dir, eval_tokens, block)}; or pass "
            "--eval-tokens 0 to train without validation"
        ) from None
    if val.total_tokens < block + 1:
        raise ShardError(
            f"--data-dir {data_dir}: the val shards hold {val.total_tokens:,} tokens, fewer than one "
            f"sequence of --block-size {block} needs ({block + 1}): evaluation would score nothing (val "
            f"loss nan); {prepare_val(data_dir, eval_tokens, block)}; or pass --eval-tokens 0 to train without "
            "validation"
        )
    return val


def check_same_tokenizer(dirs: list[str]) -> None:
    """A mixture's sources must share the tokenizer and vocabulary: their manifests (data_prep's) say which.
    One line naming two that differ; sources without a manifest (llm.c's) are GPT-2's by their format,
    and their token ids are checked like every source's."""
    seen = {}
    for d in dirs:
        manifest = read_manifest(d)
        if manifest is not None:
            seen[d] = (manifest.get("tokenizer"), manifest.get("vocab_size"), manifest.get("eot_token"))
    if len(set(seen.values())) > 1:
        (a, ta), *rest = seen.items()
        b, tb = next((d, t) for d, t in rest if t != ta)
        raise ShardError(
            f"--data-dir sources {a} and {b} were prepared with different tokenizers ({ta[0]!r}, vocab {ta[1]}, "
            f"EOT {ta[2]} against {tb[0]!r}, vocab {tb[1]}, EOT {tb[2]}, their manifest.json say): a mixture's "
            "sources share one vocabulary; prepare each with this project's `python -m data_prep`"
        )


def prepare_val(data_dir: str, eval_tokens: int, block: int) -> str:
    """How to get a val split for data_dir: data_prep's command for its corpus (from its manifest) with val
    tokens for the run's evaluation (--eval-tokens), at least one sequence of block + 1; or the flag to use."""
    found = prep_command(data_dir, eval_tokens, block + 1)
    if found is None:  # no manifest (llm.c's shards): the corpus is unknown here
        return f"prepare a val split with data_prep's --val-tokens N (N > {block})"
    command, out = found
    return f"prepare the corpus again with a val split, `{command}`, and pass --data-dir {out}"


def verify_data(data: DataConfig, shards: tuple[ShardSet, ShardSet | None], dist: Dist, detail) -> None:
    """--verify-data's reading part (verify_shards), by rank 0 alone: it reads up to
    every shard once, which every rank of a node doing it too would multiply. Every rank raises its
    ShardError or none does. What it read is said by detail (the log's), one line per source."""
    train, val = shards

    def verify() -> list[str]:
        said = []
        try:
            for k, d in enumerate(data.dirs):  # one source, or each of a mixture's
                sets = {"train": source_set(train, k), **({"val": source_set(val, k)} if val is not None else {})}
                said.append(verify_shards(d, sets, data.verify_data))
        except OSError as e:
            raise ShardError(str(e)) from None
        return said if len(said) == 1 else [f"{n}: {t}" for n, t in zip(data.names, said)]

    for line in rank0_decides(verify, dist, errors=(ShardError,)):
        detail(f"data       {line}")


def source_set(shards: ShardSet | MixedShards, k: int) -> ShardSet:
    """Source k's shards: a mixture's k-th, or the one source's."""
    return shards.sets[k] if isinstance(shards, MixedShards) else shards
