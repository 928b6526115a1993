"""Stragglers: each rank's own compute time per step, and the slowest rank named when it holds the others up.

The times ride the step's existing all-reduce of loss and flags (gpt2/train/trainer.py train_step):
the vector gets one slot per rank, each rank puts its own time in its own slot and zeros elsewhere,
and the sum is every rank's time on every rank. No new collective, world_size more floats in one.

A rank's own compute time: from the start of its step to the start of its last micro-step's backward.
That backward carries DDP's gradient all-reduce, where the fast ranks wait for the slow one, so a
time taken to the end of the step would be the same on every rank. On a CPU the host's clock is
the compute's; on CUDA the host runs ahead of the device, so two CUDA events bound the same span
and the newest completed pair is reported (a step or two late: never a wait for the device).

Test hook (tests only): GPT2_TEST_SLOW_RANK=R:S makes rank R sleep S seconds inside that span every step.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from gpt2.distributed.group import Dist

STRAGGLER_RATIO = 1.5
"""The slowest rank is named when its compute time is over 1.5x the other ranks' median. Every rank waits for the
slowest at the gradient all-reduce, so a rank 1.5x the median costs the whole group a third of its
step; smaller spreads are within what a shared or thermally throttled node shows from step to step."""

STRAGGLER_MIN_GAP_S = 0.02
"""...and over the median by at least 20 ms: tiny CPU steps (a few ms) double from scheduling noise alone."""

RECORD_EVERY_LOGS = 10
"""metrics.jsonl keeps every rank's time on every 10th log step (and whenever a rank is named)."""

SLOW_RANK_ENV = "GPT2_TEST_SLOW_RANK"


def slow_rank_hook(rank: int, env=None) -> tuple[float, float]:
    """The test hook GPT2_TEST_SLOW_RANK=R:S (rank R sleeps S seconds per step) or R:Fx (rank R takes F
    times its own compute time, whatever the machine's load): (seconds, factor) for this rank."""
    spec = (os.environ if env is None else env).get(SLOW_RANK_ENV, "")
    if not spec:
        return 0.0, 1.0
    try:
        who, amount = spec.split(":")
        if int(who) != rank:
            return 0.0, 1.0
        return (0.0, float(amount[:-1])) if amount.endswith("x") else (float(amount), 1.0)
    except ValueError:
        raise ValueError(
            f"{SLOW_RANK_ENV}={spec!r}: expected RANK:SECONDS or RANK:FACTORx, e.g. 1:0.5 or 1:4x (a test hook)"
        ) from None


class ComputeClock:
    """One rank's compute time per step: start() at the step's start, mark() before the last backward."""

    def __init__(self, dist: Dist, env=None) -> None:
        self.dist = dist
        self.delay_s, self.factor = slow_rank_hook(dist.rank, env)
        self._slept = 0.0
        self.cuda = dist.device.type == "cuda"
        self._t0 = 0.0
        self._seconds = 0.0
        self._events: list = []  # CUDA: (start, end) pairs not yet known complete, oldest first

    def start(self) -> None:
        if self.cuda:
            self._events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self._events[-1][0].record()
        else:
            self._t0 = time.perf_counter()
        if self.delay_s or self.factor != 1.0:  # the test hook: a slower rank, on purpose
            own = max(0.0, self._seconds - self._slept)
            self._slept = self.delay_s + (self.factor - 1.0) * own
            time.sleep(self._slept)

    def mark(self) -> None:
        if self.cuda:
            self._events[-1][1].record()
        else:
            self._seconds = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """This rank's newest known compute time (0.0 until one is known)."""
        if self.cuda:
            while self._events and self._events[0][1].query():  # completed: reading it does not wait
                start, end = self._events.pop(0)
                self._seconds = start.elapsed_time(end) / 1000
        return self._seconds

    def host_slots(self) -> list[float]:
        """world_size floats on the host: this rank's time in its own slot, zeros elsewhere (the trainer
        copies them to the device with its other host numbers, in one copy: train_step's host_numbers)."""
        out = [0.0] * self.dist.world_size
        out[self.dist.rank] = self.seconds()
        return out

    def slots(self) -> torch.Tensor:
        """host_slots() as a tensor on the device (a blocking copy on CUDA: the trainer uses host_slots)."""
        return torch.tensor(self.host_slots()).to(self.dist.device)


def others_median(times: list[float], rank: int) -> float:
    """The median of every rank's time but `rank`'s: at 2 ranks the other rank's own (the median of all
    two would be their mean, and a rank could never be more than 2x it)."""
    return statistics.median(times[:rank] + times[rank + 1 :])


def slowest(times: list[float]) -> tuple[int, float] | None:
    """(slowest rank, its time over the others' median) when it is a straggler by the thresholds above,
    else None. A pure function of the ranks' times; a zero (a time not known yet on CUDA) means no verdict."""
    if len(times) < 2 or min(times) <= 0:
        return None
    rank = max(range(len(times)), key=times.__getitem__)
    median = others_median(times, rank)
    ratio = times[rank] / median
    if ratio < STRAGGLER_RATIO or times[rank] - median < STRAGGLER_MIN_GAP_S:
        return None
    return rank, ratio


def straggler_line(step: int, times: list[float]) -> str | None:
    """The console's line on a log step when one rank holds the others up, else None."""
    found = slowest(times)
    if found is None:
        return None
    rank, ratio = found
    return (
        f"step {step:>6} | straggler: rank {rank} computes {times[rank] * 1000:.0f} ms, {ratio:.2f}x the median "
        f"{others_median(times, rank) * 1000:.0f} ms of the other {len(times) - 1} rank(s) (every rank waits for it "
        "at the "
        "gradient all-reduce); check that node's load, clocks and data reads"
    )


def times_record(step: int, times: list[float], log_index: int, named: bool) -> dict | None:
    """metrics.jsonl's record of every rank's time: every RECORD_EVERY_LOGS-th log step, or when named."""
    if len(times) < 2 or not (named or log_index % RECORD_EVERY_LOGS == 0):
        return None
    return {"step": step, "rank_compute_s": [round(t, 6) for t in times]}
