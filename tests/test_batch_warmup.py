"""--batch-warmup-steps (issue 76): the first steps take 1/(stages+1), 2/(stages+1), ... of --total-batch-size.
Each against a plainly written rule: the schedule against a loop; the loaders read one stream of rows whatever
each step's size; a warmup step is the smaller batch's own step, bit for bit; the refusals name the fix. The
exactness with it on (kill -9, 2 ranks = 1, FSDP = DDP) is in tests/test_modern_exact.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import import_train_ddp, load_ckpt, losses, records, tiny_run_flags

from gpt2.core.config import BatchConfig, ModelConfig, RunConfig, TrainConfig
from gpt2.core.precision import FLOAT32
from gpt2.core.schedule import (
    BatchLayout,
    batch_tokens_at,
    batch_warmup_problem,
    tokens_before,
    warmup_micro_steps,
)
from gpt2.data.loader import TrainLoader, find_shards
from gpt2.data.mixture import MixedShards, MixtureLoader
from gpt2.data.shards import write_shard
from gpt2.plan.batch_choice import choose_micro_batch
from gpt2.plan.hardware import GIB, Hardware
from gpt2.plan.memory import run_config

CPU = torch.device("cpu")
CPU_HW = Hardware(name="cpu-test", memory_bytes=24 * GIB, peak_flops=1e11, device_type="cpu", reserve_bytes=GIB)
T = 8


@pytest.mark.parametrize("warmup,stages", [(0, 3), (1, 1), (4, 1), (7, 3), (9, 2), (12, 3), (5, 7)])
def test_the_schedule_against_a_loop(warmup, stages):
    total = 64 * (stages + 1)
    for step in range(warmup + 5):
        if step >= warmup:
            want = total
        else:  # which of `stages` equal stretches of the warmup's steps holds this step
            stretch = next(j for j in range(stages) if step < (j + 1) * warmup / stages)
            want = total * (stretch + 1) // (stages + 1)
        assert batch_tokens_at(step, total=total, warmup_steps=warmup, stages=stages) == want, step
        kw = dict(total=total, warmup_steps=warmup, stages=stages)
        assert tokens_before(step, **kw) == sum(batch_tokens_at(s, **kw) for s in range(step))
    if warmup:  # the first stretch is 1/(stages+1) of the batch, the last step before the end stages/(stages+1)
        assert batch_tokens_at(0, total=total, warmup_steps=warmup, stages=stages) == total // (stages + 1)
        if warmup >= stages:
            assert batch_tokens_at(warmup - 1, total=total, warmup_steps=warmup, stages=stages) == total * stages // (
                stages + 1
            )


def test_micro_steps_of_a_smaller_step_and_the_refusals():
    assert warmup_micro_steps(8, 128, 512) == 2 and warmup_micro_steps(8, 512, 512) == 8
    with pytest.raises(ValueError, match="not a whole number"):
        warmup_micro_steps(2, 128, 512)
    assert batch_warmup_problem(512, 2, 64, 2, 1) == ""  # 2 micro-steps per rank: halves
    msg = batch_warmup_problem(512, 4, 64, 2, 1)  # 1 micro-step per rank: no half of it
    assert "1 micro-step(s) per rank" in msg and "pass --micro-batch-size 1 or 2" in msg
    msg = batch_warmup_problem(524_288, 16, 1024, 8, 2)  # GPT-2's batch on 8 ranks: 4 micro-steps, no thirds
    assert "does not divide by 3" in msg and "--batch-warmup-stages 1 or 3" in msg
    with pytest.raises(ValueError, match=r"does not divide by 3: pass --batch-warmup-stages 1 or 3"):
        TrainConfig.of(batch_warmup_steps=10, batch_warmup_stages=2, total_batch_size=524_288)
    with pytest.raises(ValueError, match=r"batch_warmup_steps=-1 must be >= 0"):
        BatchConfig(batch_warmup_steps=-1)
    assert BatchConfig(batch_warmup_steps=0, batch_warmup_stages=2).problems() == []  # off: any total


def plain_shards(tmp_path, n=4000):
    write_shard(tmp_path / "train_000000.bin", np.arange(n, dtype=np.uint16) % 50_000)
    return find_shards(tmp_path, "train")


def stream_of_rows(loaders, steps: int, tokens_of) -> list[int]:
    """Every step's global rows (their first tokens), in global order, one loader per rank stepped as train_step
    steps them: the step's first k micro-steps, then advance past its tokens."""
    out = []
    for step in range(steps):
        tokens = tokens_of(step)
        rows = {}
        for r, ld in enumerate(loaders):
            k = warmup_micro_steps(ld.accum_steps, tokens, ld.G)
            for m in range(k):
                x, _ = ld.micro_batch(m)
                for i, row in enumerate(x):
                    rows[(m * ld.world_size + r) * ld.B + i] = int(row[0])
            ld.advance(tokens)
        out += [rows[i] for i in sorted(rows)]
    return out


