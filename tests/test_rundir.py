"""Run directories (gpt2/ckpt/rundir.py) and the start decision (gpt2/ckpt/resume.py choose_start): run ids, which
checkpoints count, and moving an earlier run's records aside. One process, no training."""

from __future__ import annotations

import json
import os
import re
import socket
import time

import pytest
import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt import resume, rundir
from gpt2.distributed.group import Dist

ONE = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))


def save(run_dir, step: int, run_id: str | None, keep: int = 10):
    """A checkpoint of run_id (retention's warnings about other runs' checkpoints are tested elsewhere)."""
    return ckpt.save_checkpoint(
        run_dir, step, {"w": torch.arange(4.0) + step}, keep=keep, run_id=run_id, warn=lambda message: None
    )


def run_info(run_dir, **info) -> None:
    """RUN/config.json as the trainer writes it (only the fields that matter here)."""
    (run_dir / "config.json").write_text(json.dumps({"config": {}, **info}))


def an_earlier_run(run_dir, run_id: str | None = "old-run") -> dict[str, bytes]:
    """RUN as a finished run leaves it (plus files that are not the trainer's); returns its files' bytes."""
    save(run_dir, 3, run_id)
    save(run_dir, 6, run_id)
    run_info(run_dir, **({} if run_id is None else {"run_id": run_id}))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s}) + "\n" for s in range(7)))
    (run_dir / "loss_curve.png").write_bytes(b"png")
    (run_dir / "tb").mkdir()
    (run_dir / "tb" / "events.out.tfevents.1").write_bytes(b"tb")
    (run_dir / "hf").mkdir()  # an export: not the trainer's, it stays
    (run_dir / "notes.txt").write_text("mine")
    return files(run_dir)


