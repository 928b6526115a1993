"""The training loop: train(), run_loop(), train_step(), due(). Importable and testable.

train(run) trains the Run that start() (gpt2/train/startup.py) made, from its config to its first step
(train_ddp.py: the run's guards, start, train). One step, top to bottom: run_loop() -> train_step() (this
file; the model's forward in gpt2/model/gpt.py), then due() says what else the step owes (evaluate, sample, save,
stop) and save() writes the checkpoint (gpt2/train/state.py).
Everything distributed goes through the `Dist` passed in; nothing reads the environment.
"""

from __future__ import annotations

import contextlib
import functools
import math
import resource
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gpt2.core import precision
from gpt2.core.config import (
    EOT_TOKEN,
    BatchConfig,
    EvalConfig,
    OptimConfig,
    ScheduleConfig,
    TrainConfig,
)
from gpt2.core.schedule import batch_tokens_at, lr_at, momentum_at, tokens_before, warmup_micro_steps
from gpt2.data.loader import TrainLoader
from gpt2.data.mixture import MixtureEval, MixtureLoader
from gpt2.data.shards import ShardError
from gpt2.distributed import preempt
from gpt2.distributed.fsdp import clip_grad_norm, is_sharded, no_grad_sync
from gpt2.distributed.group import Dist, all_gather_object, all_reduce_sum, collective, set_timeout
from gpt2.distributed.straggler import ComputeClock, straggler_line, times_record
from gpt2.model.gpt import TOP_K, cut_at_stop
from gpt2.plan import matmul_peak
from gpt2.plan.flops import checked_mfu, mfu
from gpt2.train import compile_cache
from gpt2.train.gc_steps import collect_at_steps, collect_if_due
from gpt2.train.run_log import RunLog, plot_loss_curve
from gpt2.train.spike_guard import VERDICT_SIZE, roll_back, verdict_of
from gpt2.train.startup import Run
from gpt2.train.state import Parts, finish_background_write, save
from gpt2.train.step_clock import StepClock, StepMarks


class NonFiniteError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops without checkpointing the bad state."""


def no_sync(train_model: torch.nn.Module):
    """The model's skip-the-gradient-sync context: DDP's no_sync, or FSDP's (no reduce-scatter)."""
    return no_grad_sync(train_model) if is_sharded(train_model) else train_model.no_sync()


