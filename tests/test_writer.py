"""Background checkpoint writes (gpt2/ckpt/writer.py): the same file as a synchronous save, training
goes on while it is written, one write at a time, and a failed write is never lost.

Nothing here waits on time: a writer is held by patching save_checkpoint to block on an Event the
test sets; the timeouts only turn a broken implementation (a deadlock) into a failure.
"""

from __future__ import annotations

import threading

import pytest
import torch
from _helpers import assert_same_state, import_train_ddp, losses, no_space_after, optimizer_of, tiny_run_flags

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.writer import CheckpointWriteError, CheckpointWriter, HostCopier
from gpt2.core.config import ModelConfig, TrainConfig
from gpt2.model.gpt import GPT

GUARD_S = 120  # a deadlock guard only: correct code never comes near it


def trained_parts(device="cpu"):
    """A tiny GPT (tied embedding/head) and AdamW after one step: every state tensor exists."""
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)).to(device)
    opt = optimizer_of(model, TrainConfig.of(fused_adamw=False), torch.device(device))
    train_one_step(model, opt)
    return model, opt


def train_one_step(model, opt) -> None:
    x = torch.randint(0, 50257, (2, 16), device=next(model.parameters()).device)
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def live_state(model, opt, step: int) -> dict:
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": [{"torch": torch.get_rng_state()}],
        "loader": {"position": 512 * step, "epoch": 0},
        "config": {"lr": 3e-3, "betas": (0.9, 0.95)},
        "world_size": 1,
        "tokens": 512 * step,
    }


class Gate:
    """Patches ckpt.save_checkpoint so that writing `step` blocks until open() (other steps pass)."""

    def __init__(self, monkeypatch, step: int) -> None:
        self.step, self.entered, self.released = step, threading.Event(), threading.Event()
        self.log: list[str] = []
        plain = ckpt.save_checkpoint

        def gated(out_dir, step, state, *, keep, **kwargs):
            self.log.append(f"start {step}")
            if step == self.step:
                self.entered.set()
                assert self.released.wait(GUARD_S), "the test never released the writer"
            path = plain(out_dir, step, state, keep=keep, **kwargs)
            self.log.append(f"end {step}")
            return path

        monkeypatch.setattr(ckpt, "save_checkpoint", gated)

    def open(self) -> None:
        self.released.set()


def test_background_write_equals_a_synchronous_one_while_training_changes_the_state(tmp_path, monkeypatch):
    model, opt = trained_parts()
    sync_path = ckpt.save_checkpoint(tmp_path / "sync", 1, live_state(model, opt, 1), keep=3)
    gate = Gate(monkeypatch, 1)
    writer = CheckpointWriter(torch.device("cpu"))
    writer.submit(tmp_path / "async", 1, live_state(model, opt, 1), keep=3)
    assert gate.entered.wait(GUARD_S) and writer.in_flight
    writer.wait_copied()  # what train_step does before the optimizer update
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for _ in range(2):  # training goes on (in place) while the write is held
        train_one_step(model, opt)
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "async" / "checkpoints" / "step_00000001.pt").exists()
    gate.open()
    done = writer.wait()
    assert done["path"] == tmp_path / "async" / "checkpoints" / "step_00000001.pt" and not writer.in_flight
    # The same bytes (so the same sha256 in the sidecar) and, loaded, the same content.
    assert done["path"].read_bytes() == sync_path.read_bytes()
    a, b = ckpt.load_checkpoint(sync_path), ckpt.load_checkpoint(done["path"])
    assert_same_state(a, b)
    assert {k: v for k, v in a.items() if k not in ("model", "optimizer", "rng")} == {
        k: v for k, v in b.items() if k not in ("model", "optimizer", "rng")
    }
    # Tied weights stay one storage in the file, as torch.save of the live state writes them.
    assert b["model"]["lm_head.weight"].data_ptr() == b["model"]["transformer.wte.weight"].data_ptr()


def test_host_copy_is_a_real_copy_on_cpu():
    t = torch.arange(6.0)
    state = {"a": t, "view": t[2:4], "nested": [(t, 3)]}
    copier = HostCopier(pinned=False)
    host = copier.copy(state)
    assert copier.copies_pending
    copier.finish()
    t.add_(100)
    assert host["a"].tolist() == [0, 1, 2, 3, 4, 5] and host["view"].tolist() == [2, 3]
    assert host["nested"][0][0].data_ptr() == host["a"].data_ptr() and host["nested"][0][1] == 3


