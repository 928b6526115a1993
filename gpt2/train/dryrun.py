"""train_ddp.py --dry-run: a real run's start-up up to its first step, without a process group or weights.

It is the trainer's own start-up's pre-flight, decide_run in gpt2/train/startup.py, without the writes
and process groups of start(): the same check_data, resume decision, keep-on-resume, record of every choice
(gpt2/plan/resolve.py: precision, activation checkpointing, micro-batch, loss path, parallelism,
accumulation, compile, the memory plan), epochs and warmup checks, so the first error it meets is the one
a real run stops with, word for word, and the numbers it prints are the ones a real run would use. Then it
reports what the start-up would build: each rank's loader, the checkpoint it would resume (checked with
gpt2/train/state.py check_compatible, its weights not read), the checkpoint size, the first step's
schedule. It writes nothing.

Where to rehearse: this launch (torchrun's WORLD_SIZE, else one process, on this machine's device),
or a hypothetical cluster: --world-size N [--nproc-per-node K] and a GPU, --gpu NAME (gpt2/plan/
GPUS) or --gpu-memory-gb X [--gpu-peak-tflops Y], as `python -m gpt2.plan` takes them. A hypothetical
GPU's precision is what that GPU would pick, not this machine's: bf16 where its data sheet lists bf16
tensor cores (every GPU in the table), a custom one is taken to have them.

The data: a real run needs --data-dir, so when it exists here its shards are checked as a real run
checks them and each rank's first windows are listed. When it does not (planning a cluster from a
laptop), the dry run says `data SKIPPED`, quotes what a real run would say, plans the rest and lists
each rank's rows of the first global batch instead of windows: still exit 0, since everything the
dry run could check passed. A run directory held by a live run (RUN/run.lock) is a warning, not an
error: a real start now would be refused, but the rehearsal takes no lock and checks what it would do
once that run ends (a requeue being planned while its job still runs), so it still exits 0.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt.rundir import LOCK, live_holder
from gpt2.core.config import CheckpointConfig, ComputeConfig, DataConfig, RunConfig, describe_model, weight_changes
from gpt2.core.schedule import BatchLayout
from gpt2.core.start_point import StartDecision
from gpt2.data.loader import ShardSet, TrainLoader, find_shards
from gpt2.data.mixture import MixedShards, MixtureLoader, eval_loader, train_loader
from gpt2.data.shards import ShardError
from gpt2.distributed.group import Dist, resolve_device, set_cpu_threads, single_process, world_from_env
from gpt2.plan.hardware import GIB
from gpt2.plan.resolve import Target
from gpt2.train.cli import Rehearsal
from gpt2.train.startup import announce_start, check_data, decide_run
from gpt2.train.state import check_compatible, tokens_of

GPUS_PER_NODE = 8
"""A hypothetical GPU cluster's ranks per node unless --nproc-per-node says otherwise."""


class Log:
    """What the trainer's RunLog prints, without its files: info to out, warnings marked."""

    def __init__(self, out) -> None:
        self.out = out

    def info(self, message: str) -> None:
        self.out(message)

    def warn(self, message: str) -> None:
        self.out(f"warning: {message}")

    def detail(self, message: str) -> None:  # a rehearsal shows the whole plan: that is what it is for
        self.out(message)


