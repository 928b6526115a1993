"""Several nodes simulated on one machine: two torchrun agents meeting through the c10d rendezvous, one
rank each. The second "node" can get its own view of the run directory (a mount namespace with an
empty tmpfs over it) and its own hostname (a UTS namespace), as a node-local --out-dir would give.
Needs root for the namespaces (as CI and this machine have); elsewhere these tests are skipped."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO
from _helpers import children, losses, patched_train_script, records, tiny_run_flags

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="unshare -m / -u need root")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Agent:
    """One torchrun agent of a two-node c10d rendezvous, optionally in its own namespaces."""

    def __init__(self, name: str, script: Path, args: list[str], *, port: int, log_dir: Path,
                 private_dir: Path | None = None, hostname: str | None = None) -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=multinode-test",
               "--monitor-interval=0.2", str(script), *args]
        if private_dir is not None or hostname is not None:
            setup = []
            if private_dir is not None:
                setup.append(f'mount -t tmpfs tmpfs "{private_dir}"')
            if hostname is not None:
                setup.append(f"hostname {hostname}")
            cmd = ["unshare", "-m", "-u", "sh", "-c", " && ".join(setup) + ' && exec "$@"', "sh", *cmd]
        self.name, self.log_dir = name, log_dir / name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # gloo binds to the address of the hostname, which a renamed node cannot resolve: use loopback.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "30"}
        with open(self.log_dir / "out.txt", "w") as out, open(self.log_dir / "err.txt", "w") as err:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err, env=env,
                                         start_new_session=True)

    @property
    def output(self) -> str:
        return (self.log_dir / "out.txt").read_text() + (self.log_dir / "err.txt").read_text()

    def worker_rank(self) -> int | None:
        """The global rank of this agent's worker (found through its environment), once it runs."""
        for pid in _descendants(self.proc.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(e == b"TORCHELASTIC_RUN_ID=multinode-test" for e in env):
                ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"RANK=")]
                if ranks:
                    return ranks[0]
        return None

    def kill_tree(self) -> None:
        """SIGKILL the agent and everything it started (what srun --kill-on-bad-exit does to a step)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def two_nodes(args: list[str], tmp_path: Path, tag: str, *, script: Path = REPO / "train_ddp.py",
              private_dir: Path | None = None) -> tuple[Agent, Agent]:
    port = free_port()
    a = Agent(f"{tag}-node1", script, args, port=port, log_dir=tmp_path)
    b = Agent(f"{tag}-node2", script, args, port=port, log_dir=tmp_path, private_dir=private_dir,
              hostname="node2")
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
import gpt2.preempt as preempt

_write = preempt.write_requeue_marker


def slow_write(*args, **kwargs):  # rank 0 is slow to write the marker (a loaded shared filesystem)
    time.sleep(3)
    return _write(*args, **kwargs)


preempt.write_requeue_marker = slow_write
"""


@needs_root
def test_requeue_marker_is_on_disk_before_any_node_can_leave_the_stop(tmp_path, shakespeare_shards):
    """The stop's exit says "requeue" on one node while the other node's torchrun is killed as soon as
    that node's torchrun exits (srun --kill-on-bad-exit=1): the marker must exist anyway."""
    script = patched_train_script(tmp_path, SLOW_MARKER)
    run_dir = tmp_path / "run"
    agents = two_nodes(run_flags(shakespeare_shards, run_dir, 1000, 0), tmp_path, "stop", script=script)
    try:
        deadline = time.monotonic() + 180
        while not any(r.get("step", 0) >= 2 and "loss" in r for r in records(run_dir)):
            assert time.monotonic() < deadline and all(a.proc.poll() is None for a in agents), \
                "\n".join(a.output for a in agents)
            time.sleep(0.1)
        rank0 = next(a for a in agents if a.worker_rank() == 0)
        other = next(a for a in agents if a is not rank0)
        os.kill(other.proc.pid, signal.SIGTERM)  # torchrun forwards it to its worker: every rank stops
        other.proc.wait(120)
        rank0.kill_tree()  # the moment the other node's torchrun is gone
    finally:
        for a in agents:
            if a.proc.poll() is None:
                a.kill_tree()
    assert "stopped by signal" in other.output or "stopped by signal" in rank0.output, \
        "\n".join(a.output for a in agents)
    marker = run_dir / "requeue"
    assert marker.is_file(), "the other node left the stop path before rank 0 wrote the requeue marker\n" + \
        "\n".join(a.output for a in agents)
    info = json.loads(marker.read_text())
    from gpt2.checkpoint import verify_checkpoint
    verify_checkpoint(run_dir / "checkpoints" / info["checkpoint"])  # the marker promises a complete one
    assert info["checkpoint"] == f"step_{info['step']:08d}.pt"


