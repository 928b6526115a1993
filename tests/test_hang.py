"""Hang dumps (gpt2/distributed/hang.py) and the collective trace they read (gpt2/distributed/group.py),
with the straggler line (gpt2/distributed/straggler.py) through torchrun: a rank slowed on purpose is named,
SIGUSR2 dumps every rank's stacks, and a SIGSTOPped rank is named by its peers' dumps."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpt2.distributed.group import TRACE, CollectiveError, collective, single_process
from gpt2.distributed.hang import HANG_GRACE_S, HangDumps, flight_recorder_env, never_arrived
from tests.conftest import REPO, TINY_MODEL_FLAGS


def test_never_arrived_names_the_ranks_behind_and_the_silent_ones():
    assert never_arrived({0: 21, 2: 21, 3: 20}, 4) == (21, [1, 3])  # 1 silent (stopped), 3 one behind
    assert never_arrived({0: 5, 1: 5}, 2) == (5, [])


def test_collective_records_its_entry_and_calls_the_failure_hook_before_raising():
    seen = []
    TRACE.on_failure = seen.append
    try:
        before = TRACE.seq
        with collective("a test collective"):
            pass
        assert (TRACE.seq, TRACE.name, TRACE.done) == (before + 1, "a test collective", True)
        with pytest.raises(CollectiveError, match="a failing one failed"):
            with collective("a failing one"):
                raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
        assert (TRACE.seq, TRACE.done) == (before + 2, False)
        assert [str(e) for e in seen] == ["Timed out waiting 5000ms for recv operation to complete"]
    finally:
        TRACE.on_failure = None


def _wait_for(predicate, what: str, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.05)


def test_sigusr2_dumps_the_stacks_while_the_main_thread_is_blocked(tmp_path):
    """The dump is written by our thread: the main thread stays blocked in a read until it exists."""
    read_fd, write_fd = os.pipe()
    dump = tmp_path / "run"

    def release_when_dumped():  # unblocks the main thread once the dump is there (or after the deadline)
        deadline = time.monotonic() + 120
        while not list(dump.glob("hang-*/rank-0.txt")) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.write(write_fd, b"x")

    with HangDumps(str(dump), single_process()):
        helper = threading.Thread(target=release_when_dumped)
        helper.start()
        os.kill(os.getpid(), signal.SIGUSR2)
        os.read(read_fd, 1)  # blocked here while the dump is written
        helper.join()
    os.close(read_fd)
    os.close(write_fd)
    [path] = dump.glob("hang-*/rank-0.txt")
    text = path.read_text()
    assert "reason: SIGUSR2" in text and "last collective: #" in text, text
    assert "test_sigusr2_dumps_the_stacks_while_the_main_thread_is_blocked" in text  # the main thread's stack
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL and signal.set_wakeup_fd(-1) == -1  # put back


def test_flight_recorder_is_turned_on_for_nccl_only_keeping_the_users_settings(tmp_path):
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    assert flight_recorder_env(str(tmp_path), "cpu", env) == {}
    added = flight_recorder_env(str(tmp_path), "cuda", env)
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in added
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert (
        env["TORCH_FR_DUMP_TEMP_FILE"]
        == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
        == str(tmp_path / "flight-recorder" / "nccl_trace_rank_")
    )


# ---------------------------------------------------------------- through torchrun

STEP_TIMEOUT_S = 8
SHUTDOWN_S = 5
"""torchrun's shutdown wait for the runs here (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""


