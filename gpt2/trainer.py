"""The training loop: build(), train_step(), evaluate(), train(). Importable and testable.

Everything distributed goes through the `Dist` passed in; nothing reads the environment.
"""

from __future__ import annotations

import contextlib
import json
import math
import platform
import random
import resource
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt2 import checkpoint as ckpt
from gpt2 import precision
from gpt2 import preempt
from gpt2.atomic import atomic_write_text
from gpt2.bandwidth import NetworkCost, format_network_cost, measure_network, network_warning
from gpt2.ckpt_writer import CheckpointWriteError, CheckpointWriter
from gpt2.config import RunConfig, TrainConfig
from gpt2.data import EvalLoader, ShardSet, TrainLoader, find_shards
from gpt2.dist import (Dist, all_gather_object, all_reduce_sum, barrier, broadcast_object, collective,
                       set_compile_threads, set_cpu_threads, set_timeout)
from gpt2.flops import checked_mfu, device_peak_flops, format_flops, peak_problem
from gpt2.metrics import Metrics, plot_loss_curve
from gpt2.model import GPT
from gpt2.optim import make_optimizer, optimizer_kind
from gpt2.resume import Start, agree_on_step, choose_start, set_aside_earlier_run
from gpt2.rundir import RUN_INFO
from gpt2.schedule import grad_accum_steps, lr_at

if TYPE_CHECKING:
    from gpt2.plan import LossChoice


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops without checkpointing the bad state."""


@dataclass
class Parts:
    """What build() makes: the raw model (for checkpoints and sampling) and the wrapped one (to train)."""
    model: GPT
    train_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: TrainLoader
    val_loader: EvalLoader | None
    accum_steps: int
    scaler: torch.amp.GradScaler
    """Scales the loss under float16 (its gradients would underflow); disabled, a pass-through, otherwise."""
    step: int = 0
    writer: CheckpointWriter | None = None
    """Rank 0's background checkpoint writer (--async-ckpt); None on the other ranks and when off."""
    run_id: str | None = None
    """The run this one is (gpt2/rundir.py): recorded in config.json and in every checkpoint it writes."""


def configure_backends(cfg: TrainConfig, dist: Dist) -> None:
    if dist.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    set_cpu_threads(dist, cfg.num_threads)


def check_data(cfg: RunConfig, world_size: int, *, shards: bool = True) -> tuple[ShardSet | None, ShardSet | None]:
    """Validate shards and batch maths before any process group or model exists.

    shards=False checks everything but the shards (train_ddp.py --dry-run where --data-dir is absent).
    """
    tc = cfg.train
    if tc.micro_batch_size == "auto":  # sized later, by the planner: here only "some micro-batch divides"
        grad_accum_steps(tc.total_batch_size, 1, cfg.model.block_size, world_size)
    else:
        grad_accum_steps(tc.total_batch_size, tc.micro_batch_size, cfg.model.block_size, world_size)
    train_shards = find_shards(tc.data_dir, "train") if shards else None
    val_shards = find_shards(tc.data_dir, "val") if shards and tc.eval_tokens > 0 else None
    import importlib.util
    for wanted, package, flag in ((tc.tensorboard, "tensorboard", "--tensorboard"),
                                  (tc.wandb_project, "wandb", "--wandb-project")):
        if wanted and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} needs the {package} package: pip install {package}, or drop the flag")
    if tc.sample_interval:
        from gpt2.tokenizer import encode_prompt
        try:  # too long: an error now, not at the first sample
            encode_prompt(tc.sample_prompt, cfg.model.block_size)
        except ValueError as e:
            raise ValueError(f"--sample-prompt: {e}") from None
    if tc.hellaswag_interval and Path(tc.hellaswag_file).is_file():
        from gpt2.hellaswag import load_examples
        load_examples(tc.hellaswag_file)  # a malformed line fails here (file:line), before any process group
    return train_shards, val_shards


def auto_micro_batch(cfg: RunConfig, dtype: str, hardware, world_size: int) -> int:
    """The run's micro-batch: the explicit one, or (auto) the planner's largest that fits hardware
    and divides the global batch at world_size. dtype: the resolved TrainConfig.dtype."""
    from gpt2.plan import auto_micro_batch_size, plan_dtype

    tc = cfg.train
    if tc.micro_batch_size != "auto":
        return tc.micro_batch_size
    return auto_micro_batch_size(cfg.model, cfg.model.block_size, hardware, world_size=world_size,
                                 total_batch_size=tc.total_batch_size, optimizer=tc.optimizer,
                                 dtype=plan_dtype(dtype, tf32=tc.tf32 and hardware.device_type == "cuda"))