class StepStats:
    """One optimizer step's numbers, on the device until read(): the loss (mean over micro-steps and
    ranks), the gradient norm, whether any rank asked to stop or met a token outside the vocabulary, whether the
    update was skipped because
    the loss or the gradient norm was not finite, and (fp16) whether the loss scaler found an overflow
    and skipped the update itself. `stats["loss"]` reads them (once; cached), as a dict would.

    On CUDA the four numbers (loss, stop votes, bad-token flag, norm) are copied to pinned host memory
    behind the step's all-reduce and an event is recorded after the copy: read() waits for that event alone, not for
    the kernels queued
    after it (the optimizer update, the next step's forward), as a plain .tolist() would.
    """

    def __init__(self, step: int, lr: float, numbers: torch.Tensor, world_size: int, scaler_enabled: bool) -> None:
        self.step, self.lr, self.world_size, self.scaler_enabled = step, lr, world_size, scaler_enabled
        self.marks: StepMarks | None = None  # run_loop's marks around the step's launch (its time)
        self.sources: dict = {}  # a mixture's tokens/NAME and epochs/NAME after the step (train_step)
        self.news: list[str] = []  # a mixture's weight change and epochs begun after the step: logged after its row
        self._event = None
        self.numbers = numbers  # on the device: train_step's update decides its skip there (update)
        if numbers.device.type == "cuda":
            host = torch.empty(numbers.shape, dtype=numbers.dtype, pin_memory=True)
            host.copy_(numbers, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            numbers = host
        self._numbers = numbers
        self._host: dict | None = None

    @property
    def is_read(self) -> bool:
        return self._host is not None

    def read(self) -> dict:
        """The step's numbers on the host: the step's one device read (waits for its all-reduce)."""
        if self._host is None:
            if self._event is not None:
                self._event.synchronize()
            loss_total, stop_votes, bad_data, grad_norm, *rest = self._numbers.tolist()
            guard, rank_s = rest[:VERDICT_SIZE], rest[VERDICT_SIZE:]
            loss_mean, stop = loss_total / self.world_size, stop_votes > 0
            loss_ok, norm_ok = math.isfinite(loss_mean), math.isfinite(grad_norm)
            # fp16: a finite loss with non-finite gradients is an overflow of the scaled gradients. The
            # scaler skips that update and lowers its scale: its normal working, not a bad step.
            overflow = self.scaler_enabled and loss_ok and not norm_ok
            skipped = not (loss_ok and norm_ok) and not overflow
            self._host = {
                "loss": loss_mean,
                "grad_norm": grad_norm,
                "lr": self.lr,
                "stop": stop,
                "skipped": skipped,
                "overflow": overflow,
                "bad_data": bad_data > 0,
                "guard": verdict_of(guard),
                "rank_s": rank_s,
            }
        return self._host

    def __getitem__(self, key: str):
        return self.read()[key]


def raise_bad_data(parts: Parts, dist: Dist) -> None:
    """A rank found a token outside the vocabulary in this step's batch (gpt2/data/loader.py): every rank
    raises the finder's message (a collective: every rank reads the same flag at the same point)."""
    raise ShardError(next(p for p in all_gather_object(parts.loader.problem, dist) if p))


def skips_on_device(parts: Parts) -> bool:
    """Whether the skip of a non-finite step can be decided on the device: fused AdamW (the default)
    takes GradScaler's found_inf tensor and, where it is 1, leaves every parameter and moment as they
    were and undoes its step count, all in its kernels. torch's other AdamW paths and Muon refuse or
    ignore found_inf, and fp16's GradScaler sets its own: those read the numbers before the update."""
    opt = parts.optimizer
    return (
        isinstance(opt, torch.optim.Adam)
        and bool(opt.defaults.get("fused"))
        and getattr(opt, "_step_supports_amp_scaling", False)
        and not parts.scaler.is_enabled()
    )


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), skipped in its kernels where found_inf (an fp32 scalar, 0.0 or 1.0) is 1.0:
    GradScaler's protocol for optimizers with _step_supports_amp_scaling (it sets and deletes the same
    attribute around step()). With 0.0 the update is bitwise a plain step's (tests/test_trainer.py)."""
    optimizer.found_inf = found_inf
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def micro_batch(parts: Parts, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loader's micro-batch, micro-step 0's taken from prefetch() when it read this position."""
    ahead, parts.prefetched = parts.prefetched, None
    if micro_step == 0 and ahead is not None and ahead[0] == parts.loader.position:
        return ahead[1]
    return parts.loader.micro_batch(micro_step)


def prefetch(parts: Parts) -> None:
    """Read the next step's first micro-batch now, while the device still runs this step's backward
    and update: the host's read, permutation and pinning, and the queued non-blocking copy, overlap
    device work instead of following it. (Micro-steps after the first are read while the previous
    one's backward runs, as train_step's loop comes round.) Keyed by the loader's position: a
    resume or anything else that moves the loader makes micro_batch() read afresh."""
    if isinstance(parts.loader, (TrainLoader, MixtureLoader)):
        parts.prefetched = (parts.loader.position, parts.loader.micro_batch(0))


def train_step(parts: Parts, tc: TrainConfig, dist: Dist, stop_requested: bool) -> StepStats:
    """One optimizer step: accumulate micro-batches, sync gradients on the last, clip, update.

    Returns the step's StepStats. Where the skip can be decided on the device (skips_on_device: fused
    AdamW, the default), nothing is read from the device here: the update, zero_grad and the next
    micro-batch are queued behind the forward and backward, and the numbers are read when asked (the
    trainer's loop asks one step later on CUDA, run_loop). Otherwise they are read before the update.
    """
    lr = set_lr(parts, tc.schedule)
    if tc.optim.optimizer == "muon" and tc.optim.muon_momentum_warmup:
        set_muon_momentum(parts, tc.optim)
    loss_sum = None
    autocast = parts.precision.autocast(dist.device)
    # This rank's own compute time, up to the gradient sync (gpt2/distributed/straggler.py): it names the
    # slowest rank, so with one rank there is nobody to compare and no clock (two CUDA events a step).
    timed = dist.world_size > 1
    if timed and parts.clock is None:  # made at the first step: Parts made elsewhere (tests, benchmarks) have none
        parts.clock = ComputeClock(dist)
    if timed:
        parts.clock.start()
    # --batch-warmup-steps: a smaller step is the first micro-steps of the full one's (schedule.warmup_micro_steps)
    tokens = step_tokens(tc.batch, parts.step)
    micro_steps = warmup_micro_steps(parts.accum_steps, tokens, tc.batch.total_batch_size)
    for micro_step in range(micro_steps):
        x, y = micro_batch(parts, micro_step)
        # Decide gradient sync before the forward pass: DDP registers its hooks during forward.
        last = micro_step == micro_steps - 1
        sync = contextlib.nullcontext() if last or not dist.is_distributed else no_sync(parts.train_model)
        with sync:
            with autocast:
                _, loss = parts.train_model(x, y, return_logits=False)  # the model's loss_impl path
            if micro_steps > 1:  # x / 1 is x bitwise: no kernel for it without accumulation
                loss = loss / micro_steps
            # The first micro-step's loss is the sum so far (0 + x is x): no zeros, no add, at 1 micro-step.
            loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach()
            if last and timed:
                parts.clock.mark()
            # The last micro-step's backward all-reduces the gradients (DDP's hooks), so its errors
            # are reported as the process group's; a compute error there (rarer: the same backward
            # runs in every micro-step) is reported the same way, with its own message kept.
            with collective("the gradient all-reduce") if last and dist.is_distributed else contextlib.nullcontext():
                parts.scaler.scale(loss).backward()
    parts.scaler.unscale_(parts.optimizer)  # clip and measure the true gradients (a no-op unless fp16)
    clip = tc.optim.grad_clip if tc.optim.grad_clip > 0 else float("inf")
    # The global norm of every rank's shards under FSDP, and the same number under DDP (gpt2/distributed/fsdp.py).
    grad_norm = clip_grad_norm(parts.model.parameters(), clip, dist)
    out = step_stats(parts, lr, loss_sum, grad_norm, stop_requested, dist)
    update(parts, out, dist)
    parts.loader.advance(tokens)
    parts.step += 1
    parts.tokens += tokens
    if isinstance(parts.loader, MixtureLoader):  # the next step's weights (a schedule's change), each source's tokens
        parts.loader.at_step(parts.step)
        out.sources, out.news = parts.loader.source_numbers(), parts.loader.news()
    if parts.step < tc.schedule.max_steps:
        prefetch(parts)
    return out


def set_lr(parts: Parts, schedule: ScheduleConfig) -> float:
    """The schedule's learning rate for step parts.step, set on every parameter group; returns it."""
    lr = lr_at(
        parts.step,
        max_lr=schedule.lr,
        min_lr=schedule.min_lr,
        warmup_steps=schedule.warmup_steps,
        max_steps=schedule.max_steps,
        decay_steps=schedule.decay_steps,
    )
    for group in parts.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)  # Muon's groups: --muon-lr on the same schedule
    return lr


