"""slurm/: the shell logic on its own (fast, no SLURM), then the sbatch files on a real one-node SLURM
brought up by tests/slurm/setup_local_slurm.sh (marker `slurm`).

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

from gpt2.core.precision import Precision
from gpt2.train import run_log

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "tests" / "slurm" / "setup_local_slurm.sh"
TEARDOWN = REPO / "tests" / "slurm" / "teardown_local_slurm.sh"
SKIP_STATUS = 77  # setup_local_slurm.sh: this machine cannot host SLURM (not root, apt cannot install)
MAX_STEPS = 30
STOP_AFTER_STEP = 5  # signal the job once this step is logged, well before MAX_STEPS
# A 2-layer, 32-wide model on 32-token sequences: ~0.1 s a step on CPU. 2 ranks x 2 x 32 tokens =
# 128 tokens per step, one micro-step. No periodic checkpoint: a mid-run one can only be the stop's.
TRAINER_ARGS = [
    "--preset",
    "debug",
    "--device",
    "cpu",
    "--compile",
    "false",
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--micro-batch-size",
    "2",
    "--total-batch-size",
    "128",
    "--log-interval",
    "1",
    "--eval-interval",
    "0",
    "--eval-tokens",
    "256",
    "--sample-interval",
    "0",
    "--ckpt-interval",
    "0",
    "--plot",
    "false",
]
TERMINAL = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


# ---------------------------------------------------------------- slurm/common.sh without SLURM

GPU_VARS = ("GPUS_PER_NODE", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")


def run_common(script: str, env: dict[str, str] | None = None, path_prefix: Path | None = None):
    """Run bash with slurm/common.sh sourced, in a clean SLURM-free environment plus `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in GPU_VARS}
    # python (with torch, for the launcher) from the interpreter running the tests, whether or not its
    # venv is activated.
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    if path_prefix:
        base["PATH"] = f"{path_prefix}{os.pathsep}{base['PATH']}"
    return subprocess.run(
        ["bash", "-c", f"source {REPO}/slurm/common.sh\n{script}"],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"GPUS_PER_NODE": "2", "SLURM_GPUS_ON_NODE": "8"}, "2"),  # the environment wins (CPU nodes, tests)
        ({"SLURM_GPUS_ON_NODE": "4"}, "4"),  # else what SLURM allocated
        ({"SLURM_GPUS_PER_NODE": "a100:8"}, "8"),  # typed --gpus-per-node=a100:8
    ],
)
def test_gpus_per_node_comes_from_env_or_allocation(env, expected):
    r = run_common("gpt2_gpus_per_node", env)
    assert (r.returncode, r.stdout.strip()) == (0, expected), r.stderr


def test_gpus_per_node_without_gpus_names_the_fix():
    r = run_common("gpt2_gpus_per_node", {"SLURM_GPUS_PER_NODE": "0"})
    assert r.returncode == 2
    assert "GPUS_PER_NODE=N" in r.stderr and "--gpus-per-node" in r.stderr


# ---------------------------------------------------------------- the stop budget: README = scripts = rule

SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
GRACE_DEFAULT = re.compile(r"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=\$\{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-(\d+)\}")


def script_lead_and_grace(script: Path) -> tuple[int, int]:
    """The script's #SBATCH signal lead and the torchrun grace it runs with (its own default, else common.sh's)."""
    text = script.read_text()
    leads = re.findall(r"^#SBATCH --signal=B:USR1@(\d+)\s*$", text, flags=re.M)
    assert len(leads) == 1, f"{script.name}: want one #SBATCH --signal=B:USR1@N line, found {leads}"
    assert "--signal" not in "".join(ln for ln in text.splitlines() if ln.startswith("#SBATCH") and "USR1@" not in ln)
    graces = GRACE_DEFAULT.findall(text) or GRACE_DEFAULT.findall((REPO / "slurm" / "common.sh").read_text())
    assert len(graces) == 1, f"{script.name}: want one default TORCH_ELASTIC_SHUTDOWN_TIMEOUT, found {graces}"
    return int(leads[0]), int(graces[0])


def readme_slurm_section() -> str:
    """The SLURM section of the documentation (docs/multinode.md)."""
    text = (REPO / "docs" / "multinode.md").read_text()
    return text[text.index("\n## SLURM\n") : text.index("\n## ", text.index("\n## SLURM\n") + 1)]


def test_readme_every_sbatch_script_and_common_sh_state_one_signal_lead_and_grace():
    """(issue 26: the debug script said @60 where README said @120.)"""
    values = {script.name: script_lead_and_grace(script) for script in SCRIPTS}
    assert len(values) == 3 and len(set(values.values())) == 1, values
    lead, grace = next(iter(values.values()))
    section = readme_slurm_section()
    readme_leads = {int(n) for n in re.findall(r"--signal=B:USR1@(\d+)`", section)}
    readme_leads |= {int(n) for n in re.findall(r"signal lead[^|]*\| `[^`]*` \(default (\d+) s\)", section)}
    readme_graces = {int(n) for n in re.findall(r"`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` \(default (\d+) s\)", section)}
    readme_graces |= {int(n) for n in re.findall(r"`TORCH_ELASTIC_SHUTDOWN_TIMEOUT`, (\d+) s in every script", section)}
    assert readme_leads == {lead} and readme_graces == {grace}, (readme_leads, readme_graces, values)
    assert f"the signal lead ({lead} s in every script)" in section
    assert f"{lead} s before the time limit SLURM sends USR1" in section
    common = (REPO / "slurm" / "common.sh").read_text()
    assert {int(n) for n in re.findall(r"#SBATCH --signal=B:USR1@(\d+)", common)} == {lead}
    assert {int(n) for n in re.findall(r"--signal lead\s*#?\s*time \((\d+) s\)", common)} == {lead}


