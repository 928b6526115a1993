"""End-to-end fault tolerance with real processes (torchrun, gloo, CPU, fp32): a run that is killed,
stopped by a signal, or resumed at another world size computes what the uninterrupted run computes."""

from __future__ import annotations

import json
import os
import random
import signal
import time

import pytest

from _helpers import (assert_same_state, launch, load_ckpt, losses, records, run, tiny_run_flags,
                      wait_for_step)

MAX_STEPS = 10
CKPT_INTERVAL = 3


def flags(data_dir, out_dir, *extra):
    return [*tiny_run_flags(data_dir, max_steps=MAX_STEPS, ckpt_interval=CKPT_INTERVAL), "--out-dir", str(out_dir),
            *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare_shards):
    """The uninterrupted 2-rank run every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    done = run(flags(shakespeare_shards, out / "run"), nproc=2, log_dir=out)
    assert done.proc.returncode == 0, done.output()
    got = losses(out / "run")
    assert sorted(got) == list(range(1, MAX_STEPS + 1))
    assert got[MAX_STEPS] < got[1] - 0.1  # it learns, so equal losses are not equal by accident
    return out / "run"


def test_kill_9_one_rank_torchrun_restarts_and_reproduces_the_run(tmp_path, shakespeare_shards, reference):
    kill_after = random.Random().randint(CKPT_INTERVAL + 1, MAX_STEPS - 2)
    run_dir = tmp_path / "run"
    job = launch(flags(shakespeare_shards, run_dir), nproc=2, log_dir=tmp_path, max_restarts=1)
    try:
        wait_for_step(job, run_dir, kill_after)
        pids = job.workers()
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGKILL)
        assert job.wait() == 0, job.output()
    finally:
        job.kill()
    resumed = [int(line.split(" at step ")[1].split()[0]) for line in job.stdout.splitlines()
               if line.startswith("resumed from ")]
    assert len(resumed) == 1 and 0 < resumed[0] <= kill_after, (kill_after, job.output())
    assert resumed[0] % CKPT_INTERVAL == 0
    assert losses(run_dir) == losses(reference), f"killed after step {kill_after}"
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))
    assert not (run_dir / "requeue").exists()


def test_sigterm_to_torchrun_checkpoints_then_resume_auto_reproduces_the_run(tmp_path, shakespeare_shards,
                                                                           reference):
    run_dir = tmp_path / "run"
    stop_after = random.Random().randint(1, MAX_STEPS - 2)
    first = launch(flags(shakespeare_shards, run_dir), nproc=2, log_dir=tmp_path / "first")
    try:
        wait_for_step(first, run_dir, stop_after)
        first.proc.send_signal(signal.SIGTERM)  # to the agent, which forwards SIGTERM to its workers
        code = first.wait()
    finally:
        first.kill()
    # torchrun re-raises the signal it got as an error: exit 1 whatever the workers returned. Workers
    # exit 0 under torchrun (a stop must not look like a failure to --max-restarts).
    assert code == 1, first.output()
    marker = json.loads((run_dir / "requeue").read_text())
    stopped = marker["step"]
    assert stop_after <= stopped < MAX_STEPS, (stop_after, first.output())
    assert marker["signal"] == "SIGTERM" and marker["checkpoint"] == f"step_{stopped:08d}.pt"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == marker["checkpoint"]
    assert f"stopped by signal at step {stopped}" in first.stdout

    second = run(flags(shakespeare_shards, run_dir, "--resume", "auto"), nproc=2, log_dir=tmp_path / "second")
    assert second.proc.returncode == 0, second.output()
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:08d}.pt at step {stopped}" in second.stdout
    assert not (run_dir / "requeue").exists()  # the marker describes the last run only
    assert losses(run_dir) == losses(reference)
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))


def test_signal_to_one_worker_stops_all_ranks_without_an_elastic_restart(tmp_path, shakespeare_shards):
    """SIGUSR1 straight to rank 1 under --max-restarts 1: every rank stops at one step boundary, exits 0,
    and torchrun ends (exit 0) instead of restarting the group into a new run."""
    run_dir = tmp_path / "run"
    job = launch(flags(shakespeare_shards, run_dir), nproc=2, log_dir=tmp_path, max_restarts=1)
    try:
        wait_for_step(job, run_dir, 2)
        os.kill(job.workers()[1], signal.SIGUSR1)
        assert job.wait() == 0, job.output()
    finally:
        job.kill()
    marker = json.loads((run_dir / "requeue").read_text())
    assert marker["signal"] is None  # rank 0 writes the marker; rank 1 got the signal
    assert job.stdout.count("model ") == 1, "torchrun restarted the workers"
    assert max(losses(run_dir)) == marker["step"] < MAX_STEPS


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path, shakespeare_shards, reference):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    for suffix in (".pt", ".json"):
        src = reference / "checkpoints" / f"step_{CKPT_INTERVAL:08d}{suffix}"
        (run_dir / "checkpoints" / src.name).write_bytes(src.read_bytes())
    one = run(flags(shakespeare_shards, run_dir), nproc=1, log_dir=tmp_path)
    assert one.proc.returncode == 0, one.output()
    assert "resume: world size 2 -> 1; accumulation is now 2 micro-steps" in one.stdout
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(CKPT_INTERVAL + 1, MAX_STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step


def test_nan_step_is_skipped_and_the_run_continues(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    done = run([*tiny_run_flags(shakespeare_shards, max_steps=5, ckpt_interval=1), "--out-dir", str(run_dir),
                "--inject-nan-step", "2"], nproc=2, log_dir=tmp_path)
    assert done.proc.returncode == 0, done.output()
    steps = {r["step"]: r for r in records(run_dir) if "loss" in r}
    assert sorted(steps) == [1, 2, 3, 4, 5]
    # inject_nan_step counts from 0: the third optimizer step, logged as step 3
    assert [s for s, r in steps.items() if r["skipped"]] == [3]
    assert steps[3]["loss"] is None or steps[3]["loss"] != steps[3]["loss"]  # NaN
    assert "SKIPPED" in done.stdout
    before, skipped = load_ckpt(run_dir, 2), load_ckpt(run_dir, 3)
    for k in before["model"]:  # the update was not applied
        assert (before["model"][k] == skipped["model"][k]).all(), k
    after = load_ckpt(run_dir, 5)
    assert all(v == v for v in [steps[4]["loss"], steps[5]["loss"]])
    assert not all((after["model"][k] == skipped["model"][k]).all() for k in after["model"])


def test_consecutive_nan_steps_stop_the_run_without_a_checkpoint_of_them(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    done = run([*tiny_run_flags(shakespeare_shards, max_steps=6, ckpt_interval=1), "--out-dir", str(run_dir),
                "--inject-nan-step", "2", "--max-bad-steps", "1"], nproc=1, log_dir=tmp_path)
    assert done.proc.returncode == 1, done.output()
    assert "train_ddp.py: error: 1 consecutive steps had a non-finite loss" in done.stderr
    assert "Traceback" not in done.stderr
    ckdir = run_dir / "checkpoints"
    assert (ckdir / "latest").read_text().strip() == "step_00000002.pt"
    assert not (ckdir / "step_00000003.pt").exists()


def test_dead_peer_gives_an_error_within_the_timeout_not_a_hang(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    job = launch([*tiny_run_flags(shakespeare_shards, max_steps=1000, ckpt_interval=0), "--out-dir", str(run_dir),
                  "--dist-timeout-s", "5"], nproc=2, log_dir=tmp_path, env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "2"})
    try:
        wait_for_step(job, run_dir, 2)
        os.kill(job.workers()[1], signal.SIGSTOP)  # alive but silent: sockets stay open
        t0 = time.monotonic()
        code = job.wait(timeout=90)
        elapsed = time.monotonic() - t0
    finally:
        job.kill()
    assert code == 1, job.output()
    assert elapsed < 60, elapsed
    assert "train_ddp.py: error: rank 0: a collective operation failed" in job.stderr, job.output()
