"""slurm/*.sbatch on a real one-node SLURM (brought up by tests/slurm/setup_local_slurm.sh).

The jobs submit the very files users submit; only sbatch options (no GPU request, 2 CPUs, a log
directory, a time limit) and environment variables (GPUS_PER_NODE, OUT_ROOT) differ. The model is
tiny so each job is mostly torchrun start-up.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "tests" / "slurm" / "setup_local_slurm.sh"
SKIP_STATUS = 77  # setup_local_slurm.sh: this machine cannot host SLURM (not root, apt cannot install)
MAX_STEPS = 30
STOP_AFTER_STEP = 5  # signal the job once this step is logged, well before MAX_STEPS
# A 2-layer, 32-wide model on 32-token sequences: ~0.1 s a step on CPU. 2 ranks x 2 x 32 tokens =
# 128 tokens per step, one micro-step. No periodic checkpoint: a mid-run one can only be the stop's.
TRAINER_ARGS = ["--preset", "debug", "--device", "cpu", "--compile", "false",
                "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "32",
                "--micro-batch-size", "2", "--total-batch-size", "128", "--max-steps", str(MAX_STEPS),
                "--log-interval", "1", "--eval-interval", "0", "--eval-tokens", "256",
                "--sample-interval", "0", "--ckpt-interval", "0", "--plot", "false"]
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


@pytest.fixture(scope="module")
def slurm() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test starts slurmctld/slurmd (and may apt-get install them)")
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
    if r.returncode == SKIP_STATUS:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, f"{SETUP} failed:\n{r.stdout}\n{r.stderr}"


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, shakespeare_path) -> Path:
    from gpt2.shards import write_shard
    from gpt2.tokenizer import get_encoding

    tokens = np.array(get_encoding().encode_ordinary(shakespeare_path.read_text()), dtype=np.uint16)
    d = tmp_path_factory.mktemp("shards")
    write_shard(d / "val_000000.bin", tokens[:8192])
    write_shard(d / "train_000000.bin", tokens[8192:])
    return d


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """OUT_ROOT and the job logs: outside the repository."""
    return tmp_path_factory.mktemp("slurm_jobs")


def submit(script: str, work: Path, data_dir: Path, *, gpus_per_node: int, sbatch_opts=()) -> str:
    env = dict(os.environ)
    # torchrun from the interpreter running the tests, whether or not its venv is activated.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(GPUS_PER_NODE=str(gpus_per_node), OUT_ROOT=str(work))
    cmd = ["sbatch", "--parsable", "--partition=local", "--time=10", "--gpus-per-node=0",
           f"--output={work}/%x-%j.out", *sbatch_opts,
           str(REPO / "slurm" / script), "--data-dir", str(data_dir), *TRAINER_ARGS]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    return r.stdout.strip().split(";")[0]


def job_info(job: str) -> dict[str, str]:
    r = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"scontrol show job {job}: {r.stderr}"
    return dict(re.findall(r"(\w+)=(\S*)", r.stdout))


def job_log(work: Path, job: str) -> str:
    logs = list(work.glob(f"*-{job}.out"))
    return logs[0].read_text() if logs else "(no log file)"


def wait_for_job(job: str, work: Path, *, restarts: int = 0, timeout_s: float = 300) -> dict[str, str]:
    """Poll until the job reaches a terminal state after `restarts` requeues (sbatch --wait polls slowly)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = job_info(job)
        if info["JobState"] in TERMINAL and int(info["Restarts"]) >= restarts:
            return info
        time.sleep(0.5)
    subprocess.run(["scancel", job], timeout=30)
    pytest.fail(f"job {job} not finished after {timeout_s} s: {job_info(job)}\n{job_log(work, job)}")


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            pass
    return records


def step_losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run) if "loss" in r}


