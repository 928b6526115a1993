"""End-to-end fault tolerance with real processes (torchrun, gloo, CPU, fp32): a run that is killed,
stopped by a signal, or resumed at another world size computes what the uninterrupted run computes."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from _helpers import (
    assert_same_state,
    hold_after_step,
    import_train_ddp,
    inject_nan,
    launch,
    load_ckpt,
    losses,
    nan_at_step,
    patched_train_script,
    records,
    release_run,
    run,
    seeded_rng,
    tiny_run_flags,
    uninterrupted_run,
    wait_for_step,
)

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.checkpoint import verify_checkpoint

MAX_STEPS = 8
CKPT_INTERVAL = 3


def flags(data_dir, out_dir, *extra):
    return [
        *tiny_run_flags(data_dir, max_steps=MAX_STEPS, ckpt_interval=CKPT_INTERVAL),
        "--out-dir",
        str(out_dir),
        *extra,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shakespeare_shards):
    """The uninterrupted 2-rank run every interrupted one must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    return uninterrupted_run(flags(shakespeare_shards, out / "run"), out, MAX_STEPS)


def test_kill_9_one_rank_torchrun_restarts_and_reproduces_the_run(tmp_path, shakespeare_shards, reference, request):
    rng = seeded_rng(request)
    victim = rng.choice([0, 1])  # rank 0 may die inside a checkpoint write
    kill_after = rng.randint(CKPT_INTERVAL + 1, MAX_STEPS - 2)  # a step after a checkpoint
    where = f"rank {victim} killed after step {kill_after}"
    run_dir = tmp_path / "run"
    release = tmp_path / "release"
    job = launch(
        flags(shakespeare_shards, run_dir),
        nproc=2,
        log_dir=tmp_path,
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(kill_after, release)),
    )
    try:
        wait_for_step(job, run_dir, kill_after)  # the ranks wait there: the run cannot end first
        pids = job.workers()
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[victim], signal.SIGKILL)
        release_run(job, release)  # the restarted ranks pass step kill_after without waiting
        assert job.wait() == 0, f"{where}\n{job.output()}"
    finally:
        job.kill()
    resumed = [
        int(line.split(" at step ")[1].split()[0])
        for line in job.stdout.splitlines()
        if line.startswith("resumed from ")
    ]
    assert len(resumed) == 1 and 0 < resumed[0] <= kill_after, f"{where}\n{job.output()}"
    assert resumed[0] % CKPT_INTERVAL == 0
    assert losses(run_dir) == losses(reference), where
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))
    assert not (run_dir / "requeue").exists()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_sigterm_to_torchrun_checkpoints_then_resume_auto_reproduces_the_run(
    tmp_path, shakespeare_shards, reference, request
):
    run_dir = tmp_path / "run"
    stop_after = seeded_rng(request).randint(1, MAX_STEPS - 4)
    # --max-restarts 1: a signalled torchrun shuts down instead of restarting its workers
    release = tmp_path / "release"
    first = launch(
        flags(shakespeare_shards, run_dir),
        nproc=2,
        log_dir=tmp_path / "first",
        max_restarts=1,
        script=patched_train_script(tmp_path, hold_after_step(stop_after, release)),
    )
    try:
        wait_for_step(first, run_dir, stop_after)  # the ranks wait there until both have the signal
        first.proc.send_signal(signal.SIGTERM)  # to the agent, which forwards SIGTERM to its workers
        release_run(first, release, signalled_ranks=(0, 1))
        code = first.wait()
    finally:
        first.kill()
    # torchrun re-raises the signal it got as an error: exit 1, whatever its workers returned (0 here).
    assert code == 1, first.output()
    assert first.stdout.count(" parameters | world size ") == 1, "torchrun restarted the workers"
    marker = json.loads((run_dir / "requeue").read_text())
    stopped = marker["step"]
    assert stop_after <= stopped < MAX_STEPS, (stop_after, first.output())
    assert marker == {"step": stopped, "signal": "SIGTERM", "checkpoint": f"step_{stopped:08d}.pt"}
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == marker["checkpoint"]
    assert f"stopped by signal at step {stopped}" in first.stdout
    assert max(losses(run_dir)) == stopped

    second = run(flags(shakespeare_shards, run_dir, "--resume", "auto"), nproc=2, log_dir=tmp_path / "second")
    assert second.proc.returncode == 0, second.output()
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:08d}.pt at step {stopped}" in second.stdout
    assert not (run_dir / "requeue").exists()  # the marker describes the last run only
    assert losses(run_dir) == losses(reference)
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))


