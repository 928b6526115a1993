"""The optimizer step alone: AdamW against Muon (Gram-form and plain Newton-Schulz), side by side.

    python bench/muon_step.py            # ~1 minute on 2 cores
    python bench/muon_step.py --small --bf16   # 4 layers, 128 wide, plus torch's own bf16 iteration

A whole training step on a shared 2-core machine varies by 10-30% from step to step (another tenant's
load), more than Muon's cost, so bench/train_throughput.py's Muon rows need many steps to resolve it.
Muon's extra work is all in optimizer.step(), which this times directly, alternately (A B C, A B C, ...)
so that the three share the load: the model is bench/train_throughput.py's workload (6 layers, 384
wide, vocab 50304, fp32), its gradients random. The extra time is then compared with the FLOPs of a
training step of that workload at 4,096 tokens, through the matmul peak measured here.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import torch

from gpt2.core.config import ModelConfig, OptimConfig
from gpt2.core.precision import FLOAT32
from gpt2.model.gpt import GPT
from gpt2.plan import matmul_peak
from gpt2.plan.flops import flops_per_token
from gpt2.train.session import make_optimizer, plain_newton_schulz

TOKENS_PER_STEP = 4096


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9, help="timed steps of each (median)")
    ap.add_argument("--small", action="store_true", help="the 4-layer, 128-wide model (block 64) instead")
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="also time the iteration in bf16, as torch.optim.Muon runs it (slow where bf16 is emulated)",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    mc = (
        ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=50304)
        if args.small
        else ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=50304)
    )
    model = GPT(mc)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = {
        kind: make_optimizer(model, OptimConfig(optimizer=kind), torch.device("cpu"), peak_lr=6e-4, prec=FLOAT32)
        for kind in ("adamw", "muon")
    }

    def step(name: str) -> float:
        opts["muon"].optimizers["muon"].ns_dtype = torch.bfloat16 if "bf16" in name else torch.float32
        form = plain_newton_schulz() if name == "muon, plain Newton-Schulz" else contextlib.nullcontext()
        with form:
            t0 = time.perf_counter()
            opts["muon" if name.startswith("muon") else "adamw"].step()
            return time.perf_counter() - t0

    names = ["adamw (fused)", "muon, Gram-form Newton-Schulz (default in fp32)", "muon, plain Newton-Schulz"]
    names += ["muon, bf16 Newton-Schulz (torch.optim.Muon's)"] if args.bf16 else []
    times: dict[str, list[float]] = {n: [] for n in names}
    with torch.no_grad():
        for i in range(args.reps + 1):  # the first round allocates the optimizers' state
            for n in names:
                dt = step(n)
                if i:
                    times[n].append(dt)
    peak = matmul_peak.matmul_rate("cpu", torch.float32, n=2048, budget_s=1.0, fresh=True)
    train_s = flops_per_token(mc) * TOKENS_PER_STEP / peak  # the training step's FLOPs at the peak rate
    adamw = statistics.median(times[names[0]])
    print(
        f"command: python bench/muon_step.py {' '.join(sys.argv[1:] if argv is None else argv)}\n"
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; fp32 matmul peak {peak / 1e9:.0f} GFLOP/s; "
        f"a training step of {TOKENS_PER_STEP:,} tokens is {train_s:.2f} s at that peak\n"
    )
    print(f"| optimizer.step() | s (median of {args.reps}) | extra over AdamW, as a share of a training step at peak |")
    print("|---|---:|---:|")
    for n in names:
        s = statistics.median(times[n])
        print(f"| {n} | {s:.3f} | {(s - adamw) / train_s:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