def files(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_run_ids_are_unique_and_name_their_start_time():
    ids = {rundir.new_run_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(r"\d{8}T\d{6}Z-[0-9a-f]{8}", i) for i in ids)


def test_directory_run_id_from_config_json(tmp_path):
    assert rundir.directory_run_id(tmp_path) == rundir.ANY_RUN  # nothing records a run: every checkpoint counts
    run_info(tmp_path)
    assert rundir.directory_run_id(tmp_path) is None  # written before run ids
    run_info(tmp_path, run_id="abc")
    assert rundir.directory_run_id(tmp_path) == "abc"
    (tmp_path / "config.json").write_text('{"run_id": ')
    with pytest.raises(ValueError, match=r"config.json is unreadable .* --resume never"):
        rundir.directory_run_id(tmp_path)
    with pytest.raises(ckpt.CheckpointError, match="config.json is unreadable"):
        ckpt.latest_valid(tmp_path)


def test_move_aside_renames_the_trainers_records_and_deletes_nothing(tmp_path):
    before = an_earlier_run(tmp_path)
    names = rundir.records_present(tmp_path)
    assert names == ("checkpoints", "metrics.jsonl", "loss_curve.png", "tb", "config.json")  # checkpoints first
    dest = rundir.move_aside(tmp_path, names)
    assert re.fullmatch(r"previous-\d{8}T\d{6}Z", dest.name) and dest.parent == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([dest.name, "hf", "notes.txt"])
    after = {(k.split("/", 1)[1] if k.startswith("previous-") else k): v for k, v in files(tmp_path).items()}
    assert after == before  # every byte still there
    # A second fresh start within the same second gets its own folder.
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    again = rundir.move_aside(tmp_path, ("metrics.jsonl",))
    assert again != dest and again.name.startswith("previous-")
    assert (again / "metrics.jsonl").read_text() == "{}\n"


def test_a_symlinked_checkpoints_directory_keeps_its_link_and_storage(tmp_path):
    """RUN/checkpoints -> other storage: the link stays (the new run writes there too); the earlier
    checkpoints move into a folder inside that storage, which previous-*/checkpoints points to."""
    scratch = tmp_path / "scratch" / "ckpts"
    scratch.mkdir(parents=True)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to(scratch)
    save(run_dir, 3, "old-run")
    run_info(run_dir, run_id="old-run")
    dest = rundir.move_aside(run_dir, rundir.records_present(run_dir))
    assert (run_dir / "checkpoints").resolve() == scratch and not ckpt.list_checkpoints(run_dir)
    assert sorted(p.name for p in (dest / "checkpoints").iterdir()) == [
        "latest",
        "step_00000003.json",
        "step_00000003.pt",
    ]
    assert (dest / "checkpoints").resolve() == scratch / dest.name
    ckpt.verify_checkpoint(dest / "checkpoints" / "step_00000003.pt")
    save(run_dir, 1, "new-run")
    assert (scratch / "step_00000001.pt").is_file()
    again = rundir.move_aside(run_dir, ("checkpoints",))  # a later fresh start leaves the first folder be
    assert sorted(p.name for p in scratch.iterdir()) == sorted([dest.name, again.name])
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == [
        "latest",
        "step_00000001.json",
        "step_00000001.pt",
    ]


def test_resume_never_in_a_used_directory_plans_a_fresh_run_and_writes_nothing(tmp_path):
    """The decision only reads: a --dry-run may call it with a one-process Dist."""
    before = an_earlier_run(tmp_path)
    start = resume.choose_start("never", tmp_path, ONE, warn=pytest.fail)
    assert start.point is None and start.run_id not in (None, "old-run")
    assert start.set_aside == ("checkpoints", "metrics.jsonl", "loss_curve.png", "tb", "config.json")
    assert files(tmp_path) == before
    assert resume.set_aside_earlier_run(start, tmp_path, ONE) is not None
    assert not rundir.records_present(tmp_path)


def test_auto_with_its_only_checkpoint_damaged_refuses_and_never_sets_everything_aside(tmp_path):
    """Issue 41: this started fresh and set the run aside; auto now refuses to start over checkpoints
    it cannot verify, and --resume never is the way to start fresh."""
    path = save(tmp_path, 2, "old-run")
    run_info(tmp_path, run_id="old-run")
    path.write_bytes(path.read_bytes()[:100])
    warnings = []
    with pytest.raises(ckpt.CheckpointError, match="none of this run's 1 checkpoint"):
        resume.choose_start("auto", tmp_path, ONE, warn=warnings.append)
    assert len(warnings) == 1 and "truncated" in warnings[0]
    start = resume.choose_start("never", tmp_path, ONE, warn=warnings.append)
    assert start.point is None and start.run_id != "old-run" and start.set_aside == ("checkpoints", "config.json")


def test_auto_ignores_another_runs_checkpoint_even_when_it_is_newer(tmp_path):
    ours = save(tmp_path, 2, "ours")
    save(tmp_path, 9, "theirs")  # a stray: later step, and `latest` names it
    run_info(tmp_path, run_id="ours")
    warnings = []
    start = resume.choose_start("auto", tmp_path, ONE, warn=warnings.append)
    assert start.point.path == str(ours) and start.run_id == "ours" and start.set_aside == ()
    assert (
        len(warnings) == 1
        and "step_00000009.pt: it belongs to run theirs, not to this directory's run ours" in warnings[0]
    )
    assert resume.newest_seen(tmp_path, "ours") == ours.name
    assert resume.newest_seen(tmp_path) == "step_00000009.pt"  # ANY_RUN: every checkpoint


def test_checkpoints_without_a_run_id_resume_where_nothing_or_no_id_is_recorded(tmp_path):
    """Written before run ids: their directory's config.json has no run_id either, and they resume as a
    run without one. A directory whose config.json names a run does not take them."""
    legacy = save(tmp_path, 4, None)
    assert "run_id" not in json.loads(legacy.with_suffix(".json").read_text())
    assert "run_id" not in ckpt.load_checkpoint(legacy)
    for info in (None, {}):  # no config.json, or one from before run ids
        if info is not None:
            run_info(tmp_path, **info)
        start = resume.choose_start("auto", tmp_path, ONE, warn=pytest.fail)
        assert start.point.path == str(legacy) and start.point.run_id is None and start.run_id is None
        assert start.set_aside == ()
    run_info(tmp_path, run_id="new")
    warnings = []
    start = resume.choose_start("auto", tmp_path, ONE, warn=warnings.append)
    assert start.point is None and "belongs to run (no run id)" in warnings[0]


def test_a_checkpoint_copied_into_a_new_directory_resumes_there_as_its_run(tmp_path):
    src = save(tmp_path / "a", 5, "run-a")
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    for suffix in (".pt", ".json"):
        (tmp_path / "b" / "checkpoints" / src.with_suffix(suffix).name).write_bytes(
            src.with_suffix(suffix).read_bytes()
        )
    start = resume.choose_start("auto", tmp_path / "b", ONE, warn=pytest.fail)
    assert start.point.step == 5 and start.run_id == "run-a" and start.set_aside == ()


def test_resuming_another_run_into_a_directory_that_holds_one_sets_that_one_aside(tmp_path):
    other = save(tmp_path / "other", 5, "other-run")
    an_earlier_run(tmp_path / "run")
    start = resume.choose_start(str(other), tmp_path / "run", ONE, warn=pytest.fail)
    assert start.point.path == str(other) and start.run_id == "other-run"
    assert start.set_aside == ("checkpoints", "metrics.jsonl", "loss_curve.png", "tb", "config.json")
    # The same run's directory: nothing to set aside.
    assert resume.choose_start(str(other), tmp_path / "other", ONE, warn=pytest.fail).set_aside == ()
    # A stray inside the directory cannot be resumed there: moving checkpoints/ would move it too.
    stray = save(tmp_path / "run", 9, "stray-run", keep=100)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"belongs to run stray-run, but .* holds run old-run .* new "
        r"--out-dir",
    ):
        resume.choose_start(str(stray), tmp_path / "run", ONE, warn=print)


