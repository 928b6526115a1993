"""The node check's environment section: devices, driver, CUDA, cuDNN, torch, NCCL, native bf16,
Triton or a C++ compiler, and what --dtype auto picks."""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import re
import shutil
import socket
import subprocess
from pathlib import Path

import torch

from gpt2.distributed.group import usable_cpus
from gpt2.doctor.context import Context
from gpt2.doctor.results import WARN, Section
from gpt2.doctor.sdpa_probe import first_line
from gpt2.plan import matmul_peak, precision_choice


def environment(ctx: Context) -> Section:
    s = Section("environment")
    if ctx.device.type == "cuda":
        cuda_rows(s)
    else:
        cpu_rows(s)
    s.info("torch", torch.__version__)
    s.info(
        "python, numpy, tiktoken",
        f"{platform.python_version()}, {package_version('numpy')}, {package_version('tiktoken')}",
    )
    prec = ctx.auto_precision()
    s.info("--dtype auto picks", f"{prec.dtype}: {prec.reason}")
    s.data.update(
        host=socket.gethostname(), torch=torch.__version__, python=platform.python_version(), auto_dtype=prec.to_dict()
    )
    return s


def cuda_rows(s: Section) -> None:
    n = torch.cuda.device_count()
    lines = [cuda_device_line(i) for i in range(n)]
    s.info("devices", "; ".join(f"{lines.count(x)} x {x}" for x in dict.fromkeys(lines)))
    driver = nvidia_driver_version()
    s.info("driver", driver or "unknown (no /proc/driver/nvidia/version, no nvidia-smi)")
    s.info("CUDA (torch build), cuDNN", f"{torch.version.cuda}, {torch.backends.cudnn.version()}")
    s.info("NCCL", nccl_version())
    native = [precision_choice.cuda_native_bf16(torch.device("cuda", i)) for i in range(n)]
    if all(native):
        s.info("native bf16", "yes")
    else:  # a working node, but not for the bf16 recipe: say so without failing it
        s.note("native bf16", f"no on {native.count(False)} of {n}: runs pick fp16 with a loss scaler", WARN)
    triton = triton_version()
    s.check("Triton (torch.compile's GPU kernels)", triton is not None, triton or "not importable")
    s.data.update(
        devices=lines,
        driver=driver,
        cuda=torch.version.cuda,
        cudnn=torch.backends.cudnn.version(),
        nccl=nccl_version(),
        native_bf16=native,
        triton=triton,
    )


def cpu_rows(s: Section) -> None:
    cpu = matmul_peak.peak_key("cpu", torch.float32)["cpu"]
    s.info("devices", f"cpu: {cpu}, {usable_cpus()} usable core(s); no CUDA device")
    flags = precision_choice.cpu_bf16_instructions()
    s.info(
        "bf16 instructions",
        {
            True: "yes (avx512_bf16 / amx_bf16 / bf16 in /proc/cpuinfo)",
            False: "no: bf16 would be emulated",
            None: "unknown",
        }[flags],
    )
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    s.check("C++ compiler (torch.compile's CPU kernels)", compiler is not None, compiler or "none on PATH")
    s.data.update(devices=[f"cpu: {cpu}"], usable_cpus=usable_cpus(), bf16_instructions=flags, cxx=compiler)


def cuda_device_line(index: int) -> str:
    p = torch.cuda.get_device_properties(index)
    return f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB)"


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def triton_version() -> str | None:
    """Triton's version, or None where it cannot be imported (its wheel is `triton` or `pytorch-triton`)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", "unknown version")


def nccl_version() -> str:
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return "not in this torch build"
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError) as e:
        return f"unknown ({first_line(e)})"


DRIVER_VERSION = re.compile(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b")


def parse_driver_version(text: str) -> str | None:
    """The driver's version from /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64 Kernel
    Module  550.54.15  ...") or nvidia-smi's csv output ("550.54.15")."""
    line = next((s for s in text.splitlines() if "NVRM" in s), text.strip().splitlines()[0] if text.strip() else "")
    m = DRIVER_VERSION.search(line)
    return m.group(1) if m else None


def nvidia_driver_version() -> str | None:
    """The kernel module's version file (no process started), else nvidia-smi; None if neither says."""
    with contextlib.suppress(OSError):
        found = parse_driver_version(Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        return parse_driver_version(out)
    return None
