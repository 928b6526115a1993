"""A measured peak: the bytes a function allocates at its peak (CUDA's allocator, or the CPU allocator's
events through torch.profiler), what the tests and benchmarks check the memory model against.
"""

from __future__ import annotations

import contextlib
import os

import torch

from gpt2.core.precision import FLOAT32, Precision


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


def train_steps(model: torch.nn.Module, batch: int, steps: int, *, prec: Precision, compiled: bool = False) -> None:
    """`steps` training steps of model as the trainer takes them on a CPU: fused AdamW, autocast in dtype, the
    loss of `model(x, y, return_logits=False)` on random tokens, backward, the gradients' norm clipped in one
    foreach pass, step, zero_grad(set_to_none=True); torch.compile first when compiled."""
    from gpt2.model.gpt import GPT2_VOCAB_SIZE

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    call = torch.compile(model) if compiled else model
    gen = torch.Generator().manual_seed(0)
    vocab = min(model.config.vocab_size, GPT2_VOCAB_SIZE)  # the padded rows are never a target
    x, y = torch.randint(0, vocab, (2, batch, model.config.block_size), generator=gen)
    for _ in range(steps):
        with prec.autocast("cpu"):
            _, loss = call(x, y, return_logits=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)


def warm_up(cfg, *, prec: Precision = FLOAT32, loss_impl: str = "chunked", compiled: bool = False) -> None:
    """Two training steps of a 1-layer, 8-wide model like cfg (its vocabulary, attention, bias) on a run's paths
    (dtype, loss, compilation): what the libraries load and keep on first use is then in the process, not what
    a real model of cfg adds. On a CPU that is tens of MiB of resident memory a plan of tensors does not count:
    torch.optim imports torch._dynamo (~25 MiB of Python objects), and each op's code is paged in from libtorch
    when it first runs (~20 MiB of file-backed pages over a debug-preset run's first step). The trainer warms up
    so before it reads what the process holds (gpt2/train/startup.py check_memory), as resident_training_peak
    does before it measures."""
    from gpt2.model.gpt import GPT

    # Two layers with value embeddings: one table is the most a 1-layer model could not have.
    layers = 2 if cfg.value_embeds else 1
    tiny = cfg.replace(
        n_layer=layers, n_head=1, n_kv_head=None, n_embd=8, block_size=8, dropout=0.0, value_embeds=layers // 2
    )
    with torch.random.fork_rng(devices=[]):  # the run's random numbers are not the warm-up's
        torch.manual_seed(0)
        train_steps(GPT(tiny, loss_impl=loss_impl), 1, 2, prec=prec, compiled=compiled)


def resident_training_peak(
    cfg,
    micro_batch_size: int,
    *,
    prec: Precision = FLOAT32,
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
    leaves glibc's defaults (bench/README.md has the two compared, by bench/plan_memory.py, removed after a823994).
    """
    from gpt2.core import host_memory
    from gpt2.model.gpt import GPT

    if tuned_malloc:
        host_memory.return_freed_memory()
    warm_up(cfg, prec=prec, loss_impl=loss_impl, compiled=compiled)
    if compiled:
        torch._dynamo.reset()
    start = host_memory.resident_bytes()
    if start is None or not host_memory.reset_resident_peak():
        raise RuntimeError("the resident peak is measured through /proc/self (Linux 4.0 or later)")
    torch.manual_seed(0)
    train_steps(GPT(cfg, loss_impl=loss_impl), micro_batch_size, steps, prec=prec, compiled=compiled)
    return host_memory.resident_peak_bytes() - start
