"""Issue 56's "still exact" with every architecture option and attention within documents on: real processes
(torchrun, gloo, CPU, fp32). A kill -9 resumes bitwise; 2 ranks equal 1 with accumulation (Muon and AdamW);
FSDP equals DDP; each with issue 76's batch warmup on (BATCH_WARMUP). The embeddings' and the head's own learning
rates (--embed-lr, --head-lr) are on throughout; the kill -9 and FSDP runs train with --preset gpt2-speedrun's
recipe (Muon's momentum warmup too, issue 76)."""

from __future__ import annotations

import os
import signal

import pytest
from _helpers import (
    assert_same_state,
    hold_after_step,
    launch,
    load_ckpt,
    losses,
    patched_train_script,
    release_run,
    run,
    tiny_run_flags,
    uninterrupted_run,
    wait_for_step,
)

MODERN = ["--arch", "modern", "--doc-attention", "--embed-lr", "0.03", "--head-lr", "0.002"]
"""Every option on, the embeddings' and the untied head's own learning rates too (issue 76)."""
GPT2_SPEEDRUN = [
    *("--preset", "gpt2-speedrun", "--muon-momentum-warmup", "5", "--muon-ortho", "polar_express"),
    *("--value-embeds", "1", "--unet-skips", "true", "--cautious-wd", "true", "--muon-weight-decay", "0.1"),
]
"""The GPT-2-size recipe (issue 76) at the tiny shape: the modern model, attention within documents, Muon with its
momentum warming up over steps 0-4 (so a resume at step 3 lands inside the warmup and runs past its end), the
embeddings' and the head's rates, no clipping, the WSD schedule to 0; and issue 76's techniques, each opt-in, every
one on here: Polar Express for Muon's orthogonalisation, value embeddings, U-net skips, cautious weight decay."""
MAX_STEPS, CKPT_INTERVAL = 6, 3
BATCH_WARMUP = ["--micro-batch-size", "2", "--batch-warmup-steps", "4", "--batch-warmup-stages", "1"]
"""Issue 76's batch warmup: steps 0-3 take half of the 512 tokens (1 of 2 micro-steps on each of 2 ranks, 2 of 4 on
one), so the kill -9's checkpoint at step 3 lands inside it and the resume runs past its end."""


def flags(data_dir, out_dir, *extra, recipe=MODERN):
    return [
        *recipe,
        *tiny_run_flags(data_dir, max_steps=MAX_STEPS, ckpt_interval=CKPT_INTERVAL),
        "--out-dir",
        str(out_dir),
        *extra,
    ]


@pytest.mark.slow
def test_kill_9_resumes_the_gpt2_speedrun_recipe_bitwise(tmp_path, shakespeare_shards):
    """The modern model under the GPT-2-size recipe (Muon's momentum warmup, the own rates): bitwise after kill -9."""
    ref_flags = flags(shakespeare_shards, tmp_path / "ref" / "run", *BATCH_WARMUP, recipe=GPT2_SPEEDRUN)
    reference = uninterrupted_run(ref_flags, tmp_path / "ref", MAX_STEPS)
    run_dir, release = tmp_path / "run", tmp_path / "release"
    job = launch(
        flags(shakespeare_shards, run_dir, *BATCH_WARMUP, recipe=GPT2_SPEEDRUN),
        nproc=2,
        log_dir=tmp_path,
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(CKPT_INTERVAL + 1, release)),
    )
    try:
        wait_for_step(job, run_dir, CKPT_INTERVAL + 1)
        os.kill(job.workers()[1], signal.SIGKILL)
        release_run(job, release)
        assert job.wait() == 0, job.output()
    finally:
        job.kill()
    assert "resumed from" in job.stdout, job.output()
    assert losses(run_dir) == losses(reference)
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
@pytest.mark.slow
def test_two_modern_ranks_equal_one_with_accumulation(tmp_path, shakespeare_shards, optimizer):
    """2 ranks x 2 micro-steps x 2 == 1 rank x 4 micro-steps x 2 (half of each in the batch warmup), every option
    on; and it learns (the equality is not trivial)."""
    extra = [
        "--optimizer",
        optimizer,
        "--ckpt-interval",
        "0",
        "--muon-momentum-warmup",
        "4",
        "--muon-ortho",
        "polar_express",
        *("--value-embeds", "1", "--unet-skips", "true"),
        *(("--cautious-wd", "true", "--muon-weight-decay", "0.1") if optimizer == "muon" else ()),
        *BATCH_WARMUP,
    ]
    two = run(flags(shakespeare_shards, tmp_path / "two", *extra), nproc=2, log_dir=tmp_path / "l2")
    assert two.proc.returncode == 0, two.output()
    one = run(flags(shakespeare_shards, tmp_path / "one", *extra), nproc=1, log_dir=tmp_path / "l1")
    assert one.proc.returncode == 0, one.output()
    a, b = losses(tmp_path / "two"), losses(tmp_path / "one")
    assert sorted(a) == sorted(b) == list(range(1, MAX_STEPS + 1))
    assert all(a[s] == pytest.approx(b[s], abs=1e-5) for s in a), (a, b)
    assert a[MAX_STEPS] < a[1] - 0.1


@pytest.mark.slow
def test_fsdp_equals_ddp_with_the_gpt2_speedrun_recipe(tmp_path, shakespeare_shards):
    """Muon's sharded matrices gathered for Newton-Schulz (gpt2/train/muon.py), each rank applying its rows, the
    momentum warmup on the sharded groups; both of FSDP's micro-step paths (the batch warmup's 1 micro-step a rank,
    then 2: no-sync, then the reduce-scatter). test_fsdp.py's plain-GPT-2 Muon case (10 steps, 1e-5) was folded
    into this one (issue 72): the same optimizer path, at 2 x the CPU time."""
    extra = ["--ckpt-interval", "0", *BATCH_WARMUP]
    ddp = run(
        flags(shakespeare_shards, tmp_path / "ddp", *extra, recipe=GPT2_SPEEDRUN), nproc=2, log_dir=tmp_path / "ld"
    )
    assert ddp.proc.returncode == 0, ddp.output()
    fsdp = run(
        flags(shakespeare_shards, tmp_path / "fsdp", *extra, "--parallel", "fsdp", recipe=GPT2_SPEEDRUN),
        nproc=2,
        log_dir=tmp_path / "lf",
    )
    assert fsdp.proc.returncode == 0, fsdp.output()
    a, b = losses(tmp_path / "ddp"), losses(tmp_path / "fsdp")
    assert sorted(a) == sorted(b) == list(range(1, MAX_STEPS + 1))
    assert all(a[s] == pytest.approx(b[s], abs=1e-4) for s in a), (a, b)