def test_readme_stop_budget_table_follows_the_planner_and_the_defaults_cover_every_preset():
    from gpt2.core.config import MODEL_PRESETS, model_preset
    from gpt2.plan.budget import REQUEUE_MARGIN_S, StopBudget, checkpoint_bytes
    from gpt2.plan.hardware import gpu_hardware
    from gpt2.plan.memory import run_config
    from gpt2.plan.planner import plan

    lead, grace = script_lead_and_grace(SCRIPTS[0])
    rows = re.findall(
        r"^\| ([\w-]+) \| ([\d.]+) GB \| ([\d.]+) s \| ([\d.]+) s \| (\d+) s \| (\d+) s \|$",
        readme_slurm_section(),
        flags=re.M,
    )
    assert sorted(r[0] for r in rows) == sorted(MODEL_PRESETS)
    for name, gb, step, writes, need_grace, need_lead in rows:
        cfg = model_preset(name)
        p = plan(
            run_config(cfg, 1, world_size=8, total_batch_size=524288),
            gpu_hardware("A100-80GB", Precision.from_key("bf16")),
            world_size=8,
        )
        b = StopBudget(checkpoint_bytes(cfg), p.step_time_s, 1e9)
        assert (gb, step, writes) == (f"{b.checkpoint_bytes / 1e9:.2f}", f"{b.step_s:.1f}", f"{b.writes_s:.1f}"), name
        assert (int(need_grace), int(need_lead)) == (b.grace_s, b.lead_s), name
        assert b.grace_s <= grace and b.lead_s <= lead, f"{name}: the scripts' defaults do not cover it"
    assert grace + REQUEUE_MARGIN_S <= lead


def test_prepare_refuses_out_dir_flag_because_requeues_must_find_the_run():
    r = run_common("gpt2_prepare --preset debug --out-dir elsewhere", {"GPUS_PER_NODE": "1"})
    assert r.returncode == 2 and "set OUT_DIR=" in r.stderr