def auto_loss_impl(cfg: RunConfig, dtype: str, mb: int, hardware, world_size: int) -> LossChoice:
    """The run's loss path (gpt2.plan.LossChoice) for its resolved dtype and micro-batch on hardware:
    --loss-impl chunked/full, or (auto) the planner's rule, choose_loss_impl."""
    from gpt2.plan import choose_loss_impl, plan_dtype

    tc = cfg.train
    return choose_loss_impl(cfg.model, tc.loss_impl, micro_batch_size=mb, hardware=hardware, world_size=world_size,
                            optimizer=tc.optimizer, compiled=tc.compile,
                            dtype=plan_dtype(dtype, tf32=tc.tf32 and hardware.device_type == "cuda"))


def log_auto(cfg: RunConfig, prec: precision.Precision, mb: int, warning: str | None, log,
             loss: LossChoice) -> None:
    log.info(f"precision  {prec.dtype}: {prec.reason}")
    if warning:
        log.warn(warning)
    if cfg.train.micro_batch_size == "auto":
        log.info(f"micro-batch auto: {mb} sequences, the largest that fits and divides the global batch")
    log.info(loss.describe())


def resolve_auto(cfg: RunConfig, dist: Dist, log: Metrics,
                 hardware=None) -> tuple[RunConfig, precision.Precision, LossChoice]:
    """--dtype, --micro-batch-size and --loss-impl auto made concrete (the loss path is chosen for the
    micro-batch, gpt2/plan.py FULL_LOSS_MEMORY_SHARE says why). Rank 0 measures and decides and every
    rank takes its answer: ranks that chose differently would compute different things silently.
    A model that fits nowhere is rank 0's finding too: every rank raises its error, none waits.

    hardware: what the planner sizes the micro-batch for (default: this device; tests pass a cap).
    """
    from gpt2.plan import device_hardware

    tc = cfg.train
    decision = None
    if dist.is_main:
        try:
            prec = precision.resolve(tc.dtype, dist.device)
            hardware = hardware or device_hardware(dist.device, 0.0, processes_per_host=dist.local_world_size)
            mb = auto_micro_batch(cfg, prec.dtype, hardware, dist.world_size)
            loss = auto_loss_impl(cfg, prec.dtype, mb, hardware, dist.world_size)
            decision = ("ok", (prec, mb, loss, precision.emulation_warning(prec, dist.device)))
        except ValueError as e:
            decision = ("error", str(e))
    kind, answer = broadcast_object(decision, dist)
    if kind == "error":
        raise ValueError(answer)
    prec, mb, loss, warning = answer
    log_auto(cfg, prec, mb, warning, log, loss)
    return RunConfig(cfg.model, tc.replace(dtype=prec.dtype, micro_batch_size=mb, loss_impl=loss.impl)), prec, loss


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


MODEL_SHAPE_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "bias")


def check_compatible(saved: dict, cfg: RunConfig, log: Metrics) -> None:
    """Refuse a checkpoint of a different model or tokenizer; log other changed settings."""
    old_model, old_train = saved["config"]["model"], saved["config"]["train"]
    shape = [f"{k}: checkpoint {old_model[k]} vs now {getattr(cfg.model, k)}"
             for k in MODEL_SHAPE_FIELDS if old_model[k] != getattr(cfg.model, k)]
    if shape:
        raise ckpt.CheckpointError("the checkpoint's model shape differs from this run's: " + "; ".join(shape)
                                   + ". Use the same shape flags, or start fresh with --resume never")
    saved_optimizer = optimizer_kind(saved.get("optimizer", {}))
    if saved_optimizer != cfg.train.optimizer:
        raise ckpt.CheckpointError(
            f"the checkpoint was trained with --optimizer {saved_optimizer}, this run asks for "
            f"--optimizer {cfg.train.optimizer}: their states differ (AdamW keeps two moments per parameter, "
            f"Muon one momentum per block matrix). Resume with --optimizer {saved_optimizer}, or start fresh "
            "with --resume never")
    if saved.get("tokenizer") != "gpt2":
        raise ckpt.CheckpointError(f"checkpoint tokenizer {saved.get('tokenizer')!r} is not gpt2")
    changed = {k: (v, getattr(cfg.train, k)) for k, v in old_train.items()
               if k not in ("resume",) and getattr(cfg.train, k, v) != v}
    for k, (old, new) in changed.items():
        log.info(f"resume: {k} changed from {old!r} to {new!r}")