def test_a_failed_move_is_every_ranks_error(tmp_path, monkeypatch):
    """Rank 0 cannot move the records: it and every other rank raise the same error (no rank waits)."""
    an_earlier_run(tmp_path)
    start = resume.choose_start("never", tmp_path, ONE, warn=pytest.fail)

    def refused(*args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "previous-x"))

    monkeypatch.setattr(rundir, "move_aside", refused)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"cannot move the earlier run's checkpoints, .* nothing was "
        r"deleted\. Fix the directory's permissions",
    ):
        resume.set_aside_earlier_run(start, tmp_path, ONE)
    # Rank 1's view: it moved nothing itself, rank 0's report arrives through the gather.
    rank1 = Dist(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"))
    monkeypatch.setattr(resume, "all_gather_object", lambda obj, d: ["rank 0: cannot move", obj])
    with pytest.raises(ckpt.CheckpointError, match="rank 0: cannot move"):
        resume.set_aside_earlier_run(start, tmp_path, rank1)
    assert rundir.records_present(tmp_path)  # nothing was moved, and nothing deleted


def test_resuming_an_earlier_checkpoint_of_the_run_moves_its_later_ones_into_abandoned(tmp_path):
    """A rollback (--resume PATH of step 3 while 6 and 9 exist): the decision lists 6 and 9 (a damaged
    one too, another run's stray not), the move keeps their bytes in checkpoints/abandoned-*/ with a
    copy of the log, and `auto` then takes step 3. auto and a run directory argument abandon nothing."""
    an_earlier_run(tmp_path)  # steps 3 and 6 of old-run, metrics.jsonl to step 6
    nine = save(tmp_path, 9, "old-run")
    nine.write_bytes(nine.read_bytes()[:100])  # damaged: auto skips it, but it is the old branch's too
    save(tmp_path, 12, "stray-run")
    ckdir = tmp_path / "checkpoints"
    quiet = []
    for resume_arg in ("auto", str(tmp_path)):
        assert resume.choose_start(resume_arg, tmp_path, ONE, warn=quiet.append).abandon == ()
    log = (tmp_path / "metrics.jsonl").read_bytes()
    before = {
        name: (ckdir / name).read_bytes()
        for name in ("step_00000006.pt", "step_00000006.json", "step_00000009.pt", "step_00000009.json")
    }
    start = resume.choose_start(str(ckdir / "step_00000003.pt"), tmp_path, ONE, warn=quiet.append)
    assert start.point.step == 3 and start.set_aside == ()
    assert start.abandon == ("step_00000006.pt", "step_00000009.pt")
    dest = resume.set_aside_abandoned(start, tmp_path, ONE)
    assert dest.parent == ckdir and re.fullmatch(r"abandoned-00000003-\d{8}T\d{6}Z", dest.name)
    assert {name: (dest / name).read_bytes() for name in before} == before
    assert (dest / "metrics.jsonl").read_bytes() == log  # the abandoned branch's log, whole
    assert sorted(p.name for p in ckdir.iterdir()) == sorted(
        [dest.name, "step_00000003.pt", "step_00000003.json", "step_00000012.pt", "step_00000012.json", "latest"]
    )
    assert (ckdir / "latest").read_text() == "step_00000012.pt\n"  # named no moved one: left as it was
    again = resume.choose_start("auto", tmp_path, ONE, warn=quiet.append)
    assert again.point.path == str(ckdir / "step_00000003.pt") and again.abandon == ()
    # `latest` naming a moved checkpoint is removed (the next save writes it), not left dangling
    save(tmp_path, 5, "old-run")
    second = resume.set_aside_abandoned(
        resume.choose_start(str(ckdir / "step_00000003.pt"), tmp_path, ONE, warn=quiet.append), tmp_path, ONE
    )
    assert second != dest and sorted(p.name for p in second.iterdir()) == [
        "metrics.jsonl",
        "step_00000005.json",
        "step_00000005.pt",
    ]
    assert not (ckdir / "latest").exists() and ckpt.latest_valid(tmp_path, quiet.append).name == "step_00000003.pt"


def test_a_failed_abandon_move_is_every_ranks_error(tmp_path, monkeypatch):
    an_earlier_run(tmp_path)
    start = resume.choose_start(str(tmp_path / "checkpoints" / "step_00000003.pt"), tmp_path, ONE, warn=pytest.fail)

    def refused(*args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "checkpoints"))

    monkeypatch.setattr(ckpt, "abandon_checkpoints", refused)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"cannot move step_00000006.pt in .* into an abandoned-\* "
        r"folder .* nothing was deleted",
    ):
        resume.set_aside_abandoned(start, tmp_path, ONE)
    assert ckpt.latest_valid(tmp_path, pytest.fail).name == "step_00000006.pt"


