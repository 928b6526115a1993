"""The training state: what a checkpoint holds, how it is saved and how it is put back.

A checkpoint is the state_dict() of five (six) components, each with state_dict/load_state_dict (as
torchtitan's checkpoint manager keeps its stateful components), plus the run's config and progress:

    model       the raw GPT's weights (never the compiled or DDP wrapper's: no `_orig_mod.` prefix)
    optimizer   AdamW's or Muon's state; this run's hyperparameters win over the saved ones
    scaler      fp16's GradScaler (empty when disabled)
    loader      the data position, seed, shard fingerprint and order (gpt2/data/loader.py); a mixture's
                also each source's fingerprint and the weights' segments (gpt2/data/mixture.py)
    rng         every rank's Python, NumPy, torch (and CUDA) generators: one entry per rank
    spike_guard the loss-spike guard's history and decisions (gpt2/train/spike_guard.py); absent with the
                guard off, and from checkpoints older than it (a fresh guard then)

check_compatible refuses a checkpoint of another model, optimizer or tokenizer before anything is
loaded. The bytes go through gpt2/ckpt/checkpoint.py (atomic file, sidecar hash, `latest`) and, in the
background, gpt2/ckpt/writer.py.

A sharded model (--parallel fsdp on several ranks) saves a sharded checkpoint instead: every rank
writes its shards of model and optimizer through torch.distributed.checkpoint (gpt2/ckpt/dcp.py), rank 0
the rest (train.pt). Any checkpoint loads into any run of the same model: a sharded one into a
sharded, a DDP or a one-process run (DCP reads each rank's slices by parameter name), a .pt file
into a sharded run (every rank reads the whole tensors and keeps its slice).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt import dcp as dcp_io
from gpt2.ckpt.writer import CheckpointWriteError, CheckpointWriter
from gpt2.core.config import ModelConfig, RunConfig, ScheduleConfig, train_values, weight_changes
from gpt2.core.precision import Precision
from gpt2.core.schedule import BatchLayout, lr_at
from gpt2.data.loader import EvalLoader, TrainLoader
from gpt2.data.mixture import MixtureEval, MixtureLoader, train_loader
from gpt2.distributed import preempt
from gpt2.distributed.fsdp import is_sharded
from gpt2.distributed.group import Dist, all_gather_object, barrier, rank0_decides
from gpt2.distributed.straggler import ComputeClock
from gpt2.model.gpt import GPT
from gpt2.train.optim import optimizer_kind
from gpt2.train.run_log import RunLog

TOKENIZER = "gpt2"
"""The tokenizer every checkpoint records; another is refused on resume."""


@dataclass
class Parts:
    """What build() makes: the raw model (for checkpoints and sampling) and the wrapped one (to train)."""

    model: GPT
    train_model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loader: TrainLoader | MixtureLoader
    val_loader: EvalLoader | MixtureEval | None
    accum_steps: int
    scaler: torch.amp.GradScaler
    """Scales the loss under float16 (its gradients would underflow); disabled, a pass-through, otherwise."""
    precision: Precision
    """The run's precision (the start-up's record): the autocast of every forward, training's and evaluation's."""
    step: int = 0
    tokens: int = 0
    """Training tokens consumed by the steps so far: each step adds its --total-batch-size, so a resume
    with another batch size continues the count (step x batch would rewrite the past)."""
    writer: CheckpointWriter | None = None
    """Rank 0's background checkpoint writer (--async-ckpt); None on the other ranks and when off."""
    run_id: str | None = None
    """The run this one is (gpt2/ckpt/rundir.py): recorded in config.json and in every checkpoint it writes."""
    prefetched: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    """(loader position, that step's first micro-batch) read ahead by the trainer (gpt2/train/trainer.py prefetch)."""
    clock: ComputeClock | None = None
    """This rank's compute time per step, which rides the step's all-reduce (gpt2/distributed/straggler.py)."""
    guard: Stateful | None = None
    """The loss-spike guard (gpt2/train/spike_guard.py SpikeGuard); None with --spike-guard false."""
    init_from: dict | None = None
    """Rank 0's record of the weights --init-from started this run from (path, sha256; gpt2/train/init_from.py),
    written into config.json; None without --init-from and on the other ranks."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# ------------------------------------------------------------------ the components


def rng_state(cuda: bool = False) -> dict:
    """Python's, NumPy's and torch's generators, and the current CUDA device's when cuda (the run's
    device is CUDA). Only then: asking CUDA for its state opens a context on GPU 0, so every rank
    of a --device cpu run on a GPU node would hold one there (and all on the same GPU)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, cuda: bool = False) -> None:
    """rng_state's inverse; a saved CUDA state is restored only into a CUDA run (a checkpoint of
    one, or an older checkpoint that saved it whenever CUDA was present, loads anywhere)."""
    random.setstate((state["python"][0], tuple(state["python"][1]), state["python"][2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if cuda and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


@dataclass(frozen=True)
class RankRng:
    """This rank's generators. Saved: one entry per rank (save() gathers them). Loaded: the same
    world size gives each rank its own back; otherwise rank r takes saved rank r mod W. cuda: the run's
    device is CUDA (its generator is saved and restored too)."""

    rank: int
    cuda: bool = False

    def state_dict(self) -> dict:
        return rng_state(self.cuda)

    def load_state_dict(self, per_rank: list[dict]) -> None:
        set_rng_state(per_rank[self.rank % len(per_rank)], self.cuda)


@dataclass(frozen=True)
class OptimizerState:
    """The optimizer's moments and step counts. The schedule sets lr each step, and weight decay,
    momentum and Muon's lr_scale come from this run's flags, not from the checkpoint."""

    optimizer: torch.optim.Optimizer

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        with this_runs_hyperparameters(self.optimizer):
            self.optimizer.load_state_dict(state)


@contextlib.contextmanager
def this_runs_hyperparameters(optimizer):
    """Whatever loads the optimizer's state inside, its groups keep this run's weight decay,
    momentum and lr_scale (the saved param_groups carry the old run's)."""
    fresh = [{k: g[k] for k in ("weight_decay", "momentum", "lr_scale") if k in g} for g in optimizer.param_groups]
    yield
    for group, keep in zip(optimizer.param_groups, fresh, strict=True):
        group.update(keep)


@dataclass(frozen=True)
class ScalerState:
    """fp16's loss scale. Restored only when fp16 was on before and is now: the scale goes on."""

    scaler: torch.amp.GradScaler

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


def components(parts: Parts, dist: Dist) -> dict[str, Stateful]:
    """The checkpoint's stateful components, by their key in the checkpoint."""
    return {
        "model": parts.model,
        "optimizer": OptimizerState(parts.optimizer),
        "scaler": ScalerState(parts.scaler),
        "loader": parts.loader,
        "rng": RankRng(dist.rank, dist.device.type == "cuda"),
        **({"spike_guard": parts.guard} if parts.guard is not None else {}),
    }


# ------------------------------------------------------------------ compatibility


def check_compatible(saved: dict, cfg: RunConfig, log: RunLog) -> None:
    """Refuse a checkpoint of a different model or tokenizer; log other changed settings."""
    # Through ModelConfig: a checkpoint from before an option was added lacks its key, and its default
    # (off: GPT-2's layout) is what that checkpoint was trained with.
    old_model, old_train = ModelConfig(**saved["config"]["model"]).to_dict(), train_values(saved["config"]["train"])
    shape = [
        f"{k}: checkpoint {old_model[k]} vs now {getattr(cfg.model, k)}"
        for k in ModelConfig.shape_fields()
        if old_model[k] != getattr(cfg.model, k)
    ]
    if shape:
        raise ckpt.CheckpointError(
            "the checkpoint's model shape differs from this run's: "
            + "; ".join(shape)
            + ". Use the same shape flags, or start fresh with --resume never"
        )
    saved_optimizer = saved.get("optimizer_kind") or optimizer_kind(saved.get("optimizer", {}))
    if saved_optimizer != cfg.train.optim.optimizer:
        raise ckpt.CheckpointError(
            f"the checkpoint was trained with --optimizer {saved_optimizer}, this run asks for "
            f"--optimizer {cfg.train.optim.optimizer}: their states differ (AdamW keeps two moments per parameter, "
            f"Muon one momentum per block matrix). Resume with --optimizer {saved_optimizer}, or start fresh "
            "with --resume never"
        )
    own = [
        "--" + k.replace("_", "-")
        for k in ("embed_lr", "head_lr")
        if (old_train.get(k) is None) != (getattr(cfg.train.optim, k) is None)
    ]
    if own:
        raise ckpt.CheckpointError(
            f"{' and '.join(own)}: set in one of the checkpoint and this run, not in the other, so their AdamW "
            "groups differ; resume with the checkpoint's setting (its value may change), or start fresh with "
            "--resume never"
        )
    if saved.get("tokenizer") != TOKENIZER:
        raise ckpt.CheckpointError(f"checkpoint tokenizer {saved.get('tokenizer')!r} is not gpt2")
    now = cfg.train.flat()
    changed = {k: (v, now[k]) for k, v in old_train.items() if k not in ("resume", "verbose") and now.get(k, v) != v}
    for k, (old, new) in changed.items():
        log.info(f"resume: {k} changed from {old!r} to {new!r}")
    if "max_steps" in changed and (note := horizon_note(old_train["max_steps"], cfg.train.schedule, saved.get("step"))):
        log.info(note)


def horizon_note(old_max_steps: int, schedule: ScheduleConfig, step: int | None) -> str | None:
    """One line when a resume's new --max-steps moves the learning rate of its next step (step, the
    checkpoint's, counted from 0: the log numbers it step + 1, and so does the line). The decay is stretched
    over the new horizon, so a finished run extended climbs back from min_lr towards --lr. None where the
    rate there is the same (still warming up, or warmup-stable-decay's stable part) or the step is unknown."""
    if step is None:
        return None
    new, old = lr_of(schedule, step), lr_of(replace(schedule, max_steps=old_max_steps), step)
    if new == old:
        return None
    return (
        f"resume: --max-steps {old_max_steps} -> {schedule.max_steps} stretches the learning-rate schedule over the "
        f"new horizon: step {step + 1}, the first after the checkpoint, trains at lr {new:.2e} where the old one "
        f"gave {old:.2e}. To keep the old rate pass --max-steps {old_max_steps}, or a constant one with --lr "
        f"{old:.3g} --min-lr {old:.3g}; a run meant to be extended can use --decay-steps N (warmup-stable-decay: "
        "--lr until the last N steps, so a longer --max-steps moves only the decay)"
    )


def lr_of(schedule: ScheduleConfig, step: int) -> float:
    """The schedule's learning rate at step (what the trainer's set_lr sets)."""
    return lr_at(
        step,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        warmup_steps=schedule.warmup_steps,
        max_steps=schedule.max_steps,
        decay_steps=schedule.decay_steps,
    )


class _Quiet:
    """A log that says nothing: check_resumable's rehearsal of the checks restore() logs for real."""

    def info(self, message: str) -> None:
        pass


def check_resumable(path: Path, cfg: RunConfig, train_shards, dist: Dist) -> None:
    """Raise the CheckpointError restore() would raise for path's contents (another model shape,
    optimizer or tokenizer; other data, seed or order), reading no weights.

    The start-up asks this before it moves an earlier run's records aside for a resume of another
    run (gpt2/train/startup.py): a refused resume must leave the directory as it found it.
    """
    tc = cfg.train
    state = ckpt.load_checkpoint(path, verify=False, mmap=True)  # verified by choose_start
    check_compatible(state, cfg, _Quiet())
    loader = train_loader(
        train_shards,
        BatchLayout(tc.batch.micro_batch_size, cfg.model.block_size, tc.batch.total_batch_size, dist.world_size),
        changes=weight_changes(tc),
        rank=dist.rank,
        seed=tc.data.seed,
        device=torch.device("cpu"),
        pin_memory=False,
        order=tc.data.data_order,
    )
    try:
        load_components({"loader": loader}, state, path)
    finally:
        loader.close()


# ------------------------------------------------------------------ put back


def restore(parts: Parts, path: Path, cfg: RunConfig, dist: Dist, log: RunLog) -> None:
    # Verified by choose_resume (hashed once per node). mmap: the tensors stay in the page cache,
    # which the ranks of a node share, so host memory does not grow with ranks x checkpoint size.
    state = ckpt.load_checkpoint(path, verify=False, mmap=True)
    check_compatible(state, cfg, log)
    load_weights_and_moments(parts, path, state)
    rest = {k: c for k, c in components(parts, dist).items() if k not in ("model", "optimizer")}
    load_components(rest, state, path)
    if isinstance(parts.loader, MixtureLoader):  # the weights of this step: other --data-weights start here
        parts.loader.at_step(state["step"])
        for line in parts.loader.news():
            log.info(line)
    if parts.loader.order != cfg.train.data.data_order:
        log.info(
            f"resume: {path} predates --data-order; continuing with the {parts.loader.order} order "
            "it was trained with (start fresh, --resume never, for the shuffled one)"
        )
    parts.step = state["step"]
    parts.tokens = tokens_of(state)
    if state["world_size"] != dist.world_size:
        log.info(
            f"resume: world size {state['world_size']} -> {dist.world_size}; "
            f"accumulation is now {parts.accum_steps} micro-steps"
        )
    log.info(f"resumed from {path} at step {parts.step} ({parts.tokens:,} tokens)")
    try:  # rank 0 alone reads the log: its problem must reach every rank (build's agree_on_step)
        log.truncate_after(parts.step)
    except ValueError as e:
        raise ckpt.CheckpointError(str(e)) from None


def tokens_of(state: dict) -> int:
    """The tokens a checkpoint's steps consumed. A checkpoint without the count (none is written without
    it now) was a run whose batch never changed: its steps x its --total-batch-size."""
    if "tokens" in state:
        return int(state["tokens"])
    return int(state["step"]) * int(train_values(state["config"]["train"])["total_batch_size"])


def load_weights_and_moments(parts: Parts, path: Path, state: dict) -> None:
    """Model and optimizer from any checkpoint into this run, sharded or not (module docstring)."""
    if not state.get("sharded") and not is_sharded(parts.model):  # .pt into DDP or one process: as always
        parts.model.load_state_dict(state["model"])
        OptimizerState(parts.optimizer).load_state_dict(state["optimizer"])
        return
    try:
        with this_runs_hyperparameters(parts.optimizer):
            if state.get("sharded"):  # collective when there is a process group: every rank restores
                dcp_io.load(parts.model, parts.optimizer, path)
            else:
                dcp_io.load_full(
                    parts.model,
                    parts.optimizer,
                    state["model"],
                    dcp_io.named_optimizer_state(state["optimizer"], parts.model, parts.optimizer),
                )
    except (KeyError, RuntimeError, ValueError) as e:
        raise ckpt.CheckpointError(
            f"{path}: its model or optimizer state does not load into this run "
            f"({type(e).__name__}: {' '.join(str(e).split())[:500]})"
        ) from None


def load_components(states: dict[str, Stateful], saved: dict, path: Path) -> None:
    """Each component's load_state_dict from its key (the order of `states`). A loader that refuses
    the saved position (other data, seed or order) is a user error with its fix in the message."""
    for key, component in states.items():
        try:
            component.load_state_dict(saved.get(key))
        except ValueError as e:
            if key != "loader":
                raise
            raise ckpt.CheckpointError(f"{path}: {e}") from None


# ------------------------------------------------------------------ save


def checkpoint_state(parts: Parts, cfg: RunConfig, dist: Dist, rngs: list[dict], *, sharded: bool = False) -> dict:
    """Rank 0: the dict a checkpoint file holds (rngs: every rank's RankRng.state_dict()). sharded:
    without model and optimizer (train.pt of a sharded checkpoint; DCP holds those)."""
    small = {
        "scaler": parts.scaler.state_dict(),
        "config": cfg.to_dict(),
        "tokenizer": TOKENIZER,
        "loader": parts.loader.state_dict(),
        "rng": rngs,
        "world_size": dist.world_size,
        "tokens": parts.tokens,
        "torch_version": str(torch.__version__),
        **({"spike_guard": parts.guard.state_dict()} if parts.guard is not None else {}),
    }
    if sharded:
        return {**small, "optimizer_kind": "muon" if hasattr(parts.optimizer, "optimizers") else "adamw"}
    return {"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(), **small}


def save(
    parts: Parts, cfg: RunConfig, dist: Dist, log: RunLog, requeue: dict | None = None, *, background: bool = False
) -> None:
    """Every rank contributes its RNG state; rank 0 writes.

    background (the same on every rank; needs parts.writer on rank 0, gpt2/ckpt/writer.py): rank 0
    copies the state to host memory, a thread writes it, and every rank goes on training. Otherwise
    everyone waits for the write at a barrier. Either way rank 0 first waits for the write in flight,
    and its error travels with the RNG states, so every rank raises the same CheckpointWriteError
    (none is left waiting in a collective).
    requeue: a signal stop's RUN/requeue content (always synchronous). Rank 0 writes and fsyncs the
    marker after the checkpoint and before the closing barrier, so no rank (on no node) can leave
    the stop path, and let srun --kill-on-bad-exit end the job step, before the marker is on disk.
    """
    problem = finish_background_write(parts, log) if dist.is_main else None
    gathered = all_gather_object((RankRng(dist.rank, dist.device.type == "cuda").state_dict(), problem), dist)
    if gathered[0][1] is not None:
        raise CheckpointWriteError(gathered[0][1])
    background = background and requeue is None
    if is_sharded(parts.model):
        save_sharded(parts, cfg, dist, log, [rng for rng, _ in gathered], requeue)
        return
    out_dir, keep = cfg.train.ckpt.out_dir, cfg.train.ckpt.keep_checkpoints

    def write() -> None:  # rank 0's
        state = checkpoint_state(parts, cfg, dist, [rng for rng, _ in gathered])
        if background:
            parts.writer.submit(out_dir, parts.step, state, keep=keep, run_id=parts.run_id, warn=log.warn)
            log.info(f"checkpoint of step {parts.step}: writing it in the background")
            return
        try:
            path = ckpt.save_checkpoint(out_dir, parts.step, state, keep=keep, run_id=parts.run_id, warn=log.warn)
        except (OSError, RuntimeError) as e:  # torch's RuntimeError hides ENOSPC in its context
            raise CheckpointWriteError(
                f"writing the checkpoint of step {parts.step} failed "
                f"({ckpt.write_failure(e, ckpt.checkpoint_dir(out_dir))}). The newest complete "
                "checkpoint is the one before it; free space or fix the run directory, then resume "
                "with --resume auto"
            ) from None
        log.info(f"saved checkpoint {path}")
        if requeue is not None:  # after the checkpoint: the marker promises a complete one
            preempt.write_requeue_marker(out_dir, {**requeue, "checkpoint": path.name})

    if background:  # the writer reports a failure at a later step (gpt2/ckpt/writer.py): nobody waits here
        if dist.is_main:
            write()
        return
    rank0_decides(write, dist, errors=(CheckpointWriteError,))  # every rank raises rank 0's failure, none waits
    barrier(dist)


def save_sharded(parts: Parts, cfg: RunConfig, dist: Dist, log: RunLog, rngs: list[dict], requeue: dict | None) -> None:
    """Every rank writes its shards into step_*.tmp/ (no rank gathers the model), fsyncs and hashes
    them; rank 0 publishes the directory (rename, sidecar, `latest`, retention: checkpoint.publish_sharded).

    Always synchronous, --async-ckpt or not: DCP's async_save would run its own collectives from a
    background thread beside training's on the same process group (needing a second group) and the
    rename and sidecar would have to wait for every rank's write at a later step. Each rank writes
    1/world_size of the state, so the wait is short. Any rank's failure is every rank's
    CheckpointWriteError, and the newest valid checkpoint stays the one before.
    """
    tc, t0 = cfg.train, time.perf_counter()
    tmp = ckpt.sharded_temp_dir(tc.ckpt.out_dir, parts.step)
    problem = _attempt(lambda: ckpt.begin_sharded(tc.ckpt.out_dir, parts.step)) if dist.is_main else None
    _raise_any(all_gather_object(problem, dist), parts.step)  # the directory exists before anyone writes
    problem = _attempt(lambda: dcp_io.save_dcp(parts.model, parts.optimizer, tmp), tmp)
    if dist.is_main and problem is None:
        problem = _attempt(
            lambda: ckpt.write_train_state(
                tmp, parts.step, checkpoint_state(parts, cfg, dist, rngs, sharded=True), parts.run_id
            ),
            tmp,
        )
    _raise_any(all_gather_object(problem, dist), parts.step)  # every rank's files are complete
    files = {}
    problem = _attempt(lambda: files.update(ckpt.hash_files(tmp, ckpt.own_files(tmp, dist.rank))))
    reports = all_gather_object((files, problem), dist)
    _raise_any([p for _, p in reports], parts.step)
    problem = None
    if dist.is_main:
        every = {name: meta for f, _ in reports for name, meta in f.items()}
        path = []
        problem = _attempt(
            lambda: path.append(
                ckpt.publish_sharded(
                    tc.ckpt.out_dir,
                    parts.step,
                    every,
                    keep=tc.ckpt.keep_checkpoints,
                    run_id=parts.run_id,
                    warn=log.warn,
                )
            )
        )
        if problem is None:
            sync = "; synchronous: --async-ckpt applies to .pt checkpoints" if tc.ckpt.async_ckpt else ""
            log.info(
                f"saved checkpoint {path[0]} (sharded: {len(every)} files from {dist.world_size} ranks in "
                f"{time.perf_counter() - t0:.1f} s{sync})"
            )
            if requeue is not None:  # after the checkpoint: the marker promises a complete one
                preempt.write_requeue_marker(tc.ckpt.out_dir, {**requeue, "checkpoint": path[0].name})
    _raise_any(all_gather_object(problem, dist), parts.step)  # nobody leaves before it is published


def _attempt(work, directory: Path | None = None) -> str | None:
    """Run work(); its OSError or RuntimeError (DCP's) as a message, so every rank can raise it. With
    the directory written: an OS error behind it (a full disk) is said as such, naming the directory."""
    try:
        work()
    except (OSError, RuntimeError, ValueError) as e:
        if directory is not None and ckpt.os_error_of(e) is not None:
            return ckpt.write_failure(e, directory)
        return f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"
    return None


def _raise_any(problems: list[str | None], step: int) -> None:
    bad = [(rank, p) for rank, p in enumerate(problems) if p]
    if bad:
        rank, p = bad[0]
        raise CheckpointWriteError(
            f"writing the sharded checkpoint of step {step} failed on rank {rank} ({p}). "
            "The newest complete checkpoint is the one before it; free space or fix the "
            "run directory, then resume with --resume auto"
        )


def finish_background_write(parts: Parts, log: RunLog) -> str | None:
    """Rank 0: wait for the checkpoint write in flight; its error as a message, or None."""
    if parts.writer is None:
        return None
    try:
        done = parts.writer.wait()
    except CheckpointWriteError as e:
        return (
            f"{e}. The newest complete checkpoint is the one before it; free space or fix the run directory, "
            "then resume with --resume auto"
        )
    if done is not None:
        log.info(
            f"saved checkpoint {done['path']} (in the background: copied in {done['copy_s']:.1f} s, "
            f"written in {done['write_s']:.1f} s)"
        )
    return None