def build(cfg: RunConfig, dist: Dist, log: Metrics, shards: tuple[ShardSet, ShardSet | None, int],
          start: Start | None = None) -> Parts:
    """The model, optimizer and loaders, restored from start.point when resuming.

    start: train()'s decision (choose_start, made before anything is written); None decides here,
    for callers that build in a new directory (tests, benchmarks): nothing is moved aside then.
    """
    tc, mc = cfg.train, cfg.model
    train_shards, val_shards = shards
    accum = grad_accum_steps(tc.total_batch_size, tc.micro_batch_size, mc.block_size, dist.world_size)
    torch.manual_seed(tc.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    # loss_impl is resolved by resolve_auto; callers that build without it (tests, benchmarks) and
    # leave it auto get the chunked loss, the one that is safe on memory.
    model = GPT(mc, loss_impl="full" if tc.loss_impl == "full" else "chunked").to(dist.device)
    # From here on each rank draws its own random numbers: with one seed for all, every rank would
    # drop out the same units (dropout > 0) and the ranks' noise would not average out.
    torch.manual_seed(tc.seed + dist.rank)
    optimizer = make_optimizer(model, tc, dist.device, dist)
    loader = TrainLoader(train_shards, micro_batch_size=tc.micro_batch_size, seq_len=mc.block_size,
                         total_batch_size=tc.total_batch_size, rank=dist.rank, world_size=dist.world_size,
                         seed=tc.seed, device=dist.device, pin_memory=tc.pin_memory, order=tc.data_order)
    val_loader = None
    if val_shards is not None:
        val_loader = EvalLoader(val_shards, micro_batch_size=tc.micro_batch_size, seq_len=mc.block_size,
                                eval_tokens=tc.eval_tokens, rank=dist.rank, world_size=dist.world_size,
                                device=dist.device, pin_memory=tc.pin_memory)
        if val_loader.clamped:
            log.warn(f"--eval-tokens {tc.eval_tokens} exceeds the val shards; evaluating on all "
                     f"{val_loader.tokens} tokens")
    parts = Parts(model, model, optimizer, loader, val_loader, accum, precision.make_scaler(tc.dtype, dist.device))
    if start is None:
        start = choose_start(tc.resume, tc.out_dir, dist, warn=log.warn)
    parts.run_id = start.run_id
    point = start.point
    if point is not None:
        problem = None
        try:
            restore(parts, Path(point.path), cfg, dist, log)
        except ckpt.CheckpointError as e:
            problem = str(e)
        agree_on_step(parts.step, problem, dist)  # the same error on every rank, or the same step
    if tc.compile:
        set_compile_threads(dist)  # before the first compilation, which starts inductor's workers
    train_model = torch.compile(model) if tc.compile else model
    if dist.is_distributed:
        train_model = wrap_ddp(train_model, tc, dist)
        settle_buckets(train_model, parts.loader.B, parts.loader.T, cfg.train.dtype, dist)
    parts.train_model = train_model
    return parts


def settle_buckets(ddp_model: torch.nn.Module, batch: int, seq_len: int, dtype: str, dist: Dist) -> None:
    """One synced backward of a dummy micro-batch, gradients and random numbers discarded: DDP's
    buckets take their final layout before the first step.

    DDP all-reduces a process's first backward as one bucket in parameter order and then rebuilds
    its buckets in the order the gradients became ready. With 3 or more ranks a sum's rounding
    depends on where an element sits in the all-reduced buffer (the ring's chunks), so a resumed
    run's first step summed the gradients differently from the uninterrupted run's same step and
    the runs drifted apart (found by the 4-node x 2-rank rehearsal in tests/test_multinode.py; with
    2 ranks a sum is exact either way). Now every step of every run uses the same buckets. Costs one
    micro-step's forward, backward and all-reduce at start-up.
    """
    saved = rng_state()  # dropout draws here must not shift the training's random numbers
    x = torch.zeros(batch, seq_len, dtype=torch.long, device=dist.device)
    with collective("DDP's first (bucket-settling) gradient all-reduce"):
        with precision.autocast(dtype, dist.device):
            _, loss = ddp_model(x, x, return_logits=False)
        loss.backward()
    for p in ddp_model.parameters():
        p.grad = None
    set_rng_state(saved)


DDP_DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's own default bucket size (TrainConfig.ddp_bucket_cap_mb's default)."""


def wrap_ddp(train_model: torch.nn.Module, tc: TrainConfig, dist: Dist) -> DDP:
    """DDP around the (compiled) model; its all-reduces overlap the compiled backward.

    torch.compile is lazy: the model is compiled at the first training step, inside DDP's forward,
    where dynamo's DDPOptimizer (torch 2.13: any frame compiled while DDP's forward runs) splits the
    graph at DDP's buckets. One compiled backward per bucket, each bucket's all-reduce starting when
    its graph ends (tests/test_ddp_compile.py: the graphs, a profile, losses as eager DDP's). For
    124M on NCCL that is ~500 MB of fp32 gradients in ~20 buckets of 25 MiB; the tied embedding's
    154 MB is complete only after the embedding's backward, the last op, so its all-reduce is
    exposed in any order. Chosen by bench/train_throughput.py's order rows (README, "DDP and
    torch.compile"): compiling the DDP module builds the same graphs (same compile and step time
    within noise) but evaluation, which bypasses DDP, would run eager. Compiling each block alone
    (torchtitan's way) compiled 2.8x faster at the benchmark's shape, at a step time within this
    machine's noise, but leaves the LM head and loss eager (on a GPU the memory-bound part compile
    fuses) and would compile the blocks that sampling and HellaSwag share (KV-cache generation
    recompiling per length): compile time is paid once a run, steps every step.
    """
    # Gradients as views into the all-reduce buckets: no second copy of every gradient (memory)
    # and no copy in and out of the buckets each step (the maths is unchanged). No buffer sync
    # before each forward: the only buffer (the padded vocab's -inf logit bias) is a constant every
    # rank builds identically (forward_sync_buffers replaces torch 2.13's deprecated
    # broadcast_buffers; it still syncs buffers once, at init). bucket_cap_mb=None at DDP's default
    # keeps DDP's small first bucket (1 MiB, also dynamo's first split); any other value applies
    # to every bucket.
    cap = None if tc.ddp_bucket_cap_mb == DDP_DEFAULT_BUCKET_CAP_MB else tc.ddp_bucket_cap_mb
    with collective("DDP's broadcast of the initial weights"):
        return DDP(train_model, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
                   bucket_cap_mb=cap, gradient_as_bucket_view=True, forward_sync_buffers=False)


def restore(parts: Parts, path: Path, cfg: RunConfig, dist: Dist, log: Metrics) -> None:
    # Verified by choose_resume (hashed once per node). mmap: the tensors stay in the page cache,
    # which the ranks of a node share, so host memory does not grow with ranks x checkpoint size.
    state = ckpt.load_checkpoint(path, verify=False, mmap=True)
    check_compatible(state, cfg, log)
    parts.model.load_state_dict(state["model"])
    # The schedule sets lr each step; these come from this run's flags, not from the checkpoint.
    fresh = [{k: g[k] for k in ("weight_decay", "momentum", "lr_scale") if k in g}
             for g in parts.optimizer.param_groups]
    parts.optimizer.load_state_dict(state["optimizer"])
    for group, keep in zip(parts.optimizer.param_groups, fresh, strict=True):
        group.update(keep)
    if parts.scaler.is_enabled() and state.get("scaler"):  # fp16 before and now: the scale goes on
        parts.scaler.load_state_dict(state["scaler"])
    try:
        parts.loader.load_state_dict(state["loader"])
    except ValueError as e:  # other data, seed or order: a user error with its fix in the message
        raise ckpt.CheckpointError(f"{path}: {e}") from None
    if parts.loader.order != cfg.train.data_order:
        log.info(f"resume: {path} predates --data-order; continuing with the {parts.loader.order} order "
                 "it was trained with (start fresh, --resume never, for the shuffled one)")
    rngs = state["rng"]
    # Same world size: each rank gets its own RNG back. Otherwise rank r takes saved rank r mod W.
    set_rng_state(rngs[dist.rank % len(rngs)])
    parts.step = state["step"]
    if state["world_size"] != dist.world_size:
        log.info(f"resume: world size {state['world_size']} -> {dist.world_size}; "
                 f"accumulation is now {parts.accum_steps} micro-steps")
    log.info(f"resumed from {path} at step {parts.step} ({state['tokens']:,} tokens)")
    try:  # rank 0 alone reads the log: its problem must reach every rank (build's agree_on_step)
        log.truncate_after(parts.step)
    except ValueError as e:
        raise ckpt.CheckpointError(str(e)) from None


def save(parts: Parts, cfg: RunConfig, dist: Dist, log: Metrics, requeue: dict | None = None, *,
         background: bool = False) -> None:
    """Every rank contributes its RNG state; rank 0 writes.

    background (the same on every rank; needs parts.writer on rank 0, gpt2/ckpt_writer.py): rank 0
    copies the state to host memory, a thread writes it, and every rank goes on training. Otherwise
    everyone waits for the write at a barrier. Either way rank 0 first waits for the write in flight,
    and its error travels with the RNG states, so every rank raises the same CheckpointWriteError
    (none is left waiting in a collective).
    requeue: a signal stop's RUN/requeue content (always synchronous). Rank 0 writes and fsyncs the
    marker after the checkpoint and before the closing barrier, so no rank (on no node) can leave
    the stop path, and let srun --kill-on-bad-exit end the job step, before the marker is on disk.
    """
    problem = finish_background_write(parts, log) if dist.is_main else None
    gathered = all_gather_object((rng_state(), problem), dist)
    if gathered[0][1] is not None:
        raise CheckpointWriteError(gathered[0][1])
    background = background and requeue is None
    if dist.is_main:
        state = {"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
                 "scaler": parts.scaler.state_dict(),
                 "config": cfg.to_dict(), "tokenizer": "gpt2", "loader": parts.loader.state_dict(),
                 "rng": [rng for rng, _ in gathered], "world_size": dist.world_size,
                 "tokens": parts.step * cfg.train.total_batch_size, "torch_version": str(torch.__version__)}
        if background:
            parts.writer.submit(cfg.train.out_dir, parts.step, state, keep=cfg.train.keep_checkpoints,
                                run_id=parts.run_id, warn=log.warn)
            log.info(f"checkpoint of step {parts.step}: writing it in the background")
        else:
            path = ckpt.save_checkpoint(cfg.train.out_dir, parts.step, state, keep=cfg.train.keep_checkpoints,
                                        run_id=parts.run_id, warn=log.warn)
            log.info(f"saved checkpoint {path}")
            if requeue is not None:  # after the checkpoint: the marker promises a complete one
                preempt.write_requeue_marker(cfg.train.out_dir, {**requeue, "checkpoint": path.name})
    if not background:
        barrier(dist)


def finish_background_write(parts: Parts, log: Metrics) -> str | None:
    """Rank 0: wait for the checkpoint write in flight; its error as a message, or None."""
    if parts.writer is None:
        return None
    try:
        done = parts.writer.wait()
    except CheckpointWriteError as e:
        return f"{e}. The newest complete checkpoint is the one before it; free space or fix the run directory, " \
               "then resume with --resume auto"
    if done is not None:
        log.info(f"saved checkpoint {done['path']} (in the background: copied in {done['copy_s']:.1f} s, "
                 f"written in {done['write_s']:.1f} s)")
    return None


def train_step(parts: Parts, cfg: RunConfig, dist: Dist, stop_requested: bool) -> dict:
    """One optimizer step: accumulate micro-batches, sync gradients on the last, clip, update.

    Returns loss (mean over micro-steps and ranks), grad_norm, lr, whether any rank asked to stop,
    whether the update was skipped because the loss or the gradient norm was not finite, and (fp16)
    whether the loss scaler found an overflow and skipped the update itself.
    """
    tc = cfg.train
    lr = lr_at(parts.step, max_lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps)
    for group in parts.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups: --muon-lr on the same schedule
    loss_sum = torch.zeros((), device=dist.device)
    autocast = precision.autocast(tc.dtype, dist.device)
    for micro_step in range(parts.accum_steps):
        x, y = parts.loader.micro_batch(micro_step)
        # Decide gradient sync before the forward pass: DDP registers its hooks during forward.
        last = micro_step == parts.accum_steps - 1
        sync = contextlib.nullcontext() if last or not dist.is_distributed else parts.train_model.no_sync()
        with sync:
            with autocast:
                _, loss = parts.train_model(x, y, return_logits=False)  # the model's loss_impl path
            loss = loss / parts.accum_steps
            loss_sum += loss.detach()
            # The last micro-step's backward all-reduces the gradients (DDP's hooks), so its errors
            # are reported as the process group's; a compute error there (rarer: the same backward
            # runs in every micro-step) is reported the same way, with its own message kept.
            with collective("the gradient all-reduce") if last and dist.is_distributed else contextlib.nullcontext():
                parts.scaler.scale(loss).backward()
    parts.scaler.unscale_(parts.optimizer)  # clip and measure the true gradients (a no-op unless fp16)
    clip = tc.grad_clip if tc.grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(parts.model.parameters(), clip)
    # One all-reduce carries the loss and the stop flag: every rank sees the same values, so
    # every rank takes the same skip / stop decision. torch.full launches a fill, no host copy.
    stats = torch.stack([loss_sum.float(), torch.full((), float(stop_requested), device=dist.device)])
    all_reduce_sum(stats, dist)
    # The step's one host sync: the skip decision below needs these three numbers on the host.
    # (fp16 adds the GradScaler's own read of its overflow flag inside scaler.step.)
    loss_total, stop_votes, grad_norm = torch.stack([stats[0], stats[1], grad_norm.float()]).tolist()
    loss_mean, stop = loss_total / dist.world_size, stop_votes > 0
    loss_ok, norm_ok = math.isfinite(loss_mean), math.isfinite(grad_norm)
    # fp16: a finite loss with non-finite gradients is an overflow of the scaled gradients. The
    # scaler skips that update and lowers its scale: its normal working, not a bad step.
    overflow = parts.scaler.is_enabled() and loss_ok and not norm_ok
    skipped = not (loss_ok and norm_ok) and not overflow
    if parts.writer is not None:  # rank 0, a checkpoint being copied: the update below changes its tensors
        parts.writer.wait_copied()
    if not skipped:
        parts.scaler.step(parts.optimizer)  # optimizer.step(), unless the scaler found an overflow
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)
    parts.loader.advance()
    parts.step += 1
    return {"loss": loss_mean, "grad_norm": grad_norm, "lr": lr, "stop": stop, "skipped": skipped,
            "overflow": overflow}


def evaluate(parts: Parts, cfg: RunConfig, dist: Dist) -> float:
    """Mean loss per token over the fixed validation set, reduced over ranks."""
    from gpt2.scoring import loader_loss

    return loader_loss(parts.train_model, parts.val_loader, cfg.train.dtype, dist)


def sample_text(parts: Parts, cfg: RunConfig, dist: Dist) -> str:
    """A text sample from rank 0's model (KV-cache generation, its own RNG: training is unaffected)."""
    from gpt2 import tokenizer
    from gpt2.model import TOP_K

    tc = cfg.train
    prompt = tokenizer.encode_prompt(tc.sample_prompt, cfg.model.block_size)  # checked in check_data
    gen = torch.Generator(device=dist.device).manual_seed(tc.seed + parts.step)
    idx = torch.tensor([prompt], dtype=torch.long, device=dist.device)
    parts.model.eval()
    with precision.autocast(tc.dtype, dist.device):
        out = parts.model.generate(idx, tc.sample_tokens, temperature=1.0, top_k=TOP_K, generator=gen)
    parts.model.train()
    return tokenizer.decode(out[0, len(prompt):].tolist())