def test_prepare_derives_out_dir_threads_and_resume_on_restart(tmp_path):
    env = {
        "REPO_DIR": str(REPO),
        "GPUS_PER_NODE": "2",
        "SLURM_CPUS_PER_TASK": "6",
        "OUT_ROOT": str(tmp_path),
        "SLURM_JOB_NAME": "exp",
        "SLURM_JOB_ID": "77",
        "SLURM_RESTART_COUNT": "1",
    }
    (tmp_path / "exp-77").mkdir()
    (tmp_path / "exp-77" / "requeue").write_text("{}")  # left by the previous run's stop
    r = run_common(
        "unset OMP_NUM_THREADS; gpt2_prepare --resume never --lr 1e-3 >/dev/null\n"
        'echo "$OUT_DIR|$OMP_NUM_THREADS|${TRAIN_ARGS[*]}|$GPT2_PYTHON"',
        env,
    )
    assert r.returncode == 0, r.stderr
    out_dir, threads, args, python = r.stdout.strip().split("|")
    assert Path(python).parent == Path(sys.executable).parent  # the environment's, which runs gpt2.launch
    assert out_dir == f"{tmp_path}/exp-77" and Path(out_dir).is_dir()
    assert not (tmp_path / "exp-77" / "requeue").exists(), "only the run about to start may confirm a stop"
    assert threads == "3"  # 6 CPUs / 2 processes
    # A requeued run resumes from its own checkpoints whatever the first run was told (last flag wins).
    assert args == f"--out-dir {tmp_path}/exp-77 --num-threads 3 --resume never --lr 1e-3 --resume auto"


def test_prepare_without_torch_names_the_fix(tmp_path):
    fake = tmp_path / "bin" / "python"  # a python on PATH without torch
    fake.parent.mkdir()
    fake.write_text("#!/bin/bash\nexit 1\n")
    fake.chmod(0o755)
    # VIRTUAL_ENV: an environment is "active", so gpt2_prepare does not activate the repository's .venv
    env = {"REPO_DIR": str(REPO), "GPUS_PER_NODE": "1", "OUT_DIR": str(tmp_path / "run"), "VIRTUAL_ENV": str(tmp_path)}
    r = run_common("gpt2_prepare", env, path_prefix=fake.parent)
    assert r.returncode == 2 and "no python with torch" in r.stderr and "VENV=" in r.stderr, r.stderr


def test_a_forwarded_stop_leaves_one_line_from_the_launcher_not_a_traceback(tmp_path):
    """USR1 to the batch shell -> one SIGTERM to `python -m gpt2.launch` (torchrun) -> its worker.
    torchrun would end with a 30-line SignalException traceback; the launcher prints one line and
    exits 1 as torchrun does where no clean stop was confirmed (this worker writes no OUT_DIR/requeue),
    which gpt2_finish reads together with OUT_DIR/requeue."""
    (tmp_path / "worker.py").write_text(
        "import signal, sys, time\nfrom pathlib import Path\n"
        "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))\n"
        f"Path({str(tmp_path / 'ready')!r}).touch()\ntime.sleep(60)\nsys.exit(4)\n"
    )
    r = run_common(
        f"""
        ( while [[ ! -f {tmp_path}/ready ]]; do sleep 0.1; done; kill -USR1 $$ ) &
        OUT_DIR={tmp_path}/run gpt2_run_forwarding TERM python -m gpt2.launch --standalone --nproc_per_node=1 \
            {tmp_path}/worker.py
        echo "rc=$? usr1=$GPT2_GOT_USR1"
    """,
        {"PYTHONPATH": str(REPO)},
    )
    assert "rc=1 usr1=1" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert (
        f"torchrun: stopped by SIGTERM; its workers were asked to stop and have exited; no clean stop was "
        f"confirmed ({tmp_path}/run/requeue was not written): exiting 1" in r.stderr
    ), r.stderr


CHILD = """
import signal, sys, time
got = []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
print("usr1 ignored:", signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN, flush=True)
end = time.monotonic() + 20
while not got and time.monotonic() < end:
    time.sleep(0.02)
time.sleep(1.0)  # a second SIGTERM would arrive in this window
print("sigterms:", len(got), flush=True)
sys.exit(3)
"""


