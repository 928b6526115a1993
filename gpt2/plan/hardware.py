"""The devices the planner knows: the GPU table (memory, data-sheet name), custom hardware from flags,
this machine's device, and the byte formatting the reports share.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from gpt2.core import host_memory
from gpt2.core.precision import Precision
from gpt2.plan.flops import gpu_table_peak

GIB = 1024**3


# CUDA context, cuBLAS/NCCL workspaces and allocator fragmentation: memory a run never gets.
CUDA_RESERVE_BYTES = 2 * GIB


# Memory as torch.cuda.get_device_properties().total_memory reports it (a little under the label),
# and the data-sheet name flops.gpu_table_peak() matches.
GPUS: dict[str, tuple[float, str]] = {
    "A100-40GB": (39.4 * GIB, "NVIDIA A100-SXM4-40GB"),
    "A100-80GB": (79.1 * GIB, "NVIDIA A100-SXM4-80GB"),
    "H100-80GB": (79.1 * GIB, "NVIDIA H100 80GB HBM3"),
    "H200": (139.8 * GIB, "NVIDIA H200"),
    # A 24 GB card. 23.99 GiB is what CUDA reports as its total memory ("NVIDIA GeForce RTX 4090 (sm_89,
    # 22.434 GiB / 23.988 GiB available)", github.com/pc2/GPUInspector.jl/issues/11); its peak is the Ada
    # whitepaper's FP32-accumulate rate in gpt2/plan/flops.py (165 TFLOP/s bf16).
    "RTX4090-24GB": (23.99 * GIB, "NVIDIA GeForce RTX 4090"),
}


@dataclass(frozen=True, kw_only=True)
class Hardware:
    name: str
    """Shown in the summary."""
    memory_bytes: int
    """Total device memory of one GPU (for a CPU run: host RAM). On CUDA it also sizes the loss's
    chunks, as gpt2.model.loss.loss_chunk_logits does from the device's total_memory."""
    peak_flops: float | None
    """Dense peak FLOP/s of one device in the plan's dtype; None for a GPU without a data-sheet
    peak (gpt2.plan.flops.device_peak_flops), which leaves the time estimates out."""
    device_type: str = "cuda"
    """'cuda' or 'cpu': autocast keeps different ops in fp32 on each."""
    reserve_bytes: int = CUDA_RESERVE_BYTES
    """Memory the run cannot use (CUDA context, workspaces, fragmentation; on a CPU the libraries' own
    first-use memory: threads, kernels, the compiler)."""
    available_bytes: int | None = None
    """A CPU run's share of what the host has free now (MemAvailable over the ranks on it), where it is
    known: other processes hold the rest of its RAM. None: the whole device is the run's (a GPU, or a plan
    made for other hardware)."""

    @property
    def usable_bytes(self) -> int:
        """What a plan may fill: the memory less the reserve, and no more than is free now, less the reserve."""
        usable = self.memory_bytes - self.reserve_bytes
        return usable if self.available_bytes is None else min(usable, self.available_bytes - self.reserve_bytes)


def gpu_hardware(name: str, prec: Precision) -> Hardware:
    """One of the GPUS by name, with its data-sheet peak in prec (its dtype, and TF32 for float32)."""
    memory, sheet_name = known_gpu(name)
    peak = gpu_table_peak(sheet_name, prec.torch_dtype, tf32=prec.tf32)
    return Hardware(name=name, memory_bytes=int(memory), peak_flops=peak)


def known_gpu(name: str) -> tuple[float, str]:
    if name not in GPUS:
        raise ValueError(
            f"unknown GPU {name!r}; choose one of {list(GPUS)} or give --gpu-memory-gb and --gpu-peak-tflops"
        )
    return GPUS[name]


def custom_hardware(
    gpu: str | None, prec: Precision, *, memory_gb: float | None = None, peak_tflops: float | None = None
) -> Hardware:
    """--gpu NAME and/or --gpu-memory-gb/--gpu-peak-tflops (which override the named GPU's figures):
    the device `python -m gpt2.plan` and `train_ddp.py --dry-run` plan for."""
    if gpu is None and memory_gb is None:
        raise ValueError("name a GPU (--gpu, one of " + ", ".join(GPUS) + ") or give --gpu-memory-gb")
    if memory_gb is not None and not memory_gb > 0 or peak_tflops is not None and not peak_tflops > 0:
        raise ValueError(f"--gpu-memory-gb {memory_gb} and --gpu-peak-tflops {peak_tflops} must be > 0")
    hw = gpu_hardware(gpu, prec) if gpu is not None else Hardware(name="custom", memory_bytes=0, peak_flops=None)
    return dataclasses.replace(
        hw,
        name="custom" if memory_gb is not None else hw.name,
        memory_bytes=int(memory_gb * GIB) if memory_gb is not None else hw.memory_bytes,
        peak_flops=peak_tflops * 1e12 if peak_tflops is not None else hw.peak_flops,
    )


def gpu_native_bf16(gpu: str | None) -> bool:
    """Whether a GPUS entry has bf16 tensor cores (its data sheet lists a bf16 peak); a custom GPU
    (None) is assumed to be Ampere or newer, like every GPU a GPT-2 run is planned on today."""
    return gpu is None or gpu_table_peak(known_gpu(gpu)[1], torch.bfloat16) is not None


def device_hardware(device: torch.device | str, peak_flops: float | None, *, processes_per_host: int = 1) -> Hardware:
    """The hardware a run is on: a CUDA device's memory, or for a CPU run this host's RAM shared
    by the processes_per_host ranks on it, and their share of what it has free now (MemAvailable), which
    is what a plan may fill (Hardware.usable_bytes)."""
    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Hardware(name=props.name, memory_bytes=props.total_memory, peak_flops=peak_flops)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = host_memory.available_bytes()
    return Hardware(
        name=f"cpu (1/{processes_per_host} of host RAM)" if processes_per_host > 1 else "cpu",
        memory_bytes=ram // processes_per_host,
        peak_flops=peak_flops,
        device_type="cpu",
        reserve_bytes=GIB // processes_per_host,
        available_bytes=None if free is None else free // processes_per_host,
    )


def usable_note(hw: Hardware) -> str:
    """What a plan's "usable" leaves out, in parentheses: the reserve, and on a CPU what is free now."""
    free = "" if hw.available_bytes is None else f"; {gib(hw.available_bytes)} free now, MemAvailable"
    return f"({gib(hw.reserve_bytes)} reserved{free})"


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"