@pytest.mark.slow
def test_nan_step_skipped_then_signal_to_one_worker_stops_every_rank_without_restart(tmp_path, shakespeare_shards):
    """A NaN loss at one step (tests/_helpers.nan_at_step): that update is skipped on every rank and training goes on.
    Then SIGUSR1 straight to rank 1 under --max-restarts 1: all ranks stop at one step boundary and exit 0, so
    torchrun ends (exit 0) instead of restarting the group into a new run."""
    run_dir = tmp_path / "run"
    release = tmp_path / "release"
    job = launch(
        flags(shakespeare_shards, run_dir, "--ckpt-interval", "1"),
        nproc=2,
        log_dir=tmp_path,
        max_restarts=1,
        script=patched_train_script(tmp_path, nan_at_step(1) + hold_after_step(3, release)),
    )
    try:
        wait_for_step(job, run_dir, 3)
        os.kill(job.workers()[1], signal.SIGUSR1)
        release_run(job, release, signalled_ranks=(1,))
        assert job.wait() == 0, job.output()
    finally:
        job.kill()
    assert job.stdout.count(" parameters | world size ") == 1, "torchrun restarted the workers"
    marker = json.loads((run_dir / "requeue").read_text())
    assert marker["signal"] is None  # rank 0 writes the marker; only rank 1 got the signal
    steps = {r["step"]: r for r in records(run_dir) if "loss" in r}
    assert sorted(steps) == list(range(1, marker["step"] + 1)) and marker["step"] < MAX_STEPS
    # nan_at_step counts optimizer steps from 0: the second one, logged as step 2
    assert [s for s, r in steps.items() if r["skipped"]] == [2]
    assert steps[2]["loss"] is None or steps[2]["loss"] != steps[2]["loss"]  # NaN
    assert all(r["loss"] == r["loss"] for s, r in steps.items() if s != 2)
    assert "SKIPPED" in job.stdout
    before, skipped, after = load_ckpt(run_dir, 1), load_ckpt(run_dir, 2), load_ckpt(run_dir, 3)
    for k in before["model"]:  # the update was not applied ...
        assert torch.equal(before["model"][k], skipped["model"][k]), k
    assert skipped["loader"]["position"] == before["loader"]["position"] + 512  # ... but its batch was used
    assert not all(torch.equal(after["model"][k], skipped["model"][k]) for k in after["model"])


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_rank_and_sigterm_exits_3(tmp_path, shakespeare_shards, reference):
    """A 2-rank checkpoint continues on 1 process (2 accumulation steps) with the same losses; plain
    `python train_ddp.py` stopped by SIGTERM (twice: the second lands during the step or the save)
    exits 3 with a loadable checkpoint."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    for suffix in (".pt", ".json"):
        src = reference / "checkpoints" / f"step_{CKPT_INTERVAL:08d}{suffix}"
        (run_dir / "checkpoints" / src.name).write_bytes(src.read_bytes())
    release = tmp_path / "release"
    one = launch(
        flags(shakespeare_shards, run_dir),
        nproc=1,
        log_dir=tmp_path,
        script=patched_train_script(tmp_path, hold_after_step(CKPT_INTERVAL + 1, release)),
    )
    try:
        wait_for_step(one, run_dir, CKPT_INTERVAL + 1)
        one.proc.send_signal(signal.SIGTERM)
        release_run(one, release, signalled_ranks=(0,))
        time.sleep(0.05)
        one.proc.send_signal(signal.SIGTERM)
        code = one.wait()
    finally:
        one.kill()
    assert code == 3, one.output()
    assert "resume: world size 2 -> 1; accumulation is now 2 micro-steps" in one.stdout
    stopped = json.loads((run_dir / "requeue").read_text())["step"]
    got, want = losses(run_dir), losses(reference)
    assert sorted(got) == list(range(CKPT_INTERVAL + 1, stopped + 1)) and stopped < MAX_STEPS
    for step in got:
        assert got[step] == pytest.approx(want[step], abs=1e-5), step
    verify_checkpoint(run_dir / "checkpoints" / f"step_{stopped:08d}.pt")
    assert load_ckpt(run_dir, stopped)["world_size"] == 1


def test_consecutive_nan_steps_stop_the_run_without_a_checkpoint_of_them(
    tmp_path, shakespeare_shards, capsys, monkeypatch
):
    inject_nan(monkeypatch, 2)
    train_ddp = import_train_ddp()  # in this process: one rank, no process group, no start-up cost
    run_dir = tmp_path / "run"
    code = train_ddp.main(
        [
            *tiny_run_flags(shakespeare_shards, max_steps=6, ckpt_interval=1, eval_tokens=256),
            "--out-dir",
            str(run_dir),
            "--max-bad-steps",
            "1",
        ]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "train_ddp.py: error: 1 consecutive steps had a non-finite loss or gradient norm (last: step 3)" in err
    assert "no checkpoint was written from them" in err
    ckdir = run_dir / "checkpoints"
    assert (ckdir / "latest").read_text().strip() == "step_00000002.pt"
    assert not (ckdir / "step_00000003.pt").exists()
    assert [r["step"] for r in records(run_dir) if r.get("skipped")] == [3]


@pytest.mark.slow
def test_dead_peer_gives_an_error_within_the_step_timeout_not_a_hang(tmp_path, shakespeare_shards):
    """Start-up's long timeout (600 s) gives way to the steady-state one (3 s) after the first step."""
    run_dir = tmp_path / "run"
    job = launch(
        [
            *tiny_run_flags(shakespeare_shards, max_steps=1000, ckpt_interval=0),
            "--out-dir",
            str(run_dir),
            "--dist-timeout-s",
            "600",
            "--dist-step-timeout-s",
            "3",
        ],
        nproc=2,
        log_dir=tmp_path,
    )
    try:
        wait_for_step(job, run_dir, 2)
        workers = job.workers()
        os.kill(workers[1], signal.SIGSTOP)  # alive but silent: its sockets stay open, nothing fails fast
        t0 = time.monotonic()
        while "train_ddp.py: error:" not in job.stderr and time.monotonic() - t0 < 60:
            time.sleep(0.1)
        elapsed = time.monotonic() - t0
        # torchrun would now wait 30 s (fixed, for a failed group) for the stopped rank before SIGKILL
        os.kill(workers[1], signal.SIGKILL)
        code = job.wait(timeout=60)
    finally:
        job.kill()
    assert "train_ddp.py: error: rank 0: a collective operation failed" in job.stderr, job.output()
    assert "another rank died, or did not answer within --dist-step-timeout-s 3 (steady training)" in job.stderr
    assert elapsed < 25, elapsed  # 3 s timeout plus a busy machine's slack, not a hang
    assert code == 1


