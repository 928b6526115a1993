"""gpt2/data/check.py and the loader's per-batch check: the shards are checked against data_prep's
manifest.json and the vocabulary before a token reaches the embedding (issue 32, items 5 and 6).

Each run goes through train_ddp.main in this process (one rank) or torchrun (two), with the issue's
tiny model; before these checks every one of them trained with exit 0, crashed with a raw IndexError,
or logged `loss nan` / `val loss nan`."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import import_train_ddp, tiny_run_flags
from conftest import REPO

from gpt2.core.schedule import BatchLayout
from gpt2.data.check import FULL_CHECK_BYTES, verify_shards
from gpt2.data.loader import TrainLoader, find_shards
from gpt2.data.shards import HEADER_BYTES, ShardError, write_shard


def tokens_of(path: Path) -> np.ndarray:
    return np.fromfile(path, dtype="<u2", offset=HEADER_BYTES).astype(np.int64)


@pytest.fixture
def data(tmp_path, shakespeare_shards) -> Path:
    """A private copy of the Shakespeare shards and their manifest, to damage."""
    out = tmp_path / "data"
    shutil.copytree(shakespeare_shards, out)
    return out


def train(data_dir: Path, out: Path, capsys, *extra: str, max_steps: int = 2, eval_tokens: int = 1024):
    """(exit code, stderr, stdout) of the issue's tiny run in this process."""
    capsys.readouterr()
    code = import_train_ddp().main(
        [
            *tiny_run_flags(data_dir, max_steps=max_steps, ckpt_interval=2, eval_tokens=eval_tokens),
            "--out-dir",
            str(out),
            *extra,
        ]
    )
    captured = capsys.readouterr()
    return code, captured.err, captured.out


def one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train_ddp.py: error: "), err
    return lines[0]


# ------------------------------------------------------------------ item 5: a val split shorter than a block


def test_a_val_split_shorter_than_one_block_is_refused_at_start_up(data, tmp_path, capsys):
    (data / "manifest.json").unlink()  # an llm.c-style directory: only the size check can catch it
    write_shard(data / "val_000000.bin", tokens_of(data / "val_000000.bin")[:40])
    code, err, _ = train(data, tmp_path / "run", capsys)
    line = one_error(err)
    assert code == 2, err
    assert "the val shards hold 40 tokens, fewer than one sequence of --block-size 64 needs (65)" in line
    assert "--val-tokens N" in line and "--eval-tokens 0" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before any step
    # and --eval-tokens 0 trains without validation
    code, err, _ = train(data, tmp_path / "run", capsys, eval_tokens=0)
    assert code == 0, err


def test_eval_tokens_below_one_block_is_refused(data, tmp_path, capsys):
    code, err, _ = train(data, tmp_path / "run", capsys, eval_tokens=40)
    assert code == 2
    assert "--eval-tokens 40 is less than one sequence of --block-size 64" in one_error(err)


def test_missing_val_shards_say_why_they_are_needed_with_eval_interval_0(data, tmp_path, capsys):
    (data / "manifest.json").unlink()
    (data / "val_000000.bin").unlink()
    code, err, _ = train(data, tmp_path / "run", capsys)  # tiny_run_flags has --eval-interval 0
    line = one_error(err)
    assert code == 2
    assert "no *val*.bin shards" in line and "--val-tokens N" in line
    assert "at step 0 and at the end (--eval-interval 0 leaves out only the evaluations in between)" in line
    assert "--eval-tokens 0" in line