# ---- One run per directory: RUN/run.lock ---------------------------------------------------------

HERE = {
    "host": "node1",
    "pid": 4242,
    "pid_start": 777,
    "pid_space": "node1/boot-a/pid:[1]",
    "since": "2026-01-01T00:00:00Z",
    "nonce": "mine",
    "launch": {},
}
"""The process asking (rundir.holder_record's fields); holders below are judged from its point of view."""


def holder(**changes) -> dict:
    return {**HERE, "pid": 1000, "pid_start": 555, "nonce": "theirs", **changes}


@pytest.mark.parametrize(
    "lock, age_s, pid_start, me, stale",
    [
        # Same host, boot and pid namespace: the holder's process decides, whatever its heartbeat's age.
        (holder(), 10_000, 555, HERE, None),  # alive, heartbeat stalled
        (holder(), 0, None, HERE, "its process (pid 1000) has exited"),  # kill -9
        (holder(), 0, 999, HERE, "its pid 1000 now belongs to another process"),  # pid reused
        # Another host (or the same name in another boot or pid namespace): the heartbeat decides.
        (holder(host="node2", pid_space="node2/boot-b/pid:[1]"), 299, None, HERE, None),
        (holder(host="node2", pid_space="node2/boot-b/pid:[1]"), 301, None, HERE, "its heartbeat stopped 301 s ago"),
        (holder(pid_space="node1/boot-OLD/pid:[1]"), 60, None, HERE, None),  # rebooted? not known: wait
        (None, 60, None, HERE, None),  # unreadable lock, fresh
        (None, 400, None, HERE, "its heartbeat stopped 400 s ago"),
        # A SLURM requeue (same job id, a later restart) or a torchrun restart takes over at once.
        (
            holder(host="node2", pid_space="x", launch={"SLURM_JOB_ID": "77"}),
            5,
            None,
            {**HERE, "launch": {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}},
            "an earlier run of this launch",
        ),
        (
            holder(launch={"TORCHELASTIC_RUN_ID": "u", "TORCHELASTIC_RESTART_COUNT": "0"}),
            5,
            555,
            {**HERE, "launch": {"TORCHELASTIC_RUN_ID": "u", "TORCHELASTIC_RESTART_COUNT": "1"}},
            "an earlier run",
        ),
        # ... but not the same restart (two job steps writing one directory), nor another job.
        (
            holder(host="node2", pid_space="x", launch={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}),
            5,
            None,
            {**HERE, "launch": {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}},
            None,
        ),
        (
            holder(host="node2", pid_space="x", launch={"SLURM_JOB_ID": "76"}),
            5,
            None,
            {**HERE, "launch": {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "3"}},
            None,
        ),
        (
            holder(host="node2", pid_space="x", launch={"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": [1]}),
            5,
            None,
            {**HERE, "launch": {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "junk"}},
            None,
        ),  # no error, no takeover
    ],
)
def test_the_stale_decision_is_a_function_of_the_lock_its_age_and_the_holders_pid(lock, age_s, pid_start, me, stale):
    reason = rundir.stale_reason(lock, age_s=age_s, me=me, pid_start=pid_start)
    assert (reason is None) == (stale is None) and (stale is None or stale in reason), reason