SLOW_RANK_0 = """
import time
import gpt2.ckpt.checkpoint as ckpt
import gpt2.train.trainer as trainer

_save, _sample = ckpt.save_checkpoint, trainer.sample_text


def slow_save(*args, **kwargs):  # a multi-GB checkpoint to a shared filesystem
    time.sleep(6)
    return _save(*args, **kwargs)


def slow_sample(*args, **kwargs):  # rank 0 generates text while the others go on to the next step
    time.sleep(6)
    return _sample(*args, **kwargs)


ckpt.save_checkpoint, trainer.sample_text = slow_save, slow_sample
"""


@pytest.mark.slow  # ~27 s
def test_checkpoints_and_samples_longer_than_the_step_timeout_run_under_the_long_one(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    job = run(
        [
            *tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=2),
            "--out-dir",
            str(run_dir),
            "--sample-interval",
            "3",
            "--sample-tokens",
            "4",
            "--dist-timeout-s",
            "60",
            "--dist-step-timeout-s",
            "2",
        ],
        nproc=2,
        log_dir=tmp_path,
        script=patched_train_script(tmp_path, SLOW_RANK_0),
    )
    assert job.proc.returncode == 0, job.output()
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    assert [r["step"] for r in records(run_dir) if "sample" in r] == [3, 4]


def test_each_rank_draws_its_own_random_numbers(reference):
    """Dropout masks come from the global torch RNG: one seed on every rank would drop the same units on
    every rank. The ranks' saved RNG states differ."""
    rngs = load_ckpt(reference, CKPT_INTERVAL)["rng"]
    assert len(rngs) == 2
    assert not torch.equal(rngs[0]["torch"], rngs[1]["torch"])


HOLD_WRITE_OF_STEP_6 = """
import threading
from pathlib import Path
import gpt2.ckpt.checkpoint as ckpt

_save, _write, _now = ckpt.save_checkpoint, ckpt._HashingWriter.write, {{"step": None}}


def save_checkpoint(out_dir, step, state, **kwargs):  # runs in rank 0's writer thread
    _now["step"] = step
    return _save(out_dir, step, state, **kwargs)


def write(self, data):  # step 6's file: some bytes reach the temp file, then the writer hangs
    n = _write(self, data)
    if _now["step"] == 6 and self.size > 0:
        self.f.flush()
        Path({marker!r}).touch()
        threading.Event().wait()
    return n


ckpt.save_checkpoint, ckpt._HashingWriter.write = save_checkpoint, write
"""


@pytest.mark.slow
def test_kill_9_during_a_background_write_resumes_from_the_previous_checkpoint(tmp_path, shakespeare_shards, reference):
    """Rank 0's writer thread hangs half-way through step 6's file; training goes on past it (step 7);
    then kill -9 of the whole group. Step 3 is the newest valid checkpoint and --resume auto
    reproduces the uninterrupted run bitwise."""
    run_dir, marker = tmp_path / "run", tmp_path / "writing_step_6"
    first = launch(
        flags(shakespeare_shards, run_dir),
        nproc=2,
        log_dir=tmp_path / "first",
        script=patched_train_script(tmp_path, HOLD_WRITE_OF_STEP_6.format(marker=str(marker))),
    )
    try:
        wait_for_step(first, run_dir, 7)  # step 7 ran while step 6's checkpoint was being written ...
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline and first.proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), first.output()  # ... and the write is still in flight
    finally:
        first.kill()  # SIGKILL: launcher and workers
    ckdir = run_dir / "checkpoints"
    assert list(ckdir.glob("step_00000006.pt.*.tmp")) and not (ckdir / "step_00000006.pt").exists()
    assert (ckdir / "latest").read_text().strip() == "step_00000003.pt"
    second = run(flags(shakespeare_shards, run_dir, "--resume", "auto"), nproc=2, log_dir=tmp_path / "second")
    assert second.proc.returncode == 0, second.output()
    assert f"resumed from {ckdir}/step_00000003.pt at step 3" in second.stdout
    assert losses(run_dir) == losses(reference)
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))
    assert not list(ckdir.glob("*.tmp"))  # the next write cleared the dead one's temp file


FAIL_WRITE_OF_STEP_3 = """
import gpt2.ckpt.checkpoint as ckpt

_save = ckpt.save_checkpoint


def save_checkpoint(out_dir, step, state, **kwargs):
    if step == 3:
        raise OSError(28, "No space left on device")
    return _save(out_dir, step, state, **kwargs)


ckpt.save_checkpoint = save_checkpoint

import time
import gpt2.train.trainer as trainer

_trainer_save = trainer.save


def save(parts, *args, **kwargs):  # rank 0 holds the run after step 3's save until its writer has failed
    _trainer_save(parts, *args, **kwargs)
    if parts.step == 3 and parts.writer is not None:
        while not parts.writer.failed:
            time.sleep(0.01)


trainer.save = save
"""


