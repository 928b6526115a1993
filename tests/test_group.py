"""gpt2/distributed/group.py: the per-rank share of the node's CPUs for inductor's compile workers; the
rank's device; rank0_decides, the one way rank 0 decides for every rank."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._inductor.config as inductor_config

from gpt2.distributed.group import Dist, compile_threads, set_compile_threads, usable_cpus


def test_compile_threads_share_the_node_among_its_local_ranks():
    assert compile_threads(32, 8) == 4  # not 8 x 32 = 256 workers on a 32-core node
    assert compile_threads(32, 1) == 32
    assert compile_threads(30, 8) == 3  # rounded down: never more workers than cores
    assert compile_threads(2, 8) == 1  # at least one
    assert compile_threads(1, 0) == 1


def test_set_compile_threads_takes_effect_in_inductor():
    from torch._inductor import async_compile

    # torch >= 2.6 sizes the pool by get_compile_threads(); 2.5 reads config.compile_threads itself.
    get_compile_threads = getattr(async_compile, "get_compile_threads", lambda: inductor_config.compile_threads)
    with inductor_config.patch(compile_threads=99):  # restored after (torch's own config patcher)
        for local_ranks in (1, 2, 64):
            dist = Dist(
                rank=0, local_rank=0, world_size=local_ranks, local_world_size=local_ranks, device=torch.device("cpu")
            )
            expected = max(1, usable_cpus() // local_ranks)
            assert set_compile_threads(dist) == expected
            # what inductor's worker pool is sized from, when the first compilation creates it
            assert inductor_config.compile_threads == get_compile_threads() == expected


def _recording(monkeypatch, barrier_error=None):
    """gpt2.distributed.group's view of torch.distributed with its barrier and destroy recorded (a 2-rank Dist)."""
    import torch.distributed as tdist

    calls = []

    def barrier():
        calls.append("barrier")
        if barrier_error is not None:
            raise barrier_error

    monkeypatch.setattr(tdist, "is_initialized", lambda: True)
    monkeypatch.setattr(tdist, "barrier", barrier)
    monkeypatch.setattr(tdist, "destroy_process_group", lambda: calls.append("destroy"))
    return calls, Dist(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"))


def test_teardown_meets_at_a_barrier_before_destroying_when_every_rank_gets_there(monkeypatch):
    from gpt2.distributed.group import teardown

    calls, dist = _recording(monkeypatch)
    teardown(dist, agreed=True)
    assert calls == ["barrier", "destroy"]
    calls.clear()
    teardown(dist)  # a peer died or one rank failed: no barrier that would wait out the timeout
    assert calls == ["destroy"]
    calls, dist = _recording(monkeypatch, barrier_error=RuntimeError("Connection closed by peer"))
    teardown(dist, agreed=True)  # a peer gone since: destroyed all the same, nothing raised
    assert calls == ["barrier", "destroy"]


def test_the_trainer_exits_through_the_barrier_when_every_rank_ends_alike(monkeypatch, tmp_path):
    """train_ddp.main: a normal end and the errors every rank raises alike tear down with agreed=True;
    a failed collective (a dead peer) without."""
    import gpt2.distributed.group
    import gpt2.train.startup
    import gpt2.train.trainer
    import train_ddp
    from gpt2.distributed.group import CollectiveError
    from gpt2.train.trainer import NonFiniteError

    seen = []
    world = gpt2.distributed.group.WorldInfo(0, 0, 2, 2)
    monkeypatch.setattr(gpt2.distributed.group, "world_from_env", lambda env=None: world)
    monkeypatch.setattr(gpt2.distributed.group, "setup", lambda info, device, timeout_s: Dist(0, 0, 2, 2, device))
    monkeypatch.setattr(gpt2.distributed.group, "teardown", lambda dist, agreed=False: seen.append(agreed))
    monkeypatch.setattr(gpt2.train.startup, "check_data", lambda tc, block_size, world_size: None)
    monkeypatch.setattr(gpt2.train.startup, "run_guards", lambda out_dir, dist: contextlib.nullcontext())
    monkeypatch.setattr(gpt2.train.startup, "start", lambda cfg, dist, shards, stop_request: "the run")
    argv = ["--preset", "debug", "--device", "cpu", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "run")]

    def ending(outcome):
        def train(run):
            assert run == "the run"
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        return train

    for outcome, code, agreed in (
        (0, 0, True),
        (NonFiniteError("nan"), 1, True),
        (ValueError("no fit"), 2, True),
        (CollectiveError("all_reduce failed"), 1, False),
    ):
        monkeypatch.setattr(gpt2.train.trainer, "train", ending(outcome))
        assert train_ddp.main(argv) == code, outcome
        assert seen.pop() is agreed, outcome