def a_dead_pid() -> tuple[int, int | None]:
    """The pid of a process that has exited, and the start it had (as a lock records it)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    start = rundir.process_start(proc.pid)
    proc.communicate(b"")
    return proc.pid, start


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_or_silent_one(tmp_path):
    lock = rundir.RunLock.acquire(tmp_path)
    path = tmp_path / rundir.LOCK
    record = json.loads(path.read_text())
    assert record["pid"] == os.getpid() and record["pid_space"] == rundir.pid_space() and lock.taken_over is None
    with pytest.raises(
        rundir.RunDirBusy,
        match=rf"^{tmp_path} is in use by another training run \(host "
        rf"{socket.gethostname()}, pid {os.getpid()}, since "
        rf"{record['since']}; {path}\).* pass another --out-dir",
    ):
        rundir.RunLock.acquire(tmp_path)
    assert json.loads(path.read_text()) == record and sorted(p.name for p in tmp_path.iterdir()) == [rundir.LOCK]
    lock.release()
    assert not path.exists()

    # kill -9: the holder's pid is gone on this host; the next start takes over at once.
    pid, start = a_dead_pid()
    path.write_text(json.dumps({**record, "pid": pid, "pid_start": start, "nonce": "dead"}))
    lock = rundir.RunLock.acquire(tmp_path)
    assert (
        lock.taken_over == f"host {record['host']}, pid {pid}, since {record['since']}: its process (pid {pid}) "
        "has exited"
    )
    assert json.loads(path.read_text())["nonce"] == lock.record["nonce"]
    lock.release()

    # Another host: refused while its heartbeat is fresh, taken over once it is older than the bound.
    other = {**record, "host": "elsewhere", "pid_space": "elsewhere/b/p", "nonce": "far"}
    path.write_text(json.dumps(other))
    with pytest.raises(rundir.RunDirBusy, match="host elsewhere"):
        rundir.RunLock.acquire(tmp_path)
    old = path.stat().st_mtime - rundir.STALE_AFTER_S - 60
    os.utime(path, (old, old))
    lock = rundir.RunLock.acquire(tmp_path)
    assert "its heartbeat stopped" in lock.taken_over
    lock.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temp or renamed lock left behind


def test_live_holder_reads_the_lock_and_takes_nothing(tmp_path):
    """--dry-run's question: would a start now be refused? Answered without writing into RUN."""
    assert rundir.live_holder(tmp_path) is None
    lock = rundir.RunLock.acquire(tmp_path)
    before = files(tmp_path)
    assert rundir.live_holder(tmp_path) == rundir.describe_holder(lock.record)
    assert files(tmp_path) == before
    lock.release()
    pid, start = a_dead_pid()  # kill -9: a start would take it over
    (tmp_path / rundir.LOCK).write_text(json.dumps({**lock.record, "pid": pid, "pid_start": start}))
    assert rundir.live_holder(tmp_path) is None


def test_run_lock_release_and_takeover_never_remove_another_runs_lock(tmp_path):
    lock = rundir.RunLock.acquire(tmp_path)
    path = tmp_path / rundir.LOCK
    theirs = json.dumps({**lock.record, "nonce": "theirs"})
    path.write_text(theirs)  # taken over meanwhile (e.g. after an NFS outage stopped our heartbeat)
    lock.release()
    assert path.read_text() == theirs
    # Judged stale, then replaced by a fresh lock before the removal: the fresh one is put back.
    assert not rundir._remove_if_unchanged(path, b"the stale one", tmp_path / "aside")
    assert path.read_text() == theirs and not (tmp_path / "aside").exists()
    assert rundir._remove_if_unchanged(path, theirs.encode(), tmp_path / "aside") and not path.exists()


def test_run_lock_heartbeat_refreshes_the_mtime(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.01)
    lock = rundir.RunLock.acquire(tmp_path)
    path = tmp_path / rundir.LOCK
    os.utime(path, (0, 0))
    deadline = time.monotonic() + 60  # a safety net: the beat comes within milliseconds
    while path.stat().st_mtime == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    lock.release()
    assert time.monotonic() < deadline