def set_muon_momentum(parts: Parts, optim: OptimConfig) -> None:
    """--muon-momentum-warmup: Muon's momentum for step parts.step on its groups (the only ones with a
    "momentum"; AdamW's are betas). A function of the step alone, so a resumed run sets what it would have."""
    momentum = momentum_at(
        parts.step, start=optim.muon_momentum_start, end=optim.muon_momentum, warmup_steps=optim.muon_momentum_warmup
    )
    for group in parts.optimizer.param_groups:
        if "momentum" in group:
            group["momentum"] = momentum


def step_stats(
    parts: Parts, lr: float, loss_sum: torch.Tensor, grad_norm: torch.Tensor, stop_requested: bool, dist: Dist
) -> StepStats:
    """The step's numbers, all-reduced, still on the device (StepStats reads them when asked):
    [loss sum, stop votes, bad-token flags, grad norm, the guard's (spike, loss z, norm z), and with
    more than one rank each rank's compute time].

    One all-reduce carries the loss, the stop flag, the bad-token flag and each rank's compute time
    (gpt2/data/loader.py): every rank sees the same values, so every rank takes the same skip / stop
    decision. The host's numbers (the flags, this rank's time) reach the device in one copy
    (host_numbers); with one rank there is nothing to reduce, and the vector is made in one cat."""
    host = [float(stop_requested), float(parts.loader.problem is not None)]
    if dist.world_size > 1:  # each rank's time in its own slot (zeros elsewhere): the sum has every rank's
        host += parts.clock.host_slots()
    flags = host_numbers(host, dist.device)
    loss = loss_sum.reshape(1)  # fp32 already (train_step): a view
    if dist.world_size > 1:
        stats = torch.cat([loss, flags])
        all_reduce_sum(stats, dist, what="the step's loss, flags and compute times")
        loss, flags, rank_s = stats[:1], stats[1:3], [stats[3:]]
    else:
        rank_s = []
    # The spike guard's verdict on the all-reduced loss and norm (gpt2/train/spike_guard.py): on the device.
    if parts.guard is not None:
        mean = loss[0] / dist.world_size if dist.world_size > 1 else loss[0]  # x / 1 is x: no kernel
        guard = parts.guard.verdict_parts(mean, grad_norm)
    else:
        guard = [constant((0.0,) * VERDICT_SIZE, dist.device)]
    numbers = torch.cat([loss, flags, grad_norm.float().reshape(1), *guard, *rank_s])
    return StepStats(parts.step + 1, lr, numbers, dist.world_size, parts.scaler.is_enabled())