@pytest.mark.parametrize("order", ["shuffled", "sequential"])
def test_a_warmup_reads_the_same_stream_of_rows_at_any_world_size(tmp_path, order):
    """Smaller steps take the first micro-steps of each rank's layout, which are the global batch's first rows:
    the rows read, step after step, are the full-batch run's, in its order, on 1 rank and on 2."""
    shards, G = plain_shards(tmp_path), 16 * T
    warm = dict(total=G, warmup_steps=4, stages=3)

    def loaders(world, B):
        layout = BatchLayout(B, T, G, world)
        return [
            TrainLoader(shards, layout, rank=r, seed=3, device=CPU, pin_memory=False, order=order) for r in range(world)
        ]

    full = stream_of_rows(loaders(1, 2), 6, lambda s: G)
    one = stream_of_rows(loaders(1, 1), 7, lambda s: batch_tokens_at(s, **warm))
    two = stream_of_rows(loaders(2, 2), 7, lambda s: batch_tokens_at(s, **warm))
    assert one == two == full[: len(one)]
    assert len(one) == tokens_before(7, **warm) // T  # 4 warmup steps (4+8+12+12 rows... here 4, 8, 12, 16) then 16s


def test_a_mixtures_warmup_reads_the_same_stream_too(tmp_path):
    dirs = []
    for k, name in enumerate(("a", "b")):
        d = tmp_path / name
        d.mkdir()
        write_shard(d / "train_000000.bin", np.arange(k * 20_000, k * 20_000 + 3000, dtype=np.uint16))
        dirs.append(d)
    mixed = MixedShards(("a", "b"), tuple(map(str, dirs)), tuple(find_shards(d, "train") for d in dirs))
    G, warm = 8 * T, dict(total=8 * T, warmup_steps=3, stages=1)

    def loaders(world):
        layout = BatchLayout(2, T, G, world)
        return [
            MixtureLoader(mixed, layout, changes=[(0, (0.7, 0.3))], rank=r, seed=5, device=CPU, order="shuffled")
            for r in range(world)
        ]

    full = stream_of_rows(loaders(1), 5, lambda s: G)
    warmed = stream_of_rows(loaders(2), 6, lambda s: batch_tokens_at(s, **warm))
    assert warmed == full[: len(warmed)] and len(warmed) == tokens_before(6, **warm) // T


def test_auto_takes_a_micro_batch_whose_steps_divide_into_the_stages():
    """gpt2.plan.batch_choice under FSDP (auto takes the largest that divides): with a warmup by quarters, the
    largest that leaves a multiple of 4 micro-steps."""
    model = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    for world, seqs in ((2, 16), (4, 8)):  # 2,048 tokens a step: 32 sequences, seqs on each rank
        plain = run_config(model, "auto", prec=FLOAT32, world_size=world, total_batch_size=2048, parallel="fsdp")
        warm = RunConfig(model, plain.train.replace(batch_warmup_steps=10, batch_warmup_stages=3))
        assert choose_micro_batch(plain, CPU_HW, world_size=world).size == seqs
        assert choose_micro_batch(warm, CPU_HW, world_size=world).size == seqs // 4


def test_a_warmup_step_is_the_smaller_batchs_own_step_and_the_log_counts_its_tokens(tmp_path, shakespeare_shards):
    """Steps 1-2 of a warmup by halves are, bit for bit, the steps of a run whose whole batch is that half (the
    same rows, the same learning rates); the tokens column and the checkpointed position count what was read."""
    base = tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=4, eval_tokens=256)
    base += ["--micro-batch-size", "2"]
    warm = [*base, "--batch-warmup-steps", "2", "--batch-warmup-stages", "1", "--out-dir", str(tmp_path / "warm")]
    assert import_train_ddp().main(warm) == 0
    half = [*base, "--total-batch-size", "256", "--max-steps", "2", "--out-dir", str(tmp_path / "half")]
    assert import_train_ddp().main(half) == 0
    got, ref = losses(tmp_path / "warm"), losses(tmp_path / "half")
    assert [got[1], got[2]] == [ref[1], ref[2]]
    assert got[4] != got[2]
    tokens = {r["step"]: r["tokens"] for r in records(tmp_path / "warm") if "loss" in r}
    assert tokens == {1: 256, 2: 512, 3: 1024, 4: 1536}
    log = (tmp_path / "warm" / "train.log").read_text()
    assert "batch      warmup over steps 0-1: 1 equal stretches taking 1/2 of each step's tokens" in log
    assert "(less in the 2-step batch warmup) = 1,536 tokens planned" in log
    state = load_ckpt(tmp_path / "warm", 4)
    assert state["loader"]["position"] == 1536 and state["tokens"] == 1536
