"""Data mixtures (gpt2/data/mixture.py): the schedule against a plainly written reference, the loader's
promises (world-size-invariant global batches, disjoint ranks, each source's epochs, exact resume, changed
weights), every refusal, and one set of real torchrun runs: 2 ranks DDP, kill -9, SIGTERM then 2 -> 1
ranks, FSDP, each with a mixture and a weight schedule."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import (
    FP32_CPU,
    assert_same_state,
    hold_after_step,
    launch,
    load_ckpt,
    losses,
    patched_train_script,
    records,
    release_run,
    run,
    wait_for_step,
)
from conftest import REPO, TINY_MODEL_FLAGS

from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
from gpt2.core.schedule import BatchLayout
from gpt2.data.loader import TrainLoader, find_shards
from gpt2.data.mixture import MixedShards, MixtureLoader, drawn, pick, planned_draws, quantize
from gpt2.data.shards import ShardError, write_shard

CPU = torch.device("cpu")


# ---- the schedule --------------------------------------------------------------------------------------


def plain_schedule(weights: tuple[int, ...], n: int) -> list[int]:
    """The schedule written out plainly, one sequence after another: split the sources into two halves
    (the left one the larger when odd); the left half takes the sequence when its share of the sequences
    this split has seen, this one included, rounded (half up), is more than it has taken; repeat inside the
    half that took it, down to one source."""
    out, seen, taken = [], {}, {}
    for _ in range(n):
        lo, hi = 0, len(weights)
        while hi - lo > 1:
            mid = (lo + hi + 1) // 2
            share = Fraction(sum(weights[lo:mid]), sum(weights[lo:hi]))
            node = (lo, hi)
            seen[node] = seen.get(node, 0) + 1
            left = math.floor(seen[node] * share + Fraction(1, 2)) > taken.get(node, 0)
            taken[node] = taken.get(node, 0) + left
            lo, hi = (lo, mid) if left else (mid, hi)
        out.append(lo)
    return out


WEIGHTS = [(0.75, 0.25), (1, 1, 1), (0.5, 0.3, 0.2), (1, 0, 3), tuple(range(1, 9))]


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_the_schedule_is_its_plainly_written_reference(weights):
    q = quantize(weights)
    assert sum(q) == 1 << 20 and all((w > 0) == (n > 0) for w, n in zip(weights, q))
    want = plain_schedule(q, 3000)
    source, place = pick(q, np.arange(3000))
    assert source.tolist() == want
    for k in range(len(q)):  # each source's places are its draws, in order, from 0
        assert place[source == k].tolist() == list(range(want.count(k)))
    for n in (0, 1, 2, 17, 999, 3000):
        assert drawn(q, n) == [want[:n].count(k) for k in range(len(q))]
    # a block anywhere (a resume far into the run) is the same closed form: no walk from the start
    far = 10**12 + np.arange(500)
    source, place = pick(q, far)
    before = drawn(q, 10**12)
    for k in range(len(q)):
        assert place[source == k].tolist() == list(range(before[k], before[k] + int((source == k).sum())))


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
def test_each_source_gets_its_weight_at_every_scale(weights):
    """Within 0.5% of its weight after 1,000 sequences and after 100,000 (the issue's measure), and within
    1.5 sequences of weight x n after every n: never a run of one source beyond what its weight makes."""
    q = quantize(weights)
    share = np.array(weights) / sum(weights)
    source, _ = pick(q, np.arange(100_000))
    counts = np.stack([np.cumsum(source == k) for k in range(len(q))])  # (sources, n)
    n = np.arange(1, 100_001)
    assert np.abs(counts - np.outer(share, n)).max() <= 1.5
    for at in (1000, 100_000):
        assert np.abs(counts[:, at - 1] / at - share).max() <= 0.005


def test_planned_draws_follow_a_schedule_of_weights():
    # 10 steps of 4 sequences at 0.75/0.25, then 0/1 from step 10 on, to step 20
    got = planned_draws([(0, (0.75, 0.25)), (10, (0.0, 1.0))], lambda step: 4 * step, steps=20)
    assert got == [30, 50]
    past_the_end = planned_draws([(0, (0.5, 0.5)), (30, (1.0, 0.0))], lambda step: 4 * step, steps=20)
    assert past_the_end == [40, 40]
    # a batch warmup: steps 0-9 take 2 rows each (20 at 0.75/0.25: 15 + 5), then 4 each (40 at 0/1)
    warm = planned_draws([(0, (0.75, 0.25)), (10, (0.0, 1.0))], lambda s: 2 * min(s, 10) + 4 * max(0, s - 10), 20)
    assert warm == [15, 45]


# ---- the loader ------------------------------------------------------------------------------------------


T = 16
SIZES = {"alpha": (2500, 1500), "beta": (3000,), "gamma": (600,)}
"""Three sources; a token is its source's base (0, 20000, 40000) + its position there, so a row names
its source and window. gamma has 37 windows: it runs out, epoch after epoch."""
BASE = {"alpha": 0, "beta": 20000, "gamma": 40000}


@pytest.fixture
def mixed(tmp_path) -> MixedShards:
    dirs = []
    for name, sizes in SIZES.items():
        d = tmp_path / name
        d.mkdir()
        start = BASE[name]
        for i, n in enumerate(sizes):
            write_shard(d / f"train_{i:06d}.bin", np.arange(start, start + n, dtype=np.uint16))
            start += n
        write_shard(d / "val_000000.bin", np.arange(BASE[name], BASE[name] + 300, dtype=np.uint16))
        dirs.append(d)
    return MixedShards(tuple(SIZES), tuple(map(str, dirs)), tuple(find_shards(d, "train") for d in dirs))


CHANGES = [(0, (0.5, 0.3, 0.2)), (4, (0.1, 0.1, 0.8))]


def mixture(mixed, world=1, rank=0, B=2, G=128, changes=CHANGES, order="shuffled", seed=7) -> MixtureLoader:
    return MixtureLoader(
        mixed, BatchLayout(B, T, G, world), changes=changes, rank=rank, seed=seed, device=CPU, order=order
    )


def row_id(row: torch.Tensor) -> tuple[str, int]:
    """(source, window) of a row whose tokens are positions (the fixture's)."""
    first = int(row[0])
    name = next(n for n in reversed(BASE) if first >= BASE[n])
    return name, (first - BASE[name]) // T


def global_rows(mixed, world, steps, **kw) -> list[list[tuple[str, int]]]:
    """Each step's rows in global order ((micro_step * world + rank) * B ...), as (source, window), from one
    loader per rank stepped as the trainer steps them (advance, at_step)."""
    loaders = [mixture(mixed, world, r, **kw) for r in range(world)]
    out = []
    for step in range(steps):
        rows = {}
        for r, ld in enumerate(loaders):
            for m in range(ld.accum_steps):
                x, y = ld.micro_batch(m)
                assert torch.equal(x[:, 1:], y[:, :-1])
                for i, row in enumerate(x):
                    rows[(m * world + r) * ld.B + i] = row_id(row)
            ld.advance()
            ld.at_step(step + 1)
        out.append([rows[i] for i in sorted(rows)])
    return out


@pytest.mark.parametrize("order", ["shuffled", "sequential"])
def test_global_batches_follow_the_schedule_at_any_world_size(mixed, order):
    one = global_rows(mixed, 1, 12, order=order)  # 1 rank x 4 micro-steps, 8 sequences a step
    assert global_rows(mixed, 2, 12, order=order) == one == global_rows(mixed, 4, 12, order=order)
    for rows in one:
        assert len(set(rows)) == len(rows)  # ranks read disjoint rows: every sequence once
    names = list(SIZES)
    flat = [names.index(s) for rows in one for s, _ in rows]
    # the first 4 steps at 0.5/0.3/0.2, then 0.1/0.1/0.8 from step 4's first sequence on
    first = pick(quantize(CHANGES[0][1]), np.arange(32))[0].tolist()
    assert flat[:32] == first
    counts = [first.count(k) for k in range(3)]
    then = pick(quantize(CHANGES[1][1]), np.arange(64))[0].tolist()
    assert flat[32:] == then
    assert sum(k == 2 for k in then) / 64 == pytest.approx(0.8, abs=1 / 64)
    # each source goes on where it was: alpha's windows after the change continue its own order
    ld = mixture(mixed)
    alpha = [w for rows in one for s, w in rows if s == "alpha"]
    expected = ld.sources[0].window_ids(np.arange(len(alpha)))
    if order == "shuffled":
        assert alpha == expected.tolist()
    else:
        assert alpha[: counts[0]] == list(range(alpha[0], alpha[0] + counts[0]))  # consecutive windows of its stream


def test_a_source_that_runs_out_starts_an_epoch_of_its_own_in_a_new_order(mixed):
    ld = mixture(mixed, changes=[(0, (0.2, 0.2, 0.6))])
    gamma, news = [], []
    for step in range(1, 31):  # 240 sequences: ~144 of gamma's, its 37 windows ~4 times over
        for m in range(ld.accum_steps):
            gamma += [w for s, w in map(row_id, ld.micro_batch(m)[0]) if s == "gamma"]
        ld.advance()
        ld.at_step(step)
        news += ld.news()
    n = ld.sources[2].n_windows
    assert n == 37
    epochs = [gamma[i : i + n] for i in range(0, 3 * n, n)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # every window once an epoch
    assert len({tuple(e) for e in epochs}) == 3  # each epoch its own order
    began = [line for line in news if "source gamma ran out" in line]
    assert len(began) == len(gamma) // n and "its epoch 2 began (its windows in a new order)" in began[0]
    assert not [line for line in news if "source alpha" in line]  # 48 of its 249 windows
    numbers = ld.source_numbers()
    assert numbers["tokens/gamma"] == len(gamma) * T and numbers["epochs/gamma"] == pytest.approx(len(gamma) / n)
    assert sum(numbers[f"tokens/{s}"] for s in SIZES) == ld.position


def test_the_state_resumes_exactly_at_any_world_size_and_new_weights_keep_each_position(mixed):
    whole = global_rows(mixed, 1, 10)
    a = mixture(mixed, 2, 1)
    for step in range(1, 7):  # past the schedule's change at step 4
        a.advance()
        a.at_step(step)
    state = json.loads(json.dumps(a.state_dict()))  # what a checkpoint holds, through JSON: plain numbers
    assert len(state["segments"]) == 2 and state["segments"][1][0] == 4 * 8
    b = mixture(mixed, 1, 0)
    b.load_state_dict(state)
    b.at_step(6)
    assert b.news() == []  # the same weights: nothing changed, nothing said
    got = [row_id(row) for m in range(b.accum_steps) for row in b.micro_batch(m)[0]]
    assert got == whole[6]
    # other weights on resume: said in one line, each source continues from its own position
    c = mixture(mixed, 1, 0, changes=[(0, (1, 1, 1))])
    c.load_state_dict(state)
    c.at_step(6)
    (line,) = c.news()
    assert line == (
        "resume: mixture weights alpha 0.1, beta 0.1, gamma 0.8 -> alpha 0.3333, beta 0.3333, gamma 0.3333 from "
        "step 6 (the position in each source is kept)"
    )
    before = c.drawn()
    assert before == b.drawn()
    rows = [row_id(row) for m in range(c.accum_steps) for row in c.micro_batch(m)[0]]
    for k, name in enumerate(SIZES):
        mine = [w for s, w in rows if s == name]
        assert mine == c.sources[k].window_ids(np.arange(before[k], before[k] + len(mine))).tolist()
    # a rewind (the spike guard's) before the last change drops it; the change comes again at its step
    rewound = {**state, "position": 3 * 128}
    d = mixture(mixed, 1, 0)
    d.load_state_dict(rewound)
    assert [row_id(r) for m in range(4) for r in d.micro_batch(m)[0]] == whole[3]
    d.advance()
    d.at_step(4)
    assert [row_id(r) for m in range(4) for r in d.micro_batch(m)[0]] == whole[4]


def test_states_of_other_data_are_refused_in_one_line(mixed, tmp_path):
    state = mixture(mixed).state_dict()
    single = TrainLoader(mixed.sets[0], BatchLayout(2, T, 128, 1), rank=0, seed=7, device=CPU)
    with pytest.raises(ValueError, match="trained on a mixture of alpha, beta, gamma, this run reads one --data-dir"):
        single.load_state_dict(state)
    with pytest.raises(ValueError, match="trained on one source, this run mixes alpha, beta, gamma"):
        mixture(mixed).load_state_dict(single.state_dict())
    swapped = MixedShards(("beta", "alpha", "gamma"), mixed.dirs, (mixed.sets[1], mixed.sets[0], mixed.sets[2]))
    with pytest.raises(ValueError, match=r"pass --data-dir in its order \(alpha, beta, gamma\)"):
        mixture(swapped).load_state_dict(state)
    other = MixedShards(("alpha", "beta", "delta"), mixed.dirs, mixed.sets)
    with pytest.raises(ValueError, match="names alpha, beta, delta: pass its --data-dir directories"):
        mixture(other).load_state_dict(state)
    fewer = MixedShards(mixed.names, mixed.dirs, (find_shards(mixed.dirs[1], "train"), *mixed.sets[1:]))
    with pytest.raises(ValueError, match=r"source alpha's train shards differ .*\(saved 2 shard\(s\), found 1\)"):
        mixture(fewer).load_state_dict(state)
    with pytest.raises(ValueError, match="--seed 8"):
        mixture(mixed, seed=8).load_state_dict(state)
    with pytest.raises(ValueError, match="--data-order shuffled"):
        mixture(mixed, order="sequential").load_state_dict(state)
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    write_shard(tiny / "train_000000.bin", np.arange(10, dtype=np.uint16))
    short = MixedShards(("alpha", "tiny"), (mixed.dirs[0], str(tiny)), (mixed.sets[0], find_shards(tiny, "train")))
    with pytest.raises(ShardError, match="source tiny: its train shards hold 10 tokens, fewer than one sequence"):
        mixture(short, changes=[(0, (1, 1))])


# ---- the flags and the data checks: one line before any work ---------------------------------------------


def refusal(argv: list[str], capsys) -> str:
    """The error of a command line, exit 2: the config's problems, one line each under its heading (every
    problem at once, as every invalid flag is said)."""
    from gpt2.train.cli import parse_config

    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "train_ddp.py: error: invalid training config:" and len(err) == 2, err
    return err[1]


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--data-dir", "a,b"], "pass --data-weights with 2 weights"),
        (["--data-dir", "a,b", "--data-weights", "1,2,3"], "gives 3 weight(s) for the 2 --data-dir sources (a, b)"),
        (["--data-dir", "a,b", "--data-weights", "1,0"], "has the weight 0: every weight must be a finite number > 0"),
        (["--data-dir", "a,b", "--data-weights", "1,-1"], "has the weight -1"),
        (["--data-dir", "a,b", "--data-weights", "1,x"], "must be comma-separated numbers"),
        (["--data-dir", "x/code,y/code", "--data-weights", "1,1"], "names two sources 'code' (x/code, y/code)"),
        (["--data-dir", "a,,b", "--data-weights", "1,1,1"], "has an empty entry"),
        (["--data-dir", "a", "--data-weight-schedule", "5:1"], "data_weight_schedule needs a mixture"),
        (["--data-dir", "a,b", "--data-weights", "1,1", "--data-weight-schedule", "5"], "must be STEP:W1,W2"),
        (["--data-dir", "a,b", "--data-weights", "1,1", "--data-weight-schedule", "5:1"], "1 weight(s) for 2"),
        (["--data-dir", "a,b", "--data-weights", "1,1", "--data-weight-schedule", "x:1,1"], "a step or N%"),
        (["--data-dir", "a,b", "--data-weights", "1,1", "--data-weight-schedule", "5:0,0"], "at least one weight"),
        (
            ["--data-dir", "a,b", "--data-weights", "1,1", "--data-weight-schedule", "90%:1,0 10:0,1"],
            "takes effect at steps [90, 10] (with max_steps=100)",
        ),
    ],
)
def test_bad_mixture_flags_are_one_line(flags, said, capsys, tmp_path):
    line = refusal([*flags, "--out-dir", str(tmp_path), "--max-steps", "100"], capsys)
    assert line.startswith("  - ") and said in line, line


def test_weights_are_normalised_and_a_schedule_resolves_its_percentages():
    from gpt2.core.config import weight_changes

    tc = TrainConfig.of(data_dir="x/a, y/b", data_weights="3,1", data_weight_schedule="90%:0,1;95:1,1", max_steps=100)
    assert tc.data.names == ["a", "b"] and tc.data.weights == (0.75, 0.25)
    assert weight_changes(tc) == [(0, (0.75, 0.25)), (90, (0.0, 1.0)), (95, (0.5, 0.5))]
    assert TrainConfig.of(data_dir="a").data.weights == (1.0,)


def test_each_source_is_checked_before_any_work(mixed, tmp_path):
    """A missing or empty source, one without val shards while evaluating, manifests of two tokenizers."""
    from gpt2.train.startup import check_data

    def check(dirs, weights="1,1", **extra):
        cfg = RunConfig(
            ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=T),
            TrainConfig.of(
                data_dir=",".join(map(str, dirs)),
                data_weights=weights,
                out_dir=str(tmp_path / "run"),
                micro_batch_size=2,
                total_batch_size=64,
                **{"eval_tokens": 32, "sample_interval": 0, **extra},
            ),
        )
        return check_data(cfg.train, cfg.model.block_size, 1)

    alpha, beta = mixed.dirs[:2]
    train, val = check([alpha, beta])
    assert isinstance(train, MixedShards) and train.names == ("alpha", "beta") and val.names == ("alpha", "beta")
    with pytest.raises(ShardError, match=f"--data-dir {tmp_path}/nowhere: no such directory"):
        check([alpha, tmp_path / "nowhere"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ShardError, match=rf"--data-dir {tmp_path}/empty: no \*train\*\.bin shards"):
        check([alpha, tmp_path / "empty"])
    (Path(beta) / "val_000000.bin").unlink()
    with pytest.raises(ShardError, match=rf"--data-dir {beta}: no \*val\*\.bin shards.* or pass --eval-tokens 0"):
        check([alpha, beta])
    assert check([alpha, beta], eval_tokens=0)[1] is None  # no evaluation: no val needed
    for d, tokenizer in ((alpha, "tiktoken gpt2"), (beta, "sentencepiece llama")):
        manifest = {"tokenizer": tokenizer, "vocab_size": 50257, "eot_token": 50256, "complete": True, "shards": []}
        (Path(d) / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=f"--data-dir sources {alpha} and {beta} were prepared with different "):
        check([alpha, beta], eval_tokens=0)


# ---- real runs: torchrun, gloo, CPU, fp32 -----------------------------------------------------------------


MAX_STEPS = 8
CKPT_INTERVAL = 3


@pytest.fixture(scope="module")
def sources(tmp_path_factory, shakespeare_shards) -> tuple[Path, Path]:
    """Two sources with a val split each: shakespeare (the suite's shards) and code (this Python's own
    standard library, prepared by data_prep as a user would)."""
    import subprocess

    root = tmp_path_factory.mktemp("sources")
    (root / "shakespeare").symlink_to(shakespeare_shards)
    stdlib = Path(os.__file__).parent
    with open(root / "code.jsonl", "w") as f:
        for path in sorted(stdlib.glob("[a-k]*.py"))[:40]:
            f.write(json.dumps({"text": path.read_text(errors="replace")}) + "\n")
    subprocess.run(
        [sys.executable, "-m", "data_prep", "--source", str(root / "code.jsonl"), "--out", str(root / "code")]
        + ["--val-tokens", "4000", "--workers", "1", "--no-progress"],
        check=True,
        cwd=REPO,
        capture_output=True,
    )
    return root / "shakespeare", root / "code"


def flags(sources, out_dir, *extra) -> list[str]:
    """A tiny model (tests/_helpers.tiny_run_flags's batch: 512 tokens a step, 2 ranks x 4 x 64 or 1 rank x 2
    micro-steps) on shakespeare 0.75 / code 0.25, then code 0.75 from step 5 on, evaluated at steps 0, 4, 8."""
    return [
        *TINY_MODEL_FLAGS,
        *FP32_CPU,
        *("--data-dir", ",".join(map(str, sources)), "--data-weights", "3,1", "--data-weight-schedule", "5:1,3"),
        *("--micro-batch-size", "4", "--total-batch-size", "512", "--max-steps", str(MAX_STEPS)),
        *("--warmup-steps", "3", "--lr", "3e-3", "--eval-interval", "4", "--eval-tokens", "512"),
        *("--ckpt-interval", str(CKPT_INTERVAL), "--keep-checkpoints", "100", "--log-interval", "1"),
        *("--out-dir", str(out_dir), *extra),
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, sources) -> Path:
    """The uninterrupted 2-rank DDP run, and what it says of its mixture."""
    out = tmp_path_factory.mktemp("mix_reference")
    done = run(flags(sources, out / "run"), nproc=2, log_dir=out)
    assert done.proc.returncode == 0, done.output()
    assert "normalised to shakespeare 0.75, code 0.25" in done.stdout
    assert "mixture    from step 5: shakespeare 0.25, code 0.75 (weight schedule)" in done.stdout
    lines = done.stdout.splitlines()
    change = lines.index("data       after step 5: mixture weights now shakespeare 0.25, code 0.75")
    assert lines[change - 1].startswith("step      5/8 | loss")  # said after the row of the step it follows
    return out / "run"


def test_a_mixture_trains_logs_each_source_and_resumes_after_kill_9(tmp_path, sources, reference):
    """The reference's rows (tokens/NAME, val_loss/NAME and their weighted mean), then a run whose rank 1 is
    killed with SIGKILL after step 4 (past a checkpoint) and restarted by torchrun: bitwise the reference."""
    rows = [r for r in records(reference) if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    for r in rows:  # 8 sequences a step: 6/2 at 0.75/0.25, then 2/6
        assert r["tokens/shakespeare"] + r["tokens/code"] == r["tokens"]
    assert [rows[4]["tokens/shakespeare"], rows[4]["tokens/code"]] == [5 * 6 * 64, 5 * 2 * 64]
    assert [rows[7]["tokens/shakespeare"], rows[7]["tokens/code"]] == [(30 + 6) * 64, (10 + 18) * 64]
    assert all(0 < r["epochs/code"] < r["epochs/shakespeare"] < 1 for r in rows)
    evals = [r for r in records(reference) if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 4, 8]
    for r in evals:
        assert r["val_loss"] == pytest.approx(0.75 * r["val_loss/shakespeare"] + 0.25 * r["val_loss/code"], rel=1e-12)
        assert r["val_tokens"] == 2 * 512
    assert evals[-1]["val_loss/code"] < evals[0]["val_loss/code"]

    run_dir, release = tmp_path / "run", tmp_path / "release"
    job = launch(
        flags(sources, run_dir),
        nproc=2,
        log_dir=tmp_path,
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(4, release)),
    )
    try:
        wait_for_step(job, run_dir, 4)
        os.kill(job.workers()[1], signal.SIGKILL)
        release_run(job, release)
        assert job.wait() == 0, job.output()
    finally:
        job.kill()
    assert f"resumed from {run_dir}/checkpoints/step_{CKPT_INTERVAL:08d}.pt" in job.stdout
    assert losses(run_dir) == losses(reference)
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))


