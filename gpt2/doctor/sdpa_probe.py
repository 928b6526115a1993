"""Which scaled-dot-product-attention kernel the model's attention runs on this device, found by running it.

`F.scaled_dot_product_attention` picks a backend per call (flash, memory-efficient, cuDNN, or the
unfused math path) from the device, dtype, shapes and flags, and falls back silently: a GPU that
"has flash attention" can still train on the math path (a head size it does not support, fp32 inputs,
a torch build without the kernel) at a fraction of the speed and with (B, nh, T, T) memory. So:

  1. each backend alone, `torch.nn.attention.sdpa_kernel([backend])`, on the model's own
     CausalSelfAttention (attn_impl sdpa) with q, k, v of its real shape (B, nh, T, hd) and dtype,
     forward and backward: whether it runs (else torch's reason), and how far its output and
     gradients are from the explicit softmax(QK^T)V computed in fp32 from the same inputs;
  2. the default dispatch, profiled: the aten operator it called names the backend (and on CUDA
     the kernels it launched are listed as evidence).
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch

from gpt2.core.config import ModelConfig
from gpt2.doctor.acceleration import attention_fwd_bwd, attention_inputs, max_difference
from gpt2.model.gpt import CausalSelfAttention

BACKENDS = (
    ("flash", "FLASH_ATTENTION"),
    ("memory-efficient", "EFFICIENT_ATTENTION"),
    ("cudnn", "CUDNN_ATTENTION"),
    ("math", "MATH"),
)
"""Our name for each torch.nn.attention.SDPBackend member tried alone, fastest kind first."""

FORWARD_OPS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (cpu)",
    "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math (mps)",
}
"""The aten operator each backend's forward is (torch's native_functions.yaml): what the profiler
records when `scaled_dot_product_attention` dispatches to it, on every device."""


def tolerance(dtype: torch.dtype) -> float:
    """Largest relative difference (max |kernel - fp32 reference| / max |reference|, per tensor) a
    correct kernel shows. The reference is computed in fp32 from the same (already rounded) inputs, so
    only the kernel's own rounding counts. fp32: reassociation alone, ~1e-6 (the CPU's flash kernel
    measured 3.4e-7 at the CPU check's shape, (4, 2, 64, 32)); 1e-4 leaves 100x. bf16/fp16: the kernels
    accumulate in fp32 but round the probabilities and the output to 16 bits, 2^-9 = 0.2% of a value
    (bf16), and sums of random-sign terms keep that relative size: measured 4.6e-3 (CPU flash) and
    2.6e-3 (math) at that shape in bf16; 3e-2 leaves 6x. A wrong mask or scale moves the output by its
    own magnitude: a relative difference near 1."""
    return 3e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


@dataclass(frozen=True)
class BackendTrial:
    """One backend tried alone."""

    name: str
    runs: bool
    reason: str = ""
    """Why it does not run here (torch's warning or error, one line)."""
    rel_diff: float | None = None
    """Its output's and gradients' largest relative difference from the fp32 explicit reference."""
    agrees: bool | None = None
    """rel_diff within the dtype's tolerance; None when it does not run."""


@dataclass(frozen=True)
class SdpaReport:
    device: str
    dtype: str
    shape: tuple[int, int, int, int]
    """(B, nh, T, hd) of q."""
    trials: list[BackendTrial]
    dispatched: list[str]
    """The backend(s) the default dispatch ran, from the profiled aten operators ([] if none matched)."""
    ops: list[str]
    """The profiled scaled_dot_product aten operators."""
    kernels: list[str]
    """On CUDA: the attention kernels launched (names containing attention/flash/fmha/cudnn)."""
    tolerance: float

    @property
    def problems(self) -> list[str]:
        """What a node check reports as failed: a kernel that runs but disagrees, or no dispatch seen."""
        bad = [
            f"{t.name} differs from the fp32 reference by {t.rel_diff:.1e} (tolerance {self.tolerance:.0e})"
            for t in self.trials
            if t.runs and t.agrees is False
        ]
        if not self.dispatched:
            bad.append(f"the profiler saw no known SDPA operator (ops: {self.ops or 'none'})")
        return bad

    def to_dict(self) -> dict:
        return asdict(self)


def backends_of_ops(op_names) -> list[str]:
    """The backends whose forward operator is among op_names (profiler event names), in first-seen order."""
    return list(dict.fromkeys(FORWARD_OPS[n] for n in op_names if n in FORWARD_OPS))


def first_line(text: str, limit: int = 200) -> str:
    line = next((s.strip() for s in str(text).splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def why_not(error: Exception, caught: list[warnings.WarningMessage]) -> str:
    """torch's reason a backend was refused: its own warning ("Flash attention requires ..."), which is
    more specific than the error that follows, else the error's first sentence ("No viable backend for
    scaled_dot_product_attention was found": what a CPU says of the CUDA-only kernels)."""
    reasons = [first_line(w.message) for w in caught if "attention" in str(w.message).lower()]
    return reasons[0] if reasons else first_line(error).split(". ")[0]


def try_backend(
    name: str,
    member: str,
    attn: CausalSelfAttention,
    inputs: tuple[torch.Tensor, ...],
    reference: list[torch.Tensor],
    tol: float,
) -> BackendTrial:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, member, None)
    if backend is None:
        return BackendTrial(name, False, f"this torch has no SDPBackend.{member}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]):
                got = attention_fwd_bwd(attn, *inputs)
        except RuntimeError as e:
            return BackendTrial(name, False, why_not(e, caught))
    rel = relative_difference(got, reference)
    return BackendTrial(name, True, rel_diff=rel, agrees=rel <= tol)


def relative_difference(got: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest over tensors of max |got - reference| / max |reference| (tiny references count as 1)."""
    return max(max_difference([g], [r]) / max(r.abs().max().item(), 1e-12) for g, r in zip(got, reference))


def profile_dispatch(
    attn: CausalSelfAttention, inputs: tuple[torch.Tensor, ...], device: torch.device
) -> tuple[list[str], list[str]]:
    """The scaled_dot_product aten operators and (CUDA) attention kernels of one default forward+backward."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        attention_fwd_bwd(attn, *inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    names = [e.name for e in prof.events()]
    ops = list(dict.fromkeys(n for n in names if n.startswith("aten::") and "scaled_dot_product" in n))
    kernels = []
    if device.type == "cuda":
        marks = ("attention", "flash", "fmha", "cudnn", "sdpa")
        kernels = list(
            dict.fromkeys(
                e.name
                for e in prof.events()
                if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
                and any(m in e.name.lower() for m in marks)
            )
        )
    return ops, kernels


def probe(cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype) -> SdpaReport:
    """Every backend alone and the default dispatch, on the model's attention at (batch, cfg) in dtype."""
    attn = CausalSelfAttention(cfg.replace(attn_impl="sdpa", dropout=0.0), 0).to(device)
    explicit = CausalSelfAttention(cfg.replace(attn_impl="explicit", dropout=0.0), 0).to(device)
    inputs = attention_inputs(cfg, batch, device, dtype)
    reference = attention_fwd_bwd(explicit, *(t.float() for t in inputs))
    tol = tolerance(dtype)
    trials = [try_backend(name, member, attn, inputs, reference, tol) for name, member in BACKENDS]
    ops, kernels = profile_dispatch(attn, inputs, device)
    q_shape = tuple(inputs[0].shape)
    return SdpaReport(
        str(device), str(dtype).removeprefix("torch."), q_shape, trials, backends_of_ops(ops), ops, kernels, tol
    )
