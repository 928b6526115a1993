"""Model FLOPs, device peak FLOP/s and model FLOPs utilisation (MFU).

FLOPs follow the PaLM paper's convention (appendix B), which nanoGPT's `estimate_mfu` also uses, so
our MFU is comparable with the numbers people quote:

    flops_per_token = 6 * N + 12 * L * h * T

N counts every parameter except the lookup tables (config.lookup_tables): the learned position
embeddings (none with rope) and, when the LM head is untied, the token embedding. A tied token
embedding stays in because it is the LM head, whose matmul costs 2*V*h per token forward; untied,
the head's own weight is counted instead, so the untied head leaves the FLOPs (and MFU) unchanged.
The options' elementwise work (RoPE, QK-norm, ReLU^2, the logit softcap) is not counted, as GELU and
LayerNorm are not: the convention counts matmuls.

6 = 2 (multiply-add) * 3 (forward + the two backward matmuls). 12*L*h*T is attention's QK^T and
AV: 2 matmuls * 2 FLOPs * T*h per token per layer, times 3 for forward+backward. It counts the full
T x T score matrix although causal kernels skip half of it: the convention, not the kernel's work. With
--doc-attention the mask skips more (the pairs across documents): still counted, and the start-up says how much
at the data's own document lengths (within_document_share; gpt2/train/startup.py log_doc_attention_share).
Recomputation (activation checkpointing) is not counted: that is the "model" in MFU.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from gpt2.core.config import ModelConfig, lookup_tables, param_count, weight_shapes
from gpt2.core.precision import Precision
from gpt2.plan.matmul_peak import CPU_PEAK_FLOOR_PER_THREAD, REFRESH_PEAK_ENV, MeasuredPeak, measured_peaks

# Dense (no 2:4 sparsity) tensor-core peaks from NVIDIA's data sheets (for GeForce and RTX cards the
# architecture whitepapers' "with FP32 accumulate" rows, which training's matmuls use), FLOP/s.
# Matched against torch.cuda.get_device_name() on whole tokens, in order, so the more specific
# names come first: "L4" must not match "NVIDIA L40", nor "A10" "NVIDIA A100".
#   (tokens that must all appear in the name, {dtype: peak})
_GPU_PEAKS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    # Blackwell: NVIDIA's GB200 NVL72 / HGX B200 data sheet, "Individual Blackwell GPU Specifications",
    # whose tensor-core rows are with sparsity ("FP16/BF16 Tensor Core 5 | 4.5 PFLOPS", "TF32 Tensor
    # Core 2.5 | 2.2 PFLOPS"); dense is half. FP32 (no sparsity): 80 | 75 TFLOPS. The GB200's GPU runs
    # at up to 1,200 W, the HGX B200's at 1,000 W: hence two rows.
    (("GB200",), dict(bf16=2500e12, fp16=2500e12, tf32=1250e12, fp32=80e12)),
    (("B200",), dict(bf16=2250e12, fp16=2250e12, tf32=1100e12, fp32=75e12)),
    # Hopper
    (("H100", "PCIe"), dict(bf16=756e12, fp16=756e12, tf32=378e12, fp32=51.2e12)),
    (("H100", "NVL"), dict(bf16=835e12, fp16=835e12, tf32=418e12, fp32=60e12)),
    (("H200", "NVL"), dict(bf16=835e12, fp16=835e12, tf32=418e12, fp32=60e12)),  # sheet: 1671 / 835 sparse
    (("GH200",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),
    (("H200",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),
    (("H100",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),  # SXM ("H100 80GB HBM3")
    (("H800",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),
    # Ampere
    (("A100",), dict(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12)),
    (("A800",), dict(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12)),
    (("A40",), dict(bf16=149.7e12, fp16=149.7e12, tf32=74.8e12, fp32=37.4e12)),  # sheet: 149.7 | 299.4 sparse
    (("A10",), dict(bf16=125e12, fp16=125e12, tf32=62.5e12, fp32=31.2e12)),
    # AWS's A10G (G5 instances) has no public NVIDIA data sheet: these are the figures cloud
    # providers publish for it, which agree with 80 GA102 SMs at 1.71 GHz with GeForce-rate
    # FP32 accumulation (half the A10's tensor rate, a higher FP32 clock).
    (("A10G",), dict(bf16=70e12, fp16=70e12, tf32=35e12, fp32=35e12)),
    (("A6000",), dict(bf16=154.8e12, fp16=154.8e12, tf32=77.4e12, fp32=38.7e12)),  # "NVIDIA RTX A6000"
    # GA102 whitepaper, "with FP32 accumulate" (half the FP16-accumulate rate on GeForce)
    (("3090", "Ti"), dict(bf16=80e12, fp16=80e12, tf32=40e12, fp32=40e12)),
    (("3090",), dict(bf16=71e12, fp16=71e12, tf32=35.6e12, fp32=35.6e12)),
    # Ada Lovelace
    (("L40S",), dict(bf16=362e12, fp16=362e12, tf32=183e12, fp32=91.6e12)),
    # The L40 is the L40S's chip at half its FP32-accumulate tensor rate: sheet 181.05 | 362.1 sparse
    (("L40",), dict(bf16=181e12, fp16=181e12, tf32=90.5e12, fp32=90.5e12)),
    (("L4",), dict(bf16=121e12, fp16=121e12, tf32=60e12, fp32=30.3e12)),
    (("6000", "Ada"), dict(bf16=364.2e12, fp16=364.2e12, tf32=182.1e12, fp32=91.1e12)),  # "RTX 6000 Ada Generation"
    (("4090",), dict(bf16=165e12, fp16=165e12, tf32=82.6e12, fp32=82.6e12)),
    # Turing and Volta: no bf16 or TF32 tensor cores
    (("T4",), dict(fp16=65e12, fp32=8.1e12)),  # sheet: "mixed precision (FP16/FP32) 65 TFLOPS"
    (("V100S",), dict(fp16=130e12, fp32=16.4e12)),
    (("V100", "PCIe"), dict(fp16=112e12, fp32=14e12)),
    (("V100",), dict(fp16=125e12, fp32=15.7e12)),  # SXM2
)


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token: 6*N + 12*L*h*T (see the module docstring).

    N excludes the lookup tables (position embeddings; an untied token embedding); seq_len defaults to
    cfg.block_size.
    """
    T = cfg.block_size if seq_len is None else seq_len
    if not 0 < T <= cfg.block_size:
        raise ValueError(f"seq_len={seq_len} must be in [1, block_size={cfg.block_size}]")
    shapes = weight_shapes(cfg)
    n = param_count(cfg) - sum(math.prod(shapes[name]) for name in lookup_tables(cfg))
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * T


