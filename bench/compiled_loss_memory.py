"""Peak bytes per logit of the plain (full-logits) LM head + cross-entropy, eager and compiled: the
numbers gpt2/plan/'s loss_bytes(chunked=False, compiled=...) counts, which --loss-impl auto uses.

    python bench/compiled_loss_memory.py                  # CUDA if present (bf16 autocast), else CPU
    python bench/compiled_loss_memory.py --device cpu --dtype fp32 --tokens 512

Runs `F.cross_entropy(F.linear(x, W, b).float(), y, ignore_index=-1)`, forward and backward, as the
model's full path does (autocast on for bf16), eager and under torch.compile, and prints the peak
allocated above the inputs, less the gradients of x and W (the planner counts those elsewhere), per
logit (tokens x vocab). On CUDA the caching allocator's max_memory_allocated; on a CPU the allocator's
events as torch.profiler records them (gpt2.plan.measure.measured_peak_bytes). Prints one table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.core.config import ModelConfig  # noqa: E402
from gpt2.core.precision import Precision
from gpt2.plan.measure import measured_peak_bytes  # noqa: E402
from gpt2.plan.memory import loss_bytes


def head_and_loss(x, w, b, y):
    return F.cross_entropy(F.linear(x, w, b).float(), y, ignore_index=-1)


def peak_per_logit(fn, device, dtype: str, tokens: int, vocab: int, width: int) -> float:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, width, generator=gen) * 0.02).to(device).requires_grad_()
    w = (torch.randn(vocab, width, generator=gen) * 0.02).to(device).requires_grad_()
    b = torch.zeros(vocab, device=device)
    y = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def step():
        with autocast:
            loss = fn(x, w, b, y)
        loss.backward()

    step()  # warm-up: compilation, allocator caches
    x.grad = w.grad = None
    grads = x.numel() * 4 + w.numel() * 4
    peak = measured_peak_bytes(step, device)
    return (peak - grads) / (tokens * vocab)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--tokens", type=int, default=None, help="rows (B*T); default 8192 on CUDA, 512 on CPU")
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50304)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    tokens = args.tokens or (8192 if device.type == "cuda" else 512)
    cfg = ModelConfig(n_layer=1, n_head=1, n_embd=args.width, vocab_size=args.vocab, block_size=tokens)
    print(f"| path | {dtype} bytes per logit, measured | planner (gpt2/plan/ loss_bytes) |")
    print("|---|---:|---:|")
    for name, fn, compiled in (("eager", head_and_loss, False), ("compiled", torch.compile(head_and_loss), True)):
        got = peak_per_logit(fn, device, dtype, tokens, args.vocab, args.width)
        planned = loss_bytes(
            cfg, tokens, prec=Precision.from_key(dtype), chunked=False, compiled=compiled, device_type=device.type
        ) / (tokens * args.vocab)
        print(f"| {name} | {got:.2f} | {planned:g} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
