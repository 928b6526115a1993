"""Checkpoints written in the background: training does not wait for the file, only for a host copy.

At a periodic save rank 0 copies the state (model, optimizer, scaler, loader position, RNG states,
config) to host memory and one background thread writes that copy through gpt2/ckpt/checkpoint.py's
save_checkpoint (temp file, sha256 while writing, fsync, rename, sidecar, `latest`, retention).
The copy overlaps the next step's forward and backward, which only read the state:
  - on CUDA the step boundary queues non-blocking device-to-host copies into one pinned buffer on a
    side stream (HostCopier); the next optimizer update waits for them on the device (wait_copied,
    called by train_step), and the thread waits on a CUDA event before reading the buffer;
  - on a CPU the writer thread makes the copy, and the next optimizer update waits for it
    (`wait_copied`, called by train_step): the parameters and moments change only there.
Rules:
  - at most one write in flight: the next save first waits for the previous one;
  - a stop (SIGTERM/USR1) and the final save wait for any write in flight, then save synchronously,
    so RUN/requeue still follows a durable checkpoint (gpt2/distributed/preempt.py);
  - a write that failed is never lost: `failed` turns True when its thread ends, the trainer asks at
    every step and stops every rank at the next one (its stop vote), and `wait()` raises the error
    (CheckpointWriteError), which the trainer sends to every rank (gpt2/train/state.py save).
Memory: the copy is a second copy of the state in rank 0's host memory (a 124M AdamW run: ~1.5 GB;
gpt2-xl: ~19 GB). Up to CHECKPOINT_COPY_KEEP_BYTES (gpt2/core/host_memory.py, 4 GiB) its buffer is kept
from the first periodic save to the end of the run and reused (on CUDA pinned, which is slow to allocate
and makes the device-to-host copy asynchronous; on a CPU, copying into memory already touched is 2-3x
faster than a fresh clone). Above it the buffer is ordinary pageable memory, allocated at each save and
freed when its write ends, so the host holds it only while a write is in flight; on CUDA the writer thread
then makes the device-to-host copies (on a side stream, after the step the save was asked at), and the next
optimizer update waits for them as on a CPU. The plan's host line counts it (gpt2/plan/report.py). The other
ranks hold no copy. --async-ckpt false saves synchronously and holds none.
"""

from __future__ import annotations

import copy
import threading
import time
from pathlib import Path