def recompute_flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """FLOPs per token that activation checkpointing adds: one more forward of every block in the backward,
    2 * (the blocks' parameters) + 4*L*h*T (attention's forward), in flops_per_token's convention. Not
    model FLOPs, so not in MFU. For gpt2 at T=1024 it is 24% of flops_per_token (gpt2-xl 32%): the blocks' third
    of their forward-and-backward, less where the LM head's matmul is a large share (small models)."""
    T = cfg.block_size if seq_len is None else seq_len
    blocks = sum(math.prod(s) for name, s in weight_shapes(cfg).items() if ".h." in f".{name}")
    return 2.0 * blocks + 4.0 * cfg.n_layer * cfg.n_embd * T


@dataclass(frozen=True)
class DocumentShare:
    """How much of causal attention --doc-attention keeps on some tokens (within_document_share)."""

    kept: float
    """Of causal attention's (query, key) pairs, the share within one document: what the mask keeps."""
    windows: int
    documents: int
    """EOTs in those windows: the documents that start there."""

    def skipped_of_counted(self, cfg: ModelConfig, seq_len: int | None = None) -> float:
        """Of the FLOPs per token MFU counts (flops_per_token), the share the mask skips: attention's 12LhT is
        counted as the full T x T, a causal kernel computes about half of it, the mask (1 - kept) of that half."""
        T = cfg.block_size if seq_len is None else seq_len
        return 12.0 * cfg.n_layer * cfg.n_embd * T / flops_per_token(cfg, T) * (1 - self.kept) / 2