@pytest.mark.slow
def test_a_failed_background_write_stops_every_rank_with_one_error(tmp_path, shakespeare_shards):
    """Rank 0's writer fails at step 3; at the next step (4; it was the next save, step 6) every rank
    votes to stop, learns the error through the stop's save and exits: no rank is left waiting in a
    collective. Rank 0 holds the run after step 3 until its writer has failed (it may take longer than
    a step), so step 4 is deterministically the step after the failure."""
    run_dir = tmp_path / "run"
    job = run(
        flags(shakespeare_shards, run_dir, "--dist-timeout-s", "120"),
        nproc=2,
        log_dir=tmp_path,
        script=patched_train_script(tmp_path, FAIL_WRITE_OF_STEP_3),
    )
    assert job.proc.returncode == 1, job.output()
    assert (
        job.stderr.count(
            "train_ddp.py: error: writing the checkpoint of step 3 in the background failed "
            f"(No space left on device in {run_dir / 'checkpoints'} ("
        )
        == 1
    ), job.output()
    assert "a collective operation failed" not in job.stderr
    assert max(losses(run_dir)) == 4  # found at the next step, not at the step-6 save or the end
    assert not (run_dir / "checkpoints" / "step_00000003.pt").exists()


# ---- A fresh start in a used directory: the earlier run's records go to RUN/previous-*/ -------------


def previous(run_dir):
    """The one RUN/previous-*/ folder a fresh start made."""
    found = sorted(run_dir.glob("previous-*"))
    assert len(found) == 1, found
    return found[0]


def run_id(run_dir):
    return json.loads((run_dir / "config.json").read_text())["run_id"]


def sidecar_run_ids(run_dir) -> dict[str, str | None]:
    return {p.stem: json.loads(p.read_text()).get("run_id") for p in (run_dir / "checkpoints").glob("step_*.json")}


def in_process(args, capsys) -> tuple[int, str, str]:
    """train_ddp.main in this process (one rank, no process group): exit code, stdout, stderr."""
    capsys.readouterr()
    code = import_train_ddp().main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def small(data_dir, run_dir, *extra, max_steps=4, ckpt_interval=2):
    return [
        *tiny_run_flags(data_dir, max_steps=max_steps, ckpt_interval=ckpt_interval, eval_tokens=256),
        "--out-dir",
        str(run_dir),
        *extra,
    ]


def test_resume_never_in_a_used_directory_moves_the_earlier_run_aside(tmp_path, shakespeare_shards, capsys):
    run_dir = tmp_path / "run"
    assert in_process(small(shakespeare_shards, run_dir), capsys)[0] == 0
    old_id, old_losses = run_id(run_dir), losses(run_dir)
    old_bytes = (run_dir / "checkpoints" / "step_00000004.pt").read_bytes()
    code, out, _ = in_process(
        small(shakespeare_shards, run_dir, "--resume", "never", "--max-steps", "3", "--ckpt-interval", "3"), capsys
    )
    assert code == 0
    moved = previous(run_dir)
    assert (
        f"fresh start: moved the earlier run's checkpoints, metrics.jsonl, train.log, config.json from {run_dir} into "
        f"{moved}/ (nothing deleted)"
    ) in out
    assert sorted(losses(run_dir)) == [1, 2, 3]  # only the new run's steps (and each once)
    assert [r["step"] for r in records(run_dir) if "val_loss" in r] == [0, 3]
    assert losses(moved) == old_losses and run_id(moved) == old_id  # the earlier run, whole
    assert (moved / "checkpoints" / "step_00000004.pt").read_bytes() == old_bytes
    # the earlier run's console log went with it; the new one's holds only the new run's lines
    assert "step      4/4 |" in (moved / "train.log").read_text()
    assert "step      4/" not in (run_dir / "train.log").read_text()
    assert sorted(sidecar_run_ids(moved)) == ["step_00000002", "step_00000004"]
    new_id = run_id(run_dir)
    assert new_id != old_id and sidecar_run_ids(run_dir) == {"step_00000003": new_id}
    assert load_ckpt(run_dir, 3)["run_id"] == new_id


def test_a_refused_resume_of_another_run_moves_nothing_aside(tmp_path, shakespeare_shards, capsys):
    """Issue 32: --resume PATH of another run's checkpoint of another shape (or seed) into a used
    directory moved the directory's run into previous-*/ and only then refused; the next plain run
    started at step 0. Every refusal comes first: the directory is left byte for byte as it was."""
    run_dir, other = tmp_path / "run", tmp_path / "other"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "2"), capsys)[0] == 0
    assert (
        in_process(small(shakespeare_shards, other, "--max-steps", "2", "--n-layer", "3", "--seed", "7"), capsys)[0]
        == 0
    )
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    foreign = str(other / "checkpoints" / "step_00000002.pt")
    for extra, why in (
        (["--seed", "7"], "the checkpoint's model shape differs from this run's: n_layer: checkpoint 3 vs now 2"),
        (["--n-layer", "3"], "the checkpoint's data order used seed 7, this run has --seed 1337"),
    ):
        code, out, err = in_process(small(shakespeare_shards, run_dir, "--resume", foreign, *extra), capsys)
        assert code == 2 and why in err, err
        assert "moved" not in out and not list(run_dir.glob("previous-*")), out
        assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before
    code, out, _ = in_process(small(shakespeare_shards, run_dir, "--max-steps", "3", "--ckpt-interval", "3"), capsys)
    assert code == 0 and f"resumed from {run_dir}/checkpoints/step_00000002.pt at step 2" in out, out
    assert sorted(losses(run_dir)) == [1, 2, 3]


