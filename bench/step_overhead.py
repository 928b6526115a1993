"""The host's time per training step outside the model, ours against nanoGPT's ways, on any machine.

    python bench/step_overhead.py                      # ~1 minute, a CPU is enough
    python bench/step_overhead.py --data-dir .gpu/data

Why it matters: on a GPU the host queues the step's kernels while the device runs the ones before; when
the host's time per step passes the device's, the device waits. At GPT-2 124M and micro-batch 12 an H200
runs a step's kernels in ~26 ms and the compiled model's launches alone take most of that on the host,
so every millisecond the loop adds outside the model was a millisecond of the step (docs/performance.md,
"On a GPU": bench/gpu_profile.py measured it there). Rows, each the median over --reps calls, host
microseconds (on a CPU the tensors here are too small for their arithmetic to count):
  loader      one micro-batch of 12 x 1024 from warm shards: our TrainLoader.micro_batch (shuffled
              order, without replacement) against nanoGPT's get_batch (np.memmap, random windows,
              np.stack), the device copy left out (both pin and copy alike)
  clip        the gradient norm and clip over GPT-2 124M's 148 gradients (4 elements each: the
              bookkeeping, not the arithmetic): ours (fp64 sum, FSDP-aware) against torch's
              clip_grad_norm_, as nanoGPT calls it
  whole step  one optimizer step of a 12-layer model 2 wide at micro-batch 1 x 8 (a step whose
              arithmetic is nothing next to its bookkeeping): our trainer's step (Session, the
              numbers read one step late as its loop does) against nanoGPT's loop on the same model
              (forward, backward, clip_grad_norm_, fused AdamW where this torch has it, zero_grad,
              loss.item())
And one line under the table, counted, not timed: the bookkeeping ops per step, the aten ops (views
left out: they launch no kernel on a GPU) one steady-state train_step dispatches outside the model's
forward and backward and the optimizer's step and zero_grad, at one rank and no accumulation (the GPU
comparison's B=12 step), with the spike guard on (the default) and off; nanoGPT's loop has
clip_grad_norm_'s there. On a GPU each is a kernel launch the host must queue (bench/gpu_profile.py).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from corpus import add_corpus_flag, prepare_by_paragraph, require_corpus  # bench/corpus.py
from emit import emit  # bench/emit.py
from torch.utils._python_dispatch import TorchDispatchMode

from gpt2.core.schedule import BatchLayout
from gpt2.data.loader import TrainLoader, find_shards
from gpt2.distributed.fsdp import clip_grad_norm
from gpt2.distributed.group import single_process
from gpt2.model.gpt import GPT
from gpt2.train.session import Session, parse_config

B, T = 12, 1024
"""nanoGPT's micro-batch and block: the GPU comparison's shape."""
GPT2_GRADIENTS = 148
"""GPT-2 124M's parameter tensors (the tied embedding once): 2 embeddings, 12 x 12 per block, 2 for ln_f."""


def paired_median_us(ours, theirs, reps: int, warmup: int = 10) -> tuple[float, float]:
    """Each function's median time, the two called in turn (ours, theirs, ours, ...): the shared
    machine's load falls on both alike."""
    for _ in range(warmup):
        ours(), theirs()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((ours, times[0]), (theirs, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(times[0]) * 1e6, statistics.median(times[1]) * 1e6


def nanogpt_get_batch(shard: Path, rng: np.random.Generator, b: int = B, t: int = T):
    """nanoGPT's train.py get_batch on one shard (its memmap made anew per batch, as it does)."""

    def get():
        data = np.memmap(shard, dtype=np.uint16, mode="r", offset=256 * 4)
        ix = rng.integers(0, len(data) - t - 1, size=b)
        x = torch.stack([torch.from_numpy(data[i : i + t].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1 : i + 1 + t].astype(np.int64)) for i in ix])
        return x, y

    return get


def loader_row(data_dir: Path, reps: int) -> tuple[float, float]:
    shards = find_shards(data_dir, "train")
    with TrainLoader(shards, BatchLayout(B, T, B * T, 1), rank=0, seed=1337, device=torch.device("cpu")) as loader:

        def ours():
            loader.micro_batch(0)
            loader.advance()

        return paired_median_us(ours, nanogpt_get_batch(shards.paths[0], np.random.default_rng(0)), reps)


def clip_row(reps: int) -> tuple[float, float]:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(GPT2_GRADIENTS)]
    for p in params:
        p.grad = torch.full((4,), 0.5)
    dist = single_process("cpu")
    return paired_median_us(
        lambda: clip_grad_norm(params, 1.0, dist), lambda: torch.nn.utils.clip_grad_norm_(params, 1.0), reps
    )


