"""Python's garbage collector at the same step on every rank (torchtitan's gc_freq).

Left to itself, Python collects when its allocation counters say so: at a different moment on each
rank, and a full collection of a process holding torch's hundreds of thousands of objects takes tens
of milliseconds. In a synchronous step every rank then waits for the one collecting (a straggler of
Python's making). Here: after start-up everything alive is frozen (gc.freeze: moved out of the
collector's sight, it is never scanned again), automatic collection is off, and every `interval`
steps each rank collects the young generations at the same step. docs/performance.md has the
measurement (bench/gc_spread.py, removed after a823994) that decided the default.
"""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def collect_at_steps(interval: int):
    """For the training loop: freeze what start-up made and turn automatic collection off (interval > 0),
    then put the collector back as it was. interval 0: Python's own collection, untouched."""
    if interval <= 0:
        yield
        return
    was_enabled = gc.isenabled()
    gc.collect()  # start-up's garbage goes now, not into the frozen generation
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was_enabled:
            gc.enable()


def collect_if_due(step: int, interval: int) -> bool:
    """After step `step`: collect the young generations when the step is a multiple of interval (every
    rank takes the same steps, so every rank collects at once). Returns whether it collected."""
    if interval <= 0 or step % interval:
        return False
    gc.collect(1)
    return True