def host_numbers(values: list[float], device: torch.device) -> torch.Tensor:
    """Host floats on the device in one copy. On CUDA from pinned memory, non-blocking: a pageable
    copy would wait for every kernel queued before it (the step's backward)."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)


@functools.cache
def constant(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A constant fp32 vector on the device, made once (never written to: only read by cat and mul)."""
    return torch.tensor(values, device=device)


SKIP_WEIGHTS = (0.0, 0.0, 1.0, 0.0, 1.0)
"""The skip flag's weights over the numbers' first five (loss, stop, bad tokens, norm, spike): see skip_flag."""


def skip_flag(numbers: torch.Tensor) -> torch.Tensor:
    """1.0 where the loss or the norm is not finite, a rank met a bad token, or the guard saw a spike,
    else 0.0 (fp32 scalar): in four kernels. loss * 0 and norm * 0 are 0 when finite and NaN when not
    (inf * 0 is NaN), so the weighted sum is NaN or the count of bad-token ranks plus the spike flag
    (whole numbers, summed exactly, never negative): non-zero exactly when the step must be skipped."""
    weighted = (numbers[: len(SKIP_WEIGHTS)] * constant(SKIP_WEIGHTS, numbers.device)).sum()
    return weighted.ne(0).float()


def update(parts: Parts, out: StepStats, dist: Dist) -> None:
    """The optimizer update, unless the step's loss or gradient norm is not finite or a rank met a bad
    token; then zero_grad. Every rank decides alike, from the same all-reduced numbers."""
    if parts.writer is not None:  # rank 0, a checkpoint being copied: the update below changes its tensors
        parts.writer.wait_copied()
    if skips_on_device(parts):
        # The skip as a device-side condition, on the same all-reduced numbers on every rank (skip_flag).
        # No host read stands between backward and the update. A token outside the vocabulary on any rank
        # skips it too: nothing is learnt from that batch, and report() raises the finder's error when it
        # reads the numbers.
        step_unless(parts.optimizer, skip_flag(out.numbers))
    elif out.read()["bad_data"]:  # before the update: nothing learnt from the batch
        raise_bad_data(parts, dist)
    elif not (out.read()["skipped"] or out["guard"].spike):  # the host decides (fp16: the scaler reads its flag too)
        parts.scaler.step(parts.optimizer)  # optimizer.step(), unless the scaler found an overflow
    parts.scaler.update()
    parts.optimizer.zero_grad(set_to_none=True)


@dataclass(frozen=True)
class Actions:
    """What a finished step owes before the next one. Every rank decides alike (sampling then runs
    on rank 0 alone, or on every rank when the model is sharded)."""

    log: bool
    evaluate: bool
    hellaswag: bool
    sample: bool
    save: bool
    final: bool
    """The last step: its save is synchronous, so the run ends with a durable checkpoint."""
    stop: bool
    """A signal asked to stop before the last step: save synchronously, write RUN/requeue, exit."""

    @property
    def slow(self) -> bool:
        """Work that keeps some rank from the next step's collectives (rank 0 sampling or writing)."""
        return self.evaluate or self.hellaswag or self.sample or self.save

    def voted_stop(self, stop_requested: bool) -> Actions:
        """These actions once the step's stop vote is read: due(step, stop_requested=...)'s, without
        deciding the rest again (a signal at the last step changes nothing: the run is complete)."""
        stop = stop_requested and not self.final
        return replace(self, stop=stop, save=self.save or stop)


