"""The Plan of a run: memory per device, the largest micro-batch that fits, time estimates; a run's plan
(gpt2/plan/resolve.py, with its choices made) is what the trainer logs, --dry-run prints and
`python -m gpt2.plan` shows.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt2.core.config import ModelConfig, RunConfig, count_params_formula, param_count
from gpt2.core.precision import Precision
from gpt2.core.schedule import grad_accum_steps
from gpt2.plan.batch_choice import MicroBatchChoice
from gpt2.plan.flops import flops_per_token, recompute_flops_per_token
from gpt2.plan.hardware import Hardware, gib
from gpt2.plan.memory import Memory, does_not_fit, max_micro_batch_size, memory


@dataclass(frozen=True, kw_only=True)
class Plan:
    cfg: ModelConfig
    run: RunConfig
    """The run planned (cfg is its model), as the planner functions take it."""
    micro_batch_size: int
    seq_len: int
    world_size: int
    dtype: str
    hardware: Hardware
    total_batch_size: int
    """Tokens per optimizer step over all devices."""
    tokens: int | None
    """Training budget in tokens, or None."""
    mfu: float
    """Assumed model FLOPs utilisation for the time estimates."""
    n_params: int
    n_params_formula: int
    memory: Memory
    max_micro_batch_size: int
    """Largest micro-batch whose total fits in hardware memory minus its reserve (0 if none)."""
    flops_per_token: float
    parallel: str = "ddp"
    """ddp or fsdp (TrainConfig.distributed.parallel): what memory counts (Memory.shards)."""
    micro_batch_choice: MicroBatchChoice | None = None
    """--micro-batch-size auto's choice and its reason, where resolve made it; None: given."""
    recompute_flops_per_token: float = 0.0
    """With activation checkpointing (memory.checkpointed), the blocks' forward done again in the backward:
    work the device does, so in the time estimates, but not model FLOPs, so not in MFU."""

    @property
    def activation_checkpointing(self) -> bool:
        return self.memory.checkpointed

    @property
    def usable_bytes(self) -> int:
        return self.hardware.usable_bytes

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    @property
    def rs_total(self) -> int:
        """FSDP: the total with a reduce-scatter per micro-step instead of no-sync accumulation (only the
        shards kept between micro-steps); the total itself otherwise."""
        return self.memory.total - self.memory.accum_gradients

    @property
    def tokens_per_micro_step(self) -> int:
        """Over all devices."""
        return self.micro_batch_size * self.seq_len * self.world_size

    @property
    def grad_accum_steps(self) -> int:
        return grad_accum_steps(self.total_batch_size, self.micro_batch_size, self.seq_len, self.world_size)

    @property
    def tokens_per_s(self) -> float | None:
        """All devices together, at the assumed MFU; None without a peak. With activation checkpointing the
        assumed fraction of the peak also does the recompute, so the model's MFU is mfu * flops / (flops +
        recompute) (Plan.model_mfu)."""
        if self.hardware.peak_flops is None:
            return None
        return (
            self.world_size
            * self.hardware.peak_flops
            * self.mfu
            / (self.flops_per_token + self.recompute_flops_per_token)
        )

    @property
    def model_mfu(self) -> float:
        """The MFU a run at the assumed utilisation logs: model FLOPs only, recomputation not counted."""
        return self.mfu * self.flops_per_token / (self.flops_per_token + self.recompute_flops_per_token)

    @property
    def step_time_s(self) -> float | None:
        return None if self.tokens_per_s is None else self.total_batch_size / self.tokens_per_s

    @property
    def hours(self) -> float | None:
        if self.tokens is None or self.tokens_per_s is None:
            return None
        return self.tokens / self.tokens_per_s / 3600


