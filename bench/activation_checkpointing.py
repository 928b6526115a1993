"""Peak memory and time of a training micro-step with and without activation checkpointing, against the
planner's count: what --activation-checkpointing trades.

    python bench/activation_checkpointing.py              # 6 x 384, block 1024, batch 4, fp32 on CPU: ~1.5 min
    python bench/activation_checkpointing.py --batch 8 --steps 3

One micro-step is the trainer's forward and backward (`_, loss = model(x, y, return_logits=False)`, the
chunked loss; no optimizer step, which is the same either way) of a fresh seeded GPT, eager. Peak: the
allocator's bytes above the start while it runs (gpt2.plan.measure.measured_peak_bytes: CUDA's
max_memory_allocated, or the CPU allocator's events through torch.profiler), gradients included, as they
appear. Planner: what gpt2/plan/memory.py counts for that peak, the activations, the LM head + loss and
the fp32 gradients. Time: the median of --steps micro-steps after one warm-up. Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt2.core.config import ModelConfig, param_count  # noqa: E402
from gpt2.core.precision import Precision  # noqa: E402
from gpt2.model.gpt import GPT  # noqa: E402
from gpt2.plan.flops import flops_per_token, recompute_flops_per_token  # noqa: E402
from gpt2.plan.hardware import device_hardware  # noqa: E402
from gpt2.plan.measure import measured_peak_bytes  # noqa: E402
from gpt2.plan.memory import memory, run_config  # noqa: E402


def micro_step(model: GPT, x: torch.Tensor, y: torch.Tensor) -> None:
    _, loss = model(x, y, return_logits=False)
    loss.backward()


def measure(cfg: ModelConfig, checkpointed: bool, batch: int, steps: int, device: torch.device) -> tuple[int, float]:
    """(peak bytes of one micro-step, median seconds of `steps` micro-steps)."""
    torch.manual_seed(0)
    model = GPT(cfg, activation_checkpointing=checkpointed).to(device)
    x, y = torch.randint(0, 50257, (2, batch, cfg.block_size), device=device)

    def step():
        micro_step(model, x, y)

    step()  # warm-up: oneDNN primitives, allocator caches
    model.zero_grad(set_to_none=True)  # as the trainer: gradients are made in the backward
    peak = measured_peak_bytes(step, device)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return peak, statistics.median(times)


def planned(cfg: ModelConfig, checkpointed: bool, batch: int, device: torch.device) -> int:
    m = memory(
        run_config(cfg, batch, prec=Precision.from_key("fp32")),
        device_hardware(device, None),
        checkpointed=checkpointed,
    )
    return m.activations + m.logits + m.gradients


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4, help="sequences per micro-step")
    ap.add_argument("--steps", type=int, default=2, help="timed micro-steps per row (median)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cfg = ModelConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    share = recompute_flops_per_token(cfg) / flops_per_token(cfg)
    print(
        f"{args.n_layer} x {args.n_embd}, {param_count(cfg) / 1e6:.1f}M params, micro-batch {args.batch} x "
        f"{args.block_size}, fp32 eager on {device.type} ({torch.get_num_threads()} threads); recompute "
        f"+{share:.0%} of model FLOPs\n"
    )
    print("| activation checkpointing | peak measured | planner | micro-step (median) |")
    print("|---|---:|---:|---:|")
    rows = {}
    for mode in ("none", "full"):
        peak, seconds = measure(cfg, mode == "full", args.batch, args.steps, device)
        rows[mode] = (peak, seconds)
        print(
            f"| {mode} | {peak / 2**20:,.0f} MiB | {planned(cfg, mode == 'full', args.batch, device) / 2**20:,.0f} MiB "
            f"| {seconds:.2f} s |",
            flush=True,
        )
    (p0, t0), (p1, t1) = rows["none"], rows["full"]
    print(f"\nfull: {p1 / p0:.2f}x the peak, {t1 / t0:.2f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