def test_every_save_copies_into_one_flat_buffer_reused_from_save_to_save(tmp_path):
    """One host buffer for the whole state (pinned on CUDA: one block, not one per tensor), kept across
    saves; each storage of the copy is its own storage over an aligned slice of it, so the file holds
    the live state's storages (the byte-for-byte test above) and a later save overwrites in place."""
    from gpt2.ckpt.writer import ALIGN_BYTES

    model, opt = trained_parts()
    copier = HostCopier(pinned=False)
    first = copier.copy(live_state(model, opt, 1))
    copier.finish()
    flat = copier._flat
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in list(first["model"].values()) + [v for s in first["optimizer"]["state"].values() for v in s.values()]
    }
    assert all(lo <= ptr and ptr + n <= hi and (ptr - lo) % ALIGN_BYTES == 0 for ptr, n in storages.items())
    spans = sorted(storages.items())
    assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # disjoint
    want = {k: v.clone() for k, v in model.state_dict().items()}
    train_one_step(model, opt)
    second = copier.copy(live_state(model, opt, 2))
    assert all(torch.equal(first["model"][k], want[k]) for k in want)  # not overwritten before finish()
    copier.finish()
    assert copier._flat is flat  # reused
    assert all(torch.equal(second["model"][k], v) for k, v in model.state_dict().items())
    assert {k: v.data_ptr() for k, v in second["model"].items()} == {k: v.data_ptr() for k, v in first["model"].items()}


class FakeDeviceCopier(HostCopier):
    """HostCopier whose chosen storages stand for device (CUDA) tensors, on a CPU: their copies are
    queued on a fake side stream that runs only once the test releases it, as a device-to-host copy
    still in flight on a GPU; the training stream's device-side wait is counted, not waited."""

    def __init__(self, device_ptrs: set[int]) -> None:
        super().__init__(pinned=False)
        # `unblock`, not `release`: HostCopier.release() is the writer's call after each write (a name shadowed
        # here made that call raise in the writer thread, after the save)
        self.device_ptrs, self.unblock, self.device_waits = device_ptrs, threading.Event(), 0

    def _on_device(self, src):
        return src.data_ptr() in self.device_ptrs

    def _copy_on_side_stream(self, jobs):
        def side_stream():
            assert self.unblock.wait(GUARD_S), "the test never released the device copy"
            for dst, src in jobs:
                dst.copy_(src)

        stream = threading.Thread(target=side_stream, daemon=True)
        stream.start()
        self._event = type("Event", (), {"synchronize": lambda _: stream.join()})()
        self._copied_event = "recorded"

    def wait_copied_on_device(self):
        if self._copied_event is not None:
            self.device_waits += 1
            self._copied_event = None


def test_wait_copied_does_not_block_the_host_on_the_devices_copy(tmp_path, monkeypatch):
    """issue 39: wait_copied() returned only after the device-to-host copy had finished (the writer
    set _copied after the copy event's synchronize()); it must return once the host tensors' copies are
    made, with the update ordered after the device's copies on the device, while the writer thread
    still waits for them before it writes."""
    model, opt = trained_parts()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(torch.device("cpu"))
    writer.copier = fake = FakeDeviceCopier({p.untyped_storage().data_ptr() for p in model.parameters()})
    saved = threading.Event()
    plain = ckpt.save_checkpoint

    def save(*args, **kwargs):
        saved.set()
        return plain(*args, **kwargs)

    monkeypatch.setattr(ckpt, "save_checkpoint", save)
    writer.submit(tmp_path, 1, live_state(model, opt, 1), keep=3)  # the RNG and moments: host copies
    returned = threading.Event()
    threading.Thread(target=lambda: (writer.wait_copied(), returned.set()), daemon=True).start()
    try:
        assert returned.wait(GUARD_S), "wait_copied() blocked on the device's copy"
        assert fake.device_waits == 1  # the update is ordered after the copies on the device
        assert not saved.is_set()  # the writer does not read the buffer before the device's copies land
    finally:
        fake.unblock.set()
    done = writer.wait()
    state = ckpt.load_checkpoint(done["path"])
    assert all(torch.equal(state["model"][k], v) for k, v in want.items())


def test_the_next_save_waits_for_the_write_in_flight(tmp_path, monkeypatch):
    model, opt = trained_parts()
    gate = Gate(monkeypatch, 1)
    writer = CheckpointWriter(torch.device("cpu"))
    writer.submit(tmp_path, 1, live_state(model, opt, 1), keep=3)
    assert gate.entered.wait(GUARD_S)
    plain_wait = writer.wait

    def wait_then_release():  # the second submit must come through here while step 1 is still held
        assert gate.log == ["start 1"]
        gate.open()
        return plain_wait()

    monkeypatch.setattr(writer, "wait", wait_then_release)
    writer.submit(tmp_path, 2, live_state(model, opt, 2), keep=3)
    monkeypatch.setattr(writer, "wait", plain_wait)
    writer.wait()
    assert gate.log == ["start 1", "end 1", "start 2", "end 2"]
    assert ckpt.latest_valid(tmp_path).name == "step_00000002.pt"


