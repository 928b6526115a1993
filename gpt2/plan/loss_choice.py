"""--loss-impl auto: the full-logits loss or the chunked one, for a micro-batch already chosen."""

from __future__ import annotations

from dataclasses import dataclass

from gpt2.core.config import RunConfig
from gpt2.core.precision import Precision
from gpt2.plan.hardware import Hardware, gib
from gpt2.plan.memory import loss_bytes, memory

# --loss-impl auto takes the full-logits loss when its peak (loss_bytes(chunked=False)) is at most
# 1/FULL_LOSS_MEMORY_SHARE of the device's usable memory and the whole plan with it still fits.
# Why a share at all, when "the plan fits" is also checked: the full path's peak is four (B, T, V)
# tensors made and freed every micro-step, the largest single term of the plan, so an error in the
# estimate or the allocator's fragmentation around such blocks costs most there; a CPU's "device"
# is host RAM that the page cache, the data loader and other processes share. At 1/8 an estimate
# wrong by a whole (B, T, V) fp32 tensor (a quarter of the fp32 peak) costs at most 1/32 of the
# memory, and 7/8 stays for everything else. Why not less: at 1/16 the
# W1 workload (6 x 384, micro-batch 8 x 256, fp32: 1.54 GiB of full-logits peak as it was counted
# then, 6.8% of the 22.5 GiB a 23.5 GiB host leaves usable; 1.15 GiB as issue 41 counts eager's
# 12 bytes per logit) would have stayed chunked and paid the chunk loop's ~1.3x
# compiled LM-head time (issue 23, bench/lm_head_loss.py); 1/8 takes the full loss there and on the quick start, and
# keeps the chunked
# one where the logits are large, e.g. the gpt2 preset at 64 x 1024 under bf16 compiled (12.3 GiB,
# 16% of an 80 GB A100; at 16 x 1024 it is 3.1 GiB and takes nanoGPT's one fused cross-entropy, where
# eager's 12 bytes per logit, 9.2 GiB, is within the share too but runs uncompiled). Order: the micro-batch is
# chosen first (auto: the throughput model of gpt2/plan/batch_choice.py, which weighs the chunked
# loss's cost at each size by this rule, whatever --loss-impl asks), then the loss path for that
# micro-batch: this way --loss-impl never changes the micro-batch, so the two paths run the same batch
# maths and agree to rounding. Uncompiled runs
# (--compile false: the debug preset, the quick start) take the full loss where it fits only when
# it measured clearly faster on this CPU at the run's shape (gpt2/plan/loss_probe.py: faster at 384 wide,
# slower at 128 wide on one CPU; the crossover moves with the CPU); unmeasured, the chunked one.
FULL_LOSS_MEMORY_SHARE = 8
"""auto picks the full-logits loss when its peak is at most 1/FULL_LOSS_MEMORY_SHARE of usable memory."""


@dataclass(frozen=True)
class LossChoice:
    """The loss path a run takes ('full' or 'chunked') and why, as logged and written to config.json."""

    impl: str
    reason: str
    probe_bytes: int | None = None
    """On a CPU, the resident memory the loss probe (gpt2/plan/loss_probe.py) grew by when it ran in this
    start (a new shape on this machine; None: from its cache, or not probed). The plan line counts it: a
    user's peak resident set includes it."""

    def describe(self) -> str:
        """The start-up line."""
        what = (
            "full logits: F.cross_entropy over the (B, T, V) logits"
            if self.impl == "full"
            else "chunked: gpt2/model/loss.py's linear_cross_entropy, never all (B, T, V) logits at once"
        )
        return f"loss       {what} ({self.reason})"

    def to_dict(self) -> dict:
        return {"impl": self.impl, "reason": self.reason}


