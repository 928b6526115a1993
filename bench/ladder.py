"""The acceleration ladder: one switch at a time, from plain fp32 to the fast configuration.

    python bench/ladder.py                                   # CPU: a few minutes
    python bench/ladder.py --preset gpt2 --block-size 1024   # a GPU

The rungs (fp32 eager explicit attention vocab 50257 -> TF32 -> bf16 -> compile -> flash -> vocab
50304), how each is the trainer's own `train_step` and how they are timed: gpt2/doctor/acceleration.py, which
`python -m gpt2.doctor` also runs. This script times --steps interleaved rounds, then the model's
attention kernels alone with an agreement check, prints Markdown tables and writes a PNG bar chart
to --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import torch

from gpt2.core.config import GPT2_VOCAB_SIZE, MODEL_PRESETS, ModelConfig, param_count
from gpt2.doctor.acceleration import (
    LADDER,
    AttentionResult,
    RungResult,
    attention_table,
    attention_tolerance,
    initial_peaks,
    ladder_table,
    run_attention,
    run_ladder,
)

CPU_SHAPE = dict(n_layer=4, n_head=6, n_embd=384, block_size=256)


def write_chart(results: list[RungResult], attention: list[AttentionResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw=dict(width_ratios=[3, 2]))
    names = [r.rung.name for r in results]
    values = [r.tokens_per_s or 0 for r in results]
    bars = ax1.bar(names, values, color=["#bbbbbb" if v == 0 else "#3b75af" for v in values])
    base = next((v for v in values if v), 1.0)
    for bar, v in zip(bars, values):
        label = f"{v / base:.2f}x" if v else "n/a"
        ax1.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("training step, one switch per rung")
    dtypes = sorted({r.dtype for r in attention}, key=str)
    impls = ["explicit", "sdpa_mask", "sdpa"]
    width = 0.8 / len(dtypes)
    for i, dt in enumerate(dtypes):
        ms = [next(r.ms for r in attention if r.impl == impl and r.dtype == dt) for impl in impls]
        ax2.bar([j + i * width for j in range(len(impls))], ms, width, label=str(dt).removeprefix("torch."))
    ax2.set_xticks([j + width * (len(dtypes) - 1) / 2 for j in range(len(impls))], impls)
    ax2.set_ylabel("ms per forward+backward")
    ax2.set_title("attention kernels")
    ax2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def model_shape(args: argparse.Namespace) -> ModelConfig:
    base = dict(MODEL_PRESETS[args.preset]) if args.preset else dict(CPU_SHAPE)
    for name in ("n_layer", "n_head", "n_embd", "block_size"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    return ModelConfig(**base)


REPO = Path(__file__).resolve().parent.parent
DEFAULT_CHART = REPO / "runs" / "bench" / "ladder.png"
"""Under runs/ (git-ignored), whatever the working directory: a run without --out once left
ladder.png in the repository root."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="CPU default shape: " + ", ".join(f"{k}={v}" for k, v in CPU_SHAPE.items()),
    )
    ap.add_argument("--preset", choices=sorted(MODEL_PRESETS), help="model shape (default: a small CPU shape)")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-head", type=int)
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--block-size", type=int)
    ap.add_argument("--micro-batch-size", type=int, help="default 4 on CPU, 16 on CUDA")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per rung (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per rung first")
    ap.add_argument("--rungs", default=",".join(r.name for r in LADDER), help="comma-separated subset")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads for a CPU run")
    ap.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_CHART,
        help=f"bar chart PNG (default: {DEFAULT_CHART.relative_to(REPO)} in the repository, ignored by git)",
    )
    ap.add_argument("--md", type=Path, help="also write the Markdown report here")
    return ap


def peaks_line(device: torch.device, peaks: dict[str, float | None]) -> str:
    source = (
        "data sheet; n/a for a GPU or dtype gpt2.plan.flops does not list, so MFU is n/a too"
        if device.type == "cuda"
        else "measured: best square matmul of up to 2048^3, before and between the "
        "timed steps; bf16's never below fp32's"
    )
    rates = (f"{k} n/a" if v is None else f"{k} {v / 1e9:,.0f} GFLOP/s" for k, v in peaks.items())
    return f"peaks ({source}): " + ", ".join(rates)


def report_header(
    args: argparse.Namespace,
    argv: list[str] | None,
    device: torch.device,
    shape: ModelConfig,
    batch: int,
    peaks: dict[str, float | None],
) -> list[str]:
    command = "python bench/ladder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    now = datetime.datetime.now(datetime.timezone.utc)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    )
    return [
        f"command: `{command.strip()}`",
        f"date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; device: {device} ({where})",
        f"model: n_layer={shape.n_layer} n_head={shape.n_head} n_embd={shape.n_embd}, "
        f"{param_count(shape.replace(vocab_size=GPT2_VOCAB_SIZE)) / 1e6:.1f}M params; micro-batch {batch} x "
        f"block {shape.block_size} = {batch * shape.block_size:,} tokens/step; median of {args.steps} "
        f"interleaved steps after {args.warmup} warm-up",
        peaks_line(device, peaks),
        f"load average at start (other processes compete for the cores): {os.getloadavg()[0]:.1f}",
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    wanted = args.rungs.split(",")
    unknown = sorted(set(wanted) - {r.name for r in LADDER})
    if unknown:
        print(f"error: unknown rung(s) {unknown}; choose from {[r.name for r in LADDER]}", file=sys.stderr)
        return 2
    try:
        shape = model_shape(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    batch = args.micro_batch_size or (16 if device.type == "cuda" else 4)
    peaks = initial_peaks(device)  # a CPU's are raised again while timing
    header = report_header(args, argv, device, shape, batch, peaks)
    print("\n".join(header), flush=True)
    results = run_ladder(
        [r for r in LADDER if r.name in wanted],
        shape,
        batch,
        device,
        steps=args.steps,
        warmup=args.warmup,
        peaks=peaks,
        progress=lambda line: print("  " + line, file=sys.stderr, flush=True),
    )
    header[3] = peaks_line(device, peaks)  # raised by the matmuls timed between the steps
    attention = []
    for dtype in (torch.float32, torch.bfloat16):
        attention += run_attention(shape, batch, device, dtype, repeats=max(args.steps, 5))
    header.append(f"load average at end: {os.getloadavg()[0]:.1f}")
    report = (
        "\n".join(header)
        + "\n\n"
        + ladder_table(results, device)
        + "\n\nAttention alone (B="
        + f"{batch}, nh={shape.n_head}, T={shape.block_size}, hd={shape.head_dim}):\n\n"
        + attention_table(attention)
    )
    print("\n" + report.split("\n\n", 1)[1])
    if args.md:
        args.md.write_text(report + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_chart(results, attention, args.out, header[2])
    print(f"\nchart: {args.out}", file=sys.stderr)
    return 0 if all(r.max_diff <= attention_tolerance(r.dtype) for r in attention) else 1


if __name__ == "__main__":
    sys.exit(main())