def test_an_error_in_the_writer_is_raised_by_the_next_wait_and_the_writer_recovers(tmp_path, monkeypatch):
    model, opt = trained_parts()
    plain = ckpt.save_checkpoint

    def full_disk(out_dir, step, state, *, keep):
        if step == 2:
            raise OSError(28, "No space left on device")
        return plain(out_dir, step, state, keep=keep)

    monkeypatch.setattr(ckpt, "save_checkpoint", full_disk)
    writer = CheckpointWriter(torch.device("cpu"))
    writer.submit(tmp_path, 1, live_state(model, opt, 1), keep=3)
    writer.submit(tmp_path, 2, live_state(model, opt, 2), keep=3)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint of step 2 .*No space left on device"):
        writer.wait()
    assert writer.wait() is None  # raised once; the writer is idle and usable again
    assert ckpt.latest_valid(tmp_path).name == "step_00000001.pt"
    writer.submit(tmp_path, 3, live_state(model, opt, 3), keep=3)
    assert writer.wait()["step"] == 3


@pytest.mark.gpu
def test_pinned_buffers_are_reused_and_hold_the_values_at_the_step_boundary(tmp_path):
    model, opt = trained_parts("cuda")
    copier = HostCopier(pinned=True)
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    first = copier.copy(live_state(model, opt, 1))  # on the side stream
    copier.wait_copied_on_device()  # what train_step's wait_copied does before the update
    train_one_step(model, opt)  # queued on the training stream behind the copies
    copier.finish()
    assert all(torch.equal(first["model"][k], want[k]) for k in want)
    assert first["model"]["transformer.wte.weight"].is_pinned()
    ptrs = {k: v.data_ptr() for k, v in first["model"].items()}
    second = copier.copy(live_state(model, opt, 2))
    copier.finish()
    assert {k: v.data_ptr() for k, v in second["model"].items()} == ptrs


# ------------------------------------------------------------------ through the trainer (one process)


def run_main(tmp_path, shards, name: str, *extra: str) -> int:
    args = [
        *tiny_run_flags(shards, max_steps=6, ckpt_interval=2, eval_tokens=256),
        "--out-dir",
        str(tmp_path / name),
        *extra,
    ]
    return import_train_ddp().main(args)


