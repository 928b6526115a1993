"""Several nodes simulated on one machine: torchrun agents meeting through the c10d rendezvous. A "node"
can get its own view of the run directory (a mount namespace with an empty tmpfs over it) and its own
hostname (a UTS namespace, its name resolving through a private /etc/hosts), as a node-local --out-dir
would give. Two agents of one rank each test the resume decision and the stop; four agents of two
ranks, started as slurm/train_multinode.sbatch starts them, rehearse a node dying and the resume (slow).
Needs root for the namespaces (as CI and this machine have); elsewhere these tests are skipped."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _helpers import children, losses, patched_train_script, records, tiny_run_flags
from conftest import REPO

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="unshare -m / -u need root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One torchrun agent (one simulated node) of a c10d rendezvous, optionally in its own namespaces.

    `launcher` is the agent's command: torchrun(...) below, or the command the multi-node sbatch script
    has srun start on every node. `env` replaces the test's environment (GLOO_SOCKET_IFNAME is added)."""

    def __init__(
        self,
        name: str,
        launcher: list[str],
        *,
        log_dir: Path,
        env: dict | None = None,
        private_dir: Path | None = None,
        hostname: str | None = None,
        hosts: Path | None = None,
    ) -> None:
        cmd = list(launcher)
        if private_dir is not None or hostname is not None:
            setup = []
            if private_dir is not None:
                setup.append(f'mount -t tmpfs tmpfs "{private_dir}"')
            if hostname is not None:
                setup.append(f"hostname {hostname}")
                # torchrun's rank-0 agent binds the workers' store to its own hostname: it must resolve.
                setup.append(f'mount --bind "{hosts or hosts_file(log_dir, [hostname])}" /etc/hosts')
            cmd = ["unshare", "-m", "-u", "sh", "-c", " && ".join(setup) + ' && exec "$@"', "sh", *cmd]
        self.name, self.log_dir = name, log_dir / name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if env is None:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}
        # gloo binds to the address of the hostname, which a renamed node cannot resolve: use loopback.
        self.env = env = {**env, "GLOO_SOCKET_IFNAME": "lo"}
        with open(self.log_dir / "out.txt", "w") as out, open(self.log_dir / "err.txt", "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=env, start_new_session=True)

    @property
    def output(self) -> str:
        return (self.log_dir / "out.txt").read_text() + (self.log_dir / "err.txt").read_text()

    def worker_ranks(self) -> list[int]:
        """The global ranks of this agent's workers (found through their environment), once they run."""
        ranks = []
        for pid in _descendants(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
                ranks += [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
        return sorted(ranks)

    def kill_tree(self) -> None:
        """SIGKILL the agent and everything it started (what srun --kill-on-bad-exit does to a step, or a
        node failing does): its process group, and each descendant in case one left the group."""
        pids = _descendants(self.proc.pid) if self.proc.poll() is None else []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()


def hosts_file(directory: Path, names: list[str]) -> Path:
    """/etc/hosts plus one loopback address per node name (node i: 127.0.0.i+1), for the nodes' namespaces."""
    path = directory / ("hosts-" + "-".join(names))
    entries = "".join(f"127.0.0.{i} {name}\n" for i, name in enumerate(names, start=1))
    path.write_text(Path("/etc/hosts").read_text().rstrip("\n") + "\n" + entries)
    return path


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def torchrun(script: Path, args: list[str], *, nnodes: int, port: int, nproc_per_node: int = 1) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--nproc_per_node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=multinode-test",
        "--monitor-interval=0.2",
        str(script),
        *args,
    ]


def two_nodes(
    args: list[str], tmp_path: Path, tag: str, *, script: Path = REPO / "train_ddp.py", private_dir: Path | None = None
) -> tuple[Agent, Agent]:
    launcher = torchrun(script, args, nnodes=2, port=free_port())
    a = Agent(f"{tag}-node1", launcher, log_dir=tmp_path)
    b = Agent(f"{tag}-node2", launcher, log_dir=tmp_path, private_dir=private_dir, hostname="node2")
    return a, b


def wait_all(agents, timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [a.proc.wait(max(1.0, deadline - time.monotonic())) for a in agents]
    except subprocess.TimeoutExpired:
        raise AssertionError("agents still running:\n" + "\n".join(a.output[-3000:] for a in agents)) from None
    finally:
        for a in agents:
            if a.proc.poll() is None:
                a.kill_tree()


def run_flags(data_dir: Path, run_dir: Path, max_steps: int, ckpt_interval: int) -> list[str]:
    return [*tiny_run_flags(data_dir, max_steps=max_steps, ckpt_interval=ckpt_interval), "--out-dir", str(run_dir)]


@needs_root
@pytest.mark.slow
def test_resume_is_rank_0s_decision_and_a_node_that_cannot_see_it_fails_before_training(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    first = two_nodes(run_flags(shakespeare_shards, run_dir, 6, 6), tmp_path, "first")
    assert wait_all(first) == [0, 0], "\n".join(a.output for a in first)
    assert sorted(losses(run_dir)) == list(range(1, 7))

    # Node 2 sees an empty directory where the run is (a node-local --out-dir). Whichever agent gets
    # rank 0, the ranks disagree about what to resume: rank 0 on node 1 chose step 6, which node 2
    # cannot see; or rank 0 on node 2 would start fresh while node 1 sees step 6. Both must fail.
    second = two_nodes(run_flags(shakespeare_shards, run_dir, 12, 6), tmp_path, "second", private_dir=run_dir)
    codes = wait_all(second)
    text = "\n".join(a.output for a in second)
    assert codes == [1, 1], text  # torchrun's code for a failed worker (train_ddp.py exited 2)
    assert "train_ddp.py: error:" in text, text
    assert "on node2" in text and "step_00000006.pt" in text, text  # names the node and the checkpoint
    assert "Every rank must see the same run directory" in text, text
    assert "resumed from" not in text  # nobody started from the checkpoint either
    # Nothing was trained: node 1's run directory still ends at step 6.
    assert sorted(losses(run_dir)) == list(range(1, 7))

    # With the same view on both nodes the same command agrees and continues from step 6.
    third = two_nodes(run_flags(shakespeare_shards, run_dir, 12, 6), tmp_path, "third")
    assert wait_all(third) == [0, 0], "\n".join(a.output for a in third)
    text = "\n".join(a.output for a in third)
    assert "resumed from" in text and "step_00000006.pt at step 6" in text, text
    assert sorted(losses(run_dir)) == list(range(1, 13))


SLOW_MARKER = """
import time
import gpt2.distributed.preempt as preempt

_write = preempt.write_requeue_marker


def slow_write(*args, **kwargs):  # rank 0 is slow to write the marker (a loaded shared filesystem)
    time.sleep(3)
    return _write(*args, **kwargs)


preempt.write_requeue_marker = slow_write
"""


@needs_root
@pytest.mark.slow
def test_requeue_marker_is_on_disk_before_any_node_can_leave_the_stop(tmp_path, shakespeare_shards):
    """The stop's exit says "requeue" on one node while the other node's torchrun is killed as soon as
    that node's torchrun exits (srun --kill-on-bad-exit=1): the marker must exist anyway."""
    script = patched_train_script(tmp_path, SLOW_MARKER)
    run_dir = tmp_path / "run"
    agents = two_nodes(run_flags(shakespeare_shards, run_dir, 1000, 0), tmp_path, "stop", script=script)
    try:
        deadline = time.monotonic() + 180
        while not any(r.get("step", 0) >= 2 and "loss" in r for r in records(run_dir)):
            assert time.monotonic() < deadline and all(a.proc.poll() is None for a in agents), "\n".join(
                a.output for a in agents
            )
            time.sleep(0.1)
        rank0 = next(a for a in agents if 0 in a.worker_ranks())
        other = next(a for a in agents if a is not rank0)
        os.kill(other.proc.pid, signal.SIGTERM)  # torchrun forwards it to its worker: every rank stops
        other.proc.wait(120)
        rank0.kill_tree()  # the moment the other node's torchrun is gone
    finally:
        for a in agents:
            if a.proc.poll() is None:
                a.kill_tree()
    assert "stopped by signal" in other.output or "stopped by signal" in rank0.output, "\n".join(
        a.output for a in agents
    )
    marker = run_dir / "requeue"
    assert marker.is_file(), "the other node left the stop path before rank 0 wrote the requeue marker\n" + "\n".join(
        a.output for a in agents
    )
    info = json.loads(marker.read_text())
    from gpt2.ckpt.checkpoint import verify_checkpoint

    verify_checkpoint(run_dir / "checkpoints" / info["checkpoint"])  # the marker promises a complete one
    assert info["checkpoint"] == f"step_{info['step']:08d}.pt"


# ------------------------------------------ four nodes, launched as slurm/train_multinode.sbatch does

SBATCH = REPO / "slurm" / "train_multinode.sbatch"
FAKE_SRUN = """#!/bin/bash
# Stands in for srun: records the command srun would start on every node, and its environment.
printf '%s\\0' "$@" > "$SRUN_CAPTURE/argv"
env -0 > "$SRUN_CAPTURE/env"
"""
FAKE_SCONTROL = """#!/bin/bash
# Stands in for `scontrol show hostnames LIST`: one host a line.
[[ "$1 $2" == "show hostnames" ]] && tr , '\\n' <<< "$3"
"""


def documented_multinode_command(nodes_default: int = 2) -> tuple[int, list[str]]:
    """(nodes, trainer arguments) of the usage line in train_multinode.sbatch's header."""
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#") and "sbatch --nodes=" in line and "slurm/train_multinode.sbatch" in line:
            words = shlex.split(line.lstrip("# "))
            at = words.index("slurm/train_multinode.sbatch")
            nodes = next(int(w.split("=")[1]) for w in words[:at] if w.startswith("--nodes="))
            return nodes, words[at + 1 :]
    raise AssertionError(f"no `sbatch --nodes=N slurm/train_multinode.sbatch ...` line in {SBATCH}")


def sbatch_node_command(
    trainer_args: list[str], work: Path, *, out_dir: Path, nodes: int, gpus_per_node: int, port: int, job_id: int
) -> tuple[list[str], dict[str, str]]:
    """The command, and its environment, that train_multinode.sbatch has srun start on each node.

    The batch script runs for real (slurm/common.sh: OUT_DIR, --num-threads, the launcher, torchrun's
    shutdown grace, the rendezvous options) with stand-ins for srun (records instead of starting)
    and scontrol, so the test takes the script's flags without keeping a copy of them. One CPU per
    rank (--cpus-per-task=gpus_per_node): one thread each, on any machine.
    """
    bin_dir, capture = work / "bin", work / "capture"
    for d in (bin_dir, capture):
        d.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "TORCH", "OMP_", "VIRTUAL_ENV"))
        and k not in ("GPUS_PER_NODE", "MASTER_PORT", "OUT_DIR", "OUT_ROOT", "VENV", "REPO_DIR")
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        SRUN_CAPTURE=str(capture),
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="gpt2-multinode",
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes),
        SLURM_JOB_NODELIST=",".join(node_names(nodes)),
        SLURM_CPUS_PER_TASK=str(gpus_per_node),
        GPUS_PER_NODE=str(gpus_per_node),
        MASTER_PORT=str(port),
        OUT_DIR=str(out_dir),
    )
    r = subprocess.run(
        ["bash", str(SBATCH), *trainer_args], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr
    argv = (capture / "argv").read_text().split("\0")[:-1]
    command = argv[next(i for i, a in enumerate(argv) if not a.startswith("-")) :]  # after srun's options
    assert command[:2] == ["bash", str(REPO / "slurm" / "srun_task.sh")], argv
    node_env = dict(e.split("=", 1) for e in (capture / "env").read_text().split("\0") if "=" in e)
    node_env.pop("SRUN_CAPTURE")
    return command, node_env


# The gpt2 preset's batch arithmetic at a tiny size, on 4 nodes x 2 ranks: total batch = micro-batch x
# block x world size x accumulation, with accumulation 2, as the presets have at 8 ranks whenever the
# micro-batch is below 64 (gpt2-medium, or gpt2 with a smaller micro-batch on a smaller card).
RANKS_PER_NODE, MICRO_BATCH, BLOCK, ACCUM = 2, 2, 32, 2
REHEARSAL_STEPS, REHEARSAL_CKPT = 16, 4
# Generous for 8 processes on 2 shared cores, yet the test must still see a dead node noticed within them.
DIST_TIMEOUT_S, DIST_STEP_TIMEOUT_S = 120, 60


def rehearsal_args(data_dir: Path, documented: list[str], world_size: int) -> list[str]:
    """The documented arguments (--preset gpt2 --data-dir ...) on this data, with a tiny model and batch
    (later flags win), a checkpoint every few steps and timeouts short enough for a test."""
    args = list(documented)
    args[args.index("--data-dir") + 1] = str(data_dir)
    total = MICRO_BATCH * BLOCK * world_size * ACCUM
    return [
        *args,
        *tiny_run_flags(data_dir, max_steps=REHEARSAL_STEPS, ckpt_interval=REHEARSAL_CKPT),
        "--n-embd",
        "32",
        "--block-size",
        str(BLOCK),
        "--micro-batch-size",
        str(MICRO_BATCH),
        "--total-batch-size",
        str(total),
        "--dist-timeout-s",
        str(DIST_TIMEOUT_S),
        "--dist-step-timeout-s",
        str(DIST_STEP_TIMEOUT_S),
    ]


def start_cluster(args: list[str], work: Path, *, run_dir: Path, nodes: int, job_id: int) -> list[Agent]:
    """One agent per node, each with its own hostname, started as the multi-node sbatch script starts them."""
    command, env = sbatch_node_command(
        args, work, out_dir=run_dir, nodes=nodes, gpus_per_node=RANKS_PER_NODE, port=free_port(), job_id=job_id
    )
    hosts = hosts_file(work, node_names(nodes))
    return [Agent(name, command, log_dir=work, env=env, hostname=name, hosts=hosts) for name in node_names(nodes)]


def node_names(nodes: int) -> list[str]:
    return [f"node{i}" for i in range(1, nodes + 1)]


def outputs(agents: list[Agent]) -> str:
    return "\n".join(f"--- {a.name}\n{a.output[-6000:]}" for a in agents)


def wait_for_file(path: Path, agents: list[Agent], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        running = all(a.proc.poll() is None for a in agents)
        if not running or time.monotonic() > deadline:
            for a in agents:
                if a.proc.poll() is None:
                    a.kill_tree()
            raise AssertionError(f"no {path} within {timeout} s (all agents running: {running})\n{outputs(agents)}")
        time.sleep(0.05)


@needs_root
@pytest.mark.slow
def test_four_nodes_as_the_sbatch_script_starts_them_survive_a_dead_node_and_resume_bitwise(
    tmp_path, shakespeare_shards
):
    from _helpers import assert_same_state, load_ckpt

    from gpt2.ckpt.checkpoint import latest_valid

    nodes, documented = documented_multinode_command()
    world = nodes * RANKS_PER_NODE
    args = rehearsal_args(shakespeare_shards, documented, world)
    shape = f"world size {world} | parallel ddp | {ACCUM} micro-steps of {MICRO_BATCH}x{BLOCK} per step"

    # 1. The reference: the same command, left alone.
    reference = tmp_path / "reference"
    agents = start_cluster(args, tmp_path / "ref", run_dir=reference, nodes=nodes, job_id=4001)
    assert wait_all(agents, timeout=900) == [0] * nodes, outputs(agents)
    assert shape in outputs(agents), outputs(agents)
    assert sorted(losses(reference)) == list(range(1, REHEARSAL_STEPS + 1))

    # 2. Again; one node dies (SIGKILL to its agent and workers) once the first checkpoint is complete.
    run = tmp_path / "run"
    agents = start_cluster(args, tmp_path / "killed", run_dir=run, nodes=nodes, job_id=4002)
    wait_for_file(run / "checkpoints" / f"step_{REHEARSAL_CKPT:08d}.json", agents, timeout=900)
    ranks = {a.name: a.worker_ranks() for a in agents}
    assert sorted(r for rs in ranks.values() for r in rs) == list(range(world)), ranks
    victim = next(a for a in agents if 0 not in ranks[a.name])
    victim.kill_tree()
    killed = time.monotonic()
    # The script passes no --max-restarts (0): the other agents do not wait for a new rendezvous. Their
    # ranks' collectives fail (gloo: connection closed), their workers exit 1, so do the agents, within
    # the trainer's timeout plus torchrun's shutdown grace for the workers (common.sh sets it).
    survivors = [a for a in agents if a is not victim]
    grace = float(survivors[0].env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
    codes = wait_all(survivors, timeout=DIST_TIMEOUT_S + grace + 60)
    noticed_s = time.monotonic() - killed
    text = outputs(agents)
    assert all(c != 0 for c in codes), text
    assert "a collective operation failed" in text, text
    assert not (run / "checkpoints" / f"step_{REHEARSAL_STEPS:08d}.pt").exists(), "the run was not interrupted"
    newest = latest_valid(run)
    resumed_at = int(newest.stem.split("_")[1])
    assert REHEARSAL_CKPT <= resumed_at < REHEARSAL_STEPS, newest
    print(f"survivors exited {noticed_s:.1f} s after the kill; newest checkpoint {newest.name}")

    # 3. All nodes again with --resume auto: from the newest complete checkpoint, bitwise the reference.
    agents = start_cluster([*args, "--resume", "auto"], tmp_path / "restart", run_dir=run, nodes=nodes, job_id=4003)
    assert wait_all(agents, timeout=900) == [0] * nodes, outputs(agents)
    text = outputs(agents)
    assert "resumed from" in text and f"{newest.name} at step {resumed_at}" in text, text
    assert losses(run) == losses(reference)  # ==: steps up to the checkpoint from run 2, the rest resumed
    assert_same_state(load_ckpt(run, REHEARSAL_STEPS), load_ckpt(reference, REHEARSAL_STEPS))


RSS_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from gpt2.ckpt.checkpoint import load_checkpoint


def rollup():
    out = {{}}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if len(parts) >= 3 and parts[0].endswith(":"):
            out[parts[0][:-1]] = int(parts[1]) * 1024
    return out


dist.init_process_group("gloo")
mmap = sys.argv[2] == "mmap"
before = rollup()
state = load_checkpoint(sys.argv[1], verify=False, mmap=mmap)
touched = sum(float(t.sum()) for t in state["tensors"])  # read every byte, as a copy to the GPU would
dist.barrier()  # every rank has mapped the file before any rank measures its share
after = rollup()
delta = {{k: after[k] - before[k] for k in ("Rss", "Pss", "Anonymous")}}
got = [None, None]
dist.all_gather_object(got, delta)
if dist.get_rank() == 0:
    print(json.dumps(got))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # past gloo's exit-time abort, as the trainer's ranks leave (gpt2/distributed/group.py exit_after_group)
"""


def test_loading_a_checkpoint_on_two_local_ranks_holds_about_one_copy_in_host_memory(tmp_path):
    import torch

    from gpt2.ckpt.checkpoint import save_checkpoint

    # 160 MB of tensors in the trainer's own format (save_checkpoint: sidecar, sha256, latest).
    path = save_checkpoint(tmp_path, 1, {"tensors": [torch.randn(10_000_000) for _ in range(4)]}, keep=1)
    size = path.stat().st_size
    script = tmp_path / "load_rss.py"
    script.write_text(RSS_SCRIPT.format(repo=str(REPO)))

    def measure(mode: str) -> list[dict]:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(script),
                str(path),
                mode,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    mapped, copied = measure("mmap"), measure("copy")
    # mmap: both ranks map the same page-cache pages. Each rank's proportional share (Pss) is half,
    # so the node holds one copy, and neither rank holds a private (anonymous) copy.
    assert sum(r["Pss"] for r in mapped) < 1.25 * size, (mapped, size)
    assert all(r["Anonymous"] < 0.1 * size for r in mapped), (mapped, size)
    # The control: a plain load gives every rank its own copy, two for the node.
    assert sum(r["Pss"] for r in copied) > 1.8 * size, (copied, size)
    assert all(r["Anonymous"] > 0.9 * size for r in copied), (copied, size)


# ------------------------------------------------- the resume decision, one rank's view (no processes)


def _view(monkeypatch, rank: int, local_rank: int, rank0_decision, others):
    """Run choose_resume as `rank`, with rank 0's broadcast decision ((its Start, the newest checkpoint rank 0
    sees, its host, the run id whose checkpoints count), or the error it raised) and the other ranks' reports
    given."""
    import torch

    from gpt2.ckpt import resume
    from gpt2.distributed import group
    from gpt2.distributed.group import Dist

    dist = Dist(rank=rank, local_rank=local_rank, world_size=2, local_world_size=1, device=torch.device("cpu"))
    sent = (rank0_decision, None) if isinstance(rank0_decision, Exception) else (None, rank0_decision)
    monkeypatch.setattr(group, "broadcast_object", lambda obj, d: sent if rank else obj)  # rank0_decides' own
    monkeypatch.setattr(resume, "all_gather_object", lambda obj, d: sorted([obj, *others]))
    return dist


def _checkpoint(run_dir: Path, step: int, salt: float = 0.0) -> Path:
    import torch

    from gpt2.ckpt.checkpoint import save_checkpoint

    return save_checkpoint(run_dir, step, {"w": torch.arange(4.0) + step + salt}, keep=10)


def test_a_rank_that_sees_rank_0s_checkpoint_agrees_and_rehashes_once_per_node(tmp_path, monkeypatch):
    from gpt2.ckpt import resume

    path = _checkpoint(tmp_path, 6)
    point = resume._point(path)
    hashed = []
    monkeypatch.setattr(resume.ckpt, "verify_checkpoint", lambda p: hashed.append(p))
    decision = (resume.StartDecision(point, point.run_id), path.name, "node1", "*")
    for local_rank in (0, 1):
        dist = _view(monkeypatch, 1, local_rank, decision, [(0, "node1", None)])
        assert resume.choose_resume("auto", tmp_path, dist, warn=print) == point
    assert hashed == [path]  # the node's first rank hashed it; its second did not


def test_a_rank_that_sees_another_file_under_the_same_name_refuses(tmp_path, monkeypatch):
    from gpt2.ckpt import resume
    from gpt2.ckpt.checkpoint import CheckpointError

    theirs = resume._point(_checkpoint(tmp_path / "node1", 6))
    _checkpoint(tmp_path / "node2", 6, salt=0.5)  # another run's step 6 where node 2 looks
    point = resume.ResumePoint(
        str(tmp_path / "node2" / "checkpoints" / "step_00000006.pt"), 6, theirs.sha256, theirs.bytes
    )
    dist = _view(
        monkeypatch,
        1,
        1,
        (resume.StartDecision(point, None), "step_00000006.pt", "node1", "*"),
        [(0, "node1", None)],
    )
    with pytest.raises(CheckpointError, match=r"rank 1 on \S+: sees a different step_00000006.pt"):
        resume.choose_resume(str(point.path), tmp_path / "node2", dist, warn=print)


def test_rank_0_starting_fresh_while_another_node_sees_a_checkpoint_is_refused(tmp_path, monkeypatch):
    from gpt2.ckpt import resume
    from gpt2.ckpt.checkpoint import CheckpointError

    _checkpoint(tmp_path, 6)  # what this rank (node 1) sees; rank 0 on node2 saw nothing
    dist = _view(monkeypatch, 1, 0, (resume.StartDecision(None, "new-run"), None, "node2", "*"), [(0, "node2", None)])
    with pytest.raises(
        CheckpointError,
        match=r"rank 0 on node2 found no checkpoint .* would start fresh, but "
        r"rank 1 on \S+: sees step_00000006.pt as the newest",
    ):
        resume.choose_resume("auto", tmp_path, dist, warn=print)


def test_rank_0s_error_is_raised_on_every_rank(tmp_path, monkeypatch):
    from gpt2.ckpt import resume
    from gpt2.ckpt.checkpoint import CheckpointError

    dist = _view(monkeypatch, 1, 0, CheckpointError("--resume x.pt: no such checkpoint file"), [])
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        resume.choose_resume("x.pt", tmp_path, dist, warn=print)


def test_ranks_at_different_steps_or_failing_alone_are_refused_and_a_shared_problem_is_raised_as_is(monkeypatch):
    import torch

    from gpt2.ckpt import resume
    from gpt2.ckpt.checkpoint import CheckpointError
    from gpt2.distributed.group import Dist

    dist = Dist(rank=0, local_rank=0, world_size=2, local_world_size=1, device=torch.device("cpu"))

    def gathered(*others):
        monkeypatch.setattr(resume, "all_gather_object", lambda obj, d: [obj, *others])

    gathered((1, "node2", None, 6))
    resume.agree_on_step(6, None, dist)
    gathered((1, "node2", None, 5))
    with pytest.raises(CheckpointError, match="ranks resumed at different steps .*rank 1 on node2: step 5"):
        resume.agree_on_step(6, None, dist)
    gathered((1, "node2", "cannot be loaded (torn)", 0))
    with pytest.raises(CheckpointError, match="rank 1 on node2: cannot be loaded .* Every rank must see"):
        resume.agree_on_step(6, None, dist)
    gathered((1, "node2", "model shape differs", 0))
    with pytest.raises(CheckpointError, match="^model shape differs$"):
        resume.agree_on_step(0, "model shape differs", dist)
