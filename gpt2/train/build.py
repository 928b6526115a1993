"""build(): the run's model, optimizer, loaders and their wrappers, as the start-up's record says.

Called by the start-up (gpt2/train/startup.py start) once every decision is in its record (gpt2/plan/
resolve.py Resolved): the precision, the loss path and activation checkpointing, the parallelism, the
accumulation steps, what torch.compile compiles and the resume point. It decides none of them again. The
order is torchtitan's: the model (activation checkpointing set at construction), --init-from's weights, FSDP's
shards, the optimizer over what each rank holds, the loaders, the restore, then torch.compile and DDP.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.resume import agree_on_step
from gpt2.core.compat import ddp_no_buffer_sync
from gpt2.core.config import DistributedConfig, weight_changes
from gpt2.core.precision import Precision
from gpt2.core.schedule import BatchLayout
from gpt2.data.loader import ShardSet
from gpt2.data.mixture import MixedShards, eval_loader, train_loader
from gpt2.distributed.fsdp import shard as shard_fsdp
from gpt2.distributed.group import Dist, collective, set_compile_threads
from gpt2.model.gpt import GPT
from gpt2.plan.resolve import Resolved
from gpt2.train.optim import make_optimizer
from gpt2.train.run_log import RunLog
from gpt2.train.spike_guard import SpikeGuard
from gpt2.train.state import Parts, restore, rng_state, set_rng_state


def build(
    decided: Resolved, dist: Dist, log: RunLog, shards: tuple[ShardSet | MixedShards, ShardSet | MixedShards | None]
) -> Parts:
    """The model, optimizer and loaders of the decided run, restored from decided.start.point when resuming."""
    cfg = decided.cfg
    tc, mc = cfg.train, cfg.model
    train_shards, val_shards = shards
    start, fsdp = decided.start, decided.parallel == "fsdp"
    torch.manual_seed(tc.data.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    # Activation checkpointing is set at construction, before fully_shard and torch.compile see the blocks
    # (torchtitan's order: AC, then compile, then FSDP).
    model = GPT(
        mc,
        loss_impl=tc.compute.loss_impl,
        activation_checkpointing=tc.compute.activation_checkpointing == "full",
        fp8_head=tc.compute.fp8_head,
    ).to(dist.device)
    init_record = None
    if tc.ckpt.init_from:  # the source's weights over the fresh ones (the random numbers drawn are the same)
        from gpt2.train.init_from import start_from_weights

        init_record = start_from_weights(
            model, tc.ckpt.init_from, start.point, tc.ckpt.out_dir, start.run_id, dist, log, broadcast=fsdp
        )
    if fsdp:  # before the optimizer: it must hold the shards, not the full weights
        model = shard_fsdp(model, dist, decided.precision)
    # From here on each rank draws its own random numbers: with one seed for all, every rank would
    # drop out the same units (dropout > 0) and the ranks' noise would not average out.
    torch.manual_seed(tc.data.seed + dist.rank)
    optimizer = make_optimizer(model, tc.optim, dist.device, peak_lr=tc.schedule.lr, prec=decided.precision, dist=dist)
    loader = train_loader(  # TrainLoader, or a MixtureLoader for several --data-dir sources
        train_shards,
        BatchLayout(tc.batch.micro_batch_size, mc.block_size, tc.batch.total_batch_size, dist.world_size),
        changes=weight_changes(tc),
        rank=dist.rank,
        seed=tc.data.seed,
        device=dist.device,
        pin_memory=tc.compute.pin_memory,
        order=tc.data.data_order,
        defer_bad_tokens=True,  # train_step stops every rank alike
    )
    val_loader = None
    if val_shards is not None:
        val_loader = eval_loader(
            val_shards,
            tc.data.weights,
            micro_batch_size=tc.batch.micro_batch_size,
            seq_len=mc.block_size,
            eval_tokens=tc.eval.eval_tokens,
            rank=dist.rank,
            world_size=dist.world_size,
            device=dist.device,
            pin_memory=tc.compute.pin_memory,
        )
        if val_loader.clamped:
            which = "" if val_loader.clamped is True else f" of {', '.join(val_loader.clamped)}"
            log.warn(
                f"--eval-tokens {tc.eval.eval_tokens} exceeds the val shards{which}; evaluating on all "
                f"{val_loader.tokens} tokens"
            )
    prec = decided.precision
    parts = Parts(model, model, optimizer, loader, val_loader, decided.accum_steps, prec.scaler(dist.device), prec)
    parts.run_id, parts.init_from = start.run_id, init_record
    parts.guard = (
        SpikeGuard(tc.spike, dist.device) if tc.spike.spike_guard else None
    )  # before restore: its state is checkpointed
    if parts.guard is not None and decided.compile != "off" and dist.device.type == "cuda":
        parts.guard.fuse()  # its 25 kernels in a few: on CUDA the host's launches are the step's bound
    if start.point is not None:
        problem = None
        try:
            restore(parts, Path(start.point.path), cfg, dist, log)
        except ckpt.CheckpointError as e:
            problem = str(e)
        agree_on_step(parts.step, problem, dist)  # the same error on every rank, or the same step
    parts.train_model = compiled(model, decided, dist)
    if decided.parallel == "ddp":
        parts.train_model = wrap_ddp(parts.train_model, tc.distributed, dist)
        settle_buckets(parts.train_model, parts.loader.B, parts.loader.T, prec, dist)
    return parts


def compiled(model: GPT, decided: Resolved, dist: Dist) -> torch.nn.Module:
    """What each micro-step calls, before DDP: the model, compiled as decided.compile says. Under fsdp and
    with --compile-scope blocks the blocks are compiled in place and the model itself is returned."""
    if decided.compile == "off":
        return model
    set_compile_threads(dist)  # before the first compilation, which starts inductor's workers
    tc = decided.cfg.train
    if decided.compile == "blocks":  # fsdp's units each gather their weights; or less to compile
        compile_sharded(model, autotune=tc.compute.autotune and decided.parallel != "fsdp")
        return model
    return torch.compile(model, **autotune_options(tc.compute.autotune))


def autotune_options(autotune: bool) -> dict:
    """torch.compile's arguments for --autotune: inductor times each matmul shape against its
    Triton templates and keeps the fastest (GEMMs only: max_autotune_gemm, not the pointwise kernels)."""
    return {"options": {"max_autotune_gemm": True}} if autotune else {}


def compile_sharded(model: GPT, *, autotune: bool = False) -> None:
    """torch.compile for a model sharded per block (--parallel fsdp): each block in place (torchtitan's
    way: a compiled region never spans two FSDP units' gathers), and the root's final LayerNorm, LM
    head and loss (GPT.head_loss) as one more region. The head and loss are the memory-bound part that
    compile fuses (the loss's cast, softmax and gradient; planned per logit by gpt2/plan/ as compiled),
    and would otherwise run eager under fsdp while DDP's whole-model compile fuses them. The embedding
    lookups between the regions stay eager (a gather and an add), and so does the building of doc_attention's
    mask, which is FlexAttention's BlockMask for the compiled blocks (GPT.compiled_blocks)."""
    model.compiled_blocks = True  # before the first forward: the attention each block runs is compiled
    for block in model.transformer.h:
        block.compile(**autotune_options(autotune))  # autotuned: the blocks only, the head as without it
    model.head_loss = torch.compile(model.head_loss)  # an instance attribute: forward calls self.head_loss


def settle_buckets(ddp_model: torch.nn.Module, batch: int, seq_len: int, prec: Precision, dist: Dist) -> None:
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
    cuda = dist.device.type == "cuda"
    saved = rng_state(cuda)  # dropout draws here must not shift the training's random numbers
    x = torch.zeros(batch, seq_len, dtype=torch.long, device=dist.device)
    with collective("DDP's first (bucket-settling) gradient all-reduce"):
        with prec.autocast(dist.device):
            _, loss = ddp_model(x, x, return_logits=False)
        loss.backward()
    for p in ddp_model.parameters():
        p.grad = None
    set_rng_state(saved, cuda)


DDP_DEFAULT_BUCKET_CAP_MB = 25.0
"""torch's own default bucket size (TrainConfig.distributed.ddp_bucket_cap_mb's default)."""


def wrap_ddp(train_model: torch.nn.Module, distributed: DistributedConfig, dist: Dist) -> DDP:
    """DDP around the (compiled) model; its all-reduces overlap the compiled backward.

    torch.compile is lazy: the model is compiled at the first training step, inside DDP's forward,
    where dynamo's DDPOptimizer splits the graph at DDP's buckets, so each bucket's all-reduce starts
    when its backward graph ends (tests/test_ddp_compile.py). Compile-then-DDP over the alternatives
    (DDP-then-compile, each block compiled): docs/training.md, "DDP and torch.compile", with the
    measurements and the command behind them.
    """
    # Gradients as views into the all-reduce buckets: no second copy of every gradient (memory)
    # and no copy in and out of the buckets each step (the maths is unchanged). No buffer sync
    # before each forward: the only buffer (the padded vocab's -inf logit bias) is a constant every
    # rank builds identically (it is still synced once, at init; gpt2/core/compat.py names the keyword).
    # bucket_cap_mb=None at DDP's default
    # keeps DDP's small first bucket (1 MiB, also dynamo's first split); any other value applies
    # to every bucket.
    cap = None if distributed.ddp_bucket_cap_mb == DDP_DEFAULT_BUCKET_CAP_MB else distributed.ddp_bucket_cap_mb
    with collective("DDP's broadcast of the initial weights"):
        return DDP(
            train_model,
            device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
            bucket_cap_mb=cap,
            gradient_as_bucket_view=True,
            **ddp_no_buffer_sync(),
        )