def mfu_peak(dist: Dist, dtype: str, log: Metrics) -> float | None:
    """This rank's peak FLOP/s for MFU, or None (logged as "mfu n/a: why"): an unlisted GPU, or a CPU
    probe that is clearly wrong."""
    peak = device_peak_flops(dist.device, precision.torch_dtype(dtype))
    if peak is None:
        log.info(f"mfu n/a: {device_name(dist.device)} has no data-sheet peak in gpt2/flops.py (add it there)")
        return None
    if why := peak_problem(peak, dist.device, torch.get_num_threads()):
        log.info(f"mfu n/a: {why}")
        return None
    if dist.device.type == "cpu":
        log.info(f"peak       {format_flops(peak)} per rank ({torch.get_num_threads()} thread(s)): the best of "
                 f"{precision.PEAK_PROBES} matmul probes, cached in {precision.peak_cache_dir()} "
                 f"({precision.REFRESH_PEAK_ENV}=1 measures again)")
    return peak


def forget_cpu_peak(device: torch.device, dtype: str) -> None:
    """An MFU above 100% proved the measured peak wrong: the next run must not read it from the cache.
    device_peak_flops took the larger of the dtype's and fp32's peaks, so both go."""
    if device.type == "cpu":
        for d in {precision.torch_dtype(dtype), torch.float32}:
            precision.forget_peak(str(device), d)


