"""Memory and compute planner: will this model train on this hardware, and how long will it take?

    python -m gpt2.plan --preset gpt2 --world-size 8 --gpu A100-40GB

plans the run `train_ddp.py --preset gpt2` makes on 8 such GPUs: the training preset's global batch
and budget (gpt2/core/config.py TRAIN_PRESETS) and its micro-batch (auto: the fastest by the throughput
model among those that fit and divide); --micro-batch-size, --total-batch-size and --tokens override them.

The planner's parts: hardware.py (the GPUs it knows), memory.py (bytes per device), loss_choice.py
(--loss-impl auto), ac_choice.py (--activation-checkpointing auto), budget.py (the stop budget of a SLURM signal),
planner.py (the Plan), report.py
(what it prints).
"""

from __future__ import annotations

import argparse
import sys

from gpt2.core.args import OneLineParser
from gpt2.core.config import (
    ACTIVATION_CHECKPOINTING,
    ARCHS,
    MODEL_PRESETS,
    PARALLELS,
    TRAIN_PRESETS,
    RunConfig,
    TrainConfig,
    model_preset,
)
from gpt2.core.precision import PLAN_DTYPES, Precision
from gpt2.plan.budget import WRITE_BYTES_PER_S
from gpt2.plan.hardware import GPUS
from gpt2.plan.planner import Plan, check_fits
from gpt2.plan.report import format_plan, format_stop
from gpt2.plan.resolve import Target, resolve_choices

DEFAULT_GPU = "A100-80GB"
"""What a plan is for without --gpu or --gpu-memory-gb. Not this machine's device, unlike train_ddp.py
--dry-run (a rehearsal of this launch): plans are mostly made for a cluster from somewhere else (a
laptop's CPU plan of GPT-2 would say nothing useful), so the default is a common training GPU, and the
plan's first line says that it is the default and not this machine."""


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(
        prog="python -m gpt2.plan",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--preset", default="gpt2", choices=sorted(MODEL_PRESETS))
    for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, help="override the preset's " + name)
    ap.add_argument("--attn-impl", choices=("sdpa", "sdpa_mask", "explicit"))
    ap.add_argument(
        "--arch", choices=sorted(ARCHS), help="architecture options, as train_ddp.py's --arch (default: gpt2's)"
    )
    ap.add_argument("--block-size", type=int, help="sequence length (default: the preset's)")
    ap.add_argument(
        "--micro-batch-size",
        type=_int_or_auto,
        default="auto",
        help="sequences per device per micro-step (default auto, as the training presets)",
    )
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--dtype", default="bf16", choices=PLAN_DTYPES)
    ap.add_argument(
        "--gpu",
        choices=list(GPUS),
        help=f"the GPU to plan for (default {DEFAULT_GPU}, whatever this machine has: the first line "
        "of the output says so; train_ddp.py --dry-run rehearses on this machine instead)",
    )
    ap.add_argument("--gpu-memory-gb", type=float, help="custom device memory in GiB (overrides --gpu)")
    ap.add_argument("--gpu-peak-tflops", type=float, help="custom peak TFLOP/s in --dtype (overrides --gpu)")
    ap.add_argument(
        "--total-batch-size",
        type=int,
        help="tokens per optimizer step (default: the training preset's, e.g. 524288 for gpt2)",
    )
    ap.add_argument(
        "--tokens",
        type=float,
        help="training budget in tokens, e.g. 10e9 (default: the preset's max_steps x total batch)",
    )
    ap.add_argument("--mfu", type=float, default=0.4, help="assumed MFU for time estimates (default 0.4)")
    ap.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"), help="what the optimizer state counts")
    ap.add_argument(
        "--parallel",
        default="ddp",
        choices=PARALLELS,
        help="ddp (every rank holds everything) or fsdp (state sharded over --world-size ranks)",
    )
    ap.add_argument(
        "--write-gb-s",
        type=float,
        default=WRITE_BYTES_PER_S / 1e9,
        help="checkpoint write speed for the SLURM stop budget (default 1 GB/s)",
    )
    ap.add_argument(
        "--loss-impl",
        default="auto",
        choices=("auto", "chunked", "full"),
        help="the loss path the memory counts (default auto: as train_ddp.py chooses it)",
    )
    ap.add_argument(
        "--activation-checkpointing",
        default="auto",
        choices=ACTIVATION_CHECKPOINTING,
        help="recompute the blocks in the backward: none, full, or auto (full only where the run "
        "does not fit without it, as train_ddp.py chooses it)",
    )
    return ap


def _int_or_auto(text: str) -> int | str:
    return "auto" if text == "auto" else int(text)


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The run `train_ddp.py --preset P` would make (TRAIN_PRESETS[P]), with the flags' overrides."""
    overrides = {
        k: getattr(args, k)
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "attn_impl", "block_size")
        if getattr(args, k) is not None
    }
    cfg = model_preset(args.preset, **{**ARCHS.get(args.arch or "gpt2"), **overrides})
    train = {
        **TRAIN_PRESETS.get(args.preset, {}),
        "micro_batch_size": args.micro_batch_size,
        "optimizer": args.optimizer,
        "loss_impl": args.loss_impl,
        "parallel": args.parallel,
        "activation_checkpointing": args.activation_checkpointing,
    }
    prec = Precision.from_key(args.dtype)
    train["dtype"], train["tf32"] = prec.dtype, prec.tf32
    if args.total_batch_size is not None:
        train["total_batch_size"] = args.total_batch_size
    if args.world_size < 1:
        raise ValueError(f"world_size={args.world_size} must be >= 1")
    gpu = args.gpu or (None if args.gpu_memory_gb is not None else DEFAULT_GPU)
    target = Target(
        world_size=args.world_size, gpu=gpu, gpu_memory_gb=args.gpu_memory_gb, gpu_peak_tflops=args.gpu_peak_tflops
    )
    tokens = None if args.tokens is None else int(args.tokens)
    return resolve_choices(RunConfig(cfg, TrainConfig.of(**train)), target, tokens=tokens, mfu=args.mfu).plan


def planned_for(args: argparse.Namespace, p: Plan) -> str:
    """The first line: which device the plan is for, and whether that was chosen or is the default."""
    if args.gpu is None and args.gpu_memory_gb is None:
        return (
            f"plan for   {p.world_size} x {DEFAULT_GPU}, the default --gpu, not this machine's device "
            f"(--gpu NAME plans for another: {', '.join(GPUS)}; or --gpu-memory-gb; train_ddp.py --dry-run "
            "rehearses on this machine)"
        )
    how = "--gpu-memory-gb" if args.gpu_memory_gb is not None else "--gpu"
    return f"plan for   {p.world_size} x {p.hardware.name} ({how})"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        p = plan_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(planned_for(args, p))
    if p.micro_batch_choice is not None:  # the line a start prints for the same decision
        print(p.micro_batch_choice.describe())
    print(format_plan(p))
    print(format_stop(p, args.write_gb_s * 1e9))
    if p.memory.total > p.hardware.memory_bytes:
        try:
            check_fits(p)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