def due(
    step: int,
    tc: TrainConfig,
    *,
    stop_requested: bool = False,
    has_val: bool = True,
    has_hellaswag: bool = False,
    unusual: bool = False,
) -> Actions:
    """The actions after optimizer step `step` (1-based: steps done). stop_requested: any rank's signal
    (train_step's vote); has_val / has_hellaswag: whether there is a set to evaluate; unusual: a
    skipped or overflowed step, always logged."""
    final = step == tc.schedule.max_steps
    stop = stop_requested and not final  # a signal at the last step changes nothing: the run is complete
    return Actions(
        log=step % tc.log.log_interval == 0 or unusual or final,
        evaluate=has_val and (final or _every(step, tc.eval.eval_interval)),
        hellaswag=has_hellaswag and (final or _every(step, tc.eval.hellaswag_interval)),
        sample=bool(tc.eval.sample_interval) and (final or _every(step, tc.eval.sample_interval)),
        save=stop or final or _every(step, tc.ckpt.ckpt_interval),
        final=final,
        stop=stop,
    )


def _every(step: int, interval: int) -> bool:
    """interval 0 means never."""
    return bool(interval) and step % interval == 0


def train(run: Run) -> int:
    """Train the run start() made (gpt2/train/startup.py) to --max-steps, or until a stop signal: its step-0
    evaluation (where the curve begins), the loop, then the compile cache sealed and the run closed. Returns 0,
    or EXIT_REQUEUE after a signal. The caller holds the run's guards (startup.run_guards: the signals, the run
    directory's lock, the hang dumps) around start() and this."""
    dist = run.dist
    try:
        if run.parts.step == 0 and run.parts.val_loader is not None:
            loss, per_source = evaluate_sources(run.parts, dist)
            run.log.log_eval(0, 0, loss, run.parts.val_loader.tokens, per_source)
        cache = run.cache  # run_loop seals it after the first step and drops it from the run
        with collect_at_steps(run.cfg.train.distributed.gc_interval):  # every rank's collection at the same steps
            code = run_loop(run)
        compile_cache.finish(cache, dist, run.log)  # seals what this run compiled, for the next start
        return code
    finally:
        close_run(run.parts, dist, run.log)


def reads_lag(device: torch.device) -> bool:
    """Whether run_loop reads a step's numbers one step late: where kernels are queued (CUDA), reading
    them at once would drain the queue at every step; on a CPU each op has finished when it returns,
    so a late read saves nothing and the numbers are read (logged, acted on) at their own step."""
    return device.type == "cuda"


def run_loop(run: Run) -> int:
    """Steps until --max-steps (0) or a stop signal (EXIT_REQUEUE, after a checkpoint).

    On CUDA (reads_lag) a step's numbers are read after the next step has been queued: the device
    never waits for the host's logging, stop and skip bookkeeping. The skip itself is decided on the
    device (train_step), so a late read changes no update. What the late read delays: the log line
    and the bad-step count by one step, and a stop signal's stop by one step (every rank reads the
    same all-reduced vote at the same point of the loop, so the ranks still stop at one step). A step
    with work that syncs anyway (evaluate, sample, save), the last step and a stop are read at once,
    before that work: no checkpoint follows a step whose numbers were not checked.
    """
    tc, parts = run.cfg.train, run.parts
    lag = reads_lag(run.dist.device)
    clock = run.clock = run.clock or StepClock(run.dist.device)
    pending: tuple[StepStats, Actions] | None = None  # a step read late, with what it owed
    slow_phase = True  # start-up: collectives run under --dist-timeout-s until a step has completed
    while parts.step < tc.schedule.max_steps:
        begin, after_gap = clock.begin()
        # A failed background checkpoint write votes to stop like a signal: every rank stops after
        # this step and the stop's save raises the write's error on every rank (state.save).
        out = train_step(parts, run.cfg.train, run.dist, run.stop_request.signum is not None or write_failed(parts))
        out.marks = StepMarks(begin, clock.mark(), after_gap)
        collect_if_due(parts.step, tc.distributed.gc_interval)
        if slow_phase:  # steady state: a dead or hung peer is found within --dist-step-timeout-s
            set_timeout(run.dist, tc.distributed.dist_step_timeout_s)
            slow_phase = False
        check_first_step(run)
        act = due(parts.step, tc, has_val=parts.val_loader is not None, has_hellaswag=bool(run.hellaswag))
        # The previous step's numbers: ready, this step is queued behind them. A stop it voted for is
        # this step's stop (every rank reads the vote at the same point).
        stop = report(run, *pending) if pending is not None else False
        pending = None
        if run.rolled_back:  # the spike guard: this step belonged to the branch left behind
            run.rolled_back = False
            clock.gap()
            continue
        if lag and not (act.slow or act.final or stop):
            pending = (out, act)
            continue
        act = act.voted_stop(report(run, out, act) or stop)
        if run.rolled_back:  # the spike guard rolled back: parts.step is the checkpoint's, nothing is owed
            run.rolled_back = False
            clock.gap()
            continue
        if act.slow:
            clock.gap()  # the next step is timed from its own start, not across this work
            # Every rank decides this alike. The long timeout also covers the next step, whose
            # collectives wait for the ranks still busy here (rank 0 sampling or writing).
            set_timeout(run.dist, tc.distributed.dist_timeout_s)
            slow_phase = True
        perform(run, act)
        if (act.stop or act.final) and (summary := steps_summary(run)):
            run.log.info(summary)
        if act.stop:
            run.log.info(
                f"stopped by signal at step {parts.step}; checkpoint written; wrote {tc.ckpt.out_dir}/"
                f"{preempt.REQUEUE_MARKER} (requeue and resume with --resume auto)"
            )
            return preempt.EXIT_REQUEUE
    if run.dist.is_main and tc.log.plot:
        png = plot_loss_curve(run.log.path, Path(tc.ckpt.out_dir) / "loss_curve.png")
        run.log.info(f"loss curve: {png}" if png else "loss curve skipped: matplotlib is not installed")
    return 0


