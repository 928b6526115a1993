"""Each optimizer step's wall-clock time, right on every step: ordinary, evaluating, saving, stopping, last.

On CUDA the loop reads a step's numbers one step late (gpt2/train/trainer.py run_loop), and reads the
pending step and the current one back to back before a step's evaluation, checkpoint, stop or the end.
A host clock read at those reads times the second of the pair from a read moments before (~2 ms; the
H100 run's last step showed 278M tokens/s and an MFU of 24064%) and the step after it from two steps'
work. So the time is taken where the work is: a mark is made as each step is launched and as its last
kernel is queued. On CUDA a mark is an event on the stream, which the device reaches in order, so the
time between two marks is the device's timeline, idle gaps included (a host that cannot keep the
device fed shows in the step time, as it does in tokens/s). On a CPU each op has finished when it
returns, so a mark is the host's clock.

A step's time runs from the previous step's end mark to its own, so the loop's own work between steps
(logging, the late read, garbage collection) is counted; after work that is not a training step (an
evaluation, a sample, a checkpoint, a rollback, the compile cache sealed after the first step) it
runs from the step's own start mark, so none of that work is counted in it. The first step of a run is
timed from its own start (its compile included: what a user waits for).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class StepMarks:
    """One step's two marks: as its launch began and after its last kernel was queued; after_gap: work
    that is not a training step ran between the previous step's end and this step's start."""

    begin: object
    end: object
    after_gap: bool


class StepClock:
    """Marks on the device's own timeline (CUDA events) or the host's clock (CPU), and the seconds between
    two of them. `now` is the host clock (tests pass a fake one)."""

    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self.now = now
        self._previous_end: object | None = None  # the last step read's end mark
        self._gap = True  # the run's start: nothing to time the first step from but its own start

    def mark(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.now()

    def begin(self) -> tuple[object, bool]:
        """A step's start: its mark, and whether work other than training ran since the last step's end."""
        after_gap, self._gap = self._gap, False
        return self.mark(), after_gap

    def gap(self) -> None:
        """Work that is not a training step runs now, after the last step launched and before the next:
        the next step is timed from its own start."""
        self._gap = True

    def seconds(self, begin: object, end: object) -> float:
        """Seconds from mark `begin` to mark `end`. CUDA: waits for `end` alone (the step's last queued
        kernel: with the late read, the next step's kernels stay queued behind it)."""
        if self.cuda:
            end.synchronize()
            return begin.elapsed_time(end) / 1000
        return end - begin

    def step_seconds(self, marks: StepMarks) -> float:
        """A step's time; steps are read in step order. From the previous step's end mark where only
        training ran between them, else from the step's own start mark."""
        start = marks.begin if marks.after_gap or self._previous_end is None else self._previous_end
        self._previous_end = marks.end
        return self.seconds(start, marks.end)