def test_usr1_reaches_the_launcher_once_as_sigterm_and_is_remembered(tmp_path):
    """Two USR1 and a TERM to the batch shell: torchrun (here a stand-in) must get exactly one SIGTERM
    (a second one aborts torchrun's graceful shutdown) and must run with USR1 ignored."""
    (tmp_path / "child.py").write_text(CHILD)
    r = run_common(f"""
        ( sleep 1; kill -USR1 $$; sleep 0.2; kill -USR1 $$; sleep 0.2; kill -TERM $$ ) &
        gpt2_run_forwarding TERM {sys.executable} {tmp_path}/child.py
        echo "rc=$? usr1=$GPT2_GOT_USR1 term=$GPT2_GOT_TERM"
    """)
    assert "usr1 ignored: True" in r.stdout, r.stdout + r.stderr
    assert "sigterms: 1" in r.stdout, r.stdout + r.stderr
    assert "rc=3 usr1=1 term=1" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(
    "usr1, term, rc, restart, start_ckpt, marker, requeued, exit_status",
    [
        ("1", "", 3, 0, "none", True, True, 0),  # USR1 + clean stop (the launcher says 3): requeue
        ("1", "", 0, 0, "none", True, True, 0),  # same when only the workers were signalled
        ("1", "", 3, 1, "step_00000005.pt", True, True, 0),  # a requeued run that made progress: again
        ("1", "", 3, 1, "step_00000009.pt", True, False, 3),  # a requeued run without a new checkpoint: stop looping
        ("1", "", 0, 0, "none", False, False, 0),  # USR1 but training had finished: nothing to resume
        ("1", "", 1, 0, "none", False, False, 1),  # USR1 but no clean stop (died in start-up, crashed)
        ("1", "1", 3, 0, "none", True, False, 3),  # scancel during the stop: a requeue would undo it
        ("", "1", 3, 0, "none", True, False, 3),  # SIGTERM alone (scancel, preemption): SLURM decides
        ("", "", 1, 0, "none", False, False, 1),  # a crash: never requeued (it would crash again)
    ],
)
def test_finish_requeues_only_a_confirmed_stop_on_usr1(
    tmp_path, usr1, term, rc, restart, start_ckpt, marker, requeued, exit_status
):
    calls = tmp_path / "calls"
    stub = tmp_path / "bin" / "scontrol"  # records its arguments instead of talking to SLURM
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    stub.chmod(0o755)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_00000009.pt\n")  # written by the stop
    if marker:
        (tmp_path / "requeue").write_text('{"step": 9, "signal": "SIGTERM", "checkpoint": "step_00000009.pt"}\n')
    r = run_common(
        f"OUT_DIR={tmp_path}; GPT2_GOT_USR1={usr1}; GPT2_GOT_TERM={term}; "
        f"GPT2_START_CHECKPOINT={start_ckpt}; gpt2_finish {rc}",
        {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": str(restart)},
        path_prefix=stub.parent,
    )
    assert r.returncode == exit_status, r.stdout + r.stderr
    assert (calls.read_text() if calls.exists() else "") == ("requeue 42\n" if requeued else "")


# ---------------------------------------------------------------- the sbatch files on a real SLURM


@pytest.fixture(scope="module")
def slurm():
    if os.geteuid() != 0:
        pytest.skip("needs root: the test starts slurmctld/slurmd (and may apt-get install them)")
    was_running = _daemon_running(Path("/run/slurmctld.pid"))
    r = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
    if r.returncode == SKIP_STATUS:
        pytest.skip(r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, f"{SETUP} failed:\n{r.stdout}\n{r.stderr}"
    yield
    if not was_running:  # the daemons this module started do not outlive it (an earlier run's are kept)
        subprocess.run(["bash", str(TEARDOWN)], capture_output=True, timeout=120)


def _daemon_running(pidfile: Path) -> bool:
    try:
        os.kill(int(pidfile.read_text().strip()), 0)
    except (OSError, ValueError):
        return False
    return True


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, shakespeare_path) -> Path:
    from gpt2.data.shards import write_shard
    from gpt2.model.tokenizer import get_encoding

    tokens = np.array(get_encoding().encode_ordinary(shakespeare_path.read_text()), dtype=np.uint16)
    d = tmp_path_factory.mktemp("shards")
    write_shard(d / "val_000000.bin", tokens[:8192])
    write_shard(d / "train_000000.bin", tokens[8192:])
    return d


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """OUT_ROOT and the job logs: outside the repository."""
    return tmp_path_factory.mktemp("slurm_jobs")


SUBMITTED: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _cancel_leftover_jobs():
    """A failed test must not leave its job holding the node's two CPUs for the next one."""
    yield
    if SUBMITTED:
        subprocess.run(["scancel", *SUBMITTED], capture_output=True, timeout=30)


def submit(
    script: str, work: Path, data_dir: Path, *, gpus_per_node: int, sbatch_opts=(), max_steps: int = MAX_STEPS
) -> str:
    env = dict(os.environ)
    # python (with torch, for the launcher) from the interpreter running the tests, whether or not its
    # venv is activated.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(GPUS_PER_NODE=str(gpus_per_node), OUT_ROOT=str(work))
    cmd = [
        "sbatch",
        "--parsable",
        "--partition=local",
        "--time=10",
        "--gpus-per-node=0",
        f"--output={work}/%x-%j.out",
        *sbatch_opts,
        str(REPO / "slurm" / script),
        "--data-dir",
        str(data_dir),
        *TRAINER_ARGS,
        "--max-steps",
        str(max_steps),
    ]
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    job = r.stdout.strip().split(";")[0]
    SUBMITTED.append(job)
    return job


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
    return run_log.read_metrics(run / "metrics.jsonl", missing_ok=True)  # also while the job writes it


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


def assert_finished(info: dict[str, str], run: Path, log: str, max_steps: int = MAX_STEPS) -> None:
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{max_steps:08d}.pt", log
    assert (run / "checkpoints" / latest).is_file()


def assert_stopped_and_resumed(info: dict[str, str], run: Path, log: str) -> int:
    """The job was stopped by USR1, checkpointed, requeued itself once and resumed. Returns the stop step."""
    assert info["Restarts"] == "1", f"{info}\n{log}"
    stops = re.findall(r"stopped by signal at step (\d+); checkpoint written", log)
    assert len(stops) == 1, log
    stop = int(stops[0])
    assert STOP_AFTER_STEP <= stop < MAX_STEPS, log
    assert (run / "checkpoints" / f"step_{stop:08d}.pt").is_file(), log
    assert re.search(
        rf"clean stop confirmed by {re.escape(str(run))}/requeue .*\"step\": {stop}\b.*"
        rf"requeueing job {info['JobId']}",
        log,
    ), log
    assert re.search(rf"restart 1 on .*OUT_DIR={re.escape(str(run))}", log), log
    assert re.search(rf"resumed from \S+step_{stop:08d}\.pt at step {stop}\b", log), log
    # The stop reads as a stop: gpt2.launch's one line, not torchrun's SignalException traceback.
    assert "torchrun: stopped by SIGTERM" in log, log
    assert "Traceback" not in log, log
    return stop


@pytest.fixture(scope="module")
def uninterrupted(slurm, work, data_dir) -> dict:
    """train_1node.sbatch with 2 CPU "GPUs", left alone: the reference the preempted runs must match."""
    job = submit("train_1node.sbatch", work, data_dir, gpus_per_node=2, sbatch_opts=["--cpus-per-task=2"])
    info = wait_for_job(job, work)
    run = work / f"gpt2-1node-{job}"  # OUT_ROOT/<job name>-<job id>
    return dict(info=info, run=run, losses=step_losses(run), log=job_log(work, job))


@pytest.mark.slurm
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


@pytest.mark.slurm
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


@pytest.mark.slurm
def test_train_multinode_two_agents_rendezvous_and_resume_exactly(uninterrupted, work, data_dir):
    """Two torchrun agents (srun tasks) on one node meet through the c10d rendezvous: world size 2,
    one rank each. USR1 goes batch shell -> srun -> each task's torchrun -> workers."""
    reference = uninterrupted["losses"]
    job = submit(
        "train_multinode.sbatch",
        work,
        data_dir,
        gpus_per_node=1,
        sbatch_opts=["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
    )
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


@pytest.mark.slurm
def test_debug_1gpu_runs_the_debug_preset_on_one_process(slurm, work, data_dir):
    job = submit("debug_1gpu.sbatch", work, data_dir, gpus_per_node=1, sbatch_opts=["--cpus-per-task=1"], max_steps=3)
    info = wait_for_job(job, work)
    run = work / f"gpt2-debug-{job}"
    log = job_log(work, job)
    assert_finished(info, run, log, max_steps=3)
    assert "1 node(s) x 1 process(es)" in log and "world size 1" in log, log
    assert sorted(step_losses(run)) == [1, 2, 3]