def within_document_share(tokens, seq_len: int, eot: int) -> DocumentShare:
    """Of the causal (query, key) pairs of the windows of seq_len tokens cut from tokens at multiples of seq_len
    (the loader's windows start anywhere: the share over many is the same), the share within one document, a
    document starting at each eot (gpt2/model/documents.py): the attention --doc-attention's mask keeps, before
    FlexAttention's 128 x 128 block granularity (which computes a little more)."""
    import numpy as np

    n = len(tokens) // seq_len
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens hold no window of {seq_len}")
    windows = np.asarray(tokens[: n * seq_len]).reshape(n, seq_len)
    starts = windows == eot
    docs = np.cumsum(starts, axis=1)  # each token's document number within its window
    kept = 0
    for row in docs:  # a document of k tokens keeps k(k+1)/2 causal pairs
        k = np.bincount(row).astype(np.float64)
        kept += float((k * (k + 1) / 2).sum())
    return DocumentShare(kept / (n * seq_len * (seq_len + 1) / 2), n, int(starts.sum()))


def mfu(tokens_per_s: float, cfg: ModelConfig, peak: float, seq_len: int | None = None) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak, a fraction in [0, 1]."""
    if peak <= 0:
        raise ValueError(f"peak={peak} FLOP/s must be positive")
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak


def _name_tokens(gpu_name: str) -> set[str]:
    """'NVIDIA A100-SXM4-80GB' -> {'nvidia', 'a100', 'sxm4', '80gb'}: whole tokens, so that a
    short model name never matches inside a longer one."""
    return set(re.findall(r"[a-z0-9]+", gpu_name.lower()))


def mig_profile(gpu_name: str) -> str | None:
    """The MIG profile of a device name ('NVIDIA A100-SXM4-40GB MIG 1g.5gb' -> '1g.5gb'), or None."""
    m = re.search(r"\bMIG\s+(\S+)", gpu_name)
    return m.group(1) if m else None


def gpu_table_peak(gpu_name: str, dtype: torch.dtype, *, tf32: bool = False) -> float | None:
    """The data-sheet dense peak for a CUDA device name, or None if the GPU or dtype is not listed.

    A GPU without TF32 tensor cores (Turing, Volta) gets its fp32 peak for tf32. A MIG slice gets
    None: no MFU is claimed for it. Its name is the whole GPU's plus the profile, and scaling the
    GPU's peak by the slice's "g" count over 7 would still be wrong (an A100's 1g slice holds 14 of its
    108 SMs, and even 7g only 98): its peak is in no data sheet.
    """
    if mig_profile(gpu_name) is not None:
        return None
    name = str(dtype).removeprefix("torch.")
    key = Precision(name, name, tf32=tf32).key  # a dtype without a peak (int8): Precision's ValueError
    tokens = _name_tokens(gpu_name)
    for parts, peaks in _GPU_PEAKS:
        if all(p.lower() in tokens for p in parts):
            return peaks.get(key, peaks["fp32"] if key == "tf32" else None)
    return None


def device_peak_flops(device: torch.device | str, dtype: torch.dtype, *, tf32: bool) -> float | None:
    """Peak dense FLOP/s for matmuls in `dtype` on `device`, or None for a CUDA GPU (or dtype) the
    data-sheet table does not list.

    A CUDA GPU in the table gets its data-sheet number, what MFU is conventionally quoted against.
    An unlisted one gets None (callers show MFU as n/a), not a measured rate: a measured matmul
    rate is an achievable rate, below the data-sheet peak, so MFU against it would be inflated and
    not comparable with anyone else's. tf32: whether fp32 matmuls run on TF32 tensor cores (the run's
    TrainConfig.compute.tf32), passed rather than read back from torch's global state; for fp32 on CUDA it
    selects the TF32 peak.

    A CPU has no data sheet to compare with, so it gets its measured matmul peak (cpu_peak), measured
    or not doubtful: whether MFU may use it is gpt2/plan/resolve.py mfu_peak's question.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_table_peak(torch.cuda.get_device_name(device), dtype, tf32=tf32)
    return cpu_peak(device, dtype).flop_s


