"""Model FLOPs, device peak FLOP/s and model FLOPs utilisation (MFU).

FLOPs follow the PaLM paper's convention (appendix B), which nanoGPT's `estimate_mfu` also uses, so
our MFU is comparable with the numbers people quote:

    flops_per_token = 6 * N + 12 * L * h * T

N counts every parameter except the learned position embeddings (a table lookup, no matmul); the
token embedding stays in because it is tied to the LM head, whose matmul costs 2*V*h per token
forward. 6 = 2 (multiply-add) * 3 (forward + the two backward matmuls). 12*L*h*T is attention's
QK^T and AV: 2 matmuls * 2 FLOPs * T*h per token per layer, times 3 for forward+backward. It counts
the full T x T score matrix although causal kernels skip half of it: the convention, not the
kernel's work. Recomputation (activation checkpointing) is not counted: that is the "model" in MFU.
"""

from __future__ import annotations

import torch

from gpt2.config import ModelConfig
from gpt2.precision import SHORT_NAMES, matmul_rate

# Dense (no 2:4 sparsity) tensor-core peaks from NVIDIA's data sheets, FLOP/s. Matched against
# torch.cuda.get_device_name() in order, so the more specific names come first.
#   (name substrings that must all appear, {dtype: peak})
_GPU_PEAKS: tuple[tuple[tuple[str, ...], dict[str, float]], ...] = (
    (("H100", "PCIe"), dict(bf16=756e12, fp16=756e12, tf32=378e12, fp32=51.2e12)),
    (("H100", "NVL"), dict(bf16=835e12, fp16=835e12, tf32=418e12, fp32=60e12)),
    (("GH200",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),
    (("H200",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),
    (("H100",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),  # SXM ("H100 80GB HBM3")
    (("H800",), dict(bf16=989e12, fp16=989e12, tf32=494e12, fp32=67e12)),
    (("A100",), dict(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12)),
    (("A800",), dict(bf16=312e12, fp16=312e12, tf32=156e12, fp32=19.5e12)),
    (("L40S",), dict(bf16=362e12, fp16=362e12, tf32=183e12, fp32=91.6e12)),
    (("L4",), dict(bf16=121e12, fp16=121e12, tf32=60e12, fp32=30.3e12)),
    (("A10",), dict(bf16=125e12, fp16=125e12, tf32=62.5e12, fp32=31.2e12)),
    (("4090",), dict(bf16=165e12, fp16=165e12, tf32=82.6e12, fp32=82.6e12)),
    (("V100",), dict(fp16=125e12, fp32=15.7e12)),  # no bf16 or TF32 tensor cores
)

_DTYPE_NAMES = {getattr(torch, name): short for name, short in SHORT_NAMES.items()}


def param_count(cfg: ModelConfig, *, include_position: bool = True) -> int:
    """Exact parameter count of `GPT(cfg)` (tied LM head counted once), for any head layout.

    Unlike `config.count_params_formula` this handles grouped-query attention and bias=False.
    """
    h, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    b = 1 if cfg.bias else 0
    qkv_out = h + 2 * cfg.n_kv_head * cfg.head_dim
    layer_norm = h + b * h
    attn = h * qkv_out + b * qkv_out + h * h + b * h
    mlp = h * 4 * h + b * 4 * h + 4 * h * h + b * h
    n = V * h + L * (2 * layer_norm + attn + mlp) + layer_norm
    return n + T * h if include_position else n


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None) -> float:
    """Training FLOPs (forward + backward) per token: 6*N + 12*L*h*T (see the module docstring).

    N excludes the position embeddings; seq_len defaults to cfg.block_size.
    """
    T = cfg.block_size if seq_len is None else seq_len
    if not 0 < T <= cfg.block_size:
        raise ValueError(f"seq_len={seq_len} must be in [1, block_size={cfg.block_size}]")
    n = param_count(cfg, include_position=False)
    return 6.0 * n + 12.0 * cfg.n_layer * cfg.n_embd * T


def mfu(tokens_per_s: float, cfg: ModelConfig, peak: float, seq_len: int | None = None) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak, a fraction in [0, 1]."""
    if peak <= 0:
        raise ValueError(f"peak={peak} FLOP/s must be positive")
    return tokens_per_s * flops_per_token(cfg, seq_len) / peak


def dtype_name(dtype: torch.dtype, *, tf32: bool = False) -> str:
    """'bf16', 'fp16', 'fp32' or (fp32 with TF32 matmuls) 'tf32'."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype={dtype} has no peak; use torch.bfloat16, torch.float16 or torch.float32")
    name = _DTYPE_NAMES[dtype]
    return "tf32" if name == "fp32" and tf32 else name


def gpu_table_peak(gpu_name: str, dtype: torch.dtype, *, tf32: bool = False) -> float | None:
    """The data-sheet dense peak for a CUDA device name, or None if the GPU or dtype is not listed."""
    key = dtype_name(dtype, tf32=tf32)
    for parts, peaks in _GPU_PEAKS:
        if all(p.lower() in gpu_name.lower() for p in parts):
            return peaks.get(key, peaks["fp32"] if key == "tf32" else None)
    return None


def device_peak_flops(device: torch.device | str, dtype: torch.dtype, *, tf32: bool | None = None) -> float:
    """Peak dense FLOP/s for matmuls in `dtype` on `device`.

    CUDA GPUs in the table get their data-sheet number (what MFU is conventionally quoted
    against); CPUs and unlisted GPUs get a measured matmul rate (`precision.matmul_rate`), an
    achievable peak rather than a theoretical one. For fp32 on CUDA, tf32=None reads torch's
    current matmul precision: with TF32 enabled the tensor-core TF32 peak applies.

    On a CPU an autocast run's peak is the faster of its dtype's rate and fp32's: where bf16 is
    emulated, compiled kernels may compute in fp32, and MFU must be measured against the kernels
    that can actually run, so that it never exceeds 1.
    """
    device = torch.device(device)
    if device.type == "cuda":
        if tf32 is None:
            tf32 = torch.get_float32_matmul_precision() != "highest"
        peak = gpu_table_peak(torch.cuda.get_device_name(device), dtype, tf32=tf32)
        if peak is not None:
            return peak
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return matmul_rate(str(device), dtype)
    return max(matmul_rate(str(device), dtype), matmul_rate(str(device), torch.float32))