import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.core.host_memory import checkpoint_copy_kept


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the newest complete checkpoint is the one before it."""


def _storage_key(t: torch.Tensor) -> tuple:
    s = t.untyped_storage()
    return (s.device, s.data_ptr(), s.nbytes())


ALIGN_BYTES = 64
"""Each storage's place in the flat host buffer starts at a multiple of this: every dtype's alignment,
and whole cache lines for the copies."""


class HostCopier:
    """Copies nested state (dicts, lists, tuples of tensors and plain values) to host memory.

    copy() builds the copy's structure and queues the tensor copies; finish() completes them. Tensors
    that share storage (views, tied weights) share it in the copy too, so torch.save writes the same
    storages, hence the same bytes, as it would for the live state.

    Every storage's bytes go into one flat host buffer, kept and reused from save to save (grown when
    the state grows): pinned on CUDA, where one pinned block instead of one per tensor (~450 for a
    124M AdamW state) spares the caching host allocator's power-of-two rounding (up to 2x the state)
    and pinning's slow allocation at every first save. Each storage of the copy is its own storage
    over its slice (torch.from_numpy of the slice: the file's bytes are the live state's, not one
    storage holding everything). On CUDA the device-to-host copies run on a side stream that first
    waits for the training stream: they overlap the next forward and backward instead of queueing
    ahead of them, and the next optimizer update waits for them on the device (wait_copied).
    A state over CHECKPOINT_COPY_KEEP_BYTES gets a pageable buffer instead, dropped by release() once its
    write is done (kept False), its CUDA tensors copied by finish_host (the module docstring).
    """

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        """Pin a kept buffer for CUDA tensors (the trainer's device is CUDA)."""
        self.kept = True
        """Whether the last copy's buffer is kept for the next save (else release() drops it)."""
        self._flat: torch.Tensor | None = None  # the host buffer, uint8
        self._flat_pinned = False
        self._ready = None  # on the training stream at copy(): the writer thread's CUDA copies start after it
        self._jobs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host slice, source bytes) not yet copied
        self._event = None  # recorded on the side stream after the CUDA copies; the writer thread waits on it
        self._copied_event = None  # the same event, for the training stream's wait (wait_copied, main thread)
        self._stream = None

    def copy(self, state):
        """The host copy of state, valid after finish(). Everything but tensor contents is copied now."""
        sources: dict = {}  # storage key -> the source's bytes, in first-seen order
        self._collect(state, sources, set())
        offsets, total = {}, 0
        for key, src in sources.items():
            offsets[key] = total
            total += -(-src.numel() // ALIGN_BYTES) * ALIGN_BYTES
        cuda = any(src.device.type == "cuda" for src in sources.values())
        pin, self.kept = checkpoint_copy_kept(total, cuda=self.pinned and cuda)
        if self._flat is None or self._flat.numel() < total or self._flat_pinned != pin:
            self._flat = None  # the old buffer goes before the new one is allocated
            self._flat = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=pin)
            self._flat_pinned = pin
        flat_np = self._flat.numpy()
        self._jobs = []
        hosts = {}
        for key, src in sources.items():
            begin, n = offsets[key], src.numel()
            hosts[key] = torch.from_numpy(flat_np[begin : begin + n])  # its own storage over the slice
            self._jobs.append((self._flat[begin : begin + n], src))
        out = self._walk(state, {}, hosts)
        device = [(dst, src) for dst, src in self._jobs if self._on_device(src)]
        if device:
            self._jobs = [(dst, src) for dst, src in self._jobs if not self._on_device(src)]
            self._copy_on_side_stream(device)
        if any(src.device.type == "cuda" for _, src in self._jobs):  # into pageable memory, by finish_host
            self._ready = torch.cuda.Event()
            self._ready.record()  # the state as the step left it
        return out

    def _on_device(self, src: torch.Tensor) -> bool:
        """Whether src's copy is queued on the device (CUDA, into the pinned buffer) rather than made by
        finish_host() (a host tensor, or a CUDA one copied into pageable memory, which blocks the caller)."""
        return src.device.type == "cuda" and self._flat_pinned

    def release(self) -> None:
        """After the copy's write: drop a buffer that is not kept (over CHECKPOINT_COPY_KEEP_BYTES), whose memory
        goes back once the written copy is gone too; a kept one stays for the next save."""
        if not self.kept:
            self._flat = None

    def _copy_on_side_stream(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())  # the state as the step left it
        with torch.cuda.stream(self._stream):
            for dst, src in jobs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self._stream)  # a temporary's memory is not reused before its copy
        self._event = self._copied_event = torch.cuda.Event()
        self._event.record(self._stream)

    @property
    def copies_pending(self) -> bool:
        """True while finish_host() has host copies to make (the live state must not change until then)."""
        return bool(self._jobs)

    def wait_copied_on_device(self) -> None:
        """Make the training stream wait for the side stream's copies (no host wait): after this, work
        queued on it (the optimizer update) cannot change a tensor before its copy has read it."""
        if self._copied_event is not None:
            torch.cuda.current_stream().wait_event(self._copied_event)
            self._copied_event = None

    def finish(self) -> None:
        """Make the host's copies and wait for the device's: the copy is then complete."""
        self.finish_host()
        self.wait_device()

    def finish_host(self) -> None:
        """Make the copies of host tensors (the writer thread calls this; the live state's host tensors
        must not change before it returns)."""
        self._run_jobs()

    def wait_device(self) -> None:
        """Block until the device's copies have landed in the host buffer (the writer thread, before it
        reads the buffer; training never waits here: wait_copied_on_device orders it on the device)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _run_jobs(self) -> None:
        if self._ready is not None:  # CUDA tensors into pageable memory: on a side stream, after the step
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_event(self._ready)
            self._ready = None
            with torch.cuda.stream(self._stream):  # each copy returns once its bytes have landed
                self._copy_jobs()
            return
        self._copy_jobs()

    def _copy_jobs(self) -> None:
        for buf, src in self._jobs:
            buf.copy_(src)  # a real copy: training changes src
        self._jobs = []

    def _collect(self, x, sources: dict, seen: set) -> None:
        """Every tensor's whole storage, as uint8 bytes, once per storage (the walk's order)."""
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            t = x.detach()
            key = _storage_key(t)
            if key not in sources:
                sources[key] = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        elif isinstance(x, dict):
            for v in x.values():
                self._collect(v, sources, seen)
        elif type(x) in (list, tuple):
            for v in x:
                self._collect(v, sources, seen)

    def _walk(self, x, memo: dict, hosts: dict):
        # One copy per object (memo by id), so what the live state shares (AdamW's one betas tuple in
        # every param group) is shared in the copy too: pickle then writes the same bytes.
        if id(x) in memo:
            return memo[id(x)]
        if isinstance(x, torch.Tensor):
            t = x.detach()
            view = torch.empty(0, dtype=t.dtype)
            out = view.set_(hosts[_storage_key(t)].untyped_storage(), t.storage_offset(), t.size(), t.stride())
        elif isinstance(x, (int, float, complex, str, bytes, bool, type(None))):
            out = x  # immutable
        elif isinstance(x, dict):
            out = type(x)((k, self._walk(v, memo, hosts)) for k, v in x.items())
            if getattr(x, "__dict__", None):  # a state_dict's _metadata (pickled with it)
                out.__dict__.update(copy.deepcopy(x.__dict__))
        elif type(x) in (list, tuple):
            out = type(x)(self._walk(v, memo, hosts) for v in x)
        else:
            out = copy.deepcopy(x)  # anything else: a private copy
        memo[id(x)] = out
        return out


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

    @property
    def failed(self) -> bool:
        """True once the write in flight has ended with an error (which wait() raises). Never blocks:
        the trainer asks at every step, so a full disk is reported at the next step, not at the next
        save (gpt2/train/trainer.py run_loop)."""
        return self._thread is not None and not self._thread.is_alive() and "error" in self._result

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
        self._thread = threading.Thread(
            target=self._write,
            args=(Path(out_dir), step, host, keep, self._result, save_kwargs),
            name=f"checkpoint-writer-{step}",
            daemon=True,
        )
        self._thread.start()

    def wait_copied(self) -> None:
        """Before changing the state: block until the host tensors' copies are made; the device's are
        ordered before the training stream's next work instead (no host wait: _copied is set once the
        host copies are made, before the writer thread waits for the device's)."""
        self._copied.wait()
        self.copier.wait_copied_on_device()

    def _write(self, out_dir: Path, step: int, host: dict, keep: int, result: dict, save_kwargs: dict) -> None:
        try:
            t0 = time.perf_counter()
            try:
                self.copier.finish_host()
            finally:
                self._copied.set()  # also on an error: training must never wait for it forever
            self.copier.wait_device()  # the device's copies, already ordered before the next update
            t1 = time.perf_counter()
            # Looked up on the module at call time: tests patch ckpt.save_checkpoint.
            result["path"] = ckpt.save_checkpoint(out_dir, step, host, keep=keep, **save_kwargs)
            result["copy_s"], result["write_s"] = t1 - t0, time.perf_counter() - t1
        except BaseException as e:  # kept for wait(): an exception in a thread is otherwise only printed
            result["error"] = e
        finally:
            self.copier.release()  # a buffer over the bound is held only while its write is in flight

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
            raise CheckpointWriteError(
                f"writing the checkpoint of step {result['step']} in the background "
                f"failed ({ckpt.write_failure(e, result['directory'])})"
            ) from e
        return result
