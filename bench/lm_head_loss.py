"""The LM head + loss alone, forward and backward: the chunked loss against plain F.cross_entropy.

    python bench/lm_head_loss.py                        # CPU: micro-batch 2, ~8 minutes on 2 shared cores
    python bench/lm_head_loss.py --device cuda          # a GPU: micro-batch 16, bf16 where native
    python bench/lm_head_loss.py --device cuda --batch 64 --also-chunk-logits 33554432 --md loss.md
        # the gpt2 preset's micro-batch on an 80 GB GPU, plus the 2**25-logit chunks used before

Shape: GPT-2 124M's LM head, the final LayerNorm's output x (B*T, 768) in fp32 against the tied
(50304, 768) fp32 weight, with the model's -inf logit bias on the 47 padded vocab rows, random
targets; the matmuls in --dtype under autocast as in training (fp32: no autocast; TF32 allowed on
CUDA, the trainer's default). One row times loss.backward() from x and the weight (what the model's
step spends past ln_f) in:
  chunked eager     gpt2.model.loss.linear_cross_entropy, what the trainer runs, uncompiled
  chunked compiled  the same under torch.compile (the trainer compiles the whole model)
  plain eager       F.cross_entropy(F.linear(x, w, bias).float(), y), the model's plain path
  plain compiled    the same under torch.compile: the reference of the ratio column
  chunked compiled, N logits/chunk   with --also-chunk-logits N: another chunk size
Columns: median ms per forward + backward; that time over plain compiled's; the peak memory the
step allocates above its inputs (CUDA: max_memory_allocated; CPU: the CPU allocator's own events
under torch.profiler, as gpt2.plan.measure.measured_peak_bytes); the chunks the loss runs in (the device's
rule, gpt2.model.loss.loss_chunk_logits); the loss, equal on every row up to the dtype's rounding.
Each row is warmed up twice (compilation happens there), then each round times --steps steps of
every row, the order reversed every other round so that all rows see the same drift of a shared
machine; a row's number is the median over all its timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from emit import emit  # bench/emit.py (a script's directory is on sys.path)

from gpt2.core.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE
from gpt2.core.precision import Precision
from gpt2.model.loss import linear_cross_entropy, loss_chunk_logits, loss_chunks
from gpt2.plan.measure import measured_peak_bytes
from gpt2.plan.precision_choice import resolve_precision

MIB = 2**20


def chunked(chunk_logits: int | None) -> Callable:
    """The trainer's loss; chunk_logits overrides the device's chunk size."""

    def loss(x, w, bias, y):
        rows = None if chunk_logits is None else max(1, chunk_logits // w.size(0))
        return linear_cross_entropy(x, w, bias, y, chunk_rows=rows)

    return loss


def plain(x, w, bias, y):
    return F.cross_entropy(F.linear(x, w, bias).float(), y, ignore_index=-1)


def make_step(
    loss_fn: Callable, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, y: torch.Tensor, dtype: str
) -> Callable[[], torch.Tensor]:
    def step() -> torch.Tensor:
        x.grad = w.grad = None
        with Precision(dtype, dtype).autocast(x.device):  # the --dtype flag's name
            loss = loss_fn(x, w, bias, y)
        loss.backward()
        return loss.detach()

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step: Callable, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    step()
    sync(device)
    return time.perf_counter() - t0


def build_rows(args, device: torch.device) -> dict[str, tuple[Callable, int | None]]:
    """name -> (loss function, logits per chunk or None for the plain loss)."""
    own = loss_chunk_logits(device)
    rows = {
        "chunked eager": (chunked(None), own),
        "chunked compiled": (torch.compile(chunked(None), backend=args.backend), own),
        "plain eager": (plain, None),
        "plain compiled": (torch.compile(plain, backend=args.backend), None),
    }
    if args.also_chunk_logits:
        rows[f"chunked compiled, {args.also_chunk_logits:,} logits/chunk"] = (
            torch.compile(chunked(args.also_chunk_logits), backend=args.backend),
            args.also_chunk_logits,
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bfloat16", "float16", "float32"),
        help="autocast dtype of the matmuls (auto: gpt2.core.precision's pick for the device)",
    )
    ap.add_argument("--batch", type=int, help="micro-batch in sequences (default: 16 on CUDA, 2 on CPU)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--vocab-size", type=int, default=PADDED_VOCAB_SIZE)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each row per round")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (tests use aot_eager)")
    ap.add_argument("--also-chunk-logits", type=int, help="add a compiled row with this many logits per chunk")
    ap.add_argument("--md", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = 16 if args.device == "cuda" else 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer (TrainConfig.compute.tf32); only fp32 on CUDA
    dtype = resolve_precision(args.dtype, device).dtype
    n, h, V = args.batch * args.seq_len, args.n_embd, args.vocab_size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=gen).to(device).requires_grad_()
    w = (torch.randn(V, h, generator=gen) * 0.02).to(device).requires_grad_()  # GPT-2's init
    bias = torch.zeros(V)
    bias[min(V, GPT2_VOCAB_SIZE) :] = float("-inf")
    bias = bias.to(device)
    y = torch.randint(0, min(V, GPT2_VOCAB_SIZE), (n,), generator=gen).to(device)

    rows = build_rows(args, device)
    steps, chunks, loss, peak, times = {}, {}, {}, {}, {}
    for name, (fn, chunk_logits) in rows.items():
        step = make_step(fn, x, w, bias, y, dtype)
        try:
            loss[name] = float(step())
            step()
            peak[name] = measured_peak_bytes(step, device)
        except torch.OutOfMemoryError:  # the plain loss at a large micro-batch on a small GPU
            print(f"  {name}: out of memory, skipped", file=sys.stderr, flush=True)
            torch.cuda.empty_cache()
            continue
        steps[name], times[name] = step, []
        chunks[name] = "-" if chunk_logits is None else str(loss_chunks(n, max(1, chunk_logits // V))[0])
    names = list(steps)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name] += [timed(steps[name], device) for _ in range(args.steps)]
        print(
            f"  round {r + 1}/{args.rounds}: "
            + ", ".join(f"{m} {statistics.median(times[m][-args.steps :]) * 1e3:.0f} ms" for m in names),
            file=sys.stderr,
            flush=True,
        )

    ref = statistics.median(times["plain compiled"]) if "plain compiled" in times else None
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {args.threads} threads"
    out = [
        f"LM head + loss, forward + backward: B={args.batch} x T={args.seq_len} = {n:,} tokens, h={h}, V={V}, "
        f"{dtype}, {where}, {args.rounds} rounds x {args.steps} steps, torch {torch.__version__}",
        "",
        "| row | ms (median) | time vs plain compiled | peak MiB above inputs | chunks | loss |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        ms = statistics.median(times[name]) * 1e3
        ratio = "n/a" if ref is None else f"{ms / 1e3 / ref:.2f}x"
        out.append(f"| {name} | {ms:.1f} | {ratio} | {peak[name] / MIB:,.1f} | {chunks[name]} | {loss[name]:.4f} |")
    out += [f"| {name} | out of memory | | | | |" for name in rows if name not in steps]
    emit("\n".join(out), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