def rehearse(cfg: RunConfig, r: Rehearsal, *, env=None, out=print) -> int:
    """Print the run up to its first step and return 0; raise the ValueError (ShardError,
    CheckpointError) a real run would stop with."""
    log = Log(out)
    info = world_from_env(env)
    world = r.world_size or info.world_size
    per_node = nodes_layout(r, world, info)
    tc = cfg.train
    out(
        "dry run    train_ddp.py --dry-run: start-up up to the first step; no process group, no weights, "
        "nothing written"
    )
    out(
        f"config     {describe_model(cfg.model)} | total_batch_size {tc.batch.total_batch_size:,} tokens | "
        f"micro_batch_size {tc.batch.micro_batch_size} | max_steps {tc.schedule.max_steps:,} | {tc.optim.optimizer} | "
        f"dtype {tc.compute.dtype} | parallel {tc.distributed.parallel} | data order {tc.data.data_order} | resume "
        f"{tc.ckpt.resume}"
    )
    target, device_desc = rehearsal_target(cfg.train.compute, r, world, per_node, info.local_rank)
    out(f"world      {world} rank(s) = {world // per_node} node(s) x {per_node} on {device_desc}")
    shards = check_data(tc, cfg.model.block_size, world, shards=any(Path(d).is_dir() for d in tc.data.dirs))
    train_shards, val_shards = shards
    report_data(cfg.train.data, train_shards, val_shards, out)
    with rank_threads(cfg.train.compute, target):  # a CPU's peaks are per thread count: measure with a rank's
        dist = single_process()
        at = announce_start(tc.ckpt, dist, log, quiet=True)  # where a real start would begin
        decided = decide_run(cfg, dist, log, shards, at, target)  # the real start-up's pre-flight
    cfg, plan, accum = decided.cfg, decided.plan, decided.accum_steps
    tc, mb = cfg.train, cfg.train.batch.micro_batch_size
    loaders = None
    if train_shards is not None:  # the loaders a real run builds, one per rank, none of them reading
        loaders = [
            train_loader(
                train_shards,
                BatchLayout(mb, cfg.model.block_size, tc.batch.total_batch_size, world),
                changes=weight_changes(tc),
                rank=rank,
                seed=tc.data.seed,
                device=torch.device("cpu"),
                order=tc.data.data_order,
            )
            for rank in range(world)
        ]
        if (
            val_shards is not None
            and eval_loader(
                val_shards,
                tc.data.weights,
                micro_batch_size=mb,
                seq_len=cfg.model.block_size,
                eval_tokens=tc.eval.eval_tokens,
                rank=0,
                world_size=world,
                device=torch.device("cpu"),
            ).clamped
        ):
            log.warn(f"--eval-tokens {tc.eval.eval_tokens} exceeds the val shards; a real run evaluates on all of them")
    step, position = resume_decision(cfg, decided.start, loaders, log)
    if tc.ckpt.init_from:  # the source's shape is cfg.model's already (gpt2/train/cli.py); its weights are not read
        from gpt2.train.init_from import rehearsal_line

        out(rehearsal_line(tc.ckpt.init_from, step))
    report_checkpoint(cfg.train.ckpt, plan, out)
    if step >= tc.schedule.max_steps:
        out(
            f"nothing to train: {tc.ckpt.out_dir} already finished step {step} of --max-steps "
            f"{tc.schedule.max_steps}; a real "
            "run would say so and exit 0"
        )
        return 0
    report_schedule(cfg, loaders, world, accum, mb, step, position, out)
    out("dry run OK: a real run would now start the process group, build the model and train")
    return 0


