"""Precision, the value: a run's compute dtype, why it was chosen, and what follows from it (the torch
dtype, the autocast context, the loss scaler, the planner's and the peak tables' key). Made once from the
command line's --dtype (gpt2/plan/precision_choice.py decides `auto`; gpt2/plan/resolve.py records it) and
passed on as this type: nothing below the command line takes a dtype's name.

Weights, gradients and optimizer state stay fp32 in every mode. The dtype is what autocast runs
matmuls in; float32 runs no autocast. What `auto` picks, and why: gpt2/plan/precision_choice.py; the CPU
matmul peaks it measures and caches: gpt2/plan/matmul_peak.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

DTYPES = ("auto", "bfloat16", "float16", "float32")
"""What a user may ask for (--dtype); every name but auto is also what a run resolves to."""
SHORT_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
"""Each resolved dtype's short name: the planner's, the peak tables' and the log's."""
PLAN_DTYPES = ("bf16", "fp16", "fp32", "tf32")
"""The planner's keys (Precision.from_key): the short names, and tf32, float32 with TF32 matmuls (fp32
memory, the TF32 peak). bf16/fp16 are autocast over fp32 weights. `python -m gpt2.plan --dtype` takes these,
auto and the training spellings (PLAN_DTYPE_CHOICES)."""
PLAN_DTYPE_CHOICES = (*DTYPES, "tf32", *SHORT_NAMES.values())
"""`python -m gpt2.plan --dtype`: train_ddp.py's names (auto, bfloat16, float16, float32: float32 without TF32),
tf32, and the short names the planner took first (bf16, fp16, fp32), kept as aliases."""
AUTOCAST_DTYPES = ("bf16", "fp16")
"""The planner's dtypes that run matmuls in 16 bits under autocast."""


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
    autocasts: bool = field(init=False, repr=False, compare=False)
    """Matmuls in 16 bits under autocast (bfloat16, float16); float32 runs none. Derived, stored: the planner
    asks it for every micro-batch it sizes."""
    matmul_bytes: int = field(init=False, repr=False, compare=False)
    """Bytes per element of what autocast's matmuls take and give: the memory model's s."""

    def __post_init__(self) -> None:
        if self.dtype not in SHORT_NAMES:
            raise ValueError(f"dtype={self.dtype!r} must be one of {tuple(SHORT_NAMES)}")
        object.__setattr__(self, "autocasts", self.dtype != "float32")
        object.__setattr__(self, "matmul_bytes", 2 if self.autocasts else 4)

    @classmethod
    def of_config(cls, compute, device_type: str) -> Precision:
        """A resolved config's precision (its ComputeConfig, whose dtype is not auto) on a device type."""
        return cls(compute.dtype, compute.dtype, tf32=compute.tf32 and device_type == "cuda")

    @classmethod
    def from_key(cls, key: str) -> Precision:
        """The planner's name as a precision (`python -m gpt2.plan --dtype`, not auto): a short name, tf32
        (float32 with TF32) or a training spelling (float32 without TF32)."""
        if key in SHORT_NAMES:
            key = SHORT_NAMES[key]
        if key not in PLAN_DTYPES:
            raise ValueError(f"dtype={key!r} must be one of {PLAN_DTYPE_CHOICES[1:]}")
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


FLOAT32 = Precision("float32", "float32")
"""Plain float32 (no autocast, no scaler): what a caller without a run's precision evaluates in."""
BFLOAT16 = Precision("bfloat16", "bfloat16")
"""bf16 autocast over fp32 weights: what the planner assumes when a caller names no precision (a GPU's)."""