def cpu_peak(device: torch.device | str, dtype: torch.dtype) -> MeasuredPeak:
    """A CPU's measured matmul peak for a run in dtype, with how it was measured and, where the measurement
    was doubtful (a busy machine, scattered probes), why (`matmul_peak.measured_peaks`: the best of several
    probes, cached per machine where quiet). An autocast run's peak is the faster of its dtype's rate and
    fp32's: where bf16 is emulated, compiled kernels may compute in fp32, and MFU must be measured against
    the kernels that can actually run, so that it never exceeds 1."""
    return max(measured_peaks(str(device), (dtype, torch.float32)), key=lambda m: m.flop_s)


def format_flops(flop_s: float) -> str:
    """TFLOP/s with three significant digits and at least one decimal: '312.0', '0.151', '0.0123'.

    A CPU's peak is a fraction of a TFLOP/s: one decimal printed 150 GFLOP/s as "0.1" and a
    disturbed 40 GFLOP/s probe as "0.0"."""
    t = flop_s / 1e12
    if t <= 0:
        return f"{t:g} TFLOP/s"
    return f"{t:.{max(1, 2 - math.floor(math.log10(t)))}f} TFLOP/s"


def peak_problem(peak: float, device: torch.device | str, threads: int) -> str | None:
    """Why a peak cannot be used for MFU (a CPU probe below the sanity floor), or None."""
    if torch.device(device).type != "cpu" or peak >= CPU_PEAK_FLOOR_PER_THREAD * threads:
        return None
    return (
        f"the measured CPU matmul peak {format_flops(peak)} is below {CPU_PEAK_FLOOR_PER_THREAD / 1e9:g} "
        f"GFLOP/s per thread x {threads} thread(s): the probe was disturbed (a busy machine), so no MFU is "
        f"shown; it is not cached, the next run measures again ({REFRESH_PEAK_ENV}=1 forces it)"
    )


def doubtful_peak(peak: MeasuredPeak) -> str | None:
    """Why a measured CPU peak is not used for MFU (measured on a busy machine: MFU against it would swing
    with the load), or None."""
    if peak.doubt is None:
        return None
    return (
        f"the CPU matmul peak {format_flops(peak.flop_s)} is doubtful ({peak.how}), and MFU against it would "
        f"move with the load; a quieter start measures and caches it ({REFRESH_PEAK_ENV}=1 forces a measurement)"
    )


def checked_mfu(
    tokens_per_s: float, cfg: ModelConfig, peak: float, *, measured: bool = True, step_s: float | None = None
) -> tuple[float | None, str | None]:
    """(MFU, None), or (None, why) when the MFU is above 100%. Against a measured peak (a CPU's matmul
    probe, measured=True) the peak is then certainly wrong (the probe was slowed by another process), and
    any MFU against it would be too. Against a data-sheet peak (a GPU's) the peak is right and the step
    time is what is wrong: only that step's MFU is left out (step_s: its time, named in the reason)."""
    value = mfu(tokens_per_s, cfg, peak)
    if value <= 1.0:
        return value, None
    if not measured:
        took = f" in {step_s * 1000:.1f} ms" if step_s is not None else ""
        return None, (
            f"MFU {value:.0%} against the data-sheet peak of {format_flops(peak)} is impossible: this step's "
            f"time{took} was mis-measured, so its MFU is left out (the peak stays for the next steps)"
        )
    return None, (
        f"MFU {value:.0%} against a peak of {format_flops(peak)}: the peak is below what training "
        f"achieves, so it was measured on a busy machine; MFU is left out of this run, and a cached "
        f"CPU peak is dropped so that the next run measures it again"
    )