def _start(run_dir: Path, data: Path, nproc: int, slow_rank: int) -> subprocess.Popen:
    args = [
        *TINY_MODEL_FLAGS,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--compile",
        "false",
        "--sample-interval",
        "0",
        "--plot",
        "false",
        "--data-dir",
        str(data),
        "--out-dir",
        str(run_dir),
        "--micro-batch-size",
        "2",
        "--total-batch-size",
        str(128 * nproc),
        "--max-steps",
        "100000",
        "--warmup-steps",
        "2",
        "--eval-interval",
        "0",
        "--eval-tokens",
        "1024",
        "--ckpt-interval",
        "0",
        "--log-interval",
        "1",
        "--dist-step-timeout-s",
        str(STEP_TIMEOUT_S),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GPT2_TEST_SLOW_RANK": f"{slow_rank}:4x",
        # torchrun's wait between its SIGTERM and SIGKILL (30 s by default): a stopped rank cannot act on the SIGTERM,
        # so the run ends this much after its peers have dumped and left
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(SHUTDOWN_S),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(REPO / "train_ddp.py"),
        *args,
    ]
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _worker_pids(launcher: subprocess.Popen, nproc: int) -> dict[int, int]:
    """rank -> pid of torchrun's workers (read from their environments)."""
    pids = {}
    for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
        env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
        pids[rank] = int(child)
    assert sorted(pids) == list(range(nproc)), pids
    return pids


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _verdict(path: Path) -> str | None:
    text = path.read_text() if path.exists() else ""
    return next((line for line in text.splitlines() if line.startswith("ranks that ")), None)


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def hang_run(tmp_path: Path, data: Path, nproc: int, slow_rank: int, stopped: int | None) -> None:
    """A run with one rank slowed on purpose, SIGUSR2 to every rank, then SIGSTOP to rank `stopped`
    (or, None, SIGTERM to every rank: the stop-signal path ends the run with a checkpoint)."""
    run_dir = tmp_path / "run"
    launcher = _start(run_dir, data, nproc, slow_rank)
    try:
        _wait_for(
            lambda: (
                any(r.get("step", 0) >= 4 and "loss" in r for r in _records(run_dir)) or launcher.poll() is not None
            ),
            "step 4",
        )
        assert launcher.poll() is None, launcher.communicate()[0]
        pids = _worker_pids(launcher, nproc)
        # SIGUSR2 to every rank: each writes its stacks into one folder, every rank reported.
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR2)
        files = lambda folder: [folder / f"rank-{r}.txt" for r in range(nproc)]  # noqa: E731
        _wait_for(
            lambda: any(all(_verdict(f) for f in files(d)) for d in run_dir.glob("hang-*")),
            "SIGUSR2 dumps of every rank",
        )
        [signalled] = list(run_dir.glob("hang-*"))
        for f in files(signalled):  # every rank reported (one may be a collective ahead: signals are not steps)
            assert all(f" {r}@#" in _verdict(f) or f"(reported: {r}@#" in _verdict(f) for r in range(nproc)), _verdict(
                f
            )
        assert "reason: SIGUSR2" in (signalled / "rank-0.txt").read_text()
        # SIGSTOP one rank: its peers' collective times out, their dumps name it.
        if stopped is not None:
            os.kill(pids[stopped], signal.SIGSTOP)
        else:  # the workers signalled, as a scheduler's preemption does: they stop with a checkpoint, exit 0
            for pid in pids.values():
                os.kill(pid, signal.SIGTERM)
        stopped_at = time.monotonic()
        output, _ = launcher.communicate(timeout=STEP_TIMEOUT_S + HANG_GRACE_S + 240)
        ended_s = time.monotonic() - stopped_at
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    check_stragglers(run_dir, output, nproc, slow_rank)
    if stopped is None:
        assert launcher.returncode == 0 and "stopped by signal" in output, output[-4000:]
        assert [signalled] == list(run_dir.glob("hang-*"))  # a stop signal is not a hang
        return
    assert launcher.returncode != 0, output  # the job still ends as it did: torchrun fails
    assert not any(_alive(p) for p in pids.values()), (pids, output)  # no orphan, the stopped rank included
    [failed] = [d for d in run_dir.glob("hang-*") if d != signalled]
    live = [r for r in range(nproc) if r != stopped]
    for r in live:
        text = (failed / f"rank-{r}.txt").read_text()
        assert "reason: the collective failed" in text, text[:2000]
        collective_line = next(line for line in text.splitlines() if line.startswith("last collective: #"))
        verdict = _verdict(failed / f"rank-{r}.txt")
        assert verdict and re.search(rf"never arrived at collective #\d+: {stopped} \(", verdict), text[:2000]
        assert re.search(r"#\d+ \S", collective_line), collective_line  # its name
    assert not (failed / f"rank-{stopped}.txt").exists()
    assert re.search(rf"hang dump: rank {min(live)} .*never arrived at collective #\d+: {stopped} ", output), output[
        -4000:
    ]
    # Within the step timeout, the wait for the other ranks' reports and torchrun's shutdown wait (plus slack).
    assert ended_s < STEP_TIMEOUT_S + HANG_GRACE_S + SHUTDOWN_S + 120, ended_s


def check_stragglers(run_dir: Path, output: str, nproc: int, slow_rank: int) -> None:
    # The straggler: named on the console, the per-rank times in metrics.jsonl.
    # From step 3: the hook slows a rank by its own previous compute time, which the first step has not got.
    named = [int(r) for s, r in re.findall(r"step +(\d+) \| straggler: rank (\d+) computes", output) if int(s) >= 3]
    assert named and set(named) == {slow_rank}, output[-4000:]
    times = [r["rank_compute_s"] for r in _records(run_dir) if "rank_compute_s" in r and r["step"] >= 3]
    assert times and all(len(t) == nproc and max(range(nproc), key=t.__getitem__) == slow_rank for t in times), times


def test_two_ranks_name_the_straggler_and_dump_every_rank_on_sigusr2(tmp_path, shakespeare_shards):
    hang_run(tmp_path, shakespeare_shards, nproc=2, slow_rank=1, stopped=None)


# Slow: a stopped rank costs torchrun's wait before its SIGKILL (SHUTDOWN_S here), on top of the timeout. CI's long
# pass stops one of 2 ranks; the 4-rank cases add no path it lacks: soak only (a function-level slow mark would let
# `-m "slurm or slow"` select them too).
@pytest.mark.parametrize(
    "nproc, slow_rank, stopped",
    [
        pytest.param(2, 1, 1, marks=pytest.mark.slow),
        pytest.param(4, 2, 3, marks=pytest.mark.soak),
        pytest.param(4, 3, 0, marks=pytest.mark.soak),
    ],
)
def test_a_stopped_rank_is_named_by_its_peers_dumps(tmp_path, shakespeare_shards, nproc, slow_rank, stopped):
    hang_run(tmp_path, shakespeare_shards, nproc=nproc, slow_rank=slow_rank, stopped=stopped)
