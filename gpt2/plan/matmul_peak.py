"""A device's matmul rate, measured: the peak FLOP/s a CPU's MFU and the plan's times are against, and
what --dtype auto compares on a CPU with bf16 instructions (gpt2/plan/precision_choice.py). Several short
probes, the best kept, cached per machine (CPU model, threads, torch) under ~/.cache/gpt2-ddp, so a run
measures once per machine; GPUs use their data sheets instead (gpt2/plan/flops.py). Also the probes'
shared cache entry format (read_cache_entry, write_cache_entry), which the loss and micro-batch probes use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.core.atomic import atomic_write_text


@dataclass(frozen=True)
class MatmulRate:
    """One matmul measurement's best rates (what `matmul_rate(..., cpu_time=True)` returns)."""

    wall: float
    """Best FLOP/s by the wall clock."""
    cpu: float
    """Best FLOPs per second of this process's CPU time (all threads; on a GPU, the host's time).
    Load from other processes moves it much less than the wall-clock rate."""
    n: int
    """The square matrices' size."""


_MATMUL_RATES: dict[tuple, MatmulRate] = {}
"""matmul_rate's per-process cache, by (device, dtype, budget_s, min_time_s, n)."""


def matmul_rate(
    device: str,
    dtype: torch.dtype,
    *,
    budget_s: float = 0.25,
    min_time_s: float = 0.004,
    n: int | None = None,
    fresh: bool = False,
    cpu_time: bool = False,
) -> float | MatmulRate:
    """Best FLOP/s of a square matmul on device in dtype, measured within about budget_s.

    The size doubles from 128 until one matmul takes min_time_s (long enough for the timer and for
    the BLAS to reach its plateau) or reaches the largest useful size; then it is timed until the
    budget is spent and the best time taken. Bounded on any device and dtype: an emulated bf16
    matmul (1 GFLOP/s) stops growing at n=256, a fast one at 1024-2048 (CPU) or 8192 (GPU).
    With n, that size alone is timed (no search; one untimed call, then at least one timed call and
    more while the budget lasts): a fixed workload such as a benchmark's 2048^3.

    Cached per process by its arguments. The trainer's peaks (--dtype auto, MFU, the planner) are
    `peak_rates`: several fresh probes of this, kept across runs. fresh=True measures again and leaves the cache alone
    (benchmarks re-measure between their timed
    steps and keep the best, so that the peak sees the same load as the steps).
    cpu_time=True returns a `MatmulRate`: the wall-clock rate and, from the same calls, the rate by
    process CPU time; otherwise the wall-clock rate alone, a float.
    """
    key = (str(device), dtype, budget_s, min_time_s, n)
    rate = None if fresh else _MATMUL_RATES.get(key)
    if rate is None:
        rate = _measure_matmul(torch.device(device), dtype, budget_s, min_time_s, n)
        if not fresh:
            _MATMUL_RATES[key] = rate
    return rate if cpu_time else rate.wall