def test_a_rank_of_a_group_exits_with_its_code_and_its_buffered_output_but_without_finalizing(tmp_path):
    """exit_after_group: a rank of several skips the interpreter's finalization (where gloo's worker
    threads abort the process) yet keeps its exit code and its buffered stdout/stderr; one process
    exits normally (its atexit handlers run)."""
    import subprocess
    import sys

    from conftest import REPO

    script = (
        "import atexit, sys\n"
        "from gpt2.distributed.group import WorldInfo, exit_after_group\n"
        "atexit.register(lambda: print('finalized'))\n"
        "print('buffered out'); print('buffered err', file=sys.stderr)\n"
        "exit_after_group(3, WorldInfo(0, 0, int(sys.argv[1]), int(sys.argv[1])))\n"
    )
    for world, finalized in ((2, False), (1, True)):
        done = subprocess.run(
            [sys.executable, "-c", script, str(world)], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 3, done
        assert done.stdout.splitlines() == ["buffered out", *(["finalized"] if finalized else [])], done
        assert done.stderr.strip() == "buffered err", done


def test_resolve_device_uses_the_one_visible_gpu_whatever_local_rank_and_refuses_a_missing_one(monkeypatch):
    """srun --gpus-per-task=1 gives each task one GPU through CUDA_VISIBLE_DEVICES: it is cuda:0 for every
    LOCAL_RANK. With several visible, LOCAL_RANK picks one, and a LOCAL_RANK beyond them is refused."""
    import pytest

    from gpt2.distributed.group import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda", 5) == resolve_device("auto", 0) == torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device("auto", 3) == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="LOCAL_RANK=4 but only 4 CUDA devices are visible"):
        resolve_device("cuda", 4)
    assert resolve_device("cpu", 7) == torch.device("cpu")


def test_rank0_decides_runs_on_rank_0_alone_and_every_rank_returns_or_raises_its_outcome(monkeypatch):
    """Rank 0 decides; every rank takes what the broadcast carries (one rank's view at a time, the broadcast
    replaced by what rank 0 sent); an error of `errors` is every rank's, anything else rank 0's alone."""
    from gpt2.distributed import group
    from gpt2.distributed.group import rank0_decides

    def view(rank: int) -> Dist:
        return Dist(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=torch.device("cpu"))

    sent, calls = [], []
    monkeypatch.setattr(group, "broadcast_object", lambda obj, dist: sent.append(obj) or obj)

    def decide():
        calls.append(1)
        return {"micro_batch": 4}

    assert rank0_decides(decide, view(0)) == {"micro_batch": 4} and calls == [1]
    monkeypatch.setattr(group, "broadcast_object", lambda obj, dist: sent[-1])  # rank 1 receives rank 0's
    assert rank0_decides(decide, view(1)) == {"micro_batch": 4} and calls == [1]  # rank 1 never decides

    def refuse():
        raise ValueError("no micro-batch fits: pass --activation-checkpointing full")

    monkeypatch.setattr(group, "broadcast_object", lambda obj, dist: sent.append(obj) or obj)
    for rank in (0, 1):
        with pytest.raises(ValueError, match="no micro-batch fits: pass --activation-checkpointing full"):
            rank0_decides(refuse, view(rank), errors=(ValueError,))
        monkeypatch.setattr(group, "broadcast_object", lambda obj, dist: sent[-1])
    with pytest.raises(ValueError):  # not in errors: rank 0 raises before its broadcast
        rank0_decides(refuse, view(0), errors=(OSError,))


def test_rank0_decides_is_the_one_place_rank_0_broadcasts_a_decision():
    """Issue 77: 'rank 0 decides, then broadcasts' was written by hand at 13 call sites; now once."""
    import re
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    files = [*(repo / "gpt2").rglob("*.py"), *(repo / "data_prep").rglob("*.py"), repo / "train_ddp.py"]
    sites = [
        f"{f.relative_to(repo)}:{i}"
        for f in files
        for i, line in enumerate(f.read_text().splitlines(), 1)
        if re.search(r"\bbroadcast_object\(", line) and not line.lstrip().startswith("def ")
    ]
    assert sites == ["gpt2/distributed/group.py:" + sites[0].split(":")[1]] and len(sites) == 1, sites