def step_row(data_dir: Path, reps: int) -> tuple[float, float]:
    out = tempfile.mkdtemp(prefix="step_overhead_")
    flags = [
        *("--n-layer", "12", "--n-head", "1", "--n-embd", "2", "--block-size", "8"),
        *("--micro-batch-size", "1", "--total-batch-size", "8", "--max-steps", "1000000"),
        *("--device", "cpu", "--dtype", "float32", "--compile", "false", "--loss-impl", "full"),
        *("--data-dir", str(data_dir), "--out-dir", out, "--eval-interval", "0", "--eval-tokens", "0"),
        *("--sample-interval", "0", "--ckpt-interval", "0", "--plot", "false", "--log-interval", "1"),
    ]
    session = Session(parse_config(flags), single_process("cpu"))
    pending = []

    def ours():
        pending.append(session.step())
        if len(pending) > 1:  # the trainer's loop reads a step's numbers one step later
            pending.pop(0).read()

    torch.manual_seed(0)
    model = GPT(session.cfg.model, loss_impl="full")
    fused = "fused" in torch.optim.AdamW.__init__.__code__.co_varnames
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, **({"fused": True} if fused else {}))
    get = nanogpt_get_batch(find_shards(data_dir, "train").paths[0], np.random.default_rng(0), 1, 8)

    def nano():
        x, y = get()
        _, loss = model(x, y, return_logits=False)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()

    try:
        return paired_median_us(ours, nano, reps)
    finally:
        session.close()


VIEW_OPS = frozenset({"view", "select", "slice", "unsqueeze", "alias", "detach", "_reshape_alias", "as_strided"})
VIEW_OPS |= {"t", "expand", "lift_fresh", "reshape"}
"""Aten ops that make no kernel on a GPU: views, and lift_fresh (torch.tensor's wrapping of host data)."""


class OpCount(TorchDispatchMode):
    """Counts the aten ops dispatched while it is active and not paused (paused(): the model, the optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused, self.ops = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def kernels(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEW_OPS)

    def pausing(self, fn):
        def call(*args, **kwargs):
            self.paused += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused -= 1

        return call


@contextlib.contextmanager
def counting_outside_model(parts):
    """An OpCount over train_step's own ops: the model's forward and backward, optimizer.step() and
    zero_grad() paused (patched on the instances; Tensor.backward on the class, put back after)."""
    count, backward = OpCount(), torch.Tensor.backward
    patched = [(parts.train_model, "forward"), (parts.optimizer, "step"), (parts.optimizer, "zero_grad")]
    for obj, name in patched:
        setattr(obj, name, count.pausing(getattr(obj, name)))
    torch.Tensor.backward = count.pausing(backward)
    try:
        with count:
            yield count
    finally:
        torch.Tensor.backward = backward
        for obj, name in patched:
            delattr(obj, name)


def bookkeeping_ops(data_dir: Path, out_dir: Path) -> dict[str, int]:
    """train_step's ops outside the model and optimizer (VIEW_OPS left out), guard on and off: {"ops",
    "guard off"}, each a steady-state step's (the third) of a 1-layer model at 1 x 8 tokens, one rank."""
    counts = {}
    for name, guard in (("ops", "true"), ("guard off", "false")):
        flags = [
            *("--n-layer", "1", "--n-head", "1", "--n-embd", "8", "--block-size", "8", "--spike-guard", guard),
            *("--micro-batch-size", "1", "--total-batch-size", "8", "--max-steps", "100", "--spike-window", "8"),
            *("--device", "cpu", "--dtype", "float32", "--compile", "false", "--loss-impl", "full"),
            *("--data-dir", str(data_dir), "--out-dir", str(out_dir / name), "--eval-interval", "0"),
            *("--eval-tokens", "0", "--sample-interval", "0", "--ckpt-interval", "0", "--plot", "false"),
        ]
        session = Session(parse_config(flags), single_process("cpu"))
        try:
            for _ in range(10):  # past the guard's window: a full history, judged as in a long run
                session.step().read()
            with counting_outside_model(session.parts) as count:
                session.step()  # train_step, as the trainer's loop calls it (no stop vote)
            counts[name] = count.kernels()
        finally:
            session.close()
    return counts


def nanogpt_clip_ops() -> int:
    """torch's clip_grad_norm_ over GPT-2 124M's count of gradients: nanoGPT's loop's ops outside the model."""
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(GPT2_GRADIENTS)]
    for p in params:
        p.grad = torch.full((4,), 0.5)
    with OpCount() as count:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
    return count.kernels()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_corpus_flag(ap)
    ap.add_argument("--data-dir", type=Path, help="train shards to read (default: --corpus prepared in a temp dir)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--md", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # host bookkeeping: one thread, as the loop that launches kernels has
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir
        if data is None:
            require_corpus(args.corpus, "step_overhead.py")
            data = Path(tmp) / "data"
            prepare_by_paragraph(args.corpus, data, "step_overhead.py")
        rows = [
            ("loader: one 12 x 1024 micro-batch, warm", *loader_row(data, args.reps)),
            (f"clip: {GPT2_GRADIENTS} gradients' norm and scale", *clip_row(args.reps)),
            ("whole step, 12 layers x 2 wide, 1 x 8 tokens", *step_row(data, args.reps)),
        ]
        ops = bookkeeping_ops(data, Path(tmp) / "ops")
    lines = [
        "command: `" + " ".join(["python bench/step_overhead.py", *sys.argv[1:]]) + "`",
        f"machine: {cpu_name()}; torch {torch.__version__}; median of {args.reps} calls each, "
        "the two ways in turn; host microseconds",
        "",
        "| row | ours us | nanoGPT's way us | ours / nanoGPT's |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {ours:,.0f} | {nano:,.0f} | {ours / nano:.2f}x |" for name, ours, nano in rows]
    lines += [
        "",
        f"bookkeeping ops per step (outside the model and the optimizer, one rank): ours {ops['ops']} "
        f"({ops['guard off']} with --spike-guard false), nanoGPT's {nanogpt_clip_ops()} (its clip_grad_norm_)",
    ]
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