def test_the_command_printed_for_a_missing_val_split_runs(tmp_path, shakespeare_path, capsys):
    """Issue 41: the hint for a missing val split was `python -m data_prep --source --val-tokens N (the
    tokens of whole documents to hold out; 0 makes none) --out DIR`: no source, a comment inside the
    command. Now it is the command for this corpus (from the manifest), which the test runs, and the
    directory it made holds the val split the run needs."""
    src = tmp_path / "corpus odd::name"  # quoted in the printed line, and readable by data_prep
    src.mkdir()
    (src / "a.txt").write_text(shakespeare_path.read_text()[:60_000])
    data = tmp_path / "data"
    prep = [sys.executable, "-m", "data_prep", "--no-progress", "--workers", "1"]
    done = subprocess.run(
        [*prep, "--source", str(src), "--out", str(data), "--val-tokens", "0", "--txt-sample-by", "paragraph"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    code, err, _ = train(data, tmp_path / "run", capsys)
    line = one_error(err)
    assert code == 2 and "no *val*.bin shards" in line and "--eval-tokens 0" in line
    command = re.search(r"`([^`]+)`", line).group(1)
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "data_prep"] and str(src) in argv and "--val-tokens" in argv
    done = subprocess.run(
        [sys.executable, *argv[1:], "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    new_dir = Path(re.search(r"pass --data-dir (\S+);", line).group(1))
    assert new_dir == tmp_path / "data-val"
    assert find_shards(new_dir, "val").total_tokens >= 1024  # the run's --eval-tokens: it can start there


def test_a_damaged_val_shard_header_says_how_to_find_and_repair_it_and_the_repair_runs(data, tmp_path, capsys):
    """A val shard whose header was zeroed was answered with "prepare the corpus again with a val split" into a
    new directory. It is a damaged shard of a data_prep run: the line names `python -m data_prep verify DIR`
    and the same data_prep command, which the test runs: it rewrites the shard, and verify then passes."""
    from data_prep.__main__ import main as data_prep_main

    with open(data / "val_000000.bin", "r+b") as f:
        f.write(b"\0" * HEADER_BYTES)
    code, err, _ = train(data, tmp_path / "run", capsys)
    line = one_error(err)
    assert code == 2 and "val_000000.bin: bad magic number 0" in line, line
    assert "prepare the corpus again" not in line and "--eval-tokens 0" not in line
    assert f"so it is damaged: `python -m data_prep verify {data}` lists every damaged shard" in line
    verify, rerun = re.findall(r"`([^`]+)`", line)
    argv = shlex.split(rerun)
    assert argv[:3] == ["python", "-m", "data_prep"] and argv[argv.index("--out") + 1] == str(data)
    assert data_prep_main(shlex.split(verify)[3:]) == 1  # the damage it names
    done = subprocess.run(
        [sys.executable, *argv[1:], "--no-progress"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "rewrote val_000000.bin" in done.stdout, done.stdout + done.stderr
    assert "continuing the job as it began" not in done.stderr  # the job's own command: nothing to adapt
    assert data_prep_main(["verify", str(data)]) == 0


# ------------------------------------------------------------------ item 6: the manifest


def test_a_shard_of_another_data_prep_run_is_refused(data, tmp_path, capsys):
    write_shard(data / "train_000002.bin", tokens_of(data / "train_000001.bin")[:5000])
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert (
        f"{data / 'train_000002.bin'}: not listed in {data / 'manifest.json'}: a shard of another data_prep run"
        in one_error(err)
    )


def test_a_same_named_shard_of_another_run_is_refused_by_its_token_count(data, tmp_path, capsys):
    write_shard(data / "train_000001.bin", tokens_of(data / "train_000001.bin")[:-7])
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert "train_000001.bin: holds 150,745 tokens, " in one_error(err) and "says 150,752" in err


def test_a_manifest_of_another_run_is_refused_by_the_sha256(data, tmp_path, capsys):
    manifest = json.loads((data / "manifest.json").read_text())
    for entry in manifest["shards"]:  # the other run's shards had the same names and sizes, other bytes
        entry["sha256"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert "sha256 differs from" in one_error(err) and "the manifest is another data_prep run's" in err


def test_a_flipped_bit_is_caught_by_the_default_check_and_not_by_quick(data, tmp_path, capsys):
    raw = bytearray((data / "train_000000.bin").read_bytes())
    raw[HEADER_BYTES + 2 * 1234] ^= 1  # a token id one off: in the vocabulary, so only the sha256 can tell
    (data / "train_000000.bin").write_bytes(bytes(raw))
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert f"{data / 'train_000000.bin'}: sha256 differs from" in one_error(err)
    code, err, out = train(data, tmp_path / "quick", capsys, "--verify-data", "quick")
    assert code == 0, err  # the documented cost of quick: nothing is read
    assert "shards not read (--verify-data quick)" in (tmp_path / "quick" / "train.log").read_text()  # a detail


def test_an_incomplete_or_foreign_tokenizer_manifest_is_refused(data, tmp_path, capsys):
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "vocab_size": 100277}))
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2 and "the shards were written with another tokenizer" in one_error(err)
    (data / "manifest.json").write_text(json.dumps({**manifest, "complete": False}))
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2 and "data_prep has not finished writing" in one_error(err)


# ------------------------------------------------------------------ item 6: token ids outside the vocabulary


@pytest.mark.parametrize("bad_id", [60000, 50300])  # past the embedding; a padded row (loss nan before)
def test_an_id_outside_the_vocabulary_is_named_at_start_up(data, tmp_path, capsys, bad_id):
    (data / "manifest.json").unlink()  # llm.c's shards: no manifest, still checked
    tokens = tokens_of(data / "train_000001.bin")
    tokens[777] = bad_id
    write_shard(data / "train_000001.bin", tokens)
    code, err, _ = train(data, tmp_path / "run", capsys)
    assert code == 2
    assert one_error(err) == (
        f"train_ddp.py: error: {data / 'train_000001.bin'}: token id {bad_id} at token offset 777 is outside the GPT-2 "
        "vocabulary (0..50256): the shards were written with another tokenizer; prepare them with this project's "
        "`python -m data_prep`"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def poisoned_train_shard(data: Path, positions: list[int], bad_id: int = 60000) -> Path:
    """One train shard (no manifest: nothing checks it before the first batch under quick) with bad_id at
    the given offsets, and the val shard as it was."""
    out = data.parent / "poisoned"
    out.mkdir()
    tokens = np.concatenate([tokens_of(data / "train_000000.bin"), tokens_of(data / "train_000001.bin")])
    tokens[positions] = bad_id
    write_shard(out / "train_000000.bin", tokens)
    shutil.copy(data / "val_000000.bin", out / "val_000000.bin")
    return out


def test_a_bad_id_in_a_batch_stops_the_first_step_naming_shard_offset_and_id(data, tmp_path, capsys):
    """--verify-data quick reads no shard at start-up: the loader's check on each micro-batch is what
    stops it, before the embedding (formerly: IndexError: index out of range in self)."""
    out = poisoned_train_shard(data, list(range(0, 300_000, 50)))  # every window of 65 holds one
    code, err, _ = train(out, tmp_path / "run", capsys, "--verify-data", "quick")
    assert code == 2, err
    line = one_error(err)
    m = re.search(r"train_000000\.bin: token id (\d+) at token offset (\d+) is outside", line)
    assert m, line
    assert int(m.group(1)) == 60000 and tokens_of(out / "train_000000.bin")[int(m.group(2))] == 60000
    assert "skipped" not in (tmp_path / "run" / "metrics.jsonl").read_text()  # no step was logged, none learnt


@pytest.mark.parametrize("order", ["shuffled", "sequential"])
def test_the_loader_names_the_shard_offset_and_id_of_a_bad_token(tmp_path, order):
    rng = np.random.default_rng(0)
    for i in range(3):
        write_shard(tmp_path / f"train_{i:06d}.bin", rng.integers(0, 50257, size=3000))
    bad = tmp_path / "train_000001.bin"
    tokens = tokens_of(bad)
    tokens[1500] = 65535
    write_shard(bad, tokens)
    shards = find_shards(tmp_path, "train")
    layout = BatchLayout(micro_batch_size=4, seq_len=64, total_batch_size=256, world_size=1)
    kwargs = dict(rank=0, seed=3, device=torch.device("cpu"), order=order)
    with TrainLoader(shards, layout, **kwargs) as loader:
        for _ in range(200):  # a few epochs: every window is read
            try:
                loader.micro_batch(0)
            except ShardError as e:
                assert str(e).startswith(f"{bad}: token id 65535 at token offset 1500 is outside"), e
                break
            loader.advance()
        else:
            raise AssertionError("the bad token was never met")
    with TrainLoader(shards, layout, defer_bad_tokens=True, **kwargs) as loader:  # the trainer's: EOT in its place
        while loader.problem is None:
            x, y = loader.micro_batch(0)
            loader.advance()
            assert int(x.max()) < 50257 and int(y.max()) < 50257
        assert "token offset 1500" in loader.problem


def test_the_rule_reads_val_alone_above_the_bound(tmp_path, monkeypatch):
    for split in ("train", "val"):
        write_shard(tmp_path / f"{split}_000000.bin", np.full(1000, 60000 if split == "train" else 7))
    sets = {s: find_shards(tmp_path, s) for s in ("train", "val")}
    with pytest.raises(ShardError, match="token id 60000 at token offset 0"):
        verify_shards(tmp_path, sets, "auto")
    monkeypatch.setattr("gpt2.data.check.FULL_CHECK_BYTES", 1000)  # 4000 bytes of shards: above it
    assert "are not read here" in verify_shards(tmp_path, sets, "auto")
    with pytest.raises(ShardError, match="token id 60000"):
        verify_shards(tmp_path, sets, "full")
    assert FULL_CHECK_BYTES == 1 << 30


def test_ranks_stop_alike_when_one_ranks_batch_holds_a_bad_id(data, tmp_path):
    """Two ranks, the sequential order: step 0's windows 0..7, rank 1 reads windows 4..7 (tokens 256..512),
    so an id at 300 is rank 1's alone. Every rank must stop at that step with rank 1's message (before:
    rank 1 crashed and rank 0 waited in the all-reduce)."""
    out = poisoned_train_shard(data, [300])
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "train_ddp.py"),
            *tiny_run_flags(out, max_steps=3, ckpt_interval=2),
            "--out-dir",
            str(tmp_path / "run"),
            "--verify-data",
            "quick",
            "--data-order",
            "sequential",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
    assert errors == [
        f"train_ddp.py: error: {out / 'train_000000.bin'}: token id 60000 at token offset 300 is "
        "outside the GPT-2 vocabulary (0..50256): the shards were written with another tokenizer; "
        "prepare them with this project's `python -m data_prep`"
    ], run.stderr[-3000:]
    assert run.returncode == 1 and run.stderr.count("exitcode  : 2") == 2, run.stderr[-3000:]  # both ranks: exit 2
    assert "IndexError" not in run.stderr and "collective operation failed" not in run.stderr