def test_resume_auto_with_its_only_checkpoint_damaged_refuses_then_never_starts_apart(
    tmp_path, shakespeare_shards, capsys
):
    """Issue 41: auto skipped the damaged checkpoint, moved the run aside and trained from step 0 with
    exit 0. Now it refuses in one line, leaving the directory as it was; --resume never starts apart."""
    run_dir = tmp_path / "run"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "2"), capsys)[0] == 0
    damaged = run_dir / "checkpoints" / "step_00000002.pt"
    data = damaged.read_bytes()[:5000]
    damaged.write_bytes(data)
    before = {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}
    code, out, err = in_process(small(shakespeare_shards, run_dir, "--max-steps", "3", "--ckpt-interval", "3"), capsys)
    assert code == 2 and "skipping checkpoint" in err and "truncated" in err
    refusal = [line for line in err.splitlines() if "none of this run's" in line]
    assert len(refusal) == 1 and "--resume never to start fresh" in refusal[0], err
    assert {p: p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()} == before
    code, out, err = in_process(
        small(shakespeare_shards, run_dir, "--max-steps", "3", "--ckpt-interval", "3", "--resume", "never"), capsys
    )
    assert code == 0
    assert "fresh start: moved the earlier run's checkpoints, metrics.jsonl, train.log, config.json" in out
    assert sorted(losses(run_dir)) == [1, 2, 3]
    assert sorted(losses(previous(run_dir))) == [1, 2]
    assert (previous(run_dir) / "checkpoints" / "step_00000002.pt").read_bytes() == data  # kept, as it was
    assert sorted(sidecar_run_ids(run_dir)) == ["step_00000003"]


def test_checkpoints_whose_sidecars_are_gone_resume_and_export(tmp_path, shakespeare_shards, capsys):
    """Issue 41: with the .json sidecars removed, the same command warned three times, moved the run aside
    and trained from step 0 (exit 0), and --resume PATH and gpt2.export refused the intact .pt files. Now
    auto resumes the newest (warning once) and writes its sidecar again, so retention counts it;
    gpt2.export takes such a file too. (The file is the one written: a resume from it is the bitwise
    resume the tests above check.)"""
    from gpt2.export import main as export_main

    run_dir = tmp_path / "run"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "2"), capsys)[0] == 0
    for sidecar in (run_dir / "checkpoints").glob("*.json"):
        sidecar.unlink()
    capsys.readouterr()
    with pytest.warns(UserWarning, match="lost its sidecar"):
        assert (
            export_main(
                ["--checkpoint", str(run_dir / "checkpoints" / "step_00000002.pt"), "--out", str(tmp_path / "hf")]
            )
            == 0
        )
    assert "exported" in capsys.readouterr().out
    code, out, err = in_process(small(shakespeare_shards, run_dir, "--max-steps", "3", "--ckpt-interval", "3"), capsys)
    assert code == 0, err
    assert err.count("lost its sidecar step_00000002.json") == 1 and "skipping" not in err, err
    assert f"resumed from {run_dir}/checkpoints/step_00000002.pt at step 2" in out and "moved" not in out
    assert sorted(losses(run_dir)) == [1, 2, 3]
    verify_checkpoint(run_dir / "checkpoints" / "step_00000002.pt")  # its sidecar is back, and right
    assert sorted(sidecar_run_ids(run_dir)) == ["step_00000002", "step_00000003"]


@pytest.mark.slow
def test_the_issues_scenario_auto_never_resumes_the_earlier_run(tmp_path, shakespeare_shards, capsys):
    """Issue 26: a run to step 6, a fresh run (--resume never) to step 4, its newest checkpoint truncated:
    --resume auto continues the new run from its step 2, exactly, not the old run from step 6."""
    run_dir = tmp_path / "run"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "6", "--ckpt-interval", "3"), capsys)[0] == 0
    assert in_process(small(shakespeare_shards, run_dir, "--resume", "never"), capsys)[0] == 0
    fresh = losses(run_dir)
    newest = run_dir / "checkpoints" / "step_00000004.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    code, out, _ = in_process(small(shakespeare_shards, run_dir), capsys)
    assert code == 0
    assert f"resumed from {run_dir}/checkpoints/step_00000002.pt at step 2" in out
    assert "step_00000006" not in out and "moved" not in out
    assert losses(run_dir) == fresh  # steps 1-4 once each; 3 and 4 recomputed bitwise
    assert sorted(losses(previous(run_dir))) == list(range(1, 7))
    assert set(sidecar_run_ids(run_dir).values()) == {run_id(run_dir)}


def test_an_old_format_checkpoint_without_a_run_id_still_resumes(tmp_path, shakespeare_shards, capsys):
    """A run directory written before run ids (no run_id in config.json, checkpoints or sidecars)."""
    run_dir = tmp_path / "run"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "2"), capsys)[0] == 0
    for step in (2,):  # rewrite as the previous version wrote it
        state = load_ckpt(run_dir, step)
        for key in ("run_id", "format", "step"):
            del state[key]
        ckpt.save_checkpoint(run_dir, step, state, keep=100)
    info = json.loads((run_dir / "config.json").read_text())
    del info["run_id"]
    (run_dir / "config.json").write_text(json.dumps(info))
    assert sidecar_run_ids(run_dir) == {"step_00000002": None} and "run_id" not in load_ckpt(run_dir, 2)
    code, out, _ = in_process(small(shakespeare_shards, run_dir, "--max-steps", "3", "--ckpt-interval", "3"), capsys)
    assert code == 0
    assert f"resumed from {run_dir}/checkpoints/step_00000002.pt at step 2" in out and "moved" not in out
    assert sorted(losses(run_dir)) == [1, 2, 3] and not list(run_dir.glob("previous-*"))
    assert run_id(run_dir) is None  # it goes on as a run without an id ...
    assert sidecar_run_ids(run_dir) == {"step_00000002": None, "step_00000003": None}  # ... whose checkpoints match