@pytest.mark.slow
def test_a_mixture_stopped_by_sigterm_resumes_on_one_rank_with_the_same_batches(tmp_path, sources, reference):
    """SIGTERM to a 2-rank run held after step 2: it stops after step 3 or 4 with a checkpoint; then the rest on one
    process with 2 micro-steps: the same losses (to fp32 rounding: the ranks' sum is another order), the same data and
    tokens per source, the weight change at step 5 made by the resumed run."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    first = launch(
        flags(sources, run_dir),
        nproc=2,
        log_dir=tmp_path / "first",
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(2, release)),
    )
    try:
        wait_for_step(first, run_dir, 2)
        first.proc.send_signal(signal.SIGTERM)
        release_run(first, release, signalled_ranks=(0, 1))
        assert first.wait() == 1, first.output()
    finally:
        first.kill()
    stopped = json.loads((run_dir / "requeue").read_text())["step"]
    # the first step whose stop vote saw the signal (after the hold, or the next); step 5's change is the resumed run's
    assert stopped in (3, 4), first.output()
    second = run(flags(sources, run_dir), nproc=1, log_dir=tmp_path / "second")
    assert second.proc.returncode == 0, second.output()
    assert "resume: world size 2 -> 1" in second.stdout
    assert "data       after step 5: mixture weights now shakespeare 0.25, code 0.75" in second.stdout
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert all(got[s] == pytest.approx(want[s], abs=1e-5) for s in got), (got, want)
    assert load_ckpt(run_dir, MAX_STEPS)["loader"] == load_ckpt(reference, MAX_STEPS)["loader"]
    mine, theirs = ([r for r in records(d) if "loss" in r] for d in (run_dir, reference))
    assert [(r["tokens/shakespeare"], r["tokens/code"]) for r in mine] == [
        (r["tokens/shakespeare"], r["tokens/code"]) for r in theirs
    ]


@pytest.mark.torch_feature("fsdp")
@pytest.mark.slow
def test_fsdp_with_a_mixture_computes_what_ddp_does(tmp_path, sources, reference):
    done = run(flags(sources, tmp_path / "run", "--parallel", "fsdp"), nproc=2, log_dir=tmp_path)
    assert done.proc.returncode == 0, done.output()
    got, want = losses(tmp_path / "run"), losses(reference)
    assert sorted(got) == sorted(want) and all(got[s] == pytest.approx(want[s], abs=1e-5) for s in got)
    assert load_ckpt_loader(tmp_path / "run") == load_ckpt(reference, MAX_STEPS)["loader"]


def load_ckpt_loader(run_dir: Path) -> dict:
    """The loader state of a run's final checkpoint, .pt or sharded (train.pt inside step_*/)."""
    path = run_dir / "checkpoints" / f"step_{MAX_STEPS:08d}"
    if path.is_dir():
        return torch.load(path / "train.pt", map_location="cpu", weights_only=True)["loader"]
    return load_ckpt(run_dir, MAX_STEPS)["loader"]


