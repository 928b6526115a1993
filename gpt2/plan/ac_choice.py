"""--activation-checkpointing auto: recompute the blocks in the backward only where the run does not fit
without it.

The rule: full when, without it, no micro-batch fits (--micro-batch-size auto) or the explicit micro-batch's
plan does not fit (exceeds the device's memory less its reserve: the plan's "fits NO", e.g. gpt2-xl at
micro-batch 4 on an A100-40GB, 38.9 of 37.4 GiB usable), and with it the run fits; none otherwise. Why not also when
it merely allows a larger micro-batch: the recompute is one more
forward of every block, +24% of the step's FLOPs for gpt2 and +32% for gpt2-xl at T=1024
(recompute_flops_per_token), paid on every micro-step, while a larger micro-batch buys back only the
per-micro-step overheads. A micro-batch of one 1024-token sequence already gives matmuls 1024 rows tall,
and accumulation's extra micro-steps cost no extra FLOPs (DDP all-reduces once per step either way), so
those overheads are a few percent, well below the recompute. So auto never turns it on where a
micro-batch fits, and fixed-seed runs that fit are unchanged by the flag's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt2.core.config import RunConfig
from gpt2.plan.flops import flops_per_token, recompute_flops_per_token
from gpt2.plan.hardware import Hardware, gib
from gpt2.plan.memory import AUTO_HEADROOM, max_micro_batch_size, memory, sizing


@dataclass(frozen=True)
class ACChoice:
    """Whether a run checkpoints its blocks ('full' or 'none'), why, and what the recompute costs."""

    mode: str
    reason: str
    recompute_share: float = 0.0
    """Recomputed FLOPs over the model FLOPs per token (flops_per_token): not counted in MFU."""

    @property
    def on(self) -> bool:
        return self.mode == "full"

    def describe(self) -> str:
        """The start-up line."""
        if not self.on:
            return f"activation checkpointing none ({self.reason})"
        return (
            f"activation checkpointing full: every block recomputed in the backward, "
            f"+{self.recompute_share:.0%} FLOPs recomputed, not in MFU ({self.reason})"
        )

    def to_dict(self) -> dict:
        return {"mode": self.mode, "reason": self.reason, "recompute_share": self.recompute_share}


def choose_activation_checkpointing(cfg: RunConfig, hardware: Hardware, *, world_size: int = 1) -> ACChoice:
    """none or full for cfg.train.compute.activation_checkpointing (auto: the module docstring's rule) at world_size.
    Decided before the micro-batch (cfg.train.batch.micro_batch_size, a number or auto), which auto then sizes
    with the chosen activation memory."""
    model, requested, micro_batch_size = (
        cfg.model,
        cfg.train.compute.activation_checkpointing,
        cfg.train.batch.micro_batch_size,
    )
    seq_len = model.block_size
    share = recompute_flops_per_token(model, seq_len) / flops_per_token(model, seq_len)
    if requested == "none":
        return ACChoice("none", "--activation-checkpointing none")
    if requested == "full":
        return ACChoice("full", "--activation-checkpointing full", share)
    if micro_batch_size == "auto":  # with the margin --micro-batch-size auto keeps (AUTO_HEADROOM)
        without = max_micro_batch_size(cfg, hardware, world_size=world_size, checkpointed=False, headroom=AUTO_HEADROOM)
        if without:
            return ACChoice("none", f"auto: micro-batches up to {without} fit without it")
        with_ac = max_micro_batch_size(cfg, hardware, world_size=world_size, checkpointed=True, headroom=AUTO_HEADROOM)
        if not with_ac:
            return ACChoice("none", "auto: no micro-batch fits even with it")
        return ACChoice("full", f"auto: no micro-batch fits without it, up to {with_ac} with it", share)

    def total(checkpointed: bool) -> int:
        return memory(sizing(cfg), hardware, world_size=world_size, checkpointed=checkpointed).total

    at, usable = f"micro-batch {micro_batch_size}", hardware.usable_bytes
    if total(False) <= usable:
        return ACChoice("none", f"auto: {at} fits without it")
    if total(True) > usable:
        return ACChoice("none", f"auto: {at} needs {gib(total(True))} even with it, of {gib(usable)} usable")
    return ACChoice(
        "full",
        f"auto: {at} needs {gib(total(False))} without it, {gib(total(True))} with it, "
        f"of {gib(usable)} usable on {hardware.name}",
        share,
    )
