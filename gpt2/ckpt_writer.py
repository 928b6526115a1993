"""Checkpoints written in the background: training does not wait for the file, only for a host copy.

At a periodic save rank 0 copies the state (model, optimizer, scaler, loader position, RNG states,
config) to host memory and one background thread writes that copy through gpt2/checkpoint.py's
save_checkpoint (temp file, sha256 while writing, fsync, rename, sidecar, `latest`, retention).
The copy overlaps the next step's forward and backward, which only read the state:
  - on CUDA the step boundary queues non-blocking device-to-host copies on the training stream, so
    every later kernel (the next optimizer update included) runs after them; the thread waits on a
    CUDA event before reading the buffers;
  - on a CPU the writer thread makes the copy, and the next optimizer update waits for it
    (`wait_copied`, called by train_step): the parameters and moments change only there.
Rules:
  - at most one write in flight: the next save first waits for the previous one;
  - a stop (SIGTERM/USR1) and the final save wait for any write in flight, then save synchronously,
    so RUN/requeue still follows a durable checkpoint (gpt2/preempt.py);
  - a write that failed is never lost: `wait()` raises it (CheckpointWriteError) at the next save,
    stop or end of the run, and the trainer sends it to every rank (gpt2/state.py save).
Memory: the copy is a second copy of the state in rank 0's host memory (a 124M AdamW run: ~1.5 GB;
gpt2-xl: ~19 GB), from the first periodic save to the end of the run: its buffers are kept and reused
(on CUDA they are pinned, which is slow to allocate and makes the device-to-host copy asynchronous;
on a CPU, copying into memory already touched is 2-3x faster than a fresh clone). The other ranks
hold no copy. --async-ckpt false saves synchronously and holds none.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import torch

from gpt2 import checkpoint as ckpt


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the newest complete checkpoint is the one before it."""


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device, s.data_ptr(), s.nbytes())


class HostCopier:
    """Copies nested state (dicts, lists, tuples of tensors and plain values) to host memory.

    copy() builds the copy's structure and queues the tensor copies; finish() completes them. Tensors
    that share storage (views, tied weights) share it in the copy too, so torch.save writes the same
    storages, hence the same bytes, as it would for the live state.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: dict[str, torch.Tensor] = {}  # uint8 host buffers by the path of their first use
        self._jobs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, device bytes) not yet copied
        self._event = None

    def copy(self, state):
        """The host copy of state, valid after finish(). Everything but tensor contents is copied now."""
        memo: dict = {}  # id(object) -> its copy; storage key -> host storage
        self._jobs = []
        out = self._walk(state, "", memo)
        if any(src.device.type == "cuda" for _, src in self._jobs):
            self._run_jobs()  # queued on the current stream, asynchronous for pinned buffers
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    @property
    def copies_pending(self) -> bool:
        """True while finish() has CPU copies to make (the live state must not change until then)."""
        return bool(self._jobs)

    def finish(self) -> None:
        """Make the queued copies, or wait for the device's (the writer thread calls this)."""
        self._run_jobs()
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _run_jobs(self) -> None:
        for buf, src in self._jobs:
            buf.copy_(src, non_blocking=src.device.type == "cuda")  # a real copy: training changes src
        self._jobs = []

    def _walk(self, x, path: str, memo: dict):
        # One copy per object (memo by id), so what the live state shares (AdamW's one betas tuple in
        # every param group) is shared in the copy too: pickle then writes the same bytes.
        if id(x) in memo:
            return memo[id(x)]
        if isinstance(x, torch.Tensor):
            out = self._tensor(x, path, memo)
        elif isinstance(x, (int, float, complex, str, bytes, bool, type(None))):
            out = x  # immutable
        elif isinstance(x, dict):
            out = type(x)((k, self._walk(v, f"{path}/{k}", memo)) for k, v in x.items())
            if getattr(x, "__dict__", None):  # a state_dict's _metadata (pickled with it)
                out.__dict__.update(copy.deepcopy(x.__dict__))
        elif type(x) in (list, tuple):
            out = type(x)(self._walk(v, f"{path}/{i}", memo) for i, v in enumerate(x))
        else:
            out = copy.deepcopy(x)  # anything else: a private copy
        memo[id(x)] = out
        return out

    def _tensor(self, t: torch.Tensor, path: str, memo: dict) -> torch.Tensor:
        t = t.detach()
        key = _storage_key(t)
        host = memo.get(key)
        if host is None:
            host = self._buffer(t, path)
            memo[key] = host
        view = torch.empty(0, dtype=t.dtype)
        return view.set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    def _buffer(self, t: torch.Tensor, path: str) -> torch.Tensor:
        """A host uint8 buffer for the tensor's whole storage, kept for the next save; queues the copy."""
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        buf = self._buffers.get(path)
        if buf is None or buf.numel() != src.numel():
            # Kept and reused: pinning is slow, and on a CPU copying into memory already touched is
            # 2-3x faster than into fresh pages.
            buf = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=self.pinned and t.device.type == "cuda")
            self._buffers[path] = buf
        self._jobs.append((buf, src))
        return buf


class CheckpointWriter:
    """Rank 0's background checkpoint writer: one thread per write, at most one write in flight."""

    def __init__(self, device: torch.device) -> None:
        self.copier = HostCopier(pinned=device.type == "cuda")
        self._thread: threading.Thread | None = None
        self._result: dict = {}
        self._copied = threading.Event()
        self._copied.set()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, out_dir: str | Path, step: int, state: dict, *, keep: int, **save_kwargs) -> None:
        """Start writing state (after the previous write, whose error this raises).

        save_kwargs go to ckpt.save_checkpoint (run_id, warn) as they are.

        The caller may run forward and backward at once, but must call wait_copied() before changing
        the state (the optimizer update).
        """
        self.wait()
        host = self.copier.copy(state)
        self._result = {"step": step, "directory": ckpt.checkpoint_dir(out_dir)}
        if self.copier.copies_pending:
            self._copied.clear()
        self._thread = threading.Thread(target=self._write, args=(Path(out_dir), step, host, keep, self._result, save_kwargs),
                                        name=f"checkpoint-writer-{step}", daemon=True)
        self._thread.start()

    def wait_copied(self) -> None:
        """Block until the state's copy is complete (immediate on CUDA: stream order protects it)."""
        self._copied.wait()

    def _write(self, out_dir: Path, step: int, host: dict, keep: int, result: dict, save_kwargs: dict) -> None:
        try:
            t0 = time.perf_counter()
            try:
                self.copier.finish()
            finally:
                self._copied.set()  # also on an error: training must never wait for it forever
            t1 = time.perf_counter()
            # Looked up on the module at call time: tests patch ckpt.save_checkpoint.
            result["path"] = ckpt.save_checkpoint(out_dir, step, host, keep=keep, **save_kwargs)
            result["copy_s"], result["write_s"] = t1 - t0, time.perf_counter() - t1
        except BaseException as e:  # kept for wait(): an exception in a thread is otherwise only printed
            result["error"] = e

    def wait(self) -> dict | None:
        """Wait for the write in flight; its result ({step, path, copy_s, write_s}), or None if none.

        Raises CheckpointWriteError if it failed (once: the writer is then idle again).
        """
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, result = None, self._result
        if "error" in result:
            e = result["error"]
            raise CheckpointWriteError(f"writing the checkpoint of step {result['step']} in the background "
                                       f"failed ({ckpt.write_failure(e, result['directory'])})") from e
        return result
