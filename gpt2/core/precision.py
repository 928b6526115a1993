"""Precision: the compute dtypes, what `auto` picks on a device, and the autocast and loss scaler
each one implies. The trainer, sampling, evaluation, the planner and the benchmarks all ask here.

Weights, gradients and optimizer state stay fp32 in every mode. The dtype is what autocast runs
matmuls in; float32 runs no autocast.

What `auto` picks, and why:
  CUDA with native bf16 (Ampere and newer): bfloat16. torch's `is_bf16_supported()` counts
      emulation by default (a T4 or V100 says True), so we ask with including_emulation=False:
      emulated bf16 is slow, inductor does not compile it, and the flash kernels need sm80.
  CUDA without it: float16 with a GradScaler. fp16 has tensor cores from Volta on, but only 5
      exponent bits: small gradients underflow to zero unless the loss is scaled up first.
  CPU: float32 at once when /proc/cpuinfo lists no bf16 instructions (avx512_bf16, amx_bf16, or
      Arm's bf16): bf16 is then emulated at 1/40 to 1/60 of the fp32 rate, and measuring would only
      risk a wrong pick on a loaded machine (another process can stall the fp32 timing). Otherwise
      bfloat16 only where the measured peaks (`peak_rate`) show bf16 matmuls at least CPU_BF16_MIN_SPEEDUP x
      faster than fp32 (AMX), else float32: the flag does not say how fast, and on an avx512_bf16
      CPU without AMX bf16 ran at about half the fp32 rate.
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

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""What a user may ask for (--dtype); every name but auto is also what a run resolves to."""
SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""Each resolved dtype's short name: the planner's, the peak tables' and the log's."""
PLAN_DTYPES = ("bf16", "fp16", "fp32", "tf32")
"""The planner's dtypes (`python -m gpt2.plan --dtype`): the short names, and tf32, float32 with TF32
matmuls (fp32 memory, the TF32 peak). bf16/fp16 are autocast over fp32 weights."""
AUTOCAST_DTYPES = ("bf16", "fp16")
"""The planner's dtypes that run matmuls in 16 bits under autocast."""
CPU_BF16_MIN_SPEEDUP = 1.3
"""bf16 must beat fp32 by this much on a CPU for auto to pick it (a margin over measurement noise)."""


@dataclass(frozen=True)
class Precision:
    """A run's precision, made once (gpt2/plan/resolve.py, or of_config where a TrainConfig is at hand)
    and passed on: its dtype name as config.json and checkpoints keep it, why it was chosen, and what
    follows from it (torch dtype, autocast, loss scaler, the planner's and peak tables' key)."""

    requested: str
    """--dtype as given: auto or a dtype name."""
    dtype: str
    """The resolved name: 'bfloat16', 'float16' or 'float32'."""
    reason: str = ""
    tf32: bool = False
    """float32 matmuls on TF32 tensor cores (--tf32 on a CUDA device; a CPU has none)."""

    def __post_init__(self) -> None:
        if self.dtype not in SHORT_NAMES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {tuple(SHORT_NAMES)}")

    @classmethod
    def of_config(cls, tc, device_type: str) -> Precision:
        """A resolved TrainConfig's precision (tc.dtype is not auto) on a device type."""
        return cls(tc.dtype, tc.dtype, tf32=tc.tf32 and device_type == "cuda")

    @classmethod
    def from_key(cls, key: str) -> Precision:
        """The planner's name as a precision (`python -m gpt2.plan --dtype`): tf32 is float32 with TF32."""
        if key not in PLAN_DTYPES:
            raise ValueError(f"dtype={key!r} must be one of {PLAN_DTYPES}")
        name = "float32" if key == "tf32" else next(n for n, s in SHORT_NAMES.items() if s == key)
        return cls(name, name, tf32=key == "tf32")

    @property
    def torch_dtype(self) -> torch.dtype:
        """What matmuls run in (float32 for tf32 too: the tensor cores round its inputs)."""
        return getattr(torch, self.dtype)

    @property
    def short(self) -> str:
        """'bf16', 'fp16' or 'fp32', as the log says it."""
        return SHORT_NAMES[self.dtype]

    @property
    def key(self) -> str:
        """The planner's and the peak tables' name: short, or 'tf32' for float32 with TF32 matmuls."""
        return "tf32" if self.dtype == "float32" and self.tf32 else self.short

    def autocast(self, device: torch.device | str):
        """The autocast context (float32: none)."""
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(device).type, dtype=self.torch_dtype)

    def scaler(self, device: torch.device | str) -> torch.amp.GradScaler:
        """A GradScaler that is active for float16 only (disabled, its calls pass straight through)."""
        return torch.amp.GradScaler(torch.device(device).type, enabled=self.dtype == "float16")

    def to_dict(self) -> dict:
        """What config.json records (unchanged since before this type: old readers still parse it)."""
        return {"requested": self.requested, "dtype": self.dtype, "reason": self.reason}


