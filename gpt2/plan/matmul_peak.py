"""A device's matmul rate, measured: the peak FLOP/s a CPU's MFU and the plan's times are against, and
what --dtype auto compares on a CPU with bf16 instructions (gpt2/plan/precision_choice.py). Several short
probes per dtype, the dtypes' alternating (gpt2/plan/paired.py), the best kept; cached per machine (CPU
model, threads, torch) under ~/.cache/gpt2-ddp where the measurement was not doubtful (not under load, its
probes not scattered), so a quiet run measures once per machine and a busy one measures again until a quiet
one can be cached; GPUs use their data sheets instead (gpt2/plan/flops.py). Also the probes' shared cache
entry format (read_cache_entry, write_cache_entry; read_trusted_entry and write_trusted_entry for a
measurement that passed paired's checks, re-checked every paired.RECHECK_RUNS-th read), which the loss and
micro-batch probes use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.core.atomic import atomic_write_text
from gpt2.plan import paired


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
    matmul (1 GFLOP/s) stops growing at n=256, a fast one at 1024-2048 (CPU) or 8192 (GPU). On a CPU
    "takes min_time_s" is by the wall clock and by the process's CPU time per thread alike: on a busy
    machine a small matmul's wall time is mostly waiting for a core, and the size would stop too soon.
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
    threads = torch.get_num_threads() if dev.type == "cpu" else 1
    deadline = time.perf_counter() + budget_s
    size = n or 128
    while True:
        a = torch.randn(size, size, device=dev).to(dtype)
        b = torch.randn(size, size, device=dev).to(dtype)
        torch.mm(a, b)  # the first call builds the kernel (oneDNN) or warms the clocks
        sync()
        wall, cpu = timed(a, b)
        if dev.type == "cuda":
            done = wall >= min_time_s or time.perf_counter() > deadline
        else:  # both clocks: another process stretches a small matmul's wall time (issue 73: fp32 stopped at 128)
            done = min(wall, cpu / threads) >= min_time_s
        if n is not None or done or size >= max_n:
            break
        size *= 2
    while time.perf_counter() + wall < deadline:
        w, c = timed(a, b)
        wall, cpu = min(wall, w), min(cpu, c)
    flops = 2.0 * size**3
    return MatmulRate(flops / wall, flops / max(cpu, 1e-9), size)


PEAK_PROBES = 5
"""A CPU peak comes from this many probes per dtype, the dtypes' probes alternating (paired.measure_rounds):
the best of them is the peak, their pairs decide --dtype auto (gpt2/plan/precision_choice.py)."""
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
"""Set to 1 to measure the CPU peaks (and the probes' decisions) again and overwrite the cached ones."""


@dataclass(frozen=True)
class MeasuredPeak:
    """A CPU's peak matmul FLOP/s in one dtype, and how it was measured."""

    flop_s: float
    how: str
    """'the best of 5 bfloat16 matmul probes (n=2048, alternating with float32's), measured ... at load 0.4 on
    2 CPU(s)', with where it is cached."""
    doubt: str | None = None
    """Why it is neither cached nor used for MFU (measured under load, scattered probes, below the floor),
    or None."""


_PEAKS: dict[str, MeasuredPeak] = {}
"""measured_peaks' per-process cache, by cache file."""


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
    """A CPU's peak matmul FLOP/s in dtype (see measured_peaks)."""
    return peak_rates(device, (dtype,), refresh=refresh)[0]


def peak_rates(device: str, dtypes: tuple[torch.dtype, ...], *, refresh: bool | None = None) -> list[float]:
    """A CPU's peak matmul FLOP/s in each dtype (measured_peaks' values)."""
    return [m.flop_s for m in measured_peaks(device, dtypes, refresh=refresh)]


def measured_peaks(device: str, dtypes: tuple[torch.dtype, ...], *, refresh: bool | None = None) -> list[MeasuredPeak]:
    """A CPU's peak matmul FLOP/s in each dtype: the best of PEAK_PROBES probes, measured once per machine,
    dtype, thread count and torch version and cached in peak_cache_dir() (written atomically) where the
    measurement is not doubtful (measured under load, its probes scattered, or an fp32 rate below
    CPU_PEAK_FLOOR_PER_THREAD: probe_peaks); a doubtful one is returned with its doubt, which keeps it out of
    MFU, and the next run measures again. A cached peak is measured again on every paired.RECHECK_RUNS-th
    run that reads it; a doubtful re-check keeps it.

    When any of them must be measured, all are, their probes alternating: a comparison (bf16 against fp32
    for --dtype auto, an autocast peak against fp32's) is then between rates taken under the same load.
    refresh=None reads GPT2_DDP_REFRESH_PEAK: 1 measures again and replaces the cached values (once per
    process). An unreadable or unwritable cache only costs a measurement; an entry written before issue 73
    (no record of its load) is measured again.
    """
    dtypes = tuple(dict.fromkeys(dtypes))
    paths = [str(peak_cache_path(peak_key(device, d))) for d in dtypes]
    if all(p in _PEAKS for p in paths):  # a refresh happens once per process, not at every call
        return [_PEAKS[p] for p in paths]
    if refresh is None:
        refresh = refresh_requested()
    missing = refresh
    for p, d in zip(paths, dtypes):
        if p not in _PEAKS and not refresh:
            cached, due = _read_peak(device, d)
            missing = missing or cached is None or due
            if cached is not None and not due:
                _PEAKS[p] = cached
    if missing:
        probe_peaks(device, dtypes, keep_cached=not refresh)
    return [_PEAKS[p] for p in paths]


def probe_peaks(device: str, dtypes: tuple[torch.dtype, ...], *, keep_cached: bool = True) -> paired.Rounds:
    """PEAK_PROBES probes of each dtype, alternating (paired.measure_rounds: A, B, B, A, ...), each the best
    call of a matmul_rate probe at the size its first one found; each dtype's peak, the best of its probes,
    is cached and kept for this process where the measurement is not doubtful. A doubtful one does not
    replace a cached peak (keep_cached: a re-check); else it is this process's, with its doubt. Returns the
    rounds: gpt2/plan/precision_choice.py decides bf16 against fp32 from their pairs."""
    dtypes = tuple(dict.fromkeys(dtypes))
    sizes: dict[str, int | None] = {}

    def probe(d: torch.dtype):
        name = _name(d)

        def run() -> paired.Timing:
            rate = matmul_rate(
                device, d, budget_s=PEAK_PROBE_S, min_time_s=PEAK_MIN_MATMUL_S, n=sizes.get(name), fresh=True,
                cpu_time=True,
            )  # fmt: skip
            sizes.setdefault(name, rate.n)
            return paired.Timing(1.0 / rate.wall, 1.0 / (rate.cpu * torch.get_num_threads()))

        return run

    rounds = paired.measure_rounds({_name(d): probe(d) for d in dtypes}, PEAK_PROBES)
    others = {_name(d) for d in dtypes}
    for d in dtypes:
        name, key = _name(d), peak_key(device, d)
        path = peak_cache_path(key)
        rates = [1.0 / s for s in rounds.seconds(name)]
        walls = [1.0 / t.wall_s for t in rounds.times[name]]
        peak = max(walls)
        doubt = rounds.load.busy()
        if doubt is None and paired.spread(rates) > paired.MAX_SPREAD:
            doubt = f"its probes scatter by {paired.spread(rates):.0%} (more than {paired.MAX_SPREAD:.0%})"
        if doubt is None and peak > (1 + paired.MAX_SPREAD) * statistics.median(walls):  # one lucky window
            doubt = f"its best probe is {peak / statistics.median(walls):.2f}x their median"
        if doubt is None and d == torch.float32 and peak < CPU_PEAK_FLOOR_PER_THREAD * key["threads"]:
            doubt = f"below {CPU_PEAK_FLOOR_PER_THREAD / 1e9:g} GFLOP/s per thread"
        beside = sorted(others - {name})
        how = f"the best of {len(walls)} {name} matmul probes (n={sizes.get(name)}" + (
            f", alternating with {', '.join(beside)}'s)" if beside else ")"
        )
        measured = f"{how}, measured now at {rounds.load.describe()}"
        if doubt is None:
            cpu = [1.0 / t.cpu_s for t in rounds.times[name]]
            values = {"flop_s": peak, "probes_flop_s": walls, "probes_cpu_flop_s": cpu, "n": sizes.get(name)}
            write_trusted_entry(path, key, {**values, "how": how}, rounds.load)
            _PEAKS[str(path)] = MeasuredPeak(peak, f"{measured}; cached in {path}")
            continue
        kept = _PEAKS.get(str(path))
        if keep_cached and (kept is None or kept.doubt is not None):
            kept, _ = _read_peak(device, d, count=False)
        if keep_cached and kept is not None and kept.doubt is None:  # a re-check on a busy machine
            restart_recheck(path, key)
            _PEAKS[str(path)] = MeasuredPeak(kept.flop_s, f"{kept.how} (its re-check now was doubtful: {doubt})")
        else:
            _PEAKS[str(path)] = MeasuredPeak(peak, f"{measured}; not cached: {doubt}", doubt)
    return rounds


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def read_trusted_entry(
    path: Path, key: dict, fields: tuple[str, ...], *, count: bool = True
) -> tuple[dict | None, bool]:
    """A cache entry for key that a measurement passing every check wrote (write_trusted_entry: an entry
    without that record, as every entry before issue 73, is None: measured again), and whether this read
    is its re-check (every paired.RECHECK_RUNS-th; count=False reads without counting this run)."""
    entry = read_cache_entry(path, key)
    if entry is None or entry.get("trusted") is not True or not isinstance(entry.get("load"), dict):
        return None, False
    if any(f not in entry for f in fields):
        return None, False
    if not count:
        return entry, False
    runs = entry.get("runs", 0)
    runs = (runs if isinstance(runs, int) else 0) + 1
    if runs >= paired.RECHECK_RUNS and paired.quiet_now():
        # Due, and the machine quiet enough for a re-check to count: under load it would be doubtful and keep
        # the entry anyway, after the probes' seconds; the count waits for a quiet start instead.
        return entry, True
    _rewrite(path, {**entry, "runs": runs})
    return entry, False


def write_trusted_entry(path: Path, key: dict, values: dict, load: paired.Load) -> None:
    """values under key, marked as a measurement that may be cached, with the load it was measured under and
    its count of runs towards the next re-check (write_cache_entry)."""
    write_cache_entry(path, key, {**values, "load": load.to_dict(), "trusted": True, "runs": 0})


def restart_recheck(path: Path, key: dict) -> None:
    """A cached entry whose re-check was doubtful stays, counted from 0 again (a busy machine does not pay a
    measurement at every start)."""
    entry = read_cache_entry(path, key)
    if entry is not None:
        _rewrite(path, {**entry, "runs": 0})


def _rewrite(path: Path, entry: dict) -> None:
    with contextlib.suppress(OSError):
        atomic_write_text(path, json.dumps(entry, indent=1) + "\n")


def _read_peak(device: str, dtype: torch.dtype, *, count: bool = True) -> tuple[MeasuredPeak | None, bool]:
    """The cached peak (None: none, unreadable, doubtful or written before issue 73) and whether this read is
    its re-check (count: this run is counted towards it)."""
    key = peak_key(device, dtype)
    path = peak_cache_path(key)
    entry, due = read_trusted_entry(path, key, ("flop_s", "how"), count=count)
    try:
        if entry is None or not float(entry["flop_s"]) > 0:
            return None, False
        load = paired.Load.from_dict(entry["load"]).describe()
        how = f"{entry['how']}, measured {entry['measured']} at {load}; cached in {path}"
        return MeasuredPeak(float(entry["flop_s"]), how), due
    except (KeyError, TypeError, ValueError):
        return None, False
