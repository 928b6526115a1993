"""The host's memory as a CPU run sees it: what is free, this process's resident peak, and glibc's malloc.

Linux only where it reads /proc (elsewhere each reader returns None and the caller says "unknown");
glibc only where it tunes malloc. Nothing runs at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

MMAP_THRESHOLD_BYTES = 4 << 20
"""Blocks of at least this size are mapped on their own and unmapped when freed (return_freed_memory).

4 MiB, not less: each mapped block costs a page fault per 4 KiB every time it is allocated again, and a step
allocates its activations afresh. At 1 MiB a step of 6 x 384 wide, 8 x 256 tokens (3 MiB activations) took
4.6-4.9 s against 3.6 s at 4 MiB or at glibc's defaults (bench/step_parts.py's trainer row, removed after
a823994; docs/performance.md);
the memory plan holds at 4 MiB as it did at 1 (bench/plan_resident.py, docs/training.md)."""
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
"""Free memory above this at the top of glibc's heap goes back to the system (twice the mmap threshold, as
glibc's own dynamic rule keeps it)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h

CHECKPOINT_COPY_KEEP_BYTES = 4 * 2**30
"""Rank 0's host copy of the state for a background checkpoint (gpt2/ckpt/writer.py) is kept from save to save,
and pinned on CUDA, up to this size: a 124M AdamW run's 1.5 GB (pinning is slow to allocate, and the pinned
device-to-host copies overlap the next step: bench/checkpoint_stall.py). Above it (gpt2-medium's 5.7 GB with
AdamW, gpt2-xl's 19 GB) the copy is ordinary pageable memory held only while a write is in flight, freed when
the write ends: a run's host does not give up a second copy of the state for its whole length. The plan's host
line says which (gpt2/plan/report.py)."""


def checkpoint_copy_kept(copy_bytes: int, *, cuda: bool) -> tuple[bool, bool]:
    """(pinned, kept) for a background checkpoint's host copy of copy_bytes (CHECKPOINT_COPY_KEEP_BYTES): kept from
    save to save up to the bound, and then pinned when the state is on CUDA; above it neither."""
    kept = copy_bytes <= CHECKPOINT_COPY_KEEP_BYTES
    return kept and cuda, kept


def return_freed_memory() -> bool:
    """Make glibc return a freed tensor's memory to the system (a CPU run calls this before its model exists).

    By default glibc raises its mmap threshold to the largest block freed so far (up to 32 MiB) and keeps
    up to twice that free at the top of its heap; tensors under the threshold then come from the heap,
    where the order of a training step's allocations leaves freed blocks it cannot reuse, and the process
    grows past the memory plan by a different amount run to run. With a fixed 4 MiB threshold every tensor
    of 4 MiB or more (the large ones that grow with the micro-batch) is mapped and unmapped on its own, at
    the cost of a page fault per 4 KiB when it is allocated again, and the heap's holes stay small (both
    measured by bench/plan_memory.py, removed after a823994: its table in bench/README.md).
    Returns whether it was set (glibc only).

    A malloc setting the user made (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or glibc.malloc tunables
    in GLIBC_TUNABLES, e.g. bench/fsdp_memory.py's 64 KiB threshold) is theirs: left as it is."""
    if platform.libc_ver()[0] != "glibc" or user_malloc_settings():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def user_malloc_settings(env=None) -> bool:
    """Whether the environment sets glibc's malloc thresholds itself (read by glibc at process start)."""
    env = os.environ if env is None else env
    return any(k in env for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")) or "glibc.malloc." in env.get(
        "GLIBC_TUNABLES", ""
    )


def available_bytes() -> int | None:
    """MemAvailable: what the kernel can give without swapping (free memory plus reclaimable caches),
    not MemTotal, which counts what other processes hold. None where /proc/meminfo is absent."""
    return _kib_field("/proc/meminfo", "MemAvailable")


def resident_bytes() -> int | None:
    """This process's resident set now (VmRSS), or None off Linux."""
    return _kib_field("/proc/self/status", "VmRSS")


def resident_peak_bytes() -> int | None:
    """This process's resident high-water mark (VmHWM) since it started or reset_resident_peak(), or None."""
    return _kib_field("/proc/self/status", "VmHWM")


def reset_resident_peak() -> bool:
    """Set VmHWM back to the current VmRSS (Linux >= 4.0: writing 5 to /proc/self/clear_refs), so a later
    resident_peak_bytes() is the peak of what runs in between. Returns whether it could. For measuring
    processes only (gpt2/plan/measure.py's, a bench's): never in a training run, whose peak a user reads
    (`/usr/bin/time -v`, the job's accounting)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _kib_field(path: str, name: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