def autocast(dtype: str, device: torch.device | str):
    """The autocast context for a resolved dtype name (float32: none): Precision.autocast."""
    return Precision(dtype, dtype).autocast(device)


def make_scaler(dtype: str, device: torch.device | str) -> torch.amp.GradScaler:
    """A GradScaler that is active for float16 only: Precision.scaler."""
    return Precision(dtype, dtype).scaler(device)


def resolve_precision(requested: str, device: torch.device | str, *, tf32: bool = False) -> Precision:
    """auto -> the fast dtype for device (see the module docstring); an explicit name is kept. tf32: the
    run's --tf32, which counts on a CUDA device only."""
    if requested not in DTYPES:
        raise ValueError(f"dtype={requested!r} must be one of {DTYPES}")
    device = torch.device(device)
    return decide(requested, *fast_dtype(device), tf32=tf32 and device.type == "cuda")


def decide(requested: str, best: str, why: str, *, tf32: bool = False) -> Precision:
    """requested (auto or a dtype name) given the device's best dtype and the reason for it."""
    if requested == "auto":
        return Precision("auto", best, why, tf32)
    if requested == best:
        return Precision(requested, requested, f"requested ({why})", tf32)
    return Precision(requested, requested, f"requested; auto would pick {best} ({why})", tf32)


def emulation_warning(p: Precision, device: torch.device | str) -> str | None:
    """A warning when an explicit bfloat16 or float16 is emulated (slow) on this device, else None."""
    if p.requested == "auto" or p.dtype == "float32":
        return None
    device = torch.device(device)
    if device.type == "cuda":
        slow = p.dtype == "bfloat16" and not cuda_native_bf16(device)
    else:
        low, fp32 = peak_rates(str(device), (p.torch_dtype, torch.float32))
        slow = low < fp32
    if not slow:
        return None
    best, why = fast_dtype(device)
    return (
        f"--dtype {p.dtype} is emulated or slower than float32 on this {device.type} and will run slowly; "
        f"--dtype auto would pick {best} ({why})"
    )


def fast_dtype(device: torch.device) -> tuple[str, str]:
    """(dtype name, reason) of what this device trains fastest in, correctly."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if cuda_native_bf16(device):
            return "bfloat16", f"{name} has native bf16"
        return "float16", f"{name} has no native bf16: fp16 with a loss scaler"
    if cpu_bf16_instructions() is False:
        return (
            "float32",
            "this CPU has no bf16 instructions (/proc/cpuinfo: no avx512_bf16, amx_bf16 or bf16): bf16 would be "
            "emulated",
        )
    bf16, fp32 = peak_rates(str(device), (torch.bfloat16, torch.float32))
    pick = "bfloat16" if bf16 >= CPU_BF16_MIN_SPEEDUP * fp32 else "float32"
    return pick, (
        f"CPU matmuls measured at bf16 {bf16 / 1e9:.1f} vs fp32 {fp32 / 1e9:.1f} GFLOP/s: "
        f"{'bf16' if pick == 'bfloat16' else 'fp32'} is faster"
    )


CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""x86 (AVX512-BF16, AMX) and Arm (FEAT_BF16) feature names in /proc/cpuinfo."""


def cpu_bf16_instructions(cpuinfo: str | None = None) -> bool | None:
    """Whether the CPU lists bf16 instructions; None where /proc/cpuinfo cannot say (not Linux)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    features = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            features.update(value.split())
    if not features:
        return None
    return bool(features & CPU_BF16_FLAGS)


def cuda_native_bf16(device: torch.device) -> bool:
    with torch.cuda.device(device):
        return torch.cuda.is_bf16_supported(including_emulation=False)


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