def check_memory(cfg: RunConfig, dist: Dist, peak: float | None, log: Metrics) -> None:
    """Print the planner's summary and refuse a configuration that clearly cannot fit, before allocating.
    Returns the plan (gpt2.plan.Plan)."""
    from gpt2.plan import device_hardware

    hardware = device_hardware(dist.device, peak, processes_per_host=dist.local_world_size)
    return check_plan(cfg, hardware, dist.world_size, log)


def check_plan(cfg: RunConfig, hardware, world_size: int, log):
    """The planner's summary for this run on hardware (logged), refused if it clearly cannot fit."""
    from gpt2.plan import check_fits, format_plan, format_stop, plan_run

    p = plan_run(cfg, hardware, world_size=world_size)
    log.info(format_plan(p))
    log.info(format_stop(p))  # the SLURM signal lead and grace this run's checkpoint needs
    check_fits(p)
    return p


def log_network_cost(cfg: RunConfig, dist: Dist, p, log: Metrics) -> NetworkCost | None:
    """Several ranks: time one gradient bucket's all-reduce and say what a step's would cost against
    the plan's compute per step (one line; a warning above WARN_SHARE). None on one process."""
    cost = measure_network(dist, bucket_cap_mb=cfg.train.ddp_bucket_cap_mb, n_params=p.n_params,
                           step_compute_s=p.step_time_s)
    if cost is not None:
        log.info(format_network_cost(cost) + (f" at the planner's {p.mfu:.0%} MFU" if cost.share is not None else ""))
        warning = network_warning(cost)
        if warning:
            log.warn(warning)
    return cost