def test_a_resume_with_another_batch_size_continues_the_token_count(tmp_path, shakespeare_shards, capsys):
    """Issue 41: tokens were step x batch, so after a resume with another --total-batch-size metrics.jsonl
    jumped (30,720 at step 30, 63,488 at step 31), and the checkpoint, the loss curve's axis and the
    "resumed at" line said the same. Tokens are counted as consumed."""
    run_dir = tmp_path / "run"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "2"), capsys)[0] == 0  # 512 a step
    code, out, _ = in_process(
        small(shakespeare_shards, run_dir, "--max-steps", "4", "--total-batch-size", "1024"), capsys
    )
    assert code == 0 and f"resumed from {run_dir}/checkpoints/step_00000002.pt at step 2 (1,024 tokens)" in out
    assert {r["step"]: r["tokens"] for r in records(run_dir) if "loss" in r} == {1: 512, 2: 1024, 3: 2048, 4: 3072}
    assert [r["tokens"] for r in records(run_dir) if "val_loss" in r] == [0, 1024, 3072]  # the curve's axis
    assert load_ckpt(run_dir, 4)["tokens"] == 3072


def test_a_checkpoint_without_the_token_count_counts_its_steps_at_its_batch():
    """One written before the count (no "tokens"): its steps x its --total-batch-size, as then."""
    from gpt2.train.state import tokens_of

    saved = {"step": 6, "config": {"train": {"total_batch_size": 1024}}}
    assert tokens_of(saved) == 6144
    assert tokens_of({**saved, "tokens": 5000}) == 5000


@pytest.mark.slow
def test_two_ranks_start_fresh_apart_and_auto_ignores_the_earlier_runs_checkpoint(tmp_path, reference):
    """2 ranks: a fresh start in the reference run's directory (8 steps), its newest checkpoint
    truncated, and the earlier run's step 8 put back into checkpoints/ (a stray, the highest step):
    every rank resumes the new run from its step 3, retention keeps the stray, and the losses are
    the fresh run's."""
    import shutil

    data_dir = json.loads((reference / "config.json").read_text())["config"]["train"]["data"]["data_dir"]
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    fresh = run(flags(data_dir, run_dir, "--resume", "never", "--max-steps", "5"), nproc=2, log_dir=tmp_path / "fresh")
    assert fresh.proc.returncode == 0, fresh.output()
    moved = previous(run_dir)
    assert (
        fresh.stdout.count(
            f"fresh start: moved the earlier run's checkpoints, metrics.jsonl, train.log, "
            f"config.json from {run_dir} into {moved}/"
        )
        == 1
    )
    assert losses(moved) == losses(reference)
    fresh_losses, new_id = losses(run_dir), run_id(run_dir)
    assert sorted(fresh_losses) == [1, 2, 3, 4, 5] and new_id != run_id(reference)
    newest = run_dir / "checkpoints" / "step_00000005.pt"
    newest.write_bytes(newest.read_bytes()[:1000])
    stray = run_dir / "checkpoints" / "step_00000008.pt"
    for suffix in (".pt", ".json"):
        shutil.copy(moved / "checkpoints" / stray.with_suffix(suffix).name, stray.with_suffix(suffix))
    again = run(
        flags(data_dir, run_dir, "--max-steps", "5", "--keep-checkpoints", "1"), nproc=2, log_dir=tmp_path / "again"
    )
    assert again.proc.returncode == 0, again.output()
    assert f"resumed from {run_dir}/checkpoints/step_00000003.pt at step 3" in again.stdout
    assert f"ignoring checkpoint {stray}: it belongs to run {run_id(reference)}" in again.stderr
    assert losses(run_dir) == fresh_losses
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == ["step_00000005.pt", "step_00000008.pt"]
    verify_checkpoint(stray)  # never deleted by retention, though keep=1 and it is not the newest
    assert sidecar_run_ids(run_dir) == {"step_00000005": new_id, "step_00000008": run_id(reference)}


# ---- A rollback: --resume PATH of an earlier checkpoint of the run ------------------------------


def stop_during_step(monkeypatch, step: int) -> None:
    """SIGTERM to this process while optimizer step `step` (counted from 1) runs: a preemption there,
    so the run checkpoints that step and exits 3."""
    import gpt2.train.trainer as trainer

    original = trainer.train_step

    def train_step(parts, cfg, dist, stop_requested):
        if parts.step == step - 1:
            os.kill(os.getpid(), signal.SIGTERM)  # recorded by the trainer's StopRequest
            stop_requested = True  # the loop read the flag before this call; the signal is now here
        return original(parts, cfg, dist, stop_requested)

    monkeypatch.setattr(trainer, "train_step", train_step)


