"""--deterministic: the same losses, bit for bit, from two runs of one config on one machine.

Without it a GPU run is not bitwise repeatable: flash attention's backward and inductor's embedding
backward accumulate with atomics, whose order changes from run to run, and inductor may time kernel
variants on the device and keep the fastest, whose reduction order differs. That noise is small
(bf16 rounding), but it hides a resume that restored something wrongly (bench/resume_check.py). With
it on:
  - torch.use_deterministic_algorithms(True): flash/memory-efficient attention run their deterministic
    backward, scatter/index_put accumulate without atomics (inductor falls back to ATen's sorted
    version), and an op with no deterministic version raises instead of running silently;
  - CUBLAS_WORKSPACE_CONFIG=:4096:8: cuBLAS, which reads it when it makes its first handle (so it is
    set before CUDA's first use), keeps a fixed workspace per stream (deterministic split-K);
  - inductor's own deterministic mode where the installed torch has it (gpt2/core/compat.py): no
    on-device benchmarking that could pick a kernel with another reduction order.
Its cost is the slower backward of attention and of the embedding, and torch filling uninitialised
memory (torch.empty) with NaN: docs/training.md gives the measured step times.
"""

from __future__ import annotations

import os

import torch

from gpt2.core import compat

CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS's deterministic workspace setting (NVIDIA's docs: ':4096:8' or ':16:8', the smaller one slower)."""
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def enable() -> None:
    """Turn deterministic algorithms on for this process (before CUDA's first use: train_ddp.py calls it
    right after parsing its flags; the trainer's start-up again, which changes nothing then). ValueError
    naming the fix when CUBLAS_WORKSPACE_CONFIG is set to a value with which cuBLAS is not deterministic
    (torch would refuse at the first matmul)."""
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    if workspace not in CUBLAS_DETERMINISTIC:
        raise ValueError(
            f"--deterministic true: CUBLAS_WORKSPACE_CONFIG={workspace!r} does not make cuBLAS "
            f"deterministic: unset it (the run sets {CUBLAS_WORKSPACE_CONFIG}) or set it to one of "
            f"{' or '.join(CUBLAS_DETERMINISTIC)}"
        )
    torch.use_deterministic_algorithms(True)
    compat.inductor_deterministic()


def describe_determinism() -> str:
    """The start-up line: what this process's torch has set (not what was asked for)."""
    inductor = compat.inductor_deterministic_mode()
    return (
        f"deterministic torch.are_deterministic_algorithms_enabled() {torch.are_deterministic_algorithms_enabled()}, "
        f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG', 'unset')}, inductor's deterministic "
        f"mode {'on' if inductor else 'off' if inductor is not None else 'absent from this torch'}"
    )