def signal_when_training(job: str, run: Path, work: Path, timeout_s: float = 180) -> None:
    """`scancel --signal=USR1 --batch` once step STOP_AFTER_STEP is logged: what --signal=B:USR1@120 does."""
    deadline = time.monotonic() + timeout_s
    while max(step_losses(run), default=0) < STOP_AFTER_STEP:
        if time.monotonic() > deadline or job_info(job)["JobState"] in TERMINAL:
            subprocess.run(["scancel", job], timeout=30)
            pytest.fail(f"job {job} never reached step {STOP_AFTER_STEP}:\n{job_log(work, job)}")
        time.sleep(0.1)
    r = subprocess.run(["scancel", "--signal=USR1", "--batch", job], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def assert_finished(info: dict[str, str], run: Path, log: str) -> None:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{MAX_STEPS:08d}.pt", log
    assert (run / "checkpoints" / latest).is_file()


def assert_stopped_and_resumed(info: dict[str, str], run: Path, log: str) -> int:
    """The job was stopped by USR1, checkpointed, requeued itself once and resumed. Returns the stop step."""
    assert info["Restarts"] == "1", f"{info}\n{log}"
    stops = re.findall(r"stopped by signal at step (\d+); checkpoint written", log)
    assert len(stops) == 1, log
    stop = int(stops[0])
    assert STOP_AFTER_STEP <= stop < MAX_STEPS, log
    assert (run / "checkpoints" / f"step_{stop:08d}.pt").is_file(), log
    assert f"requeueing job {info['JobId']}" in log
    assert re.search(rf"restart 1 on .*OUT_DIR={re.escape(str(run))}", log), log
    assert re.search(rf"resumed from \S+step_{stop:08d}\.pt at step {stop}\b", log), log
    return stop


@pytest.fixture(scope="module")
def uninterrupted(slurm, work, data_dir) -> dict:
    """train_1node.sbatch with 2 CPU "GPUs", left alone: the reference the preempted runs must match."""
    job = submit("train_1node.sbatch", work, data_dir, gpus_per_node=2, sbatch_opts=["--cpus-per-task=2"])
    info = wait_for_job(job, work)
    run = work / f"gpt2-1node-{job}"  # OUT_ROOT/<job name>-<job id>
    return dict(info=info, run=run, losses=step_losses(run), log=job_log(work, job))


def test_train_1node_trains_through_torchrun_and_checkpoints(uninterrupted):
    info, run, losses, log = (uninterrupted[k] for k in ("info", "run", "losses", "log"))
    assert "1 node(s) x 2 process(es)" in log, log
    assert_finished(info, run, log)
    assert info["Restarts"] == "0"
    assert json.loads((run / "config.json").read_text())["world_size"] == 2
    assert sorted(losses) == list(range(1, MAX_STEPS + 1)), log
    assert all(math.isfinite(v) for v in losses.values())
    # It learned something: the last steps' loss is below the first steps' (ln 50304 = 10.8 at init).
    assert np.mean([losses[s] for s in range(MAX_STEPS - 4, MAX_STEPS + 1)]) < losses[1] - 0.3, losses


def test_train_1node_usr1_checkpoints_requeues_and_resumes_exactly(uninterrupted, work, data_dir):
    reference = uninterrupted["losses"]
    job = submit("train_1node.sbatch", work, data_dir, gpus_per_node=2, sbatch_opts=["--cpus-per-task=2"])
    run = work / f"gpt2-1node-{job}"
    signal_when_training(job, run, work)
    info = wait_for_job(job, work, restarts=1)
    log = job_log(work, job)
    assert_finished(info, run, log)
    assert_stopped_and_resumed(info, run, log)
    # The first run's log survives the requeue (--open-mode=append).
    assert "restart 0 on" in log
    assert step_losses(run) == reference, "a stop, requeue and resume must not change a single loss"


def test_train_multinode_two_agents_rendezvous_and_resume_exactly(uninterrupted, work, data_dir):
    """Two torchrun agents (srun tasks) on one node meet through the c10d rendezvous: world size 2,
    one rank each. USR1 goes batch shell -> srun -> each task's torchrun -> workers."""
    reference = uninterrupted["losses"]
    job = submit("train_multinode.sbatch", work, data_dir, gpus_per_node=1,
                 sbatch_opts=["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"])
    run = work / f"gpt2-multinode-{job}"
    signal_when_training(job, run, work)
    info = wait_for_job(job, work, restarts=1)
    log = job_log(work, job)
    assert_finished(info, run, log)
    assert re.search(r"rendezvous c10d at \S+:\d+, 2 agent\(s\)", log), log
    assert json.loads((run / "config.json").read_text())["world_size"] == 2
    assert_stopped_and_resumed(info, run, log)
    # Same world size and global batch as the one-node reference: the same losses, bit for bit.
    assert step_losses(run) == reference
