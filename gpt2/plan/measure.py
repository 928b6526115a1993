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


def resident_training_peak(
    cfg,
    micro_batch_size: int,
    *,
    dtype: str = "fp32",
    loss_impl: str = "chunked",
    compiled: bool = False,
    steps: int = 2,
    tuned_malloc: bool = True,
) -> int:
    """Bytes the process's resident set grows by while `steps` training steps of cfg run as the trainer runs
    them on a CPU: glibc told to return freed memory (gpt2.core.host_memory.return_freed_memory), AdamW
    (fused), autocast in dtype, `loss_impl`, torch.compile when compiled, the loss of
    `model(x, y, return_logits=False)`, backward, step, zero_grad(set_to_none=True).

    Measured from the resident set after a warm-up step of a 1-layer, 8-wide model on the same paths (the
    same dtype, loss and compilation), so what is counted is what this model and micro-batch add, not the
    libraries' first-use costs (threads, kernels, the compiler) that a plan leaves to its reserve. Run it in
    a fresh process: memory that earlier work freed but the process kept would be reused and not counted.
    Linux only (VmHWM, reset through /proc/self/clear_refs): elsewhere a RuntimeError. tuned_malloc=False
    leaves glibc's defaults (bench/plan_memory.py compares the two).
    """
    from gpt2.core import host_memory, precision
    from gpt2.core.config import ModelConfig
    from gpt2.model.gpt import GPT

    if tuned_malloc:
        host_memory.return_freed_memory()
    prec = precision.Precision.from_key(dtype)

    def train(model: torch.nn.Module, batch: int, n: int) -> None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        call = torch.compile(model) if compiled else model
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 50257, (2, batch, model.config.block_size), generator=gen)
        for _ in range(n):
            with prec.autocast("cpu"):
                _, loss = call(x, y, return_logits=False)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    train(
        GPT(ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=cfg.vocab_size), loss_impl=loss_impl),
        1,
        2,
    )
    if compiled:
        torch._dynamo.reset()
    start = host_memory.resident_bytes()
    if start is None or not host_memory.reset_resident_peak():
        raise RuntimeError("the resident peak is measured through /proc/self (Linux 4.0 or later)")
    train(GPT(cfg, loss_impl=loss_impl), micro_batch_size, steps)
    return host_memory.resident_peak_bytes() - start
