"""Eager (uncompiled) step time: the trainer's chunked LM-head loss against nanoGPT's plain loss.

    python bench/eager_loss.py                      # ~1 minute on 2 cores
    python bench/eager_loss.py --rounds 4 --steps 10 --md /tmp/eager.md

The quick start and the debug preset run uncompiled, so what the loss costs in eager mode matters
there. Shape: nanoGPT's small CPU recipe (4 layers, 4 heads, 128 wide, block 64, micro-batch 16,
vocab 50304), fp32, fused AdamW, random tokens, one process with --threads threads. Both rows
step the same model; only the loss differs:
  chunked   model(x, y, return_logits=False): gpt2.model.loss.linear_cross_entropy, what the trainer runs
  plain     logits = model(x); F.cross_entropy(logits.view(-1, V), y.view(-1)), as nanoGPT's model.py
Each round times --steps steps of each row after 2 warm-up steps, the rows alternating order
(A B, B A, ...) so both see the same drift of a shared machine; each row's number is the median
over all its timed steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from emit import emit  # bench/emit.py (a script's directory is on sys.path)

from gpt2.core.config import ModelConfig
from gpt2.model.gpt import GPT


def make_step(model: GPT, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, chunked: bool):
    def step() -> float:
        if chunked:
            _, loss = model(x, y, return_logits=False)
        else:
            logits, _ = model(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--md", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=64)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 50257, (16, 64), generator=gen)
    y = torch.randint(0, 50257, (16, 64), generator=gen)
    rows, first = {}, {}
    for name, chunked in (("chunked (this trainer)", True), ("plain F.cross_entropy (nanoGPT)", False)):
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
        rows[name] = make_step(model, opt, x, y, chunked=chunked)
        first[name] = rows[name]()  # same init, same batch: the first losses must agree
        rows[name]()
    times = {name: [] for name in rows}
    names = list(rows)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            for _ in range(args.steps):
                t0 = time.perf_counter()
                rows[name]()
                times[name].append(time.perf_counter() - t0)
        print(
            f"  round {r + 1}/{args.rounds}: "
            + ", ".join(f"{n} {statistics.median(times[n][-args.steps :]):.3f} s" for n in names),
            file=sys.stderr,
            flush=True,
        )
    plain = statistics.median(times[names[1]])
    tokens = x.numel()
    out = [
        f"eager step, 4 layers x 128 wide, block 64, micro-batch 16, fp32, {args.threads} threads, "
        f"{args.rounds} rounds x {args.steps} steps, torch {torch.__version__}",
        "",
        "| loss | s/step (median) | tokens/s | time vs plain | first loss |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in names:
        s = statistics.median(times[name])
        out.append(f"| {name} | {s:.3f} | {tokens / s:,.0f} | {s / plain:.2f}x | {first[name]:.4f} |")
    emit("\n".join(out), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