RSS_SCRIPT = '''
import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from gpt2.checkpoint import load_checkpoint


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
'''


def test_loading_a_checkpoint_on_two_local_ranks_holds_about_one_copy_in_host_memory(tmp_path):
    import torch

    from gpt2.checkpoint import save_checkpoint

    # 160 MB of tensors in the trainer's own format (save_checkpoint: sidecar, sha256, latest).
    path = save_checkpoint(tmp_path, 1, {"tensors": [torch.randn(10_000_000) for _ in range(4)]}, keep=1)
    size = path.stat().st_size
    script = tmp_path / "load_rss.py"
    script.write_text(RSS_SCRIPT.format(repo=str(REPO)))

    def measure(mode: str) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              str(script), str(path), mode], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
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
    """Run choose_resume as `rank`, with rank 0's broadcast decision (kind, Start or message, the newest
    checkpoint rank 0 sees, its host, the run id whose checkpoints count) and the other ranks' reports given."""
    import torch

    from gpt2 import resume
    from gpt2.dist import Dist

    dist = Dist(rank=rank, local_rank=local_rank, world_size=2, local_world_size=1, device=torch.device("cpu"))
    monkeypatch.setattr(resume, "broadcast_object", lambda obj, d: rank0_decision if rank else obj)
    monkeypatch.setattr(resume, "all_gather_object", lambda obj, d: sorted([obj, *others]))
    return dist


def _checkpoint(run_dir: Path, step: int, salt: float = 0.0) -> Path:
    import torch

    from gpt2.checkpoint import save_checkpoint

    return save_checkpoint(run_dir, step, {"w": torch.arange(4.0) + step + salt}, keep=10)


def test_a_rank_that_sees_rank_0s_checkpoint_agrees_and_rehashes_once_per_node(tmp_path, monkeypatch):
    from gpt2 import resume

    path = _checkpoint(tmp_path, 6)
    point = resume._point(path)
    hashed = []
    monkeypatch.setattr(resume.ckpt, "verify_checkpoint", lambda p: hashed.append(p))
    decision = ("ok", resume.Start(point, point.run_id), path.name, "node1", "*")
    for local_rank in (0, 1):
        dist = _view(monkeypatch, 1, local_rank, decision, [(0, "node1", None)])
        assert resume.choose_resume("auto", tmp_path, dist, warn=print) == point
    assert hashed == [path]  # the node's first rank hashed it; its second did not


def test_a_rank_that_sees_another_file_under_the_same_name_refuses(tmp_path, monkeypatch):
    from gpt2 import resume
    from gpt2.checkpoint import CheckpointError

    theirs = resume._point(_checkpoint(tmp_path / "node1", 6))
    _checkpoint(tmp_path / "node2", 6, salt=0.5)  # another run's step 6 where node 2 looks
    point = resume.ResumePoint(str(tmp_path / "node2" / "checkpoints" / "step_00000006.pt"), 6, theirs.sha256,
                               theirs.bytes)
    dist = _view(monkeypatch, 1, 1, ("ok", resume.Start(point, None), "step_00000006.pt", "node1", "*"), [(0, "node1", None)])
    with pytest.raises(CheckpointError, match=r"rank 1 on \S+: sees a different step_00000006.pt"):
        resume.choose_resume(str(point.path), tmp_path / "node2", dist, warn=print)


def test_rank_0_starting_fresh_while_another_node_sees_a_checkpoint_is_refused(tmp_path, monkeypatch):
    from gpt2 import resume
    from gpt2.checkpoint import CheckpointError

    _checkpoint(tmp_path, 6)  # what this rank (node 1) sees; rank 0 on node2 saw nothing
    dist = _view(monkeypatch, 1, 0, ("ok", resume.Start(None, "new-run"), None, "node2", "*"), [(0, "node2", None)])
    with pytest.raises(CheckpointError, match=r"rank 0 on node2 found no checkpoint .* would start fresh, but "
                                              r"rank 1 on \S+: sees step_00000006.pt as the newest"):
        resume.choose_resume("auto", tmp_path, dist, warn=print)


def test_rank_0s_error_is_raised_on_every_rank(tmp_path, monkeypatch):
    from gpt2 import resume
    from gpt2.checkpoint import CheckpointError

    dist = _view(monkeypatch, 1, 0, ("error", "--resume x.pt: no such checkpoint file", None, "node1", None), [])
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        resume.choose_resume("x.pt", tmp_path, dist, warn=print)


def test_ranks_at_different_steps_or_failing_alone_are_refused_and_a_shared_problem_is_raised_as_is(monkeypatch):
    import torch

    from gpt2 import resume
    from gpt2.checkpoint import CheckpointError
    from gpt2.dist import Dist

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
