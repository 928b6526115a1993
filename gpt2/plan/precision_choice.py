"""--dtype made a Precision (gpt2/core/precision.py): what `auto` picks on a device, an explicit name kept
with a note when auto would pick otherwise, and the warning for a dtype this device emulates. The start-up
(gpt2/plan/resolve.py), sampling, evaluation and the doctor ask here.

What `auto` picks, and why:
  CUDA with native bf16 (Ampere and newer): bfloat16. torch's `is_bf16_supported()` counts
      emulation by default (a T4 or V100 says True), so we ask with including_emulation=False:
      emulated bf16 is slow, inductor does not compile it, and the flash kernels need sm80.
  CUDA without it: float16 with a GradScaler. fp16 has tensor cores from Volta on, but only 5
      exponent bits: small gradients underflow to zero unless the loss is scaled up first.
  CPU: float32 at once when /proc/cpuinfo lists no bf16 instructions (avx512_bf16, amx_bf16, or
      Arm's bf16): bf16 is then emulated at 1/40 to 1/60 of the fp32 rate, and measuring would only
      risk a wrong pick on a loaded machine (another process can stall the fp32 timing). Otherwise
      bfloat16 only where the measured peaks (gpt2/plan/matmul_peak.py `peak_rates`) show bf16 matmuls at
      least CPU_BF16_MIN_SPEEDUP x faster than fp32 (AMX), else float32: the flag does not say how fast,
      and on an avx512_bf16 CPU without AMX bf16 ran at about half the fp32 rate.
"""

from __future__ import annotations

import torch

from gpt2.core.precision import DTYPES, Precision
from gpt2.plan import matmul_peak

CPU_BF16_MIN_SPEEDUP = 1.3
"""bf16 must beat fp32 by this much on a CPU for auto to pick it (a margin over measurement noise)."""


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
        low, fp32 = matmul_peak.peak_rates(str(device), (p.torch_dtype, torch.float32))
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
    bf16, fp32 = matmul_peak.peak_rates(str(device), (torch.bfloat16, torch.float32))
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
