"""A measured peak: the bytes a function allocates at its peak (CUDA's allocator, or the CPU allocator's
events through torch.profiler), what the tests and benchmarks check the memory model against.
"""

from __future__ import annotations

import contextlib
import os

import torch


def measured_peak_bytes(fn, device: torch.device | str) -> int:
    """Peak bytes allocated while fn() runs, above what was allocated when it started.

    CUDA: the caching allocator's max_memory_allocated. CPU: the CPU allocator's own allocation
    and free events as torch.profiler records them (profile_memory=True), replayed in time order:
    real tensors and workspaces, transients included, unlike RSS (which also moves with glibc's
    caching and page faults) or the tensors saved for backward (which miss the transients).
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with _quiet_kineto(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak
KINETO_QUIET_LEVEL = "6"
"""Above kineto's highest log level, USDT (5): kineto (torch.profiler's backend) logs "USDT: ...
profiler_start" and "profiler_stop" to stderr on every profile, at a level above ERROR, so no level
keeps its errors and drops those lines."""
@contextlib.contextmanager
def _quiet_kineto():
    """KINETO_LOG_LEVEL for the profiler's first start in this process, when kineto reads it once.

    Our profile only counts allocations, so kineto's own logging is noise to a user; a level the
    user set is left alone, and the variable is removed again afterwards.
    """
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = KINETO_QUIET_LEVEL
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)