def plan(
    cfg: RunConfig, hardware: Hardware, *, world_size: int = 1, tokens: int | None = None, mfu: float = 0.4
) -> Plan:
    """Memory per device, the largest micro-batch that fits, and time estimates of the run cfg (its
    micro-batch a number, its dtype not auto) on hardware at world_size. Pure arithmetic.

    cfg.train.batch.total_batch_size must be a multiple of micro_batch_size * block_size * world_size. The memory
    counts the loss path loss_impl names (chunked unless full; the largest micro-batch is always the chunked
    loss's, see choose_loss_impl) and the compilation (the full loss's peak differs, loss_bytes);
    activation_checkpointing full: every block recomputed in the backward (its memory and its extra FLOPs).
    tokens: the budget of the time estimates, or None; mfu: their assumed utilisation.
    """
    model, tc = cfg.model, cfg.train
    seq_len, micro_batch_size = model.block_size, tc.batch.micro_batch_size
    checkpointed = tc.compute.activation_checkpointing == "full"
    problems = _plan_problems(micro_batch_size, world_size, mfu, tokens)
    if problems:
        raise ValueError("invalid plan:\n  - " + "\n  - ".join(problems))
    grad_accum_steps(tc.batch.total_batch_size, micro_batch_size, seq_len, world_size)  # whole, else its error
    return Plan(
        cfg=model,
        run=cfg,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        world_size=world_size,
        dtype=Precision.of_config(tc.compute, hardware.device_type).key,
        hardware=hardware,
        total_batch_size=tc.batch.total_batch_size,
        tokens=tokens,
        mfu=mfu,
        n_params=param_count(model),
        n_params_formula=count_params_formula(model),
        memory=memory(cfg, hardware, world_size=world_size),
        flops_per_token=flops_per_token(model, seq_len),
        parallel=tc.distributed.parallel,
        recompute_flops_per_token=recompute_flops_per_token(model, seq_len) if checkpointed else 0.0,
        max_micro_batch_size=max_micro_batch_size(cfg, hardware, world_size=world_size),
    )


def _plan_problems(micro_batch_size, world_size, mfu, tokens) -> list[str]:
    p = []
    if not isinstance(micro_batch_size, int):
        p.append(f"micro_batch_size={micro_batch_size!r} must be a number (gpt2/plan/resolve.py settles auto)")
    elif micro_batch_size < 1:
        p.append(f"micro_batch_size={micro_batch_size} must be >= 1")
    if world_size < 1:
        p.append(f"world_size={world_size} must be >= 1")
    if not 0 < mfu <= 1:
        p.append(f"mfu={mfu} must be a fraction in (0, 1], e.g. 0.4")
    if tokens is not None and tokens < 1:
        p.append(f"tokens={tokens} must be positive")
    return p


def check_fits(p: Plan) -> None:
    """Refuse a plan that clearly cannot fit (total above the device's whole memory).

    A plan that only overflows the reserve is allowed: the reserve is an estimate and the run
    finds out at its first step.
    """
    if p.memory.total <= p.hardware.memory_bytes:
        return
    if p.max_micro_batch_size == 0:
        raise ValueError(does_not_fit(p.run, p.hardware, world_size=p.world_size))
    b = p.max_micro_batch_size
    fix = f"use --micro-batch-size {b} or less (auto: the largest that fits and divides)"
    accumulating = max_micro_batch_size(p.run, p.hardware, world_size=p.world_size, accumulate=True)
    if accumulating < b:  # fsdp: b is the micro-batch without accumulation, which keeps no no-sync gradients
        fix = f"use --micro-batch-size {b} (one micro-step: no unsharded gradients kept)" + (
            f" or, accumulating, {accumulating} or less"
            if accumulating
            else ": with accumulation not even 1 fits (FSDP's no-sync keeps the whole model's gradients unsharded)"
        )
    per_total = b * p.seq_len * p.world_size
    if p.total_batch_size % per_total == 0 and p.total_batch_size > per_total:
        fix += f" (the same total batch with {p.total_batch_size // per_total} accumulation steps)"
    raise ValueError(
        f"micro_batch_size={p.micro_batch_size} needs {gib(p.memory.total)} per device "
        f"but {p.hardware.name} has {gib(p.hardware.memory_bytes)}; {fix}"
    )
