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
      risk a wrong pick on a loaded machine. Otherwise the flag does not say how fast (AMX runs bf16
      several times fp32's rate; some avx512_bf16 CPUs without it at about half), so bf16 and fp32
      matmuls are compared (cpu_dtype_choice): the paired probes of gpt2/plan/matmul_peak.py
      (probe_peaks, which also give MFU's peak), decided by gpt2/plan/paired.py. Where the pairs decide,
      the faster dtype; where they tie (within DTYPE_TIE) or disagree, the rule from the hardware: bf16
      where the CPU lists bf16 instructions, fp32 where /proc/cpuinfo cannot say. The verdict is cached
      only when the measurement was decided and quiet (issue 73: one lucky fp32 probe on a busy machine
      had made every later run train in the slower dtype).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from gpt2.core.precision import DTYPES, Precision
from gpt2.plan import matmul_peak, paired

DTYPE_TIE = 0.10
"""bf16 and fp32 matmul rates within 10% of each other are a tie on a CPU: the rule from the hardware decides
(bf16 where the CPU lists bf16 instructions: as fast by the matmuls, and its activations are half the size)."""


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
    flags = cpu_bf16_instructions()
    if flags is False:
        return (
            "float32",
            "this CPU has no bf16 instructions (/proc/cpuinfo: no avx512_bf16, amx_bf16 or bf16): bf16 would be "
            "emulated",
        )
    return cpu_dtype_choice(str(device), flags)


_CHOICES: dict[str, tuple[str, str]] = {}
"""cpu_dtype_choice's per-process answers, by cache file."""


def dtype_choice_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return matmul_peak.peak_cache_dir() / f"dtype-choice-{digest}.json"


def cpu_dtype_choice(device: str, flags: bool | None) -> tuple[str, str]:
    """(dtype name, reason) on a CPU that lists bf16 instructions or cannot say: bf16 against fp32 from paired
    matmul probes (matmul_peak.probe_peaks), the pairs' verdict or, undecided, the rule from the hardware;
    a decided verdict measured quietly is cached (with what it was decided from) and re-checked every
    paired.RECHECK_RUNS-th run; GPT2_DDP_REFRESH_PEAK=1 measures again. flags: whether /proc/cpuinfo lists
    bf16 instructions (cpu_bf16_instructions: True, or None where it cannot say)."""
    key = {**matmul_peak.peak_key(device, torch.bfloat16), "probe": "bf16-vs-fp32"}
    path = dtype_choice_path(key)
    if str(path) in _CHOICES:
        return _CHOICES[str(path)]
    refresh = matmul_peak.refresh_requested()
    fields = ("verdict", "bf16_flop_s", "fp32_flop_s")
    entry, due = (None, False) if refresh else matmul_peak.read_trusted_entry(path, key, fields)
    if entry is not None and not due:
        verdict, bf16, fp32 = paired.Comparison.from_dict(entry["verdict"]), entry["bf16_flop_s"], entry["fp32_flop_s"]
        source = f"measured {entry['measured']}, cached in {path}"
    else:
        rounds = matmul_peak.probe_peaks(device, (torch.bfloat16, torch.float32), keep_cached=not refresh)
        verdict = rounds.verdict("bfloat16", "float32", margin=DTYPE_TIE)
        bf16, fp32 = 1 / rounds.median_s("bfloat16"), 1 / rounds.median_s("float32")
        if (doubt := verdict.doubt()) is None:
            values = {"verdict": verdict.to_dict(), "bf16_flop_s": bf16, "fp32_flop_s": fp32}
            matmul_peak.write_trusted_entry(path, key, values, verdict.load)
            source = f"cached in {path}"
        elif entry is not None:  # a re-check on a busy machine keeps the quiet verdict
            matmul_peak.restart_recheck(path, key)
            verdict, bf16, fp32 = (
                paired.Comparison.from_dict(entry["verdict"]),
                entry["bf16_flop_s"],
                entry["fp32_flop_s"],
            )
            source = f"measured {entry['measured']}, cached in {path}; its re-check now was doubtful: {doubt}"
        else:
            source = f"not cached: {doubt}; the next run measures again"
    _CHOICES[str(path)] = dtype_from(verdict, bf16, fp32, flags, source)
    return _CHOICES[str(path)]


def dtype_from(
    verdict: paired.Comparison, bf16: float, fp32: float, flags: bool | None, source: str
) -> tuple[str, str]:
    """(dtype name, reason) from bf16's verdict against fp32 (A: bf16) and their median FLOP/s."""
    measured = (
        f"CPU matmuls measured at bf16 {bf16 / 1e9:.1f} vs fp32 {fp32 / 1e9:.1f} GFLOP/s (medians of "
        f"{verdict.pairs} paired probes): {verdict.describe('bf16', 'fp32')}"
    )
    if verdict.winner is not None:
        pick = "bfloat16" if verdict.winner == "a" else "float32"
        return pick, f"{measured}: {'bf16' if pick == 'bfloat16' else 'fp32'} is faster; {source}"
    if flags:
        return "bfloat16", f"{measured}: undecided, so the hardware's rule: this CPU lists bf16 instructions; {source}"
    return "float32", f"{measured}: undecided, and /proc/cpuinfo does not say bf16 is native: fp32; {source}"


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
