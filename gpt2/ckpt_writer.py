"""Checkpoints written in the background: the training loop stalls only for a copy to host memory.

At a periodic save rank 0 copies the state (model, optimizer, scaler, loader position, RNG states,
config) to host memory and hands the copy to one background thread, which writes it through
gpt2/checkpoint.py's save_checkpoint (temp file, sha256 while writing, fsync, rename, sidecar,
`latest`, retention). Rules:
  - at most one write in flight: the next save first waits for the previous one;
  - a stop (SIGTERM/USR1) and the final save wait for any write in flight, then save synchronously,
    so RUN/requeue still follows a durable checkpoint (gpt2/preempt.py);
  - a write that failed is never lost: `wait()` raises it (CheckpointWriteError) at the next save,
    stop or end of the run, and the trainer sends it to every rank (gpt2/trainer.py save).
Memory: the copy is a second copy of the state on rank 0's host while a write runs (a 124M AdamW run:
~1.5 GB; gpt2-xl: ~19 GB). On CUDA it goes into pinned buffers that are kept and reused (pinning is
slow, and a DMA from pinned memory is asynchronous); on a CPU the copy is a fresh clone, freed after
the write. The other ranks hold no copy. Turn it off with --async-ckpt false.
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

    Tensors that share storage (views, tied weights) share it in the copy too, so torch.save writes the
    same storages, hence the same bytes, as it would for the live state.
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self._buffers: dict[str, torch.Tensor] = {}  # pinned uint8 buffers by the path of their first use
        self._event = None

    def copy(self, state):
        """The host copy of state. On CUDA the copies are queued, not done: call ready() before reading."""
        memo: dict = {}  # id(object) -> its copy; storage key -> host storage
        out = self._walk(state, "", memo)
        if self.pinned and torch.cuda.is_available():
            # Recorded on the stream that queued the copies: the next step's kernels on it cannot
            # overwrite a parameter before its copy has been read.
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def ready(self) -> None:
        """Block until the queued device-to-host copies are complete (the writer thread calls this)."""
        if self._event is not None:
            self._event.synchronize()

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
            host = self._storage_copy(t, path)
            memo[key] = host
        view = torch.empty(0, dtype=t.dtype)
        return view.set_(host.untyped_storage(), t.storage_offset(), t.size(), t.stride())

    def _storage_copy(self, t: torch.Tensor, path: str) -> torch.Tensor:
        """The tensor's whole storage as a host uint8 tensor."""
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        if not (self.pinned and t.device.type == "cuda"):
            return src.clone() if t.device.type == "cpu" else src.to("cpu")  # a real copy: training mutates t
        buf = self._buffers.get(path)
        if buf is None or buf.numel() != src.numel():
            buf = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=True)
            self._buffers[path] = buf
        buf.copy_(src, non_blocking=True)
        return buf


class CheckpointWriter:
    """Rank 0's background checkpoint writer: one thread per write, at most one write in flight."""

    def __init__(self, device: torch.device) -> None:
        self.copier = HostCopier(pinned=device.type == "cuda")
        self._thread: threading.Thread | None = None
        self._result: dict = {}

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def submit(self, out_dir: str | Path, step: int, state: dict, *, keep: int) -> float:
        """Copy state to host memory and start writing it; returns the seconds the copy took.

        Waits for the previous write first (and raises its error). The caller may change the live
        state as soon as this returns.
        """
        self.wait()
        t0 = time.perf_counter()
        host = self.copier.copy(state)
        copy_s = time.perf_counter() - t0
        self._result = {"step": step}
        self._thread = threading.Thread(target=self._write, args=(Path(out_dir), step, host, keep, self._result),
                                        name=f"checkpoint-writer-{step}", daemon=True)
        self._thread.start()
        return copy_s

    def _write(self, out_dir: Path, step: int, host: dict, keep: int, result: dict) -> None:
        try:
            t0 = time.perf_counter()
            self.copier.ready()
            # Looked up on the module at call time: tests patch ckpt.save_checkpoint.
            result["path"] = ckpt.save_checkpoint(out_dir, step, host, keep=keep)
            result["write_s"] = time.perf_counter() - t0
        except BaseException as e:  # kept for wait(): an exception in a thread is otherwise only printed
            result["error"] = e

    def wait(self) -> dict | None:
        """Wait for the write in flight; returns its result ({step, path, write_s}) or None if none.

        Raises CheckpointWriteError if it failed (once: the writer is then idle again).
        """
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, result = None, self._result
        if "error" in result:
            e = result["error"]
            raise CheckpointWriteError(f"writing the checkpoint of step {result['step']} in the background "
                                       f"failed ({type(e).__name__}: {e})") from e
        return result