def test_training_runs_on_while_the_trainer_writes_and_matches_a_synchronous_run(
    tmp_path, shakespeare_shards, monkeypatch
):
    import gpt2.train.trainer as trainer

    assert run_main(tmp_path, shakespeare_shards, "sync", "--async-ckpt", "false") == 0
    gate = Gate(monkeypatch, 2)
    plain_step, during = trainer.train_step, []

    def train_step(parts, *args, **kwargs):
        if parts.step + 1 == 3:  # step 2's state is copied, and its writer is in save_checkpoint, held
            assert gate.entered.wait(GUARD_S)
        if gate.entered.is_set() and not gate.released.is_set():
            during.append(parts.step + 1)  # this step runs while step 2's checkpoint is being written
            assert not (tmp_path / "async" / "checkpoints" / "step_00000002.pt").exists()
            if parts.step + 1 == 4:
                gate.open()
        return plain_step(parts, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", train_step)
    assert run_main(tmp_path, shakespeare_shards, "async") == 0
    assert during == [3, 4]
    assert losses(tmp_path / "async") == losses(tmp_path / "sync")
    for step in (2, 4, 6):
        name = f"checkpoints/step_{step:08d}.pt"
        a, b = (ckpt.load_checkpoint(tmp_path / run / name) for run in ("sync", "async"))
        assert_same_state(a, b)
        assert a["loader"] == b["loader"] and a["tokens"] == b["tokens"]


# A failed write through the trainer, on 2 ranks: tests/test_resume.py


def test_a_background_write_on_a_full_disk_says_no_space_and_names_the_directory(tmp_path, monkeypatch):
    model, opt = trained_parts()
    monkeypatch.setattr(ckpt._HashingWriter, "write", no_space_after(4096))
    writer = CheckpointWriter(torch.device("cpu"))
    writer.submit(tmp_path, 2, live_state(model, opt, 2), keep=3)
    with pytest.raises(CheckpointWriteError) as err:
        writer.wait()
    message = str(err.value)
    assert message.startswith(
        f"writing the checkpoint of step 2 in the background failed (No space left on device "
        f"in {tmp_path / 'checkpoints'} ("
    ), message
    assert "unexpected pos" not in message and "\n" not in message
    assert ckpt.list_checkpoints(tmp_path) == []  # the temp file went with the error


# ------------------------------------------------------------------ the host copy's bound (issue 75 item 4)


def test_the_host_copy_is_kept_and_pinned_up_to_its_bound_and_above_it_held_only_while_written():
    """Rank 0's copy lived for the whole run, pinned: ~1.5 GB at 124M, ~19 GB at gpt2-xl. Kept (pinned on CUDA)
    up to CHECKPOINT_COPY_KEEP_BYTES, pageable and released after each write above it."""
    from gpt2.core.config import MODEL_PRESETS
    from gpt2.core.host_memory import CHECKPOINT_COPY_KEEP_BYTES, checkpoint_copy_kept
    from gpt2.plan.budget import checkpoint_bytes

    small, xl = (checkpoint_bytes(ModelConfig(**MODEL_PRESETS[p])) for p in ("gpt2", "gpt2-xl"))
    assert small < CHECKPOINT_COPY_KEEP_BYTES < xl
    assert checkpoint_copy_kept(small, cuda=True) == (True, True)  # 124M: as measured by bench/checkpoint_stall.py
    assert checkpoint_copy_kept(small, cuda=False) == (False, True)
    assert checkpoint_copy_kept(xl, cuda=True) == checkpoint_copy_kept(xl, cuda=False) == (False, False)


def test_a_copy_over_the_bound_is_released_when_its_write_ends_and_writes_the_same_file(tmp_path, monkeypatch):
    from gpt2.core import host_memory

    model, opt = trained_parts()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(torch.device("cpu"))
    writer.submit(tmp_path, 1, live_state(model, opt, 1), keep=3)
    writer.wait()
    assert writer.copier.kept and writer.copier._flat is not None  # under the bound: kept for the next save
    monkeypatch.setattr(host_memory, "CHECKPOINT_COPY_KEEP_BYTES", 1024)  # this tiny state is now "large"
    writer.submit(tmp_path, 2, live_state(model, opt, 2), keep=3)
    writer.wait_copied()
    train_one_step(model, opt)  # the update after the copy: the file holds the state as the save found it
    done = writer.wait()
    assert not writer.copier.kept and writer.copier._flat is None  # held only while the write was in flight
    state = ckpt.load_checkpoint(done["path"])
    assert all(torch.equal(state["model"][k], v) for k, v in want.items())
    writer.submit(tmp_path, 3, live_state(model, opt, 3), keep=3)  # a new buffer for the next save
    assert writer.wait()["step"] == 3 and writer.copier._flat is None


def test_the_plans_host_line_counts_rank_0s_copy():
    """Issue 75 item 4: the plan said nothing of the host copy; its host line gives its size and how long it lives."""
    from gpt2.core.config import MODEL_PRESETS
    from gpt2.core.precision import BFLOAT16
    from gpt2.plan.hardware import gpu_hardware
    from gpt2.plan.memory import run_config
    from gpt2.plan.planner import plan
    from gpt2.plan.report import format_plan

    h100 = gpu_hardware("H100-80GB", BFLOAT16)

    def host(preset: str, world: int = 1, **train) -> str:
        cfg = ModelConfig(**MODEL_PRESETS[preset])
        p = plan(run_config(cfg, 1, prec=BFLOAT16, world_size=world, **train), h100, world_size=world)
        return next(line for line in format_plan(p).splitlines() if line.startswith("host "))

    assert host("gpt2") == (
        "host       rank 0's copy of the state for a background checkpoint (--async-ckpt): 1.39 GiB (pinned, kept "
        "from the first save to the end of the run); the other ranks hold none"
    )
    assert "17.41 GiB (pageable, held only while a write is in flight: over 4.00 GiB, it is not kept)" in host(
        "gpt2-xl"
    )
    assert host("gpt2", async_ckpt=False).startswith("host       no checkpoint copy: --async-ckpt false")
    assert host("gpt2-xl", world=2, parallel="fsdp").startswith("host       no checkpoint copy: fsdp's sharded")


@pytest.mark.gpu
def test_over_the_bound_the_cuda_copy_is_pageable_made_by_the_writer_thread_and_released(tmp_path, monkeypatch):
    from gpt2.core import host_memory

    monkeypatch.setattr(host_memory, "CHECKPOINT_COPY_KEEP_BYTES", 1024)
    model, opt = trained_parts("cuda")
    copier = HostCopier(pinned=True)
    want = {k: v.cpu() for k, v in model.state_dict().items()}
    first = copier.copy(live_state(model, opt, 1))
    assert copier.copies_pending and not copier.kept  # the writer thread's copies, not the side stream's
    copier.finish()  # what the writer thread does; train_step's wait_copied waits for it before the update
    train_one_step(model, opt)
    assert all(torch.equal(first["model"][k], want[k]) for k in want)
    assert not first["model"]["transformer.wte.weight"].is_pinned()
    copier.release()
    assert copier._flat is None
