"""gpt2.launch: torchrun, except that a stop signal leaves one line, and a failed worker a short summary,
instead of a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

from gpt2.launch import EXIT_REQUEUE, EXIT_SIGNALLED, out_dir_of, set_omp_threads

# A worker that says when it is ready, then stops cleanly on SIGTERM as the trainer does; with a third
# argument it confirms the stop as the trainer does after its checkpoint (RUN/requeue).
WORKER = """
import signal, sys, time
from pathlib import Path
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
Path(sys.argv[1]).touch()
end = time.monotonic() + 60
while not stop and time.monotonic() < end:
    time.sleep(0.02)
if stop and len(sys.argv) > 2:
    Path(sys.argv[2]).mkdir(parents=True, exist_ok=True)
    (Path(sys.argv[2]) / "requeue").write_text('{"step": 3}')
print("worker stopped cleanly" if stop else "worker timed out", flush=True)
sys.exit(0 if stop else 4)
"""


def launch(tmp_path: Path, *args: str, nproc: int = 1) -> subprocess.Popen:
    env = {**os.environ, "OUT_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}  # as slurm/common.sh exports it
    return subprocess.Popen(
        [sys.executable, "-m", "gpt2.launch", "--standalone", f"--nproc_per_node={nproc}", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("confirmed", [False, True])
def test_sigterm_stops_the_workers_and_leaves_one_line_not_a_traceback(tmp_path, confirmed):
    """A stop the trainer confirmed (RUN/requeue written during this launch) exits 3, as train_ddp.py
    does without torchrun; one it did not, torchrun's 1."""
    (tmp_path / "worker.py").write_text(WORKER)
    ready = tmp_path / "ready"
    run = tmp_path / "run"
    proc = launch(tmp_path, str(tmp_path / "worker.py"), str(ready), *([str(run)] if confirmed else []))
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert "worker stopped cleanly" in out, out + err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("torchrun: ")]
    said = (
        f"the trainer confirmed a clean stop after its checkpoint ({run}/requeue): exiting 3, requeue and resume "
        "with --resume auto"
        if confirmed
        else f"no clean stop was confirmed ({run}/requeue was not written): exiting 1"
    )
    assert lines == [f"torchrun: stopped by SIGTERM; its workers were asked to stop and have exited; {said}"], err
    assert proc.returncode == (EXIT_REQUEUE if confirmed else EXIT_SIGNALLED), err


def test_the_run_directory_is_the_commands_out_dir_else_out_dir_from_the_environment():
    argv = ["--standalone", "train_ddp.py", "--out-dir", "a", "--out-dir=b"]
    assert out_dir_of(argv, env={"OUT_DIR": "c"}) == "b"
    assert out_dir_of(["train_ddp.py"], env={"OUT_DIR": "c"}) == "c"
    assert out_dir_of(["train_ddp.py"], env={}) is None


def test_a_failing_worker_is_summed_up_in_a_few_lines_not_torchruns_table(tmp_path):
    """Rank 1 fails; torchrun stops rank 0 with SIGTERM and raises ChildFailedError (a traceback and a table
    in which rank 0 reads as a failure with exit code -15): the launcher says who failed and who was stopped."""
    (tmp_path / "fail.py").write_text(
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    print('worker: error: rank 1 is unhappy', file=sys.stderr, flush=True)\n"
        "    sys.exit(5)\n"
        "time.sleep(120)\n"
    )
    proc = launch(tmp_path, str(tmp_path / "fail.py"), nproc=2)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err  # torchrun's status for any failed worker: the slurm/ scripts go by it
    assert "Traceback" not in err and "ChildFailedError" not in err and "exitcode  :" not in err, err  # not the table
    assert [line for line in err.splitlines() if line.startswith("torchrun: ")] == [
        "torchrun: rank 1 failed (exit code 5)",
        "torchrun: rank 0 did not fail: torchrun stopped it (SIGTERM) when rank 1 failed",
        "torchrun: what went wrong is in the failing rank's own output above (e.g. its 'train_ddp.py: error:' "
        "line); exiting 1, as torchrun does",
    ], err
    assert err.count("worker: error: rank 1 is unhappy") == 1


def test_a_trainer_refusing_its_flags_on_every_rank_leaves_its_line_and_a_short_summary(tmp_path):
    """A real 2-rank train_ddp.py whose data directory does not exist: every rank exits 2, rank 0 says why.
    The user's line is no longer line 5 of 52."""
    proc = launch(
        tmp_path,
        str(REPO / "train_ddp.py"),
        "--preset",
        "debug",
        "--device",
        "cpu",
        "--data-dir",
        str(tmp_path / "missing"),
        "--out-dir",
        str(tmp_path / "run"),
        nproc=2,
    )
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, err
    errors = [line for line in err.splitlines() if line.startswith("train_ddp.py: error:")]
    assert len(errors) == 1 and str(tmp_path / "missing") in errors[0], err
    summary = [line for line in err.splitlines() if line.startswith("torchrun: ")]
    assert summary[0] in (
        "torchrun: ranks 0, 1 failed (exit code 2)",
        "torchrun: rank 0 failed (exit code 2)",
        "torchrun: rank 1 failed (exit code 2)",
    ), err  # whether torchrun stopped one first
    assert "Traceback" not in err and "ChildFailedError" not in err and len(err.splitlines()) <= 15, err


def test_several_workers_get_torchruns_one_omp_thread_without_its_banner(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 for several workers per node under a 5-line "Setting OMP_NUM_THREADS
    environment variable ..." banner; the quiet launcher sets it first, so the workers get the same 1 and the
    banner is gone. One worker, or a value of the user's, is left as it is."""
    script = tmp_path / "omp.py"
    # one write(2) per worker: both share the pipe, and print's pieces could interleave ("OMPOMP 1\n 1\n")
    script.write_text("import os\nos.write(1, f\"OMP {os.environ.get('OMP_NUM_THREADS')}\\n\".encode())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-m", "gpt2.launch", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines().count("OMP 1") == 2, done.stdout
    assert "OMP_NUM_THREADS" not in done.stderr and "*****" not in done.stderr, done.stderr
    for argv, before, after in (
        (["--nproc_per_node=2", "x.py"], {}, {"OMP_NUM_THREADS": "1"}),
        (["--nproc-per-node", "2", "x.py"], {"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "4"}),  # the user's
        (["--nproc_per_node=1", "x.py"], {}, {}),  # torchrun leaves one worker's alone
        (["--no-such-flag", "x.py"], {}, {}),  # torchrun's own error follows
    ):
        env = dict(before)
        set_omp_threads(argv, env)
        assert env == after, argv