@pytest.mark.slow
def test_a_rollback_moves_the_later_checkpoints_aside_and_a_requeue_continues_the_new_branch(
    tmp_path, shakespeare_shards, capsys, monkeypatch
):
    """A run to step 6 (checkpoints 2, 4, 6) rolled back with --resume RUN/checkpoints/step_00000002.pt
    and a lower --lr, preempted at step 5, requeued with --resume auto. auto used to take step 6, the
    abandoned branch; now the rollback moved steps 4 and 6 into checkpoints/abandoned-*/, and the
    requeue's losses are those of the new branch run without a stop."""
    import shutil

    run_dir, uninterrupted = tmp_path / "run", tmp_path / "uninterrupted"
    assert in_process(small(shakespeare_shards, run_dir, "--max-steps", "6"), capsys)[0] == 0
    old = losses(run_dir)
    later = {
        name: (run_dir / "checkpoints" / name).read_bytes()
        for name in ("step_00000004.pt", "step_00000004.json", "step_00000006.pt", "step_00000006.json")
    }
    shutil.copytree(run_dir, uninterrupted)
    branch = ["--lr", "1e-3", "--max-steps", "7", "--ckpt-interval", "3"]
    rollback = ["--resume", str(run_dir / "checkpoints" / "step_00000002.pt")]

    code, out, _ = in_process(
        small(
            shakespeare_shards,
            uninterrupted,
            *branch,
            "--resume",
            str(uninterrupted / "checkpoints" / "step_00000002.pt"),
        ),
        capsys,
    )
    assert code == 0
    new = losses(uninterrupted)
    assert sorted(new) == list(range(1, 8)) and new[4] != old[4]  # step 3 updates with the new lr

    before = tree(run_dir)  # a refused rollback (another seed) moves nothing
    code, out, err = in_process(small(shakespeare_shards, run_dir, *branch, *rollback, "--seed", "7"), capsys)
    assert code == 2 and "keep the seed to resume exactly" in err and "moved" not in out, err
    assert tree(run_dir) == before

    with monkeypatch.context() as patch:
        stop_during_step(patch, 5)
        code, rolled, _ = in_process(small(shakespeare_shards, run_dir, *branch, *rollback), capsys)
    assert code == 3 and "stopped by signal at step 5" in rolled, rolled
    assert losses(run_dir) == {step: loss for step, loss in new.items() if step <= 5}  # one run: 1-2, then the new 3-5

    code, out, _ = in_process(small(shakespeare_shards, run_dir, *branch), capsys)  # the requeue: --resume auto
    assert code == 0 and f"resumed from {run_dir}/checkpoints/step_00000005.pt at step 5" in out, out
    assert losses(run_dir) == new  # the new branch, bitwise; not step 6 of the old one
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*.pt")) == [
        "step_00000002.pt",
        "step_00000003.pt",
        "step_00000005.pt",
        "step_00000006.pt",
        "step_00000007.pt",
    ]
    [abandoned] = (run_dir / "checkpoints").glob("abandoned-*")
    assert abandoned.name.startswith("abandoned-00000002-")
    assert (
        f"resuming from {run_dir}/checkpoints/step_00000002.pt (step 2), an earlier checkpoint of this run: "
        f"moved its later step_00000004.pt, step_00000006.pt and their sidecars into {abandoned}/"
    ) in rolled
    assert {name: (abandoned / name).read_bytes() for name in later} == later  # nothing deleted or changed
    assert losses(abandoned) == old  # the abandoned branch's log, whole


# ---- One run per directory (RUN/run.lock), and workers that outlive their launcher ---------------


