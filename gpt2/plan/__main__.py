"""Memory and compute planner: will this model train on this hardware, and how long will it take?

    python -m gpt2.plan --preset gpt2 --world-size 8 --gpu A100-40GB

plans the run `train_ddp.py --preset gpt2` makes on 8 such GPUs: the training preset's global batch,
budget, micro-batch and optimizer (gpt2/core/config.py TRAIN_PRESETS; a micro-batch of auto: the fastest
by the throughput model among those that fit and divide); --micro-batch-size, --total-batch-size,
--optimizer and --tokens override them. `--device cpu` plans for this machine's CPU instead, measured
as train_ddp.py --device cpu measures it.

The planner's parts: hardware.py (the GPUs it knows), memory.py (bytes per device), loss_choice.py
(--loss-impl auto), ac_choice.py (--activation-checkpointing auto), budget.py (the stop budget of a SLURM signal),
planner.py (the Plan), report.py
(what it prints).
"""

from __future__ import annotations

import argparse
import sys

import torch

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
from gpt2.core.precision import PLAN_DTYPE_CHOICES, Precision
from gpt2.distributed.group import usable_cpus
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
        "--arch", choices=sorted(ARCHS), help="architecture options, as train_ddp.py's --arch (default: the preset's)"
    )
    ap.add_argument(
        "--doc-attention",
        action="store_true",
        help="attention within documents, as train_ddp.py's: the dense mask counted where it runs (a CPU, eager "
        "CUDA), none where FlexAttention runs (compiled CUDA)",
    )
    ap.add_argument(
        "--value-embeds", type=int, help="value-embedding tables, as train_ddp.py's: their weights and saved values"
    )
    ap.add_argument("--unet-skips", action="store_true", help="U-net skip connections, as train_ddp.py's")
    ap.add_argument("--block-size", type=int, help="sequence length (default: the preset's)")
    ap.add_argument(
        "--micro-batch-size",
        type=_int_or_auto,
        help="sequences per device per micro-step, or auto (default: the preset's, as train_ddp.py takes it: "
        "auto for the GPT-2 presets, 8 for debug)",
    )
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument(
        "--dtype",
        choices=PLAN_DTYPE_CHOICES,
        help="as train_ddp.py's --dtype (default: the preset's, else auto); float32 plans plain fp32 matmuls, "
        "tf32 float32 on TF32 tensor cores (what train_ddp.py's float32 runs on a GPU unless --tf32 false); "
        "bf16, fp16 and fp32 are the same as bfloat16, float16 and float32",
    )
    ap.add_argument(
        "--device",
        choices=("cpu",),
        help="cpu: plan for this machine's CPU (its free memory and measured matmul peak, as train_ddp.py "
        "--device cpu plans), instead of a GPU of the table",
    )
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
    ap.add_argument(
        "--optimizer", choices=("adamw", "muon"), help="what the optimizer state counts (default: the preset's)"
    )
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
        "--fp8-head",
        action="store_true",
        help="the LM head's matmuls in FP8, as train_ddp.py's (the full loss, and its FP8 copies counted)",
    )
    ap.add_argument(
        "--compile",
        choices=("true", "false"),
        help="torch.compile, as train_ddp.py's (default: the preset's, else true): what the loss and the document "
        "mask hold depends on it",
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
        for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "attn_impl", "block_size", "value_embeds")
        if getattr(args, k) is not None
    }
    for flag in ("doc_attention", "unet_skips"):
        if getattr(args, flag):
            overrides[flag] = True
    cfg = model_preset(args.preset, **{**(ARCHS[args.arch] if args.arch else {}), **overrides})  # over the preset's
    train = {
        **TRAIN_PRESETS.get(args.preset, {}),
        "loss_impl": args.loss_impl,
        "parallel": args.parallel,
        "activation_checkpointing": args.activation_checkpointing,
    }
    if args.fp8_head:
        train["fp8_head"] = True
    if args.compile is not None:  # None: the preset's (speed: false), else TrainConfig's (true)
        train["compile"] = args.compile == "true"
    for flag in ("micro_batch_size", "optimizer", "total_batch_size"):  # None: the preset's (or the default)
        if getattr(args, flag) is not None:
            train[flag] = getattr(args, flag)
    if args.dtype == "auto":
        train["dtype"] = "auto"
    elif args.dtype is not None:  # None: the preset's dtype (speed's float32) or auto, with --tf32's default
        prec = Precision.from_key(args.dtype)
        train["dtype"], train["tf32"] = prec.dtype, prec.tf32
    if args.world_size < 1:
        raise ValueError(f"world_size={args.world_size} must be >= 1")
    run = RunConfig(cfg, TrainConfig.of(**train))
    tokens = None if args.tokens is None else int(args.tokens)
    target = plan_target(args)
    if target.device is not None:  # a CPU's peak is per thread count: one rank's share, as train_ddp.py sets it
        torch.set_num_threads(max(1, usable_cpus() // args.world_size))
    return resolve_choices(run, target, tokens=tokens, mfu=args.mfu).plan


def plan_target(args: argparse.Namespace) -> Target:
    """The hardware the plan is for: this machine's CPU (--device cpu, shared by --world-size ranks as
    train_ddp.py's start-up shares it), or a GPU of the table or a custom one (default DEFAULT_GPU)."""
    if args.device == "cpu":
        if args.gpu or args.gpu_memory_gb is not None or args.gpu_peak_tflops is not None:
            raise ValueError(
                "--device cpu plans for this machine's CPU; --gpu/--gpu-memory-gb/--gpu-peak-tflops "
                "plan for a GPU: drop one"
            )
        return Target(world_size=args.world_size, processes_per_host=args.world_size, device=torch.device("cpu"))
    gpu = args.gpu or (None if args.gpu_memory_gb is not None else DEFAULT_GPU)
    return Target(
        world_size=args.world_size, gpu=gpu, gpu_memory_gb=args.gpu_memory_gb, gpu_peak_tflops=args.gpu_peak_tflops
    )


def planned_for(args: argparse.Namespace, p: Plan) -> str:
    """The first line: which device the plan is for, and whether that was chosen or is the default."""
    if args.device == "cpu":
        return f"plan for   {p.world_size} x {p.hardware.name} (--device cpu: this machine's, measured)"
    if args.gpu is None and args.gpu_memory_gb is None:
        return (
            f"plan for   {p.world_size} x {DEFAULT_GPU}, the default --gpu, not this machine's device "
            f"(--gpu NAME plans for another: {', '.join(GPUS)}; or --gpu-memory-gb; --device cpu for this "
            "machine's CPU; train_ddp.py --dry-run rehearses on this machine)"
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
