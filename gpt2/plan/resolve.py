"""The start-up's decisions in one function and one record: resolve_choices(cfg, target, start=...) settles
--dtype auto, --activation-checkpointing auto, --micro-batch-size auto, --loss-impl auto, the memory plan,
the parallelism in effect, the accumulation steps, what torch.compile compiles and the MFU peak of a run on
the Target hardware, and keeps the resume point it is given (Resolved: every part of the start-up and the
build reads these from it, none decides them again). A real start (gpt2/train/startup.py, on rank 0,
which broadcasts the answer) and train_ddp.py --dry-run (gpt2/train/dryrun.py) both call it, so a
rehearsal cannot decide otherwise than the start it rehearses; only their Targets differ (measured here,
or a GPU given by flags).

The order is the decisions' dependencies: the precision; the hardware in it (a peak is per dtype);
activation checkpointing (before the micro-batch, which auto then sizes with its memory); the micro-batch;
the loss path for that micro-batch (gpt2/plan/loss_choice.py says why in that order); the plan of the run
so made concrete. On this machine's CPU it measures, through caches: the matmul peaks (--dtype auto, the
throughput model) and, for an uncompiled --loss-impl auto, which loss path is faster (gpt2/plan/loss_probe.py).
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass

import torch

from gpt2.core.config import ModelConfig, RunConfig
from gpt2.core.precision import Precision
from gpt2.core.schedule import grad_accum_steps
from gpt2.core.start_point import StartDecision
from gpt2.model.fp8 import fp8_problem, fp8_shape_problem
from gpt2.plan import precision_choice
from gpt2.plan.ac_choice import ACChoice, choose_activation_checkpointing
from gpt2.plan.batch_choice import MicroBatchChoice, choose_micro_batch
from gpt2.plan.flops import cpu_peak, device_peak_flops, doubtful_peak, mig_profile, peak_problem
from gpt2.plan.hardware import Hardware, custom_hardware, device_hardware, gpu_native_bf16
from gpt2.plan.loss_choice import LossChoice, choose_loss_impl
from gpt2.plan.planner import Plan, plan


@dataclass(frozen=True, kw_only=True)
class Target:
    """The hardware a run is resolved for: this machine's device (a real start, or a dry run here), or a
    hypothetical GPU (a dry run's --gpu NAME / --gpu-memory-gb X [--gpu-peak-tflops Y])."""

    world_size: int = 1
    processes_per_host: int = 1
    """Ranks sharing one host: on a CPU they share its RAM (gpt2/plan/hardware.py device_hardware)."""
    device: torch.device | None = None
    """This machine's device, measured (memory, what is free now, the peak); None: nothing is measured
    here (the GPU below, or the hardware given)."""
    gpu: str | None = None
    """A GPU of gpt2/plan/hardware.py GPUS (hypothetical: not this machine)."""
    gpu_memory_gb: float | None = None
    gpu_peak_tflops: float | None = None
    hardware: Hardware | None = None
    """Memory and peak given instead of measured (a test's cap); the precision is still the device's."""

    @property
    def device_type(self) -> str:
        """'cuda' or 'cpu': where --tf32 counts, and what autocast keeps in fp32."""
        if self.hardware is not None:
            return self.hardware.device_type
        return "cuda" if self.device is None else self.device.type


FRESH = StartDecision(point=None, run_id=None)
"""A start at step 0 that moves nothing aside: what a plan, a rehearsal or a benchmark resolves for."""


@dataclass(frozen=True)
class Resolved:
    """What resolve_choices decided: the run's concrete config and each choice with its reason; the one
    record of a start's decisions (the trainer's start-up, its dry run, the benchmarks' Session)."""

    cfg: RunConfig
    """--dtype, --activation-checkpointing, --micro-batch-size and --loss-impl made concrete."""
    precision: Precision
    ac: ACChoice
    micro_batch: MicroBatchChoice
    loss: LossChoice
    plan: Plan
    """The memory plan and time estimates of cfg on hardware (not yet checked: planner.check_fits)."""
    parallel: str
    """What runs: "fsdp" (--parallel fsdp over several ranks), "ddp" (several ranks), or "single" (one
    process: --parallel fsdp with one rank trains the plain model)."""
    accum_steps: int
    """Micro-steps per optimizer step on each rank (gpt2/core/schedule.py)."""
    compile: str
    """What torch.compile compiles: "off", "model" (the whole model), or "blocks" (each block, then the
    head and loss: --compile-scope blocks, and always under fsdp, whose units each gather their weights)."""
    peak: float | None
    """This device's peak FLOP/s for MFU (mfu_peak), or None: then peak_why says why. The plan's times use
    hardware.peak_flops (plan_peak: on a busy CPU, the measured peak MFU does not use)."""
    peak_why: str
    start: StartDecision
    """Where every rank begins (gpt2/ckpt/resume.py choose_start): a checkpoint to resume, or FRESH."""
    warning: str | None = None
    """An explicit 16-bit dtype that this device emulates (slow), else None."""
    network: dict | None = None
    """Several ranks: what a step's collectives cost, measured by the start-up (gpt2/distributed/bandwidth.py
    NetworkCost.to_dict()); None on one process, in a plan and in a rehearsal."""
    peak_how: str = ""
    """On this machine's CPU: how its matmul peak was measured (gpt2.plan.matmul_peak.MeasuredPeak.how), used
    for MFU or not; "" elsewhere."""

    @property
    def hardware(self) -> Hardware:
        return self.plan.hardware


def resolve_choices(
    cfg: RunConfig,
    target: Target,
    *,
    mfu: float = 0.4,
    tokens: int | None = None,
    start: StartDecision = FRESH,
) -> Resolved:
    """Every start-up decision of cfg on target (the module docstring's order). Raises the ValueError a
    real start stops with (a model that fits nowhere, a batch that does not divide). tokens: the plan's
    budget (default max_steps x total_batch_size); mfu: the plan's assumed utilisation; start: the resume
    point the start-up chose (kept in the record)."""
    tc, world = cfg.train, target.world_size
    if tc.compute.fp8_head and (why := fp8_problem(target.device) or fp8_shape_problem(cfg.model)):
        raise ValueError(why)
    prec = target_precision(tc.compute.dtype, target, tf32=tc.compute.tf32 and target.device_type == "cuda")
    peak, peak_why = mfu_peak(target.device, prec) if target.device is not None else (None, "")
    hardware = target_hardware(target, prec, plan_peak(target.device, prec, peak))
    if target.device is None:  # a hypothetical GPU: its data sheet's peak, or why there is none
        peak = hardware.peak_flops
        peak_why = "" if peak is not None else f"{hardware.name} has no data-sheet peak (pass --gpu-peak-tflops)"
    # Each decision made concrete in cfg before the next reads it (the module docstring's order).
    cfg = with_train(cfg, dtype=prec.dtype)
    ac = choose_activation_checkpointing(cfg, hardware, world_size=world)
    cfg = with_train(cfg, activation_checkpointing=ac.mode)
    auto_mb = tc.batch.micro_batch_size == "auto"
    mb = (
        choose_micro_batch(cfg, hardware, world_size=world, measure=batch_measure(cfg, prec, hardware, world, target))
        if auto_mb
        else MicroBatchChoice(tc.batch.micro_batch_size, "--micro-batch-size")
    )
    cfg = with_train(cfg, micro_batch_size=mb.size)
    if tc.compute.fp8_head and (why := fp8_shape_problem(cfg.model, mb.size)):
        raise ValueError(why)  # the weight gradient's inner dimension: the micro-step's tokens
    loss = choose_loss_impl(
        cfg, hardware, world_size=world, measure_eager=eager_measure(cfg.model, prec, mb.size, target.device)
    )
    cfg = with_train(cfg, loss_impl=loss.impl)
    tc = cfg.train
    tokens = tc.schedule.max_steps * tc.batch.total_batch_size if tokens is None else tokens
    p = plan(cfg, hardware, world_size=world, mfu=mfu, tokens=tokens)
    p = dataclasses.replace(p, micro_batch_choice=mb if auto_mb else None)
    warning = None if target.device is None else precision_choice.emulation_warning(prec, target.device)
    parallel = parallelism(tc.distributed.parallel, world)
    return Resolved(
        cfg,
        prec,
        ac,
        mb,
        loss,
        p,
        parallel=parallel,
        accum_steps=grad_accum_steps(tc.batch.total_batch_size, mb.size, cfg.model.block_size, world),
        compile=compiled_scope(tc.compute.compile, tc.compute.compile_scope, parallel),
        peak=peak,
        peak_why=peak_why,
        start=start,
        warning=warning,
        peak_how=cpu_peak(target.device, prec.torch_dtype).how if on_cpu(target.device) else "",
    )


def parallelism(requested: str, world_size: int) -> str:
    """--parallel at this world size: "fsdp" or "ddp" over several ranks, "single" for one process."""
    if world_size == 1:
        return "single"
    return "fsdp" if requested == "fsdp" else "ddp"


def compiled_scope(compile_: bool, scope: str, parallel: str) -> str:
    """What torch.compile compiles: "off"; "blocks" under fsdp (a compiled region never spans two units'
    gathers, torchtitan's way) or with --compile-scope blocks; else "model"."""
    if not compile_:
        return "off"
    return "blocks" if parallel == "fsdp" or scope == "blocks" else "model"


def with_train(cfg: RunConfig, **changes) -> RunConfig:
    """cfg with these TrainConfig fields changed (validated again)."""
    return RunConfig(cfg.model, cfg.train.replace(**changes))


def target_precision(requested: str, target: Target, *, tf32: bool) -> Precision:
    """--dtype on the target: this device's fast dtype (gpt2/plan/precision_choice.py), or what a hypothetical GPU
    would pick: bf16 where its data sheet lists bf16 tensor cores (every GPU in the table), a custom one
    taken to have them."""
    if target.device is not None:
        return precision_choice.resolve_precision(requested, target.device, tf32=tf32)
    if gpu_native_bf16(target.gpu):
        why = (
            f"{target.gpu} has native bf16 (its data sheet's bf16 tensor-core peak)"
            if target.gpu
            else "a custom GPU is taken to have native bf16 (Ampere or newer; pass --dtype float16 for an older one)"
        )
        return precision_choice.decide(requested, "bfloat16", why, tf32=tf32)
    return precision_choice.decide(
        requested, "float16", f"{target.gpu} has no native bf16: fp16 with a loss scaler", tf32=tf32
    )


def target_hardware(target: Target, prec: Precision, peak: float | None) -> Hardware:
    """What the planner sizes for: the given hardware, the named or custom GPU, or this machine's device
    shared by the processes_per_host ranks on it, with the peak the trainer's MFU uses (None where the
    data sheets have none, or a CPU probe was disturbed: gpt2/plan/flops.py peak_problem)."""
    if target.hardware is not None:
        return target.hardware
    if target.device is None:
        return custom_hardware(target.gpu, prec, memory_gb=target.gpu_memory_gb, peak_tflops=target.gpu_peak_tflops)
    return device_hardware(target.device, peak, processes_per_host=target.processes_per_host)


def mfu_peak(device: torch.device, prec: Precision) -> tuple[float | None, str]:
    """This device's peak FLOP/s in prec for MFU, and where there is none, why (the start-up logs it as "mfu
    n/a: why"): no data-sheet peak (an unlisted GPU, a MIG slice), a CPU probe below the sanity floor, or a
    CPU peak measured on a busy machine (issue 73: MFU must not swing with the load)."""
    peak = device_peak_flops(device, prec.torch_dtype, tf32=prec.tf32)
    if peak is None:
        name = device_name(device)
        mig = mig_profile(name) if device.type == "cuda" else None
        if mig:
            return None, f"{name} is a MIG slice ({mig}), whose peak no data sheet gives"
        return None, f"{name} has no data-sheet peak in gpt2/plan/flops.py (add it there)"
    if why := peak_problem(peak, device, torch.get_num_threads()):
        return None, why
    if on_cpu(device) and (why := doubtful_peak(cpu_peak(device, prec.torch_dtype))):
        return None, why
    return peak, ""


def plan_peak(device: torch.device | None, prec: Precision, peak: float | None) -> float | None:
    """The peak the plan's times and the throughput model use: MFU's; on this machine's CPU whose measured peak
    MFU may not use because the machine was busy, that measurement still (a step time estimated under load
    is for steps under load too), but not one below the sanity floor."""
    if peak is not None or not on_cpu(device):
        return peak
    measured = cpu_peak(device, prec.torch_dtype).flop_s
    return None if peak_problem(measured, device, torch.get_num_threads()) else measured


def on_cpu(device: torch.device | None) -> bool:
    return device is not None and device.type == "cpu"


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's processor string."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()


def batch_measure(cfg: RunConfig, prec: Precision, hardware: Hardware, world: int, target: Target):
    """On this machine's CPU, uncompiled, what --micro-batch-size auto measures (gpt2/plan/batch_probe.py:
    tokens/s at a few micro-batches, each with the loss path --loss-impl would take at it; cached; the CPU's
    matmul peak tells a probe over its budget before any call); None
    elsewhere (a GPU, a compiled run, a rehearsal for other hardware)."""
    device = target.device
    if device is None or device.type != "cpu" or cfg.train.compute.compile:
        return None
    from gpt2.plan.batch_probe import micro_batch_rates

    def loss_at(b: int) -> str:
        at_b = with_train(cfg, micro_batch_size=b)
        probe = eager_measure(cfg.model, prec, b, device)
        return choose_loss_impl(at_b, hardware, world_size=world, measure_eager=probe).impl

    def measure(sizes: list[int]):
        losses = {b: loss_at(b) for b in sizes}
        return micro_batch_rates(cfg.model, prec, losses, peak_flop_s=probe_peak(device, prec))

    return measure


def eager_measure(m: ModelConfig, prec: Precision, mb: int, device: torch.device | None):
    """On this machine's CPU, what --loss-impl auto measures uncompiled (gpt2/plan/loss_probe.py: which path
    is faster at the run's shape, cached); None elsewhere (a GPU, or a rehearsal for other hardware)."""
    if device is None or device.type != "cpu":
        return None
    from gpt2.plan.loss_probe import eager_loss_times

    return lambda: eager_loss_times(
        str(device), prec, mb * m.block_size, m.n_embd, m.vocab_size, peak_flop_s=probe_peak(device, prec)
    )


def probe_peak(device: torch.device, prec: Precision) -> float:
    """The matmul FLOP/s a CPU probe's calls cannot beat, to know a probe over its budget before any call: this
    run's MFU peak (measured already, or cached), even where MFU may not use it. One measured under load is
    low, so its floor too high, and a busy machine may skip a probe a quiet one would run; but that probe,
    under the same load, would be doubtful, not cached, and keep the same choice (the largest micro-batch,
    the chunked loss). On 2 cores with --num-threads 4 the peak probe ran at 6 GFLOP/s and the probes' calls
    as slowly: 300 s of a dry run."""
    return cpu_peak(device, prec.torch_dtype).flop_s