def tree(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def wait_until(done, what: str, timeout: float = 180) -> None:
    """Poll for an event; the timeout is a safety net for a loaded machine, not a timing assumption."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def held_after_saving(tmp_path, shakespeare_shards, run_dir, release):
    """One process training run_dir, waiting (hold_after_step) right after its synchronous step-2
    checkpoint, which its stdout has announced: nothing in RUN changes until release exists."""
    first = launch(
        small(shakespeare_shards, run_dir, "--async-ckpt", "false"),
        nproc=1,
        log_dir=tmp_path / "first",
        script=patched_train_script(tmp_path, hold_after_step(2, release)),
    )
    saved = f"saved checkpoint {run_dir}/checkpoints/step_00000002.pt"
    wait_until(lambda: saved in first.stdout or first.proc.poll() is not None, "step-2 checkpoint")
    assert saved in first.stdout, first.output()
    return first


def test_a_second_run_in_a_held_directory_is_refused_naming_the_holder(tmp_path, shakespeare_shards, capsys):
    """Issue 32: two trainings in one --out-dir both ran, resuming each other's checkpoints. Now the
    second (2 ranks) is refused at once by every rank, naming the holder, and RUN is left as it was; a
    --dry-run takes nothing."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    first = held_after_saving(tmp_path, shakespeare_shards, run_dir, release)
    try:
        held = json.loads((run_dir / "run.lock").read_text())
        assert held["pid"] == first.proc.pid
        before = tree(run_dir)
        second = run(small(shakespeare_shards, run_dir), nproc=2, log_dir=tmp_path / "second")
        assert second.proc.returncode == 1, second.output()  # torchrun's status for its workers' exit 2
        errors = [line for line in second.stderr.splitlines() if line.startswith("train_ddp.py: error:")]
        assert errors == [
            f"train_ddp.py: error: {run_dir} is in use by another training run (host {held['host']}, "
            f"pid {first.proc.pid}, since {held['since']}; {run_dir}/run.lock): one run owns a run "
            "directory at a time. Wait for it to end or stop it, or pass another --out-dir (a holder "
            "on another host that died is taken over once its heartbeat is 300 s old; delete "
            f"{run_dir}/run.lock only if no run uses {run_dir})"
        ], second.output()
        assert second.stderr.count("exitcode  : 2") == 2, second.output()  # both ranks refused alike
        assert "resumed from" not in second.stdout and "starting" not in second.stdout
        assert in_process(small(shakespeare_shards, run_dir, "--dry-run"), capsys)[0] == 0
        assert tree(run_dir) == before
        release.touch()
        assert first.wait() == 0, first.output()
    finally:
        first.kill()
    assert sorted(losses(run_dir)) == [1, 2, 3, 4] and not (run_dir / "run.lock").exists()


def test_a_holder_killed_with_sigkill_is_taken_over_by_the_next_start(tmp_path, shakespeare_shards, capsys):
    run_dir, release = tmp_path / "run", tmp_path / "release"
    first = held_after_saving(tmp_path, shakespeare_shards, run_dir, release)
    try:
        held = json.loads((run_dir / "run.lock").read_text())
    finally:
        first.kill()  # SIGKILL: the lock stays behind, naming a process that no longer exists
    assert json.loads((run_dir / "run.lock").read_text()) == held
    code, out, _ = in_process(small(shakespeare_shards, run_dir), capsys)
    assert code == 0, out
    assert (
        f"run dir    took over {run_dir} from host {held['host']}, pid {held['pid']}, since {held['since']}: "
        f"its process (pid {held['pid']}) has exited"
    ) in out
    assert f"resumed from {run_dir}/checkpoints/step_00000002.pt at step 2" in out
    assert sorted(losses(run_dir)) == [1, 2, 3, 4] and not (run_dir / "run.lock").exists()


def alive(pid: int) -> bool:
    """pid is a running process (an exited one not yet reaped by its new parent counts as gone)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


@pytest.mark.slow
def test_kill_9_of_torchrun_stops_its_workers_with_a_checkpoint(tmp_path, shakespeare_shards, reference):
    """Issue 32: torchrun killed with SIGKILL left its workers training and writing checkpoints. Now the
    kernel sends each worker SIGTERM (PR_SET_PDEATHSIG): every rank stops at the same step with a
    checkpoint and RUN/requeue, releases RUN, and --resume auto reproduces the uninterrupted run."""
    run_dir, release = tmp_path / "run", tmp_path / "release"
    first = launch(
        flags(shakespeare_shards, run_dir),
        nproc=2,
        log_dir=tmp_path / "first",
        script=patched_train_script(tmp_path, hold_after_step(3, release)),
    )
    workers = {}
    try:
        wait_for_step(first, run_dir, 3)  # the ranks then wait in step 4 until release exists
        workers = first.workers()
        assert sorted(workers) == [0, 1], first.output()
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        signalled = [release.with_name(f"{release.name}.signalled.{rank}") for rank in (0, 1)]
        wait_until(lambda: all(p.exists() for p in signalled), "SIGTERM to both workers after torchrun died")
        release.touch()
        wait_until(lambda: not any(alive(pid) for pid in workers.values()), "exit of both workers")
    finally:
        first.kill()
        for pid in workers.values():  # the workers this test started, should they still run
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # Step 4 if a rank had the signal when it began step 4 (its vote is read before the hold), else step 5.
    stopped = json.loads((run_dir / "requeue").read_text())["step"]
    assert stopped in (4, 5), first.output()
    assert json.loads((run_dir / "requeue").read_text()) == {
        "step": stopped,
        "signal": "SIGTERM",
        "checkpoint": f"step_{stopped:08d}.pt",
    }
    assert f"stopped by signal at step {stopped}" in first.stdout
    verify_checkpoint(run_dir / "checkpoints" / f"step_{stopped:08d}.pt")
    assert sorted(losses(run_dir)) == list(range(1, stopped + 1)) and not (run_dir / "run.lock").exists()
    second = run(flags(shakespeare_shards, run_dir), nproc=2, log_dir=tmp_path / "second")
    assert second.proc.returncode == 0, second.output()
    assert f"resumed from {run_dir}/checkpoints/step_{stopped:08d}.pt at step {stopped}" in second.stdout
    assert "took over" not in second.stdout  # released at the stop, not left to be judged stale
    assert losses(run_dir) == losses(reference)
    assert_same_state(load_ckpt(run_dir, MAX_STEPS), load_ckpt(reference, MAX_STEPS))


@pytest.mark.slow
def test_a_resume_keeps_the_runs_own_auto_decisions_unless_a_flag_changes_them(tmp_path, shakespeare_shards, capsys):
    """Issue 58: a resume of an unchanged command printed `resume: loss_impl changed from 'chunked' to
    'full'` (a timing probe decided afresh on a busier machine), so the resumed run computed otherwise.
    --FLAG auto on a resume keeps the run's own decision, says so, and a flag given now still wins."""
    run_dir = tmp_path / "run"
    first = small(shakespeare_shards, run_dir, "--micro-batch-size", "1", "--loss-impl", "full", max_steps=2)
    assert in_process(first, capsys)[0] == 0
    auto = ("--micro-batch-size", "auto", "--loss-impl", "auto")
    code, out, _ = in_process(small(shakespeare_shards, run_dir, *auto, max_steps=4, ckpt_interval=4), capsys)
    assert code == 0, out
    assert "resume: --micro-batch-size auto keeps 1, the run's own choice" in out
    assert "resume: --loss-impl auto keeps 'full', the run's own choice" in out
    assert "loss_impl changed" not in out and "micro_batch_size changed" not in out
    assert "8 micro-steps of 1x64" in out
    whole = tmp_path / "whole"
    same = ("--micro-batch-size", "1", "--loss-impl", "full")
    assert in_process(small(shakespeare_shards, whole, *same), capsys)[0] == 0
    assert losses(run_dir) == losses(whole)  # bit for bit: the same decisions as the uninterrupted run
    # A flag given now wins: state.check_compatible's "resume: X changed from ... to ..." (tests/test_checkpoint.py).
