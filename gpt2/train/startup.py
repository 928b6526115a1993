"""A run's start-up: start(cfg, dist) -> Run, everything from the config to the first step, read top to
bottom in the order it happens (its body is the list).

  the run directory and the backends (threads, TF32, the allocator)
  check_data            the shards, the batch maths, the flags' packages (before any process group)
  announce_start        the first line; where the run begins (gpt2/ckpt/resume.py: a checkpoint, or fresh)
  decide_run            the pre-flight: every choice in one record (gpt2/plan/resolve.py Resolved: precision,
                        activation checkpointing, micro-batch, loss path, parallelism, accumulation, compile,
                        MFU peak, the resume point, the memory plan) and every refusal the config and the data
                        can meet, nothing written
  check_this_machine    what only this machine can say: the memory this process holds, the disk, the network,
                        a resume's refusals before it moves files; then, all passed, the held lines are shown
  make_room             the earlier run's files aside; the log's files opened
  build                 the model, optimizer and loaders as the record says (gpt2/train/build.py)
  write_run_info, announce, HellaSwag, the background checkpoint writer

train_ddp.py --dry-run (gpt2/train/dryrun.py) runs check_data and decide_run without a process group or
a write, so its first error is a real run's; the benchmarks' Session (gpt2/train/session.py) is start().

What the console shows: a few lines (RunLog.info); the plan term by term is RunLog.detail, written to
RUN/train.log and printed only with --verbose, so a newcomer reads what runs, and a refusal or
"nothing to train" is not preceded by a 30-line plan.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpt2.ckpt.checkpoint import CheckpointError
from gpt2.ckpt.disk import check_disk
from gpt2.ckpt.resume import (
    StartDecision,
    choose_start,
    keep_decisions,
    restore_sidecar,
    set_aside_abandoned,
    set_aside_earlier_run,
)
from gpt2.ckpt.rundir import RUN_INFO, TRAIN_LOG, own_run_dir
from gpt2.ckpt.writer import CheckpointWriter
from gpt2.core import determinism, host_memory
from gpt2.core.atomic import atomic_write_text
from gpt2.core.compat import missing_features
from gpt2.core.config import (
    EOT_TOKEN,
    BatchConfig,
    CheckpointConfig,
    ComputeConfig,
    DistributedConfig,
    ModelConfig,
    RunConfig,
    ScheduleConfig,
    TrainConfig,
    parse_weights,
    weight_changes,
)
from gpt2.core.schedule import batch_warmup_problem, grad_accum_steps, lr_at, tokens_before
from gpt2.data.check import check_listed
from gpt2.data.loader import ShardSet, find_shards
from gpt2.data.mixture import MixedShards, describe_weights, planned_draws
from gpt2.data.preflight import check_same_tokenizer, find_val_shards, verify_data
from gpt2.data.shards import read_tokens
from gpt2.distributed import preempt
from gpt2.distributed.bandwidth import NetworkCost, format_network_cost, fsdp_traffic, measure_network, network_warning
from gpt2.distributed.fsdp import gathered_param_bytes
from gpt2.distributed.group import Dist, compile_threads, rank0_decides, set_cpu_threads, usable_cpus
from gpt2.distributed.hang import HangDumps
from gpt2.plan import matmul_peak
from gpt2.plan.budget import checkpoint_bytes
from gpt2.plan.flops import format_flops, within_document_share
from gpt2.plan.measure import warm_up
from gpt2.plan.report import plan_line
from gpt2.plan.resolve import FRESH, Resolved, Target, device_name, resolve_choices
from gpt2.train import compile_cache
from gpt2.train.build import build
from gpt2.train.compile_cache import CompileCache
from gpt2.train.memory_watch import MemoryWatch
from gpt2.train.run_log import RunLog
from gpt2.train.state import Parts, check_resumable
from gpt2.train.step_clock import StepClock

if TYPE_CHECKING:
    from gpt2.plan.planner import Plan


def start(
    cfg: RunConfig,
    dist: Dist,
    *,
    shards: tuple[ShardSet, ShardSet | None] | None = None,
    stop_request: preempt.StopRequest | None = None,
    hardware=None,
    log=None,
) -> Run | None:
    """A run from its config to its first step, in the order things happen; None when its checkpoint
    has reached --max-steps already (said in one line). The caller holds the run's guards (run_guards: the
    run directory's lock, the signal handlers whose record is stop_request, the hang dumps).

    shards: check_data's result (train_ddp.py checks before the process group starts), else checked here.
    hardware: what the planner sizes for instead of this device (tests pass a cap)."""
    tc = cfg.train
    make_run_dir(tc.ckpt.out_dir, dist)  # RUN exists; a requeue marker there is not this run's
    configure_backends(tc.compute, dist)  # threads, TF32, the allocator
    # The console only, for now: RUN/train.log, TensorBoard and W&B write into RUN, which may still hold
    # an earlier run's records until the start is decided and they are moved aside (make_room).
    log = log or RunLog(dist, tc.ckpt.out_dir, verbose=tc.log.verbose, log_file=True)
    shards = shards or check_data(tc, cfg.model.block_size, dist.world_size)  # the shards and the batch maths
    at = announce_start(tc.ckpt, dist, log)  # where the run begins: a checkpoint, or fresh
    # Every line of the decisions and checks is held until they all pass: a refusal, or "nothing to train", is
    # the console's first line after `starting` (with --verbose, after what was decided before it).
    log.hold()
    try:
        if tc.compute.deterministic:  # train_ddp.py turned it on before CUDA's first use; in-process callers here
            determinism.enable()
            log.info(determinism.describe_determinism())
        decided = decide_run(cfg, dist, log, shards, at, start_target(dist, hardware))  # every choice, refusal
        decided = check_this_machine(decided, dist, log, shards[0])  # what only a real start can check
    except BaseException:
        log.release(console=False)
        raise
    finished = finished_message(at, tc)  # the step count and directory no decision changes
    if finished is not None:  # finished already, e.g. the quick start run a second time
        log.release(console=False)
        log.info(finished)
        log.close()
        return None
    log.release()
    make_room(decided, dist, log)  # the earlier run's files aside; the log's files opened
    announce_compile(decided, dist, log)
    cache = (
        compile_cache.use(tc.compute.compile_cache, tc.ckpt.out_dir, dist, log) if decided.compile != "off" else None
    )
    watch = MemoryWatch.start(decided.plan.memory.total, decided.plan.hardware.reserve_bytes, dist.device)
    parts = build(decided, dist, log, shards)  # the model, optimizer and loaders, restored when resuming
    write_run_info(decided, dist, parts)
    announce(decided, dist, parts, log)
    hellaswag = None
    if tc.eval.hellaswag_interval:
        from gpt2.data.hellaswag import prepare_hellaswag

        hellaswag = prepare_hellaswag(tc.eval.hellaswag_file, dist)  # collective: rank 0 downloads if missing
    if dist.is_main and tc.ckpt.async_ckpt:
        parts.writer = CheckpointWriter(dist.device)
    return Run(
        decided.cfg,
        dist,
        log,
        parts,
        stop_request,
        decided.peak,
        decided,
        hellaswag=hellaswag,
        watch=watch,
        cache=cache,
    )


@contextlib.contextmanager
def run_guards(out_dir: str, dist: Dist):
    """What a run holds from before its first touch of RUN to its end, around start() and the trainer's train():
    the stop signals recorded (yielded: one that arrives while building or restoring stops the run at the first
    step boundary, with a checkpoint, instead of killing the process), the run directory this run's alone
    (gpt2/ckpt/rundir.py own_run_dir) and the hang dumps (gpt2/distributed/hang.py)."""
    with preempt.StopRequest() as stop_request, own_run_dir(out_dir, dist), HangDumps(out_dir, dist):
        yield stop_request


@dataclass
class Run:
    """One run as its loop sees it, passed whole to every function of the loop (litgpt's `state`): what
    start() made, and what the loop carries from step to step."""

    cfg: RunConfig
    """The run's concrete config (decided.cfg: no `auto` left)."""
    dist: Dist
    log: RunLog
    parts: Parts
    stop_request: preempt.StopRequest | None
    peak: float | None
    """The matmul peak MFU is measured against (FLOP/s); None without one, or once an MFU proved it wrong."""
    decided: Resolved | None = None
    """The start-up's record of every decision (gpt2/plan/resolve.py)."""
    hellaswag: list | None = None
    """HellaSwag's examples (--hellaswag-interval), or None."""
    watch: MemoryWatch | None = None
    """The first step's check against the memory plan (gpt2/train/memory_watch.py); None once done."""
    cache: CompileCache | None = None
    """torch.compile's cache (gpt2/train/compile_cache.py): sealed once after the first step, so a run
    killed later (no signal, no end) still leaves its step's graphs for the next start; None once sealed."""
    bad_steps: int = 0
    """Consecutive steps skipped for a non-finite loss or gradient norm (NonFiniteError at --max-bad-steps)."""
    clock: StepClock | None = None
    """Each step's time (gpt2/train/step_clock.py); run_loop makes it when None (tests pass a fake clock)."""
    step_s: list[tuple[int, float]] = field(default_factory=list)
    """(step, seconds) of every step read: the run's closing summary."""
    rolled_back: bool = False
    """report() has just rolled the run back (gpt2/train/spike_guard.py): the step in hand is void."""


def make_run_dir(out_dir: str, dist: Dist) -> None:
    """RUN, created (every rank: on a node-local disk each node needs its own); rank 0 removes RUN/requeue,
    which says "the last run stopped on a signal": not true of this one."""
    try:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # check_data looked; this is the race (or a path it could not judge)
        raise ValueError(f"--out-dir {out_dir}: cannot create it ({e.strerror}); pass a writable --out-dir") from None
    if dist.is_main:
        preempt.clear_requeue_marker(out_dir)


def announce_start(ckpt: CheckpointConfig, dist: Dist, log: RunLog, *, quiet: bool = False) -> StartDecision:
    """The run's first line (before any measuring or building: a slow start is never silent; not in a
    rehearsal, quiet), then where it starts (choose_start: a checkpoint to resume, or fresh)."""
    if not quiet:
        log.info(
            f"starting   {dist.world_size} rank(s) on {dist.device}: checking the data, choosing precision, "
            "planning memory, building the model"
        )
    return choose_start(ckpt.resume, ckpt.out_dir, dist, warn=log.warn)


def finished_message(start: StartDecision, tc: TrainConfig) -> str | None:
    """The one line of a run whose checkpoint has reached --max-steps already (the quick start run a
    second time), or None. Every rank has the same start, so every rank returns alike."""
    if start.point is None or start.point.step < tc.schedule.max_steps:
        return None
    return (
        f"nothing to train: {tc.ckpt.out_dir} already finished step {start.point.step} of --max-steps "
        f"{tc.schedule.max_steps}. Pass a larger --max-steps to continue this run, or another --out-dir (or --resume "
        "never, which moves this run's files into a previous-* folder) to start a new one"
    )


def decide_run(
    cfg: RunConfig,
    dist: Dist,
    log: RunLog,
    shards: tuple[ShardSet, ShardSet | None],
    start: StartDecision,
    target: Target,
) -> Resolved:
    """The pre-flight: every decision, and every check that needs only the config, the data, the run
    directory's checkpoints and the target's hardware (nothing of this process, nothing written): the data
    read (--verify-data), a resumed run's own `auto` choices kept, the record of every choice (resolve_auto
    on target), the MFU peak, the memory plan, the epochs and warmup. A real start (start, then
    check_this_machine) and the dry run (gpt2/train/dryrun.py, on a target that may be a hypothetical
    cluster) run it alike, so the dry run's first error is a real run's, word for word.

    Most lines are detail (the plan term by term): RUN/train.log and --verbose; the console gets the
    precision and the micro-batch."""
    if shards[0] is not None:  # a dry run planning a cluster from a laptop may have no data here
        verify_data(cfg.train.data, shards, dist, log.detail)
    cfg = RunConfig(cfg.model, keep_decisions(cfg.train, start, dist, log.info))
    decided = resolve_auto(cfg, dist, log, start=start, target=target)
    log_mfu_peak(decided, dist, log)
    if decided.cfg.model.doc_attention and shards[0] is not None:
        log_doc_attention_share(decided.cfg.model, shards[0], log)
    for note in compute_notes(decided.cfg.train.compute, decided.hardware.device_type):
        log.warn(note)
    check_plan(decided, log)
    if isinstance(shards[0], MixedShards):
        log_mixture(decided.cfg.train, decided.cfg.model.block_size, shards[0], log)
    elif shards[0] is not None:
        log_epochs(decided.cfg.train.batch, decided.cfg.train.schedule.max_steps, shards[0].total_tokens, log)
    log_warmup(decided.cfg.train.schedule, log)
    return decided


def check_this_machine(decided: Resolved, dist: Dist, log: RunLog, train_shards: ShardSet | None) -> Resolved:
    """After the pre-flight, what only a start on this machine checks, before anything in RUN is moved or
    written: the memory this process holds beside the plan (one console line), the disk for the checkpoints,
    the network's cost of a step, and a resume's refusals before it moves files aside. Returns the record
    with the network's cost."""
    check_memory(decided, log)
    size = checkpoint_bytes(decided.plan.cfg, decided.plan.memory.optimizer_name)
    check_disk(decided.cfg.train, decided.start, size, dist, log.warn)
    cost = log_network_cost(decided, dist, log)
    check_before_moving(decided.start, decided.cfg, dist, train_shards)
    return replace(decided, network=None if cost is None else cost.to_dict())


def make_room(decided: Resolved, dist: Dist, log: RunLog) -> None:
    """The moves the start decision needs, before the first write into RUN: the earlier run's records,
    or an abandoned branch's checkpoints, aside (nothing deleted); a resumed checkpoint's lost sidecar
    written again; then the log's files (train.log, TensorBoard, W&B) opened."""
    start, tc = decided.start, decided.cfg.train
    moved = set_aside_earlier_run(start, tc.ckpt.out_dir, dist)
    if moved is not None:
        why = "fresh start" if start.point is None else f"resuming run {start.run_id} from {start.point.path}"
        log.info(
            f"{why}: moved the earlier run's {', '.join(start.set_aside)} from {tc.ckpt.out_dir} into {moved}/ "
            "(nothing deleted)"
        )
    abandoned = set_aside_abandoned(start, tc.ckpt.out_dir, dist)
    if abandoned is not None:
        log.info(
            f"resuming from {start.point.path} (step {start.point.step}), an earlier checkpoint of this run: "
            f"moved its later {', '.join(start.abandon)} and their sidecars into {abandoned}/ with a copy of "
            f"metrics.jsonl, so --resume auto never returns to that branch (nothing deleted); metrics.jsonl "
            f"goes on from step {start.point.step}"
        )
    try:
        restored = restore_sidecar(start, tc.ckpt.out_dir, dist)
    except OSError as e:  # the resume needs no sidecar: it goes on, and says what retention will do
        log.warn(
            f"could not write the lost sidecar of {start.point.path} again ({e.strerror or e}); the next "
            "save's retention will count it as incomplete and delete it"
        )
    else:
        if restored is not None:
            log.info(f"wrote {restored.name} again for the checkpoint resumed without it")
    log.open_sinks(
        tensorboard=tc.log.tensorboard,
        wandb_project=tc.log.wandb_project,
        run_config=decided.cfg.to_dict(),
        log_file=True,
    )


def check_before_moving(start: StartDecision, cfg: RunConfig, dist: Dist, train_shards: ShardSet) -> None:
    """A resume that moves files aside (--resume PATH of another run: the directory's earlier run; of
    an earlier checkpoint of this run: its later checkpoints): the checkpoint's refusals (another
    shape, optimizer, data, seed...) come first, else a refused resume would leave the directory's own
    run in previous-*/ (the next start would begin at step 0) or its newest checkpoints in abandoned-*/.
    A finished run's checkpoint is checked too: it is never restored, and flags it could not resume
    with are refused, not answered with "nothing to train".
    Rank 0 checks; every rank raises its error alike."""
    if start.point is None or not (start.set_aside or start.abandon or finished_message(start, cfg.train)):
        return

    def check() -> None:
        try:
            check_resumable(Path(start.point.path), cfg, train_shards, dist)
        except ValueError as e:  # CheckpointError, or a checkpoint too damaged to say
            raise CheckpointError(str(e)) from None

    rank0_decides(check, dist, errors=(CheckpointError,))


def announce(decided: Resolved, dist: Dist, parts: Parts, log: RunLog) -> None:
    """The run's shape in one line."""
    cfg = decided.cfg
    tc = cfg.train
    log.info(
        f"model {parts.model.num_params():,} parameters | world size {dist.world_size} | "
        f"parallel {tc.distributed.parallel} | {decided.accum_steps} micro-steps of "
        f"{tc.batch.micro_batch_size}x{cfg.model.block_size} "
        "per step | "
        f"{tc.batch.total_batch_size:,} tokens/step | device {dist.device} | {tc.compute.dtype} | compile "
        f"{tc.compute.compile}"
    )
    b = tc.batch
    if b.batch_warmup_steps:
        n = b.batch_warmup_stages + 1
        log.info(
            f"batch      warmup over steps 0-{b.batch_warmup_steps - 1}: {b.batch_warmup_stages} equal stretches "
            f"taking {', '.join(f'{j}/{n}' for j in range(1, n))} of each step's tokens (the first micro-steps "
            f"of each rank's {decided.accum_steps}); all of them from step {b.batch_warmup_steps}"
        )
    for line in parallel_notes(tc.distributed, decided.parallel, dist.world_size):
        log.info(line)


def announce_compile(decided: Resolved, dist: Dist, log: RunLog) -> None:
    """Before build: torch.compile works when a graph is first run, and the first one can be in build
    itself (DDP's bucket-settling step), so the line that explains a silent minute comes before it."""
    if decided.compile == "off":
        return
    first = "DDP's bucket-settling step, " if decided.parallel == "ddp" else ""
    workers = compile_threads(usable_cpus(), dist.local_world_size)  # what build's set_compile_threads sets
    log.info(
        f"compiling: torch.compile builds each graph the first time it runs ({first}the first evaluation, "
        f"the first step), a minute or more each on {workers} compile worker(s) per rank; the steps after "
        "it are fast"
    )


def parallel_notes(distributed: DistributedConfig, parallel: str, world_size: int) -> list[str]:
    """What --parallel fsdp does at this world size (parallel: the record's, in effect), and the flags it
    ignores (one line each)."""
    if distributed.parallel != "fsdp":
        return []
    if parallel != "fsdp":
        return [
            "parallel   fsdp with one process: nothing to shard, training the plain model "
            "(launch with torchrun --nproc_per_node=N to shard over N ranks)"
        ]
    notes = [
        f"parallel   fsdp: weights, gradients and optimizer state sharded over {world_size} ranks "
        "(fully_shard per block, then the root)"
    ]
    if distributed.ddp_bucket_cap_mb != DistributedConfig().ddp_bucket_cap_mb:
        notes.append(
            f"parallel   --ddp-bucket-cap-mb {distributed.ddp_bucket_cap_mb:g} ignored: fsdp reduce-scatters "
            "each block's gradients as one unit, it has no DDP buckets"
        )
    return notes


def compute_notes(compute: ComputeConfig, device_type: str) -> list[str]:
    """Compute flags that will not do what they promise on this run, one warning each: --autotune without
    --compile (it tunes the compiled regions' matmuls, and there are none), --fp8-head on a CPU (no FP8
    units: torch emulates `_scaled_mm`, which is there for tests, and the step is much slower)."""
    notes = []
    if compute.autotune and not compute.compile:
        notes.append(
            "--autotune does nothing without --compile: it times the compiled regions' matmul kernels, and "
            "nothing is compiled; pass --compile true, or drop --autotune"
        )
    if compute.fp8_head and device_type == "cpu":
        notes.append(
            "--fp8-head on a CPU runs the LM head's FP8 matmuls emulated (a CPU has no FP8 units; the path is "
            "there for tests): each step is much slower than without it; drop --fp8-head (it speeds up GPUs "
            "with FP8 tensor cores: H100, H200, L4, L40)"
        )
    return notes


def configure_backends(compute: ComputeConfig, dist: Dist) -> None:
    if dist.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = compute.tf32
        torch.backends.cudnn.allow_tf32 = compute.tf32
    else:  # freed tensors go back to the system: the process holds what the memory plan counts
        host_memory.return_freed_memory()
    set_cpu_threads(dist, compute.num_threads)


def check_layout(bc: BatchConfig, T: int, world_size: int) -> None:
    """The batch divides into micro-steps on world_size ranks, and a batch warmup's stages into whole ones: a
    ValueError naming the sizes that would. auto is sized later, by the planner: here only "some micro-batch
    divides" (1 sequence), and the planner then takes a micro-batch that divides the stages too."""
    mb = 1 if bc.micro_batch_size == "auto" else bc.micro_batch_size
    grad_accum_steps(bc.total_batch_size, mb, T, world_size)
    problem = bc.batch_warmup_steps and batch_warmup_problem(
        bc.total_batch_size, mb, T, world_size, bc.batch_warmup_stages
    )
    if problem:
        raise ValueError(problem)


def check_data(
    tc: TrainConfig, block_size: int, world_size: int, *, shards: bool = True
) -> tuple[ShardSet | MixedShards | None, ShardSet | MixedShards | None]:
    """Validate shards and batch maths before any process group or model exists: each --data-dir source's
    train shards, and its val shards when the run evaluates (MixedShards for a mixture's sources).

    block_size: the model's sequence length. shards=False checks everything but the shards and --out-dir
    (train_ddp.py --dry-run where --data-dir is absent). The shards' cheap manifest checks run here; reading
    them is verify_data's (rank 0).
    """
    missing = missing_features(optimizer=tc.optim.optimizer, parallel=tc.distributed.parallel)
    if missing:  # this torch lacks a feature asked for: say which release has it, before anything starts
        raise ValueError("; ".join(missing))
    check_layout(tc.batch, block_size, world_size)
    if 0 < tc.eval.eval_tokens < block_size:
        raise ValueError(
            f"--eval-tokens {tc.eval.eval_tokens} is less than one sequence of --block-size "
            f"{block_size}: evaluation would score nothing (val loss nan); raise it, or "
            "--eval-tokens 0 to train without validation"
        )
    train_shards, val_shards = None, None
    if shards:  # the machine the run is on (a dry run from a laptop checks neither)
        block, eval_tokens = block_size, tc.eval.eval_tokens
        found = [
            (find_shards(d, "train"), find_val_shards(d, block, eval_tokens) if eval_tokens > 0 else None)
            for d in tc.data.dirs
        ]
        check_out_dir(tc.ckpt.out_dir)
        if len(found) > 1:
            check_same_tokenizer(tc.data.dirs)
        for d, (train, val) in zip(tc.data.dirs, found):
            check_listed(d, {"train": train, **({"val": val} if val else {})})
        train_shards, val_shards = found[0]
        if len(found) > 1:
            names, dirs = tuple(tc.data.names), tuple(tc.data.dirs)
            train_shards = MixedShards(names, dirs, tuple(t for t, _ in found))
            val_shards = MixedShards(names, dirs, tuple(v for _, v in found)) if val_shards else None
    import importlib.util

    for wanted, package, flag in (
        (tc.log.tensorboard, "tensorboard", "--tensorboard"),
        (tc.log.wandb_project, "wandb", "--wandb-project"),
    ):
        if wanted and importlib.util.find_spec(package) is None:
            raise ValueError(f"{flag} needs the {package} package: pip install {package}, or drop the flag")
    if tc.eval.sample_interval:
        from gpt2.model.tokenizer import TokenizerFilesError, encode_prompt, get_encoding

        try:  # too long, or no tokenizer files on an offline machine: an error now, not at the first sample
            get_encoding()  # samples are decoded with it, whatever the prompt (an empty one needs no encoding)
            encode_prompt(tc.eval.sample_prompt, block_size)
        except TokenizerFilesError as e:
            raise ValueError(
                f"the samples (--sample-interval {tc.eval.sample_interval}) need the tokenizer: {e}; "
                "or pass --sample-interval 0"
            ) from None
        except ValueError as e:
            raise ValueError(f"--sample-prompt: {e}") from None
    if tc.eval.hellaswag_interval and Path(tc.eval.hellaswag_file).is_file():
        from gpt2.data.hellaswag import load_examples

        load_examples(tc.eval.hellaswag_file)  # a malformed line fails here (file:line), before any process group
    return train_shards, val_shards


def check_out_dir(out_dir: str) -> None:
    """--out-dir, or the nearest directory above it that exists, must be writable: otherwise the first
    mkdir or write raised OSError (EROFS, EACCES) with a traceback after the process group started.
    Nothing is created here (the dry run calls this)."""
    path = Path(out_dir).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        raise ValueError(f"--out-dir {out_dir}: {path} is a file, not a directory; pass a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        why = "a read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "no permission to write there"
        raise ValueError(f"--out-dir {out_dir}: cannot write in {path} ({why}); pass a writable --out-dir")


MANY_EPOCHS = 10
"""More passes than this over the train split earn a warning. A fine-tune on a small corpus makes a few
epochs on purpose (2-4 is common), and repeated pretraining data stays almost as useful as fresh for
about 4 epochs, its value fading to nothing past ~16 (Muennighoff et al. 2023, "Scaling Data-Constrained
Language Models"); more than 10 is past any deliberate choice, and usually a preset's token budget meant
for a 10B-token corpus pointed at a small one (--preset gpt2 on 700K tokens: ~14,000 epochs)."""


def planned_tokens(batch: BatchConfig, steps: int) -> int:
    """The tokens steps 0 .. steps - 1 of a fresh run take (--batch-warmup-steps' smaller steps counted)."""
    return tokens_before(
        steps, total=batch.total_batch_size, warmup_steps=batch.batch_warmup_steps, stages=batch.batch_warmup_stages
    )


def log_epochs(batch: BatchConfig, max_steps: int, train_tokens: int, log) -> float:
    """How many passes over the train split the planned tokens (max_steps x total_batch_size) make, as a
    line; a warning when it is more than MANY_EPOCHS. Returns the epochs."""
    planned = planned_tokens(batch, max_steps)
    epochs = planned / train_tokens
    warm = f" (less in the {batch.batch_warmup_steps:,}-step batch warmup)" if batch.batch_warmup_steps else ""
    log.detail(
        f"epochs     {epochs:,.2f} over the train split: {max_steps:,} steps x {batch.total_batch_size:,} "
        f"tokens{warm} = {planned:,} tokens planned, the train shards hold {train_tokens:,}"
    )
    if epochs > MANY_EPOCHS:
        one = max(1, train_tokens // batch.total_batch_size)
        log.warn(
            f"the run repeats the train split {epochs:,.0f} times (more than {MANY_EPOCHS} epochs): the model "
            f"will memorise this corpus more than it learns; about {one:,} step(s) make one epoch, so pass "
            f"--max-steps {one * MANY_EPOCHS:,} or fewer, or prepare more data"
        )
    return epochs


def log_mixture(tc: TrainConfig, T: int, train: MixedShards, log) -> list[float]:
    """A mixture's sources in one line (weights, train tokens, the epochs each makes by --max-steps, the
    schedule's weights included), its weight changes one line each, the normalisation when --data-weights
    do not sum to 1, and a warning for a source past MANY_EPOCHS. Returns each source's epochs. T: the
    block size (tokens per row)."""
    given = parse_weights(tc.data.data_weights, "data_weights")
    if abs(sum(given) - 1) > 1e-9:
        log.info(
            f"mixture    --data-weights {tc.data.data_weights} sum to {sum(given):g}, not 1: normalised to "
            f"{describe_weights(train.names, tc.data.weights)}"
        )
    changes = weight_changes(tc)
    draws = planned_draws(changes, lambda step: planned_tokens(tc.batch, step) // T, tc.schedule.max_steps)
    epochs = [n * T / s.total_tokens for n, s in zip(draws, train.sets)]
    log.info(
        "mixture    "
        + "; ".join(
            f"{name} {w:.4g}: {s.total_tokens:,} train tokens, {e:,.2f} epochs by step {tc.schedule.max_steps:,}"
            for name, w, s, e in zip(train.names, changes[0][1], train.sets, epochs)
        )
    )
    for step, weights in changes[1:]:
        if step < tc.schedule.max_steps:
            log.info(f"mixture    from step {step:,}: {describe_weights(train.names, weights)} (weight schedule)")
    for name, e in zip(train.names, epochs):
        if e > MANY_EPOCHS:
            log.warn(
                f"the run repeats source {name} {e:,.0f} times (more than {MANY_EPOCHS} epochs): the model will "
                f"memorise it more than it learns; lower its weight or --max-steps, or add data to it"
            )
    return epochs


WARMUP_REACH = 0.5
"""Warn when the run's largest learning rate is below this share of --lr (more than twice as many warmup
steps as steps): most of such a run trains at a small fraction of the rate its flags name, so its result
says little about the recipe. Up to it the schedule is only compressed (a warmup as long as the run still
reaches --lr), which short test runs do on purpose (tests/: 2 steps with a 3-step warmup)."""


def log_warmup(schedule: ScheduleConfig, log) -> None:
    """One warning when --warmup-steps is more than twice --max-steps (WARMUP_REACH): the learning rate only
    rises, to max_steps/warmup_steps of --lr at the last step, and never decays. A warning, not a refusal:
    a few steps of a preset's recipe (--preset gpt2 --max-steps 10, warmup 715) are how a smoke test runs,
    and what it checks (it starts, steps, saves, resumes) does not need the schedule; a run meant to learn
    gets one line that says why it will not."""
    if schedule.warmup_steps <= schedule.max_steps or schedule.max_steps / schedule.warmup_steps >= WARMUP_REACH:
        return
    last = lr_at(
        schedule.max_steps - 1,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        warmup_steps=schedule.warmup_steps,
        max_steps=schedule.max_steps,
        decay_steps=schedule.decay_steps,
    )
    log.warn(
        f"--warmup-steps {schedule.warmup_steps:,} is more than twice --max-steps {schedule.max_steps:,}: the "
        "learning rate "
        f"only rises, to {last:.3g} ({last / schedule.lr:.1%} of --lr {schedule.lr:g}) at the last step, and "
        "never decays. "
        f"Fine for a smoke test; to train, pass --warmup-steps well below --max-steps (the gpt2 recipe warms up "
        f"for 715 of its 19,073 steps)"
    )


def log_auto(r: Resolved, log) -> None:
    """The start-up's decisions (gpt2/plan/resolve.py), one line each: what a real start and a dry run print."""
    log.info(f"precision  {r.precision.dtype}: {r.precision.reason}")
    if r.warning:
        log.warn(r.warning)
    if r.plan.micro_batch_choice is not None:  # --micro-batch-size auto
        log.info(r.micro_batch.describe())
    log.detail(r.loss.describe())
    (log.info if r.ac.on else log.detail)(r.ac.describe())  # recomputing every block costs a third more compute


def start_target(dist: Dist, hardware=None) -> Target:
    """The hardware of this start, measured by resolve_choices on rank 0: its device shared by the ranks on this
    host. hardware: given instead of measured (tests pass a cap)."""
    return Target(
        world_size=dist.world_size, processes_per_host=dist.local_world_size, device=dist.device, hardware=hardware
    )


def resolve_auto(
    cfg: RunConfig,
    dist: Dist,
    log: RunLog,
    hardware=None,
    *,
    start: StartDecision = FRESH,
    target: Target | None = None,
) -> Resolved:
    """Every `auto` flag made concrete, with the run's other decisions and its memory plan, in one record:
    gpt2/plan/resolve.py's resolve_choices (the one place they are decided). Rank 0 measures and decides
    and every rank takes its answer: ranks that chose differently would compute different things
    silently. A model that fits nowhere is rank 0's finding too: every rank raises its error, none waits.

    hardware: what the planner sizes for (default: this device, measured; tests pass a cap). start: the
    resume point choose_start found (kept in the record; FRESH for a run built in a new directory).
    target: the hardware resolved for (default: this start's, start_target; the dry run's may be a
    hypothetical GPU).
    """
    target = target or start_target(dist, hardware)
    answer = rank0_decides(lambda: resolve_choices(cfg, target, start=start), dist, errors=(ValueError,))
    log_auto(answer, log)
    return answer


def log_mfu_peak(decided: Resolved, dist: Dist, log: RunLog) -> None:
    """The peak FLOP/s MFU is measured against (the record's, gpt2/plan/resolve.py mfu_peak), or "mfu n/a: why"."""
    peak = decided.peak
    if peak is None:
        log.info(f"mfu n/a: {decided.peak_why}")
    elif decided.hardware.device_type == "cpu":
        log.detail(
            f"peak       {format_flops(peak)} per rank ({torch.get_num_threads()} thread(s)): {decided.peak_how} "
            f"({matmul_peak.REFRESH_PEAK_ENV}=1 measures again)"
        )


DOC_SHARE_TOKENS = 1 << 20
"""Tokens of the first train shards log_doc_attention_share reads (2 MiB: a few milliseconds)."""


def log_doc_attention_share(model: ModelConfig, train: ShardSet, log: RunLog) -> None:
    """--doc-attention: MFU counts attention as the full T x T (gpt2/plan/flops.py), of which the mask computes less
    the shorter this data's documents are. One line (train.log, --verbose) says how much, measured on the first
    DOC_SHARE_TOKENS tokens of the train shards, so each MFU of the run can be read beside it."""
    tokens, left = [], DOC_SHARE_TOKENS
    for path in train.paths:
        if left <= 0:
            break
        tokens.append(read_tokens(path, left))
        left -= len(tokens[-1])
    T = model.block_size
    try:
        share = within_document_share(np.concatenate(tokens), T, EOT_TOKEN)
    except ValueError:  # fewer tokens than one window: nothing to say
        return
    causal = share.skipped_of_counted(model) / (1 - share.kept) if share.kept < 1 else None
    log.detail(
        f"documents  --doc-attention keeps {share.kept:.1%} of causal attention's (query, key) pairs on this data "
        f"({share.documents:,} documents start in the first {share.windows:,} windows of {T}); MFU counts attention "
        f"as the full T x T: of the FLOPs it counts the mask skips {share.skipped_of_counted(model):.1%}"
        + (f", beside the {causal:.1%} causality skips with or without it" if causal is not None else "")
    )


def check_memory(r: Resolved, log) -> None:
    """The plan's console line, with what this process holds beside it (check_plan, in the pre-flight, has
    refused a configuration that clearly cannot fit and logged the plan in detail)."""
    p, held = r.plan, None
    if p.hardware.device_type == "cpu":
        # What the first step loads and keeps whatever the model (torch._dynamo, which torch.optim imports; the
        # kernels' code paged in from libtorch), taken now by a tiny model's steps (uncompiled: a compile would
        # cost seconds), so that what the process holds is read with it: ~45 MiB that neither held nor the plan
        # counted (issue 54).
        warm_up(r.cfg.model, prec=r.precision, loss_impl=r.cfg.train.compute.loss_impl)
        held = host_memory.resident_bytes()
    probes = [b for b in (r.loss.probe_bytes, r.micro_batch.probe_bytes) if b is not None]
    log_path = Path(r.cfg.train.ckpt.out_dir) / TRAIN_LOG
    log.info(plan_line(p, log_path, shown=log.verbose, held=held, probe=max(probes, default=None)))


def check_plan(r: Resolved, log) -> Plan:
    """The planner's summary for the resolved run (logged), refused if it clearly cannot fit."""
    from gpt2.plan.planner import check_fits
    from gpt2.plan.report import format_plan, format_stop, gpu_recipe_on_cpu

    p = r.plan
    log.detail(format_plan(p))
    log.detail(format_stop(p))  # the SLURM signal lead and grace this run's checkpoint needs
    check_fits(p)
    if note := gpu_recipe_on_cpu(r.cfg.train, p):
        log.warn(note)
    return p


def log_network_cost(decided: Resolved, dist: Dist, log: RunLog) -> NetworkCost | None:
    """Several ranks: time one gradient bucket's all-reduce and say what a step's collectives would
    cost against the plan's compute per step (DDP's all-reduce, or fsdp's all-gathers and
    reduce-scatter; one line; a warning above WARN_SHARE). None on one process."""
    tc, p = decided.cfg.train, decided.plan
    fsdp = None
    if tc.distributed.parallel == "fsdp":
        fsdp = fsdp_traffic(p.n_params, gathered_param_bytes(decided.precision, dist.device), decided.accum_steps)
    cost = measure_network(
        dist,
        bucket_cap_mb=tc.distributed.ddp_bucket_cap_mb,
        n_params=p.n_params,
        step_compute_s=p.step_time_s,
        fsdp=fsdp,
    )
    if cost is not None:
        log.detail(format_network_cost(cost) + (f" at the planner's {p.mfu:.0%} MFU" if cost.share is not None else ""))
        warning = network_warning(cost)
        if warning:
            log.warn(warning)
    return cost


def write_run_info(decided: Resolved, dist: Dist, parts: Parts) -> None:
    """RUN/config.json (rank 0): the run's concrete config and what the start-up decided, for a resume's
    keep_decisions, the tools and a person."""
    if not dist.is_main:
        return
    import tiktoken

    info = {
        "run_id": parts.run_id,
        "config": decided.cfg.to_dict(),
        "world_size": dist.world_size,
        "device": str(dist.device),
        "device_name": device_name(dist.device),
        "precision": decided.precision.to_dict(),
        "loss": decided.loss.to_dict(),
        "accum_steps": decided.accum_steps,
        "params": parts.model.num_params(),
        "peak_flops_per_rank": decided.peak,
        "hostname": socket.gethostname(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "numpy": np.__version__,
            "tiktoken": tiktoken.__version__,
        },
    }
    if decided.network is not None:  # several ranks: the start-up's all-reduce (gpt2/distributed/bandwidth.py)
        info["network"] = decided.network
    if parts.init_from is not None:  # --init-from: where the weights came from (gpt2/train/init_from.py)
        info["init_from"] = parts.init_from
    atomic_write_text(Path(decided.cfg.train.ckpt.out_dir) / RUN_INFO, json.dumps(info, indent=2))