def log_hellaswag(parts: Parts, cfg: RunConfig, dist: Dist, log: Metrics, examples, step: int) -> None:
    from gpt2.scoring import hellaswag_eval

    hs = hellaswag_eval(parts.model, examples, dist, dist.device, dtype=cfg.train.dtype, progress=False)
    log.record({"step": step, "tokens": step * cfg.train.total_batch_size, "hellaswag_acc": hs["acc"],
                "hellaswag_acc_norm": hs["acc_norm"]})
    log.info(f"step {step:>6} | hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['correct_norm']}/{hs['n']})")


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()


def write_run_info(cfg: RunConfig, dist: Dist, parts: Parts, peak: float | None, prec: precision.Precision,
                   loss: LossChoice, network: NetworkCost | None = None) -> None:
    if not dist.is_main:
        return
    import tiktoken

    info = {"run_id": parts.run_id, "config": cfg.to_dict(), "world_size": dist.world_size, "device": str(dist.device),
            "device_name": device_name(dist.device),
            "precision": prec.to_dict(), "loss": loss.to_dict(),
            "accum_steps": parts.accum_steps, "params": parts.model.num_params(), "peak_flops_per_rank": peak,
            "hostname": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__,
                         "numpy": np.__version__, "tiktoken": tiktoken.__version__}}
    if network is not None:  # several ranks: the start-up all-reduce measurement (gpt2/bandwidth.py)
        info["network"] = network.to_dict()
    atomic_write_text(Path(cfg.train.out_dir) / RUN_INFO, json.dumps(info, indent=2))


