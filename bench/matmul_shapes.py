"""The matmul rate at a model's own shapes, against the peak that MFU divides by.

    python bench/matmul_shapes.py                                   # W1: 6 x 384, 8 x 256 tokens, fp32 and bf16
    python bench/matmul_shapes.py --n-embd 128 --tokens 1024        # the quick start's micro-batch

MFU (train_ddp.py, bench/vs_nanogpt.py) divides by the CPU's cached matmul peak, the best of probes at
2048 x 2048 x 2048 (gpt2/core/precision.py). A training step's matmuls have other shapes: each linear layer's
forward (tokens x in -> out), its input gradient and its weight gradient, and the LM head's three are
the largest. This times each at the run's shape in each dtype, and their FLOP-weighted rate: the MFU a
step would reach if it were nothing but these matmuls (attention's and everything else's time aside),
a ceiling for the MFU column. One process, --threads threads, random inputs; each rate the best of
--repeats timed calls after one untimed. On a CPU without native bf16 (AVX2 only) bf16 is emulated and
~40x slower: pass --dtypes float32 there unless the emulated rate is what you want to see.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from emit import emit  # bench/emit.py (a script's directory is on sys.path)

from gpt2.core import precision
from gpt2.model.gpt import GPT2_VOCAB_SIZE
from gpt2.plan import matmul_peak


def step_matmuls(tokens: int, h: int, vocab: int) -> list[tuple[str, int, int, int, int]]:
    """(name, m, k, n, count per step) of one training step's matmuls, per layer kind: forward,
    input gradient (dX) and weight gradient (dW) of the block's four linears and the LM head."""
    out = []
    for name, fan_in, fan_out, per_layer in (
        ("attn qkv", h, 3 * h, True),
        ("attn proj", h, h, True),
        ("mlp fc", h, 4 * h, True),
        ("mlp proj", 4 * h, h, True),
        ("lm head", h, vocab, False),
    ):
        out += [
            (f"{name} fwd", tokens, fan_in, fan_out, per_layer),
            (f"{name} dX", tokens, fan_out, fan_in, per_layer),
            (f"{name} dW", fan_out, tokens, fan_in, per_layer),
        ]
    return out


def rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * m * k * n / best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of one micro-batch (B x T)")
    ap.add_argument("--vocab-size", type=int, default=50304)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--md", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    if min(args.n_embd, args.n_layer, args.tokens, args.repeats, args.threads) < 1 or args.vocab_size < GPT2_VOCAB_SIZE:
        print(f"{ap.prog}: error: sizes must be positive and --vocab-size at least {GPT2_VOCAB_SIZE}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    try:
        precs = {(p := precision.Precision(d, d)).torch_dtype: p for d in args.dtypes.split(",")}
        dtypes = list(precs)
    except ValueError as e:
        print(f"{ap.prog}: error: --dtypes: {e}", file=sys.stderr)
        return 2
    shapes = step_matmuls(args.tokens, args.n_embd, args.vocab_size)
    rates = {d: [rate(m, k, n, d, args.repeats) for _, m, k, n, _ in shapes] for d in dtypes}
    peaks = dict(zip(dtypes, matmul_peak.peak_rates("cpu", tuple(dtypes))))
    lines = [
        f"{args.n_layer} layers x {args.n_embd} wide, {args.tokens:,} tokens per micro-batch, vocab "
        f"{args.vocab_size:,}; {args.threads} thread(s), best of {args.repeats}; torch {torch.__version__}",
        "",
        "| matmul | m x k x n | per step | "
        + " | ".join(f"{precs[d].short} GFLOP/s (% of peak)" for d in dtypes)
        + " |",
        "|---|---|---:|" + "---:|" * len(dtypes),
    ]
    for i, (name, m, k, n, per_layer) in enumerate(shapes):
        cells = [f"{rates[d][i] / 1e9:,.0f} ({rates[d][i] / peaks[d]:.0%})" for d in dtypes]
        lines.append(f"| {name} | {m} x {k} x {n} | {args.n_layer if per_layer else 1} | " + " | ".join(cells) + " |")
    flops = [2 * m * k * n * (args.n_layer if per_layer else 1) for _, m, k, n, per_layer in shapes]
    weighted = {d: sum(flops) / sum(f / r for f, r in zip(flops, rates[d])) for d in dtypes}
    lines.append(
        "| **all, FLOP-weighted** | | | "
        + " | ".join(f"**{weighted[d] / 1e9:,.0f} ({weighted[d] / peaks[d]:.0%})**" for d in dtypes)
        + " |"
    )
    lines += [
        "",
        "peak (the MFU denominator, cached 2048^3 probes): "
        + ", ".join(f"{precs[d].short} {peaks[d] / 1e9:,.0f} GFLOP/s" for d in dtypes),
    ]
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