def _measure_matmul(
    dev: torch.device, dtype: torch.dtype, budget_s: float, min_time_s: float, n: int | None
) -> MatmulRate:
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def timed(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        sync()
        return time.perf_counter() - t0, time.process_time() - c0

    max_n = 8192 if dev.type == "cuda" else 2048
    deadline = time.perf_counter() + budget_s
    size = n or 128
    while True:
        a = torch.randn(size, size, device=dev).to(dtype)
        b = torch.randn(size, size, device=dev).to(dtype)
        torch.mm(a, b)  # the first call builds the kernel (oneDNN) or warms the clocks
        sync()
        wall, cpu = timed(a, b)
        if n is not None or wall >= min_time_s or size >= max_n or time.perf_counter() > deadline:
            break
        size *= 2
    while time.perf_counter() + wall < deadline:
        w, c = timed(a, b)
        wall, cpu = min(wall, w), min(cpu, c)
    flops = 2.0 * size**3
    return MatmulRate(flops / wall, flops / max(cpu, 1e-9), size)


PEAK_PROBES = 5
"""A CPU peak is the best of this many probes: another tenant's burst slows some of them, rarely all."""
PEAK_PROBE_S = 0.3
"""Each probe's time budget (seconds)."""
PEAK_MIN_MATMUL_S = 0.05
"""A probe's matmul grows until one call takes this long (or reaches n=2048): long enough that a
scheduler tick or a cache miss does not decide the rate, as it could at matmul_rate's default 4 ms."""
CPU_PEAK_FLOOR_PER_THREAD = 2e9
"""fp32 FLOP/s per thread below which a CPU matmul peak is taken as a disturbed probe, not a property
of the machine: one SSE2 core at 2 GHz does 16 GFLOP/s in fp32, and the peak of an autocast run is
never below fp32's (gpt2.plan.flops.device_peak_flops). Such a value is neither cached nor used for MFU."""
REFRESH_PEAK_ENV = "GPT2_DDP_REFRESH_PEAK"
"""Set to 1 to measure the CPU peaks again and overwrite the cached ones."""

_PEAKS: dict[str, float] = {}
"""peak_rate's per-process cache, by cache key."""


def peak_cache_dir() -> Path:
    """$XDG_CACHE_HOME/gpt2-ddp (default ~/.cache/gpt2-ddp), where HellaSwag is cached too."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "gpt2-ddp"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def peak_key(device: str, dtype: torch.dtype) -> dict:
    """What a measured peak depends on: the machine, the dtype, the thread count and torch's kernels."""
    return {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def peak_cache_path(key: dict) -> Path:
    """One file per key: two ranks measuring different dtypes at once never overwrite each other."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return peak_cache_dir() / f"matmul-peak-{key['dtype']}-{digest}.json"


def peak_rate(device: str, dtype: torch.dtype, *, refresh: bool | None = None) -> float:
    """A CPU's peak matmul FLOP/s in dtype (see peak_rates)."""
    return peak_rates(device, (dtype,), refresh=refresh)[0]


def peak_rates(device: str, dtypes: tuple[torch.dtype, ...], *, refresh: bool | None = None) -> list[float]:
    """A CPU's peak matmul FLOP/s in each dtype: the best of PEAK_PROBES probes, measured once per
    machine, dtype, thread count and torch version and cached in peak_cache_dir() (written atomically).

    When any of them must be measured, all are, their probes alternating: a comparison (bf16 against
    fp32 for --dtype auto, an autocast peak against fp32's) is then between rates taken under the same
    load. refresh=None reads GPT2_DDP_REFRESH_PEAK: 1 measures again and replaces the cached values
    (once per process). An fp32 value below CPU_PEAK_FLOOR_PER_THREAD is returned but never cached:
    the next run measures again (emulated bf16 or fp16 is genuinely that slow, so only fp32 has a
    floor). An unreadable or unwritable cache only costs a measurement.
    """
    dtypes = tuple(dict.fromkeys(dtypes))
    keys = [peak_key(device, d) for d in dtypes]
    paths = [str(peak_cache_path(k)) for k in keys]
    if all(p in _PEAKS for p in paths):  # a refresh happens once per process, not at every call
        return [_PEAKS[p] for p in paths]
    if refresh is None:
        refresh = refresh_requested()
    cached = [None if refresh else _PEAKS.get(p) or _read_peak(Path(p), k) for p, k in zip(paths, keys)]
    if any(r is None for r in cached):
        probes = [[] for _ in dtypes]
        for _ in range(PEAK_PROBES):
            for i, d in enumerate(dtypes):
                probes[i].append(
                    matmul_rate(device, d, budget_s=PEAK_PROBE_S, min_time_s=PEAK_MIN_MATMUL_S, fresh=True)
                )
        cached = [max(p) for p in probes]
        for d, p, k, rate, ps in zip(dtypes, paths, keys, cached, probes):
            if d != torch.float32 or rate >= CPU_PEAK_FLOOR_PER_THREAD * k["threads"]:
                _write_peak(Path(p), k, rate, ps)
    _PEAKS.update(zip(paths, cached))
    return cached


def forget_peak(device: str, dtype: torch.dtype) -> None:
    """Drop a cached peak that training has shown to be wrong (an MFU above 100%): the next run measures again."""
    path = peak_cache_path(peak_key(device, dtype))
    _PEAKS.pop(str(path), None)
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def refresh_requested() -> bool:
    """GPT2_DDP_REFRESH_PEAK=1: measure again what is cached (the matmul peaks, gpt2/plan/loss_probe.py's times)."""
    return os.environ.get(REFRESH_PEAK_ENV, "") not in ("", "0")


def read_cache_entry(path: Path, key: dict) -> dict | None:
    """A cached measurement (a JSON object) written for exactly this key, or None."""
    try:
        entry = json.loads(path.read_text())
        return entry if isinstance(entry, dict) and entry.get("key") == key else None
    except (OSError, ValueError):
        return None


def write_cache_entry(path: Path, key: dict, values: dict) -> None:
    """values under key, with when and under what load they were measured, written atomically. An
    unwritable cache only costs the next run a measurement."""
    entry = {
        "key": key,
        **values,
        "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(entry, indent=1) + "\n")
    except OSError:
        pass  # a read-only home: measured every run, which is what happened before the cache


def _read_peak(path: Path, key: dict) -> float | None:
    entry = read_cache_entry(path, key)
    try:
        return float(entry["flop_s"]) if entry is not None and entry["flop_s"] > 0 else None
    except (KeyError, TypeError, ValueError):
        return None


def _write_peak(path: Path, key: dict, rate: float, probes: list[float]) -> None:
    write_cache_entry(path, key, {"flop_s": rate, "probes_flop_s": probes})