def train(cfg: RunConfig, dist: Dist, shards=None) -> int:
    """Run training to max_steps (or until a stop signal). Returns 0, or EXIT_REQUEUE after a signal."""
    # Signals are recorded from the start: one that arrives while building or restoring stops the
    # run at the first step boundary (with a checkpoint) instead of killing the process.
    with preempt.StopRequest() as stop_request:
        return _train(cfg, dist, shards, stop_request)


def _train(cfg: RunConfig, dist: Dist, shards, stop_request: preempt.StopRequest) -> int:
    tc = cfg.train
    Path(tc.out_dir).mkdir(parents=True, exist_ok=True)
    if dist.is_main:  # RUN/requeue says "the last run stopped on a signal": not true of this one
        preempt.clear_requeue_marker(tc.out_dir)
    configure_backends(tc, dist)
    # The console only, for now: TensorBoard and W&B write into RUN, which may still hold an earlier
    # run's records until the start is decided and they are moved aside (below).
    log = Metrics(dist, tc.out_dir)
    shards = shards or check_data(cfg, dist.world_size)
    log.info(f"starting   {dist.world_size} rank(s) on {dist.device}: choosing precision, planning memory, "
             f"building the model")
    cfg, prec, loss = resolve_auto(cfg, dist, log)
    tc = cfg.train
    peak = mfu_peak(dist, tc.dtype, log)
    network = log_network_cost(cfg, dist, check_memory(cfg, dist, peak, log), log)
    # Decided after every check that can refuse the configuration, so a refused run moves nothing;
    # the earlier run's records go aside before the first write into RUN (sinks, restore, config.json).
    start = choose_start(tc.resume, tc.out_dir, dist, warn=log.warn)
    moved = set_aside_earlier_run(start, tc.out_dir, dist)
    if moved is not None:
        why = "fresh start" if start.point is None else f"resuming run {start.run_id} from {start.point.path}"
        log.info(f"{why}: moved the earlier run's {', '.join(start.set_aside)} from {tc.out_dir} into {moved}/ "
                 "(nothing deleted)")
    log.open_sinks(tensorboard=tc.tensorboard, wandb_project=tc.wandb_project, run_config=cfg.to_dict())
    parts = build(cfg, dist, log, shards, start)
    if parts.step >= tc.max_steps:  # e.g. the quick start run a second time
        log.info(f"nothing to train: {tc.out_dir} already finished step {parts.step} of --max-steps "
                 f"{tc.max_steps}. Pass a larger --max-steps to continue this run, or another --out-dir "
                 "(or --resume never, which moves this run's files into a previous-* folder) to start a new one")
        log.close()
        return 0
    write_run_info(cfg, dist, parts, peak, prec, loss, network)
    log.info(f"model {parts.model.num_params():,} parameters | world size {dist.world_size} | "
             f"{parts.accum_steps} micro-steps of {tc.micro_batch_size}x{cfg.model.block_size} per step | "
             f"{tc.total_batch_size:,} tokens/step | device {dist.device} | {tc.dtype} | compile {tc.compile}")
    if tc.compile:
        import torch._inductor.config as inductor_config
        log.info("compiling: the first step (and the first evaluation) compile the model, which can take "
                 f"a minute or more ({inductor_config.compile_threads} compile workers per rank)")
    if parts.step == 0 and parts.val_loader is not None:
        log.log_eval(0, 0, evaluate(parts, cfg, dist))
    hellaswag = None
    if tc.hellaswag_interval:
        from gpt2.hellaswag import prepare_hellaswag
        hellaswag = prepare_hellaswag(tc.hellaswag_file, dist)  # collective: rank 0 downloads if missing
    if dist.is_main and tc.async_ckpt:
        parts.writer = CheckpointWriter(dist.device)
    bad_steps = 0
    slow_phase = True  # start-up: collectives run under --dist-timeout-s until a step has completed
    try:
        while parts.step < tc.max_steps:
            t0 = time.perf_counter()
            out = train_step(parts, cfg, dist, stop_request.signum is not None)
            if slow_phase:  # steady state: a dead or hung peer is found within --dist-step-timeout-s
                set_timeout(dist, tc.dist_step_timeout_s)
                slow_phase = False
            # No cuda.synchronize: train_step's host read waits for this step's forward and backward
            # and for the previous step's optimizer update, so in steady state dt is one step's time.
            dt = time.perf_counter() - t0
            step = parts.step
            bad_steps = bad_steps + 1 if out["skipped"] else (bad_steps if out["overflow"] else 0)
            if step % tc.log_interval == 0 or out["skipped"] or out["overflow"] or step == tc.max_steps:
                tok_s = tc.total_batch_size / dt
                step_mfu, why = checked_mfu(tok_s / dist.world_size, cfg.model, peak) if peak else (None, None)
                if why:  # once: the peak is wrong for the rest of the run too
                    log.info(f"mfu n/a: {why}")
                    forget_cpu_peak(dist.device, tc.dtype)
                    peak = None
                log.log_step({"step": step, "loss": out["loss"], "lr": out["lr"], "grad_norm": out["grad_norm"],
                              "tokens": step * tc.total_batch_size, "step_s": dt, "tok_per_s": tok_s,
                              "mfu": step_mfu,
                              "mem_mb": memory_mb(dist.device), "skipped": out["skipped"],
                              **({"overflow": out["overflow"], "loss_scale": parts.scaler.get_scale()}
                                 if parts.scaler.is_enabled() else {})}, tc.max_steps)
            if bad_steps >= tc.max_bad_steps:
                raise NonFiniteError(
                    f"{bad_steps} consecutive steps had a non-finite loss or gradient norm (last: step {step});"
                    " their updates were skipped and no checkpoint was written from them. Lower --lr, raise "
                    "--warmup-steps or check the data, then resume from the last checkpoint")
            done = step == tc.max_steps
            stopping = out["stop"] and not done  # a signal at the last step changes nothing: the run is complete
            evaluating = parts.val_loader is not None and (done or (tc.eval_interval and step % tc.eval_interval == 0))
            hellaswag_now = hellaswag and (done or step % tc.hellaswag_interval == 0)
            sampling = tc.sample_interval and (done or step % tc.sample_interval == 0)  # rank 0 samples alone
            saving = stopping or done or (tc.ckpt_interval and step % tc.ckpt_interval == 0)
            if evaluating or hellaswag_now or sampling or saving:
                # Every rank decides this alike. The long timeout also covers the next step, whose
                # collectives wait for the ranks still busy here (rank 0 sampling or writing).
                set_timeout(dist, tc.dist_timeout_s)
                slow_phase = True
            if evaluating:
                log.log_eval(step, step * tc.total_batch_size, evaluate(parts, cfg, dist))
            if hellaswag_now:
                log_hellaswag(parts, cfg, dist, log, hellaswag, step)
            if sampling and dist.is_main:
                text = sample_text(parts, cfg, dist)
                log.record({"step": step, "sample": text})
                log.info(f"sample at step {step}: {text!r}")
            if saving:  # the final and the stop's save are synchronous: the run ends with a durable one
                save(parts, cfg, dist, log, requeue={"step": step, "signal": stop_request.name} if stopping else None,
                     background=tc.async_ckpt and not (stopping or done))
            if stopping:
                log.info(f"stopped by signal at step {step}; checkpoint written; wrote {tc.out_dir}/"
                         f"{preempt.REQUEUE_MARKER} (requeue and resume with --resume auto)")
                return preempt.EXIT_REQUEUE
        if dist.is_main and tc.plot:
            png = plot_loss_curve(log.path, Path(tc.out_dir) / "loss_curve.png")
            log.info(f"loss curve: {png}" if png else "loss curve skipped: matplotlib is not installed")
        return 0
    finally:
        if dist.is_main and parts.writer is not None:  # an error or a stop: let the write in flight finish
            problem = finish_background_write(parts, log)
            if problem:
                log.warn(problem)
        log.close()
        for loader in (parts.loader, parts.val_loader):  # the shard files they keep open
            if loader is not None:
                loader.close()
