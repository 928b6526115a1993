"""The first step's measured memory against the plan: one warning line when it is far above.

The plan (gpt2/plan/memory.py) is held within PLAN_ERROR of the measured peak on the configurations its
test measures; a run outside them may hold something the plan does not count, and a larger micro-batch
chosen from that plan could then fail where the plan says it fits. So the trainer measures its first
step: on CUDA the allocator's peak (max_memory_allocated: tensors, as the plan counts them), on a CPU the
growth of the process's resident set since just before the model was built (the model, the evaluation
at step 0 and the first step; Linux only).

The CPU's peak is the kernel's high-water mark (VmHWM), which is never reset here: it is the number a user
reads (`/usr/bin/time -v`, a job's accounting), and resetting it hid the start-up's own peak (issue 58).
So the first step's growth is read only when it set a new high; below the high water the start-up left
(bounded: gpt2/plan/loss_probe.py PROBE_MAX_TOKENS), it is no news.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt2.core import host_memory
from gpt2.plan.hardware import gib
from gpt2.plan.memory import AUTO_HEADROOM


@dataclass
class MemoryWatch:
    planned: int
    """The plan's total per device (Plan.memory.total)."""
    slack: int
    """What the plan leaves to its reserve and may show in the measurement: the libraries' own memory."""
    device: torch.device
    base: int = 0
    """A CPU process's resident bytes before the model was built."""
    high: int = 0
    """A CPU process's high-water mark (VmHWM) then."""
    usable: bool = True

    @classmethod
    def start(cls, planned: int, slack: int, device: torch.device) -> MemoryWatch:
        """Call just before the model is built: on CUDA resets the allocator's peak (the process's own
        statistic), on a CPU notes the resident set and its high-water mark."""
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return cls(planned, slack, device, torch.cuda.memory_allocated(device))
        base, high = host_memory.resident_bytes(), host_memory.resident_peak_bytes()
        usable = base is not None and high is not None
        return cls(planned, slack, device, base or 0, high or 0, usable)

    def measured(self) -> int | None:
        """The peak since start(), above what was held then; None where it cannot be read or, on a CPU,
        where it stayed below the high-water mark of before start() (then it is at most that mark less
        what was held: no new high, nothing to warn of unless the start-up's own peak was)."""
        if not self.usable:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        peak = host_memory.resident_peak_bytes()
        return None if peak is None or peak <= self.high else peak - self.base

    def after_first_step(self) -> str | None:
        """The warning, when the first step's peak is above the plan's total x AUTO_HEADROOM plus the slack."""
        return far_above(self.measured(), self.planned, self.slack, self.device.type)


def far_above(measured: int | None, planned: int, slack: int, device_type: str) -> str | None:
    """One line when measured > planned x AUTO_HEADROOM + slack (the plan's margin and the reserve), else None."""
    if measured is None or measured <= planned * AUTO_HEADROOM + slack:
        return None
    what = "max_memory_allocated" if device_type == "cuda" else "the process's resident set grew by"
    return (
        f"memory: the first step peaked at {gib(measured)} ({what}), {measured / planned:.1f}x the plan's "
        f"{gib(planned)}: the plan misses something this run holds, and a micro-batch sized from it can run "
        "out of memory; pass a smaller --micro-batch-size and report this configuration (gpt2/plan/memory.py)"
    )