def check_first_step(run: Run) -> None:
    """After the first step: its memory against the plan (gpt2/train/memory_watch.py), a warning if it holds
    far more; the compile cache sealed with the training step's graphs in it (every rank: a barrier)."""
    if run.watch is not None or run.cache is not None:
        run.clock.gap()  # not the next step's work
    if run.watch is not None:
        if warning := run.watch.after_first_step():
            run.log.warn(warning)
        run.watch = None
    if run.cache is not None:
        compile_cache.finish(run.cache, run.dist, run.log, report=False)
        run.cache = None


def write_failed(parts: Parts) -> bool:
    """Rank 0's background checkpoint write has failed (gpt2/ckpt/writer.py); False on other ranks."""
    return parts.writer is not None and parts.writer.failed


def report(run: Run, stats: StepStats, act: Actions) -> bool:
    """Read a finished step's numbers: log them when due (act.log, or an unusual step), count bad steps
    (NonFiniteError at --max-bad-steps). Returns whether any rank asked to stop at that step.

    Step time: the step's own, from marks made as it was launched (gpt2/train/step_clock.py), whenever
    and however its numbers are read; on CUDA no cuda.synchronize, a wait for the step's own last kernel."""
    tc, step = run.cfg.train, stats.step
    out = stats.read()
    if out["bad_data"]:  # its update was skipped on the device (train_step); nothing is saved after it
        raise_bad_data(run.parts, run.dist)
    dt = run.clock.step_seconds(stats.marks)
    run.step_s.append((step, dt))
    run.bad_steps = run.bad_steps + 1 if out["skipped"] else (run.bad_steps if out["overflow"] else 0)
    if act.log or out["skipped"] or out["overflow"] or out["guard"].spike:  # an unusual step is always logged
        log_step(run, out, dt, step, stats.sources)
        log_stragglers(run.log, step, out["rank_s"], step // max(1, tc.log.log_interval))
    for line in stats.news:  # a mixture's: after the row of the step they follow
        run.log.info(line)
    parts = run.parts
    if parts.guard is not None and parts.guard.observe(step, out["guard"], out["loss"], out["grad_norm"], run.log):
        run.rolled_back = roll_back(parts, run.cfg, run.dist, run.log)  # or SpikeGuardError at --spike-max-rollbacks
    if run.bad_steps >= tc.spike.max_bad_steps:
        raise NonFiniteError(
            f"{run.bad_steps} consecutive steps had a non-finite loss or gradient norm (last: step {step});"
            " their updates were skipped and no checkpoint was written from them. Lower --lr, raise "
            "--warmup-steps or check the data, then resume from the last checkpoint"
        )
    return out["stop"]


def log_stragglers(log: RunLog, step: int, rank_s: list[float], log_index: int) -> None:
    """On a log step: the slowest rank named when it holds the others up; every rank's time now and then."""
    line = straggler_line(step, rank_s)
    if line:
        log.warn(line)
    if rec := times_record(step, rank_s, log_index, named=line is not None):
        log.record(rec)


def perform(run: Run, act: Actions) -> None:
    """Evaluate, sample and save as act says, after step parts.step."""
    parts, cfg, dist, log = run.parts, run.cfg, run.dist, run.log
    step = parts.step
    if act.evaluate:
        loss, per_source = evaluate_sources(parts, dist)
        log.log_eval(step, tokens_at(parts, cfg.train.batch, step), loss, parts.val_loader.tokens, per_source)
    if act.hellaswag:
        log_hellaswag(parts, cfg.train.batch, dist, log, run.hellaswag, step)
    # A sharded model's every forward all-gathers weights: every rank generates (same prompt, same
    # seeded generator, so the same tokens), rank 0 logs. A replicated model samples on rank 0 alone.
    if act.sample and (dist.is_main or is_sharded(parts.model)):
        text = sample_text(parts, cfg.train.eval, cfg.train.data.seed, cfg.model.block_size, dist)
        if dist.is_main:
            log.record({"step": step, "sample": text})
            log.info(f"sample at step {step}: {text!r}")
    if act.save:  # the final and the stop's save are synchronous: the run ends with a durable one
        save(
            parts,
            cfg,
            dist,
            log,
            requeue={"step": step, "signal": run.stop_request.name} if act.stop else None,
            background=cfg.train.ckpt.async_ckpt and not (act.stop or act.final),
        )


def measured_peak(device: torch.device) -> bool:
    """Whether MFU's peak on this device was measured (a CPU's matmul probe), not a data sheet's (a GPU's)."""
    return device.type == "cpu"


def forget_cpu_peak(device: torch.device, prec: precision.Precision) -> None:
    """An MFU above 100% proved the measured peak wrong: the next run must not read it from the cache.
    device_peak_flops took the larger of the dtype's and fp32's peaks, so both go."""
    if device.type == "cpu":
        for d in {prec.torch_dtype, torch.float32}:
            matmul_peak.forget_peak(str(device), d)


def log_step(run: Run, out: dict, dt: float, step: int, sources: dict | None = None) -> None:
    """The metrics line of step `step` (sources: a mixture's tokens/NAME and epochs/NAME, as its row's last
    columns). An MFU over 100%: against a CPU's measured peak it proves the peak wrong, which is dropped
    (run.peak = None); against a GPU's data-sheet peak it proves this step's time wrong, and only this step's
    MFU is left out."""
    parts, tc, dist = run.parts, run.cfg.train, run.dist
    tok_s = step_tokens(tc.batch, step - 1) / dt  # step counts the steps done: its own is step - 1 from 0
    measured = measured_peak(dist.device)
    step_mfu, why = (
        checked_mfu(tok_s / dist.world_size, run.cfg.model, run.peak, measured=measured, step_s=dt)
        if run.peak
        else (None, None)
    )
    if why and measured:  # once: the peak is wrong for the rest of the run too
        run.log.info(f"mfu n/a: {why}")
        forget_cpu_peak(dist.device, run.parts.precision)
        run.peak = None
    elif why:
        run.log.warn(f"step {step:>6} | mfu n/a: {why}")
    run.log.log_step(
        {
            "step": step,
            "loss": out["loss"],
            "lr": out["lr"],
            "grad_norm": out["grad_norm"],
            "tokens": tokens_at(parts, run.cfg.train.batch, step),
            "step_s": dt,
            "tok_per_s": tok_s,
            "mfu": step_mfu,
            "mem_mb": memory_mb(dist.device),
            "skipped": out["skipped"],
            **(
                {"overflow": out["overflow"], "loss_scale": parts.scaler.get_scale()}
                if parts.scaler.is_enabled()
                else {}
            ),
            **(sources or {}),
        },
        tc.schedule.max_steps,
    )


def steps_summary(run: Run) -> str | None:
    """The run's closing line: the median step time over the steps read, the first left out (it compiles
    and warms up), with its tokens/s and MFU; None with fewer than two steps."""
    times = [s for step, s in run.step_s[1:]]
    if not times:
        return None
    median = statistics.median(times)
    batch = run.cfg.train.batch
    if batch.batch_warmup_steps:  # steps of several sizes: the median of their rates
        tok_s = statistics.median(step_tokens(batch, step - 1) / s for step, s in run.step_s[1:])
    else:
        tok_s = batch.total_batch_size / median
    value = mfu(tok_s / run.dist.world_size, run.cfg.model, run.peak) if run.peak else None
    first, last = run.step_s[1][0], run.step_s[-1][0]
    return (
        f"steps {first}-{last}: median {median * 1000:.1f} ms/step, {tok_s:,.0f} tok/s"
        + (f", mfu {value:.1%}" if value is not None and value <= 1.0 else "")
        + f" ({len(times)} step(s); step {run.step_s[0][0]}, the run's first, left out: it compiles and warms up)"
    )


def step_tokens(batch: BatchConfig, step: int) -> int:
    """The tokens optimizer step `step` (from 0) takes: --total-batch-size, less in a --batch-warmup-steps."""
    return batch_tokens_at(
        step, total=batch.total_batch_size, warmup_steps=batch.batch_warmup_steps, stages=batch.batch_warmup_stages
    )


def tokens_at(parts: Parts, b: BatchConfig, step: int) -> int:
    """Tokens consumed up to step `step` (at most parts.step): parts.tokens less the steps since (read one step
    late on CUDA, run_loop, when parts.tokens already counts the next)."""
    later = functools.partial(
        tokens_before, total=b.total_batch_size, warmup_steps=b.batch_warmup_steps, stages=b.batch_warmup_stages
    )
    return parts.tokens - (later(parts.step) - later(step))


def close_run(parts: Parts, dist: Dist, log: RunLog) -> None:
    """After the loop, however it ended: the write in flight, the log, the loaders' open shard files."""
    if dist.is_main and parts.writer is not None:  # an error or a stop: let the write in flight finish
        problem = finish_background_write(parts, log)
        if problem:
            log.warn(problem)
    log.close()
    for loader in (parts.loader, parts.val_loader):
        if loader is not None:
            loader.close()


def evaluate(parts: Parts, dist: Dist) -> float:
    """Mean loss per token over the fixed validation set, reduced over ranks (a mixture: the weighted mean
    of its sources', evaluate_sources)."""
    return evaluate_sources(parts, dist)[0]


def evaluate_sources(parts: Parts, dist: Dist) -> tuple[float, dict[str, float]]:
    """The validation loss and, for a mixture, each source's ({NAME: loss}, each over that source's first
    --eval-tokens), the loss being their mean at the --data-weights (MixtureEval.mean); one source: {}."""
    from gpt2.train.scoring import loader_loss

    val = parts.val_loader
    if not isinstance(val, MixtureEval):
        return loader_loss(parts.train_model, val, parts.precision, dist), {}
    losses = {name: loader_loss(parts.train_model, one, parts.precision, dist) for name, one in val.loaders.items()}
    return val.mean(losses), losses


def sample_text(parts: Parts, ev: EvalConfig, seed: int, block_size: int, dist: Dist) -> str:
    """A text sample (KV-cache generation, its own RNG seeded by the run's seed and the step: training is
    unaffected). Rank 0's alone, or under FSDP every rank's (a collective: each forward gathers the weights)."""
    from gpt2.model import tokenizer

    prompt = tokenizer.encode_prompt(ev.sample_prompt, block_size)  # checked in check_data
    gen = torch.Generator(device=dist.device).manual_seed(seed + parts.step)
    idx = torch.tensor([prompt], dtype=torch.long, device=dist.device)
    parts.model.eval()
    with parts.precision.autocast(dist.device):
        out = parts.model.generate(
            idx, ev.sample_tokens, temperature=1.0, top_k=TOP_K, generator=gen, stop_token=EOT_TOKEN
        )
    parts.model.train()
    return tokenizer.decode(cut_at_stop(out[0, len(prompt) :].tolist(), EOT_TOKEN))  # the text ends at <|endoftext|>


def log_hellaswag(parts: Parts, batch: BatchConfig, dist: Dist, log: RunLog, examples, step: int) -> None:
    from gpt2.train.scoring import hellaswag_eval

    hs = hellaswag_eval(parts.model, examples, dist, dist.device, prec=parts.precision, progress=False)
    log.record(
        {
            "step": step,
            "tokens": tokens_at(parts, batch, step),
            "hellaswag_acc": hs["acc"],
            "hellaswag_acc_norm": hs["acc_norm"],
        }
    )
    log.info(f"step {step:>6} | hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['correct_norm']}/{hs['n']})")


def memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
