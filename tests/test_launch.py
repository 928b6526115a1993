"""gpt2.launch: torchrun, except that a stop signal leaves one line instead of a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO
from gpt2.launch import EXIT_SIGNALLED

# A worker that says when it is ready, then stops cleanly on SIGTERM as the trainer does.
WORKER = """
import signal, sys, time
from pathlib import Path
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
Path(sys.argv[1]).touch()
end = time.monotonic() + 60
while not stop and time.monotonic() < end:
    time.sleep(0.02)
print("worker stopped cleanly" if stop else "worker timed out", flush=True)
sys.exit(0 if stop else 4)
"""


def launch(tmp_path: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OUT_DIR": str(tmp_path / "run")}  # as slurm/common.sh exports it
    return subprocess.Popen([sys.executable, "-m", "gpt2.launch", "--standalone", "--nproc_per_node=1", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_stops_the_workers_and_leaves_one_line_not_a_traceback(tmp_path):
    (tmp_path / "worker.py").write_text(WORKER)
    ready = tmp_path / "ready"
    proc = launch(tmp_path, str(tmp_path / "worker.py"), str(ready))
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=30)
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert "worker stopped cleanly" in out, out + err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("torchrun: ")]
    assert lines == ["torchrun: stopped by SIGTERM; its workers were asked to stop and have exited "
                     f"(a checkpointed stop leaves {tmp_path}/run/requeue)"], err
    # What torchrun itself exits with when signalled: the slurm/ scripts go by OUT_DIR/requeue instead.
    assert proc.returncode == EXIT_SIGNALLED == 1, err


def test_a_failing_worker_is_reported_as_torchrun_reports_it(tmp_path):
    (tmp_path / "fail.py").write_text("import sys; sys.exit(5)\n")
    proc = launch(tmp_path, str(tmp_path / "fail.py"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err  # torchrun's status for any failed worker
    assert "ChildFailedError" in err and "exitcode  : 5" in err, err
    assert "torchrun: stopped" not in err
