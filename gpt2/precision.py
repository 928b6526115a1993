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
      bfloat16 only where a short measurement shows bf16 matmuls at least CPU_BF16_MIN_SPEEDUP x
      faster than fp32 (AMX), else float32: the flag does not say how fast, and on an avx512_bf16
      CPU without AMX bf16 ran at about half the fp32 rate.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""What a user may ask for; every name but auto is also what a run resolves to."""
SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""The planner's and the peak tables' names."""
CPU_BF16_MIN_SPEEDUP = 1.3
"""bf16 must beat fp32 by this much on a CPU for auto to pick it (a margin over measurement noise)."""


def torch_dtype(name: str) -> torch.dtype:
    if name not in SHORT_NAMES:
        raise ValueError(f"dtype={name!r} must be one of {tuple(SHORT_NAMES)}")
    return getattr(torch, name)


def autocast(dtype: str, device: torch.device | str):
    """The autocast context for a resolved dtype name (float32: none)."""
    device = torch.device(device)
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype(dtype))


def make_scaler(dtype: str, device: torch.device | str) -> torch.amp.GradScaler:
    """A GradScaler that is active for float16 only (disabled, its calls pass straight through)."""
    return torch.amp.GradScaler(torch.device(device).type, enabled=dtype == "float16")


@dataclass(frozen=True)
class Precision:
    """A resolved dtype and the reason it was chosen (logged, and written to config.json)."""
    requested: str
    dtype: str
    reason: str

    @property
    def short(self) -> str:
        return SHORT_NAMES[self.dtype]

    def to_dict(self) -> dict:
        return {"requested": self.requested, "dtype": self.dtype, "reason": self.reason}


def resolve(requested: str, device: torch.device | str) -> Precision:
    """auto -> the fast dtype for device (see the module docstring); an explicit name is kept."""
    if requested not in DTYPES:
        raise ValueError(f"dtype={requested!r} must be one of {DTYPES}")
    return decide(requested, *fast_dtype(torch.device(device)))


def decide(requested: str, best: str, why: str) -> Precision:
    """requested (auto or a dtype name) given the device's best dtype and the reason for it."""
    if requested == "auto":
        return Precision("auto", best, why)
    if requested == best:
        return Precision(requested, requested, f"requested ({why})")
    return Precision(requested, requested, f"requested; auto would pick {best} ({why})")


def emulation_warning(p: Precision, device: torch.device | str) -> str | None:
    """A warning when an explicit bfloat16 or float16 is emulated (slow) on this device, else None."""
    if p.requested == "auto" or p.dtype == "float32":
        return None
    device = torch.device(device)
    if device.type == "cuda":
        slow = p.dtype == "bfloat16" and not cuda_native_bf16(device)
    else:
        slow = matmul_rate(str(device), torch_dtype(p.dtype)) < matmul_rate(str(device), torch.float32)
    if not slow:
        return None
    best, why = fast_dtype(device)
    return (f"--dtype {p.dtype} is emulated or slower than float32 on this {device.type} and will run slowly; "
            f"--dtype auto would pick {best} ({why})")


def fast_dtype(device: torch.device) -> tuple[str, str]:
    """(dtype name, reason) of what this device trains fastest in, correctly."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if cuda_native_bf16(device):
            return "bfloat16", f"{name} has native bf16"
        return "float16", f"{name} has no native bf16: fp16 with a loss scaler"
    if cpu_bf16_instructions() is False:
        return "float32", "this CPU has no bf16 instructions (/proc/cpuinfo: no avx512_bf16, amx_bf16 or bf16): bf16 would be emulated"
    bf16, fp32 = matmul_rate(str(device), torch.bfloat16), matmul_rate(str(device), torch.float32)
    pick = "bfloat16" if bf16 >= CPU_BF16_MIN_SPEEDUP * fp32 else "float32"
    return pick, (f"CPU matmuls measured at bf16 {bf16 / 1e9:.1f} vs fp32 {fp32 / 1e9:.1f} GFLOP/s: "
                  f"{'bf16' if pick == 'bfloat16' else 'fp32'} is faster")


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


def matmul_rate(device: str, dtype: torch.dtype, *, budget_s: float = 0.25, min_time_s: float = 0.004,
                n: int | None = None, fresh: bool = False, cpu_time: bool = False) -> float | MatmulRate:
    """Best FLOP/s of a square matmul on device in dtype, measured within about budget_s.

    The size doubles from 128 until one matmul takes min_time_s (long enough for the timer and for
    the BLAS to reach its plateau) or reaches the largest useful size; then it is timed until the
    budget is spent and the best time taken. Bounded on any device and dtype: an emulated bf16
    matmul (1 GFLOP/s) stops growing at n=256, a fast one at 1024-2048 (CPU) or 8192 (GPU).
    With n, that size alone is timed (no search; one untimed call, then at least one timed call and
    more while the budget lasts): a fixed workload such as a benchmark's 2048^3.

    Cached per process by its arguments: the trainer, the planner and MFU share one measurement.
    fresh=True measures again and leaves the cache alone (benchmarks re-measure between their timed
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


def _measure_matmul(dev: torch.device, dtype: torch.dtype, budget_s: float, min_time_s: float,
                    n: int | None) -> MatmulRate:
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
    flops = 2.0 * size ** 3
    return MatmulRate(flops / wall, flops / max(cpu, 1e-9), size)