def nodes_layout(r: Rehearsal, world: int, info) -> int:
    """Ranks per node: --nproc-per-node, else torchrun's (this launch), else for a hypothetical GPU 8 per
    node (fewer ranks: one node of them; a world size that is not a whole number of 8-GPU nodes is
    refused with the --nproc-per-node values that would divide it, never quietly laid out otherwise),
    else all on this machine."""
    if r.nproc_per_node is not None:
        if world % r.nproc_per_node:
            raise ValueError(
                f"--world-size {world} is not a multiple of --nproc-per-node {r.nproc_per_node}: "
                "every node runs the same number of ranks"
            )
        return r.nproc_per_node
    if r.world_size is None:
        return info.local_world_size
    if not r.hypothetical_gpu or world <= GPUS_PER_NODE:
        return world
    if world % GPUS_PER_NODE:
        fits = [k for k in range(GPUS_PER_NODE - 1, 0, -1) if world % k == 0][:2]
        choices = " or ".join(f"--nproc-per-node {k} ({world // k} nodes)" for k in fits)
        near = (world // GPUS_PER_NODE) * GPUS_PER_NODE
        raise ValueError(
            f"--world-size {world} is not a whole number of {GPUS_PER_NODE}-GPU nodes (the default "
            f"ranks per node): pass {choices}, or --world-size {near} or {near + GPUS_PER_NODE}"
        )
    return GPUS_PER_NODE


def rehearsal_target(
    compute: ComputeConfig, r: Rehearsal, world: int, per_node: int, local_rank: int
) -> tuple[Target, str]:
    """The hardware to rehearse on (gpt2/plan/resolve.py Target): this machine's device, shared by the
    per_node ranks on it, or the hypothetical GPU the flags name; and the device in words."""
    if not r.hypothetical_gpu:
        device = resolve_device(compute.device, local_rank)  # the real run's first check, same error
        return (
            Target(world_size=world, processes_per_host=per_node, device=device),
            f"{device} (this machine; --gpu NAME rehearses on a GPU of python -m gpt2.plan's table)",
        )
    if compute.device == "cpu":
        raise ValueError("--gpu/--gpu-memory-gb rehearse a CUDA run, but --device cpu asks for the CPU: drop one")
    name = r.gpu or f"a custom GPU ({r.gpu_memory_gb:g} GiB)"
    return (
        Target(
            world_size=world,
            processes_per_host=per_node,
            gpu=r.gpu,
            gpu_memory_gb=r.gpu_memory_gb,
            gpu_peak_tflops=r.gpu_peak_tflops,
        ),
        f"{name} per rank (hypothetical: not this machine)",
    )


@contextlib.contextmanager
def rank_threads(compute: ComputeConfig, target: Target):
    """On this machine's CPU, the torch threads one rank of the rehearsed run would use (set_cpu_threads, as
    the trainer's configure_backends sets them) for the block, then this process's again: a CPU's matmul
    peak, which --dtype auto and --micro-batch-size auto use, is measured and cached per thread count."""
    if target.device is None or target.device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    one = Dist(
        rank=0,
        local_rank=0,
        world_size=target.world_size,
        local_world_size=target.processes_per_host,
        device=target.device,
    )
    set_cpu_threads(one, compute.num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def report_data(data: DataConfig, train_shards, val_shards, out) -> None:
    if train_shards is None:
        try:
            for d in data.dirs:
                find_shards(d, "train")
            problem = "(none)"
        except ShardError as e:
            problem = str(e)
        out(
            f"data       SKIPPED: --data-dir {data.data_dir} does not exist here. A real run needs it and stops "
            f"with: {problem}"
        )
        return
    if isinstance(train_shards, MixedShards):  # a line per source
        for k, (d, train) in enumerate(zip(train_shards.dirs, train_shards.sets)):
            out(f"data       {describe_shards(d, train, val_shards.sets[k] if val_shards else None)}")
        return
    out(f"data       {describe_shards(data.data_dir, train_shards, val_shards)}")


def describe_shards(data_dir: str, train: ShardSet, val: ShardSet | None) -> str:
    val_part = f"val {val.total_tokens:,} tokens in {len(val.paths)} shard(s)" if val else "no val"
    return (
        f"{data_dir}: train {train.total_tokens:,} tokens in {len(train.paths)} shard(s), {val_part}; headers checked"
    )


def resume_decision(
    cfg: RunConfig, start: StartDecision, loaders: list[TrainLoader] | None, log: Log
) -> tuple[int, int]:
    """What --resume would load (the start-up's choose_start, its sha256 verified; the weights are not
    read), checked against this run as a real resume checks it. Returns (step, loader position)."""
    tc = cfg.train
    holder = live_holder(tc.ckpt.out_dir)
    if holder is not None:  # own_run_dir would refuse a real start now; the rehearsal goes on, and exits 0
        log.warn(
            f"{tc.ckpt.out_dir} is in use by another training run ({holder}; {Path(tc.ckpt.out_dir) / LOCK}): a real "
            "start now would be refused (exit 2) and touch nothing. The dry run took no lock; what follows is "
            "what a start would do once that run has ended"
        )
    if start.set_aside:  # what set_aside_earlier_run would move before the run writes anything
        log.info(
            f"run dir    {tc.ckpt.out_dir} holds another run's {', '.join(start.set_aside)}: a real run moves them "
            "into a previous-<UTC time>/ folder there (nothing deleted)"
        )
    if start.abandon:  # what set_aside_abandoned would move
        log.info(
            f"run dir    {start.point.path} is an earlier checkpoint of this run: a real run moves its later "
            f"{', '.join(start.abandon)} into {ckpt.checkpoint_dir(tc.ckpt.out_dir)}/{ckpt.ABANDONED_PREFIX}"
            f"{start.point.step:08d}-<UTC time>/ (nothing deleted), so --resume auto never returns to them"
        )
    point = start.point
    if point is None:
        why = (
            "--resume never"
            if tc.ckpt.resume == "never"
            else f"no valid checkpoint in {ckpt.checkpoint_dir(tc.ckpt.out_dir)}"
        )
        log.info(f"resume     {why}: a fresh start at step 0")
        return 0, 0
    # mmap: the tensors stay in the file; only the config, loader and step are looked at.
    state = ckpt.load_checkpoint(point.path, verify=False, mmap=True)
    check_compatible(state, cfg, log)
    position = int(state["loader"]["position"])
    for rank, loader in enumerate(loaders or []):
        try:
            loader.load_state_dict(state["loader"])
        except ValueError as e:  # as gpt2/train/state.py restore words it
            raise ckpt.CheckpointError(f"{point.path}: {e}") from None
        if isinstance(loader, MixtureLoader):  # other --data-weights now: said as the real resume says it
            loader.at_step(int(state["step"]))
            for line in loader.news() if rank == 0 else []:
                log.info(line)
    log.info(
        f"resume     would load {point.path} (step {point.step}, {tokens_of(state):,} tokens, "
        f"{point.bytes / GIB:.2f} GiB, sha256 {point.sha256[:12]}... verified; saved at world size "
        f"{state['world_size']}) and continue at step {state['step']}"
    )
    return int(state["step"]), position


def report_checkpoint(ckpt: CheckpointConfig, plan, out) -> None:
    from gpt2.plan.budget import checkpoint_bytes

    m = plan.memory
    size = checkpoint_bytes(plan.cfg, m.optimizer_name)  # the number the planner's stop budget uses
    keep = ckpt.keep_checkpoints
    kept = f", {keep} kept: ~{keep * size / GIB:.2f} GiB in {ckpt.out_dir}/checkpoints"
    every = f"every {ckpt.ckpt_interval} steps and at the end" if ckpt.ckpt_interval else "at the end"
    if m.shards > 1:  # the plan's weights and optimizer are one rank's shards: the checkpoint is all of them
        out(
            f"checkpoint ~{size / GIB:.2f} GiB in all (fp32 weights + {m.optimizer_name} state), each of the "
            f"{m.shards} ranks writing its ~{(m.weights + m.optimizer) / GIB:.2f} GiB shard {every}{kept}"
        )
        return
    out(
        f"checkpoint ~{size / GIB:.2f} GiB per file (fp32 weights {m.weights / GIB:.2f} GiB + {m.optimizer_name} "
        f"state {m.optimizer / GIB:.2f} GiB), written by rank 0 {every}{kept}"
    )


def report_schedule(cfg: RunConfig, loaders, world: int, accum: int, mb: int, step: int, position: int, out) -> None:
    """Each rank's part of the first step (the module docstring of gpt2/data/loader.py has the layout)."""
    tc, T = cfg.train, cfg.model.block_size
    rows = tc.batch.total_batch_size // T
    if loaders is None:
        out(
            f"loader     step {step}: rows [0, {rows}) of its global batch (windows need the data); "
            f"rank r, micro-step m takes rows (m*{world} + r)*{mb} ... +{mb}:"
        )
        for rank in range(world):
            for m in range(accum):
                first = (m * world + rank) * mb
                out(f"  rank {rank:>3} micro-step {m:>3}: rows {first}..{first + mb - 1}")
        return
    if isinstance(loaders[0], MixtureLoader):
        sources = ", ".join(f"{s.name} {s.n_windows:,}" for s in loaders[0].sources)
        out(
            f"loader     mixture, each source {tc.data.data_order}: windows of {T + 1} tokens ({sources}); step "
            f"{step} takes sequences [{position // T:,}, {position // T + rows:,}) of the mixture; each rank's "
            "source:window:"
        )
    else:
        n = loaders[0].n_windows
        what = (
            "windows of the fixed shard order, in epoch "
            if tc.data.data_order == "shuffled"
            else "windows of the stream (shards reshuffled each epoch), in epoch "
        )
        out(
            f"loader     {tc.data.data_order}: {n:,} windows of {T + 1} tokens; step {step} takes places "
            f"[{position // T:,}, {position // T + rows:,}) of the order ({what}{(position // T) // n}); each "
            "rank's window indices:"
        )
    for rank, loader in enumerate(loaders):
        for m in range(accum):
            ids = loader.windows_of(m)
            out(f"  rank {rank:>3} micro-step {m:>3}: " + " ".join(str(i) for i in ids))