def choose_loss_impl(cfg: RunConfig, hardware: Hardware, *, world_size: int = 1, measure_eager=None) -> LossChoice:
    """The loss path for cfg's micro-batch, already chosen (see FULL_LOSS_MEMORY_SHARE), at world_size.
    Requested: cfg.train.compute.loss_impl, auto, chunked or full. Uncompiled (cfg.train.compute.compile), auto takes
    the full loss only where it also fits and measure_eager() (gpt2.plan.loss_probe.EagerLossTimes of this
    CPU at this shape, asked only then) found it clearly faster; with nothing to measure (None: a GPU, a
    rehearsal for other hardware), the chunked one. The memory counts the run's activation checkpointing.
    An explicit full that cannot fit the device's whole memory is refused, as check_fits refuses an
    explicit micro-batch (same threshold); one that only exceeds the share or the reserve is taken,
    and the reason says so."""
    tc = cfg.train
    requested, micro_batch_size, compiled = tc.compute.loss_impl, tc.batch.micro_batch_size, tc.compute.compile
    if requested == "chunked":
        return LossChoice("chunked", "--loss-impl chunked")
    if tc.compute.fp8_head and requested == "auto":
        requested = "full"  # the FP8 head multiplies the whole logits at once (gpt2/model/fp8.py)
    # What the full loss really holds: compiled, inductor's fused loss (COMPILED_FULL_LOSS_BYTES);
    # uncompiled, eager's several (B, T, V) tensors.
    full = RunConfig(cfg.model, tc.replace(loss_impl="full"))
    peak = loss_bytes(
        cfg.model,
        micro_batch_size * cfg.model.block_size,
        prec=Precision.of_config(tc.compute, hardware.device_type),
        chunked=False,
        compiled=compiled,
        device_type=hardware.device_type,
        fp8=tc.compute.fp8_head,
    )
    total = memory(full, hardware, world_size=world_size).total
    usable = hardware.usable_bytes
    share = usable // FULL_LOSS_MEMORY_SHARE
    logits = f"full-logits peak {gib(peak)} at micro-batch {micro_batch_size}"
    if requested == "full":
        if total > hardware.memory_bytes:
            raise ValueError(
                f"--loss-impl full: the plan with the {logits} needs {gib(total)} per device but "
                f"{hardware.name} has {gib(hardware.memory_bytes)}; use --loss-impl chunked (or "
                f"auto), or a smaller --micro-batch-size"
            )
        over = [] if peak <= share else [f"above the 1/{FULL_LOSS_MEMORY_SHARE} share auto allows"]
        over += [] if total <= usable else [f"plan {gib(total)} over the {gib(usable)} usable"]
        how = "--fp8-head" if tc.compute.fp8_head and tc.compute.loss_impl == "auto" else "--loss-impl full"
        return LossChoice("full", f"{how}; {logits}" + (f", {' and '.join(over)}" if over else ""))
    if peak > share:
        return LossChoice("chunked", f"auto: {logits} > 1/{FULL_LOSS_MEMORY_SHARE} of {gib(usable)} usable")
    if total > usable:
        return LossChoice(
            "chunked",
            f"auto: {logits} is within 1/{FULL_LOSS_MEMORY_SHARE} of {gib(usable)} "
            f"usable but the plan with it, {gib(total)}, does not fit",
        )
    fits = f"{logits} <= 1/{FULL_LOSS_MEMORY_SHARE} of {gib(usable)} usable, plan with it {gib(total)} fits"
    if not compiled:
        if measure_eager is None:
            return LossChoice(
                "chunked",
                f"auto: uncompiled and not measured on {hardware.name}, the chunked loss "
                "(the faster one uncompiled at small widths: bench/README.md, Eager loss)",
            )
        eager_times = measure_eager()
        probed = eager_times.peak_bytes
        if not eager_times.full_is_faster:
            return LossChoice("chunked", f"auto: uncompiled, {eager_times.describe()}", probed)
        return LossChoice("full", f"auto: {fits}; uncompiled, {eager_times.describe()}", probed)
    return LossChoice("full", f"auto: {fits}; the faster path compiled")
