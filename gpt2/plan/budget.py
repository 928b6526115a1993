"""The stop budget: how long a signalled stop needs (finish the step, wait for a background write,
write its own checkpoint), so SLURM's signal lead and torchrun's grace can be set from it.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt2.core.config import ModelConfig, param_count
from gpt2.plan.memory import optimizer_bytes

WRITE_BYTES_PER_S = 1e9
"""The write speed the SLURM stop budget assumes (docs/multinode.md, SLURM): 1 GB/s, a parallel filesystem's
share for one writer; measure yours (bench/checkpoint_stall.py prints it) and pass --write-gb-s."""
STOP_MARGIN_S = 30
"""Start-up of the save, the processes' exit and torchrun's own handling, on top of step and writes."""
REQUEUE_MARGIN_S = 30
"""Between torchrun's grace and the signal lead: the batch shell's `scontrol requeue` after it exits."""


def checkpoint_bytes(cfg: ModelConfig, optimizer: str = "adamw") -> int:
    """Bytes of a checkpoint: fp32 weights and the optimizer state (config, RNG and loader add KBs)."""
    return 4 * param_count(cfg) + optimizer_bytes(cfg, optimizer)


@dataclass(frozen=True)
class StopBudget:
    """What a stop signal needs before torchrun's grace runs out (gpt2/distributed/preempt.py, slurm/common.sh)."""

    checkpoint_bytes: int
    step_s: float
    write_bytes_per_s: float

    @property
    def writes_s(self) -> float:
        """A background write may just have started: the stop waits for it, then writes its own."""
        return 2 * self.checkpoint_bytes / self.write_bytes_per_s

    @property
    def grace_s(self) -> int:
        """TORCH_ELASTIC_SHUTDOWN_TIMEOUT at least: finish the step, both writes, a margin."""
        return int(-(-(self.step_s + self.writes_s + STOP_MARGIN_S) // 1))

    @property
    def lead_s(self) -> int:
        """sbatch --signal=B:USR1@lead at least: the grace, then the requeue."""
        return self.grace_s + REQUEUE_MARGIN_S