def test_eval_dry_run_and_plot_of_a_mixture(tmp_path, sources, reference, capsys):
    """`python -m gpt2.eval loss --data-dir A,B` gives a line per source (the trainer's val_loss/NAME) and with
    --data-weights their mean (its val_loss); --dry-run shows the mixture and, resuming the reference with
    other --data-weights, says the change in one line; the loss plot draws a curve per source."""
    from _helpers import import_train_ddp

    from gpt2.eval import main
    from gpt2.train.run_log import plot_loss_curve

    common = ["--checkpoint", str(reference), "--eval-tokens", "512", "--batch-size", "4", "--device", "cpu"]
    common += ["--num-threads", "1", "--dtype", "float32", "--data-dir", ",".join(map(str, sources))]
    assert main(["loss", *common, "--data-weights", "3,1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    final = [r for r in records(reference) if "val_loss" in r][-1]
    for name in ("shakespeare", "code"):
        assert got["sources"][name]["loss"] == pytest.approx(final[f"val_loss/{name}"], abs=1e-5)
    assert got["loss"] == pytest.approx(final["val_loss"], abs=1e-5)
    assert main(["loss", *common]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" on ")[1].split(":")[0] for line in lines] == ["shakespeare", "code"], lines
    assert main(["loss", *common, "--data-weights", "1"]) == 2
    assert "--data-weights gives 1 weight(s) for 2 --data-dir directories" in capsys.readouterr().err

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(reference / "checkpoints")
    (run_dir / "config.json").symlink_to(reference / "config.json")
    argv = flags(sources, run_dir, "--data-weights", "1,1", "--data-weight-schedule", "", "--max-steps", "20")
    assert import_train_ddp().main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "mixture    shakespeare 0.5: 310,752 train tokens" in out
    assert (
        "resume: mixture weights shakespeare 0.25, code 0.75 -> shakespeare 0.5, code 0.5 from step 8 (the position "
        "in each source is kept)"
    ) in out
    rows = [line for line in out.splitlines() if line.startswith("  rank ")]
    assert len(rows) == 2 and all(w.split(":")[0] in ("shakespeare", "code") for w in rows[0].split(": ")[1].split())

    png = plot_loss_curve(reference / "metrics.jsonl", tmp_path / "curve.png")
    assert png is None or png.stat().st_size > 0
