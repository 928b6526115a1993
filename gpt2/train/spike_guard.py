"""The loss-spike guard (--spike-guard): skip a spiking step's update, roll back after repeated spikes.

Three parts, each its own function or method:
  judge (on the device)   the step's loss and gradient norm against the recent history of healthy
                          steps: a robust z-score of each one's log over the last --spike-window
                          accepted steps (llm.c's rule, PRs #637/#711, on logs, with the median and
                          the median absolute deviation for its mean and standard deviation: see
                          judge). train_step folds the verdict
                          into its existing device-side skip, so no host read is added to the step;
                          the inputs are all-reduced, so every rank reaches the same verdict.
  observe (on the host)   when the step's numbers are read anyway (report): a console line and a
                          metrics.jsonl record per spike, and whether the spikes in the last
                          --spike-window steps reached --spike-rollback-after.
  roll_back               back to the newest checkpoint from before the cluster's first spike, the data
                          position kept where it is (past the batches that spiked), the checkpoints
                          after it moved into RUN/checkpoints/abandoned-*/ as a manual rollback
                          (--resume PATH) moves them; at most --spike-max-rollbacks times a run.

The thresholds and why (docs/spike_guard.md shows a run that uses them):
  - logs, not raw values: a spike is a ratio (the loss 1.5x its recent level), the same at loss 10 and
    loss 3, and the gradient norm's spread grows with its size;
  - the median and MAD: one high loss the window holds (small batches' noise, a spike under the
    threshold) moves them little, where it moved a mean and widened a standard deviation enough to let
    the next spike through (docs/spike_guard.md, the poisoned run: z ~11 against under 6);
  - MIN_SPREAD (0.01, 1%): a history that barely moves (a long plateau) has a tiny spread,
    and the z-score of ordinary noise over it would be large; no change under 1% counts as a spike;
  - a full window before judging: the first steps' falling loss and rising norm are no history to
    judge against (and the fast start of training is where a spike can be told least from progress);
  - a spike is a loss 6 sigma above the history; or a gradient norm 6 sigma above with the loss 3 sigma above; or a
    loss 1.5x the history's median (LOSS_RATIO) with the loss 2 sigma above (RATIO_Z_SHARE). The ratio: at the first
    judged steps the window still holds the loss's early fall, a wide spread, and a doubled loss at the debug
    preset's steps 111-115 scored z 5.2 (issue 78, the GNU info manuals); a ratio is what a bad batch is, and the 2
    sigma keeps a noisy run's scatter out (a code corpus read in order: clean steps up to 1.41x at z 1.9). The norm
    with the loss: the norm alone spikes in healthy early training (z 25-40 in a tiny model, with ordinary losses,
    and clipping absorbs those), while a poisoned batch's loss is 9-11 sigmas out (the tests'). The debug preset
    (the quick start's), the speed preset and the learning-parity recipe train bitwise the same guard on or off
    (tests/test_spike_guard.py).
  - after a rollback, the loss limit is halved for the next --spike-window steps (PROBATION): the model is
    the checkpoint's again, and the poison that made it spike scores lower against that model (a poisoned
    stretch's last batches scored z 4.7 after a rollback, under the limit of 6, and were trained on); the
    campaign's poisoned batches scored 6.6-7.0 before it, a thin margin over 6 (docs/spike_guard.md).
A non-finite step is not a spike: train_step skips it anyway, and --max-bad-steps bounds those.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.ckpt import checkpoint as ckpt
from gpt2.ckpt import resume
from gpt2.core.config import RunConfig, SpikeConfig
from gpt2.distributed.group import Dist, rank0_decides, set_timeout
from gpt2.train.run_log import RunLog
from gpt2.train.state import Parts, finish_background_write, restore

MIN_SPREAD = 0.01
"""The smallest spread (a standard deviation's worth) of a log the z-score divides by (1%): see the module
docstring."""
MAD_TO_SIGMA = 1.4826
"""A normal distribution's standard deviation over its median absolute deviation (1 / Phi^-1(3/4))."""


LOSS_RATIO = 1.5
"""A loss this many times the window's median is a spike whenever its z is over --spike-loss-z / RATIO_Z_SHARE (the
module docstring): poisoned batches of the debug preset ran 1.5-2.6x; healthy steps at most 1.02x on Shakespeare,
1.41x on a code corpus read in order (bench/spike_stat.py, docs/spike_guard.md)."""
LOG_LOSS_RATIO = math.log(LOSS_RATIO)
RATIO_Z_SHARE = 3.0
"""The ratio rule's loss z must be over --spike-loss-z / RATIO_Z_SHARE (2 at the default): on a code corpus read in
order, whose clean steps reached 1.41x their window's median at z 1.9, a doubled loss at the first judged steps
scored z 2.4 (bench/spike_stat.py)."""

PROBATION_FACTOR = 0.5
"""The loss limits' scale for --spike-window steps after a rollback (the module docstring says why)."""


class SpikeGuardError(RuntimeError):
    """The loss kept spiking after --spike-max-rollbacks rollbacks: the run stops (every rank alike)."""


@dataclass(frozen=True)
class Verdict:
    """One step's guard numbers on the host (from StepStats.read)."""

    spike: bool
    loss_z: float
    norm_z: float


class SpikeGuard:
    """The guard's history (on the device) and decisions (on the host); a checkpoint component.

    The device part: the logs of the last `window` accepted (finite, not spiking) steps' loss and
    gradient norm, and how many there are. The host part: the steps of the spikes within the last
    window, and the rollbacks so far (checkpointed too, so a resume decides as the run would have)."""

    def __init__(self, spike: SpikeConfig, device: torch.device) -> None:
        self.window, self.loss_z, self.norm_z = spike.spike_window, spike.spike_loss_z, spike.spike_norm_z
        self.rollback_after, self.max_rollbacks = spike.spike_rollback_after, spike.spike_max_rollbacks
        self.history = torch.zeros(2, self.window, device=device)  # rows: log loss, log grad norm
        self.count = torch.zeros((), dtype=torch.long, device=device)
        self._zero = torch.zeros((), device=device)  # judge's z where nothing is judged: made once, never written
        # The thresholds as _verdict compares z (loss z, norm z) with them, in one kernel: [[loss z, norm z], [loss z /
        # 2, never], [loss z / RATIO_Z_SHARE, never]] (the norm rule's loss part, the ratio rule's).
        self._limits = torch.tensor(self._limit_rows(self.loss_z), device=device)
        self._strict = torch.tensor(self._limit_rows(self.loss_z * PROBATION_FACTOR), device=device)
        self.probation = 0
        """Steps still judged with the loss limits scaled by PROBATION_FACTOR (set by a rollback)."""
        self._verdict = _verdict  # eager; fuse() compiles it
        self.spikes: deque[dict] = deque()
        """The spikes within the last window, oldest first: {step, loss, grad_norm, loss_z, grad_norm_z}."""
        self.rollbacks = 0

    def _limit_rows(self, loss_z: float) -> list[list[float]]:
        return [[loss_z, self.norm_z], [loss_z / 2, float("inf")], [loss_z / RATIO_Z_SHARE, float("inf")]]

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """[spike (0.0 or 1.0), loss z, norm z] as one fp32 device tensor; the step is appended to
        the history unless it spiked or is not finite. Launches kernels only: nothing is read."""
        return torch.cat(self.verdict_parts(loss, grad_norm))

    def verdict_parts(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> list[torch.Tensor]:
        """judge's numbers in two pieces, [spike (bool, shape (1,)), z (2,)], for the caller's own cat
        (train_step's step_stats: one cat for the whole step's numbers)."""
        limits = self._limits
        if self.probation > 0:  # after a rollback: the same tensor shape, so a compiled verdict is reused
            limits, self.probation = self._strict, self.probation - 1
        args = (self.history, self.count, self._zero, limits, loss, grad_norm, self.window)
        if self._verdict is _verdict:
            return _verdict(*args)
        try:
            return self._verdict(*args)
        except Exception as e:  # a compile failure happens before the graph runs: nothing was updated yet
            self._verdict = _verdict
            why = f"{type(e).__name__}: {e}"
            warnings.warn(f"spike guard: its compiled verdict failed ({why}); eager from now on", stacklevel=2)
            return _verdict(*args)

    def fuse(self) -> None:
        """The verdict as one torch.compile'd graph (the trainer's choice on CUDA with a compiled model):
        a few kernels instead of 28 a step, where the host's launches are what the device waits for.
        Not bitwise the eager verdict (inductor fuses the arithmetic), so CPU runs keep the eager one. Should
        its compilation fail, the verdict falls back to eager with one warning (the run goes on)."""
        self._verdict = torch.compile(_verdict, fullgraph=True, dynamic=False)

    @staticmethod
    def off(device: torch.device) -> torch.Tensor:
        """judge's numbers when the guard is off: no spike, no z."""
        return torch.zeros(VERDICT_SIZE, device=device)

    def observe(self, step: int, verdict: Verdict, loss: float, grad_norm: float, log: RunLog) -> bool:
        """Step `step`'s verdict, read with its other numbers: a spike's line and record. Returns whether
        the spikes within the last window now call for a rollback."""
        while self.spikes and self.spikes[0]["step"] <= step - self.window:
            self.spikes.popleft()
        if not verdict.spike:
            return False
        spike = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "loss_z": verdict.loss_z,
            "grad_norm_z": verdict.norm_z,
        }
        self.spikes.append(spike)
        n = len(self.spikes)
        log.record({**spike, "spike_guard": "skip", "spikes_in_window": n})
        log.warn(
            f"spike guard: step {step}'s update skipped: loss {loss:.4f} (z {verdict.loss_z:.1f}), grad norm "
            f"{grad_norm:.3g} (z {verdict.norm_z:.1f}) against the last {self.window} steps (limit z "
            f"{self.loss_z:g} / {self.norm_z:g}); spike {n} of {self.rollback_after} within {self.window} steps "
            "before a rollback"
        )
        return n >= self.rollback_after

    def state_dict(self) -> dict:
        return {
            "history": self.history.cpu().clone(),
            "count": int(self.count),
            "spikes": list(self.spikes),
            "rollbacks": self.rollbacks,
            "probation": self.probation,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint without guard state (older, or saved with the guard off) leaves a fresh guard,
        which judges again once a window of steps is in its history."""
        if not state:
            return
        saved, count = state["history"], int(state["count"])
        keep = min(count, saved.shape[1], self.window)  # the newest values, if --spike-window changed
        self.history.zero_()
        if keep:
            self.history[:, self.window - keep :] = saved[:, saved.shape[1] - keep :].to(self.history.device)
        self.count.fill_(keep)
        self.spikes = deque(state["spikes"])
        self.rollbacks = int(state["rollbacks"])
        self.probation = int(state.get("probation", 0))  # none in checkpoints from before it


def _verdict(
    history: torch.Tensor,
    count: torch.Tensor,
    zero: torch.Tensor,
    limits: torch.Tensor,
    loss: torch.Tensor,
    grad_norm: torch.Tensor,
    window: int,
) -> list[torch.Tensor]:
    """SpikeGuard.verdict_parts' rules, history and count updated in place. Every op here is a kernel
    on the device, so the rules are written in as few as give the same bits (tests/test_spike_guard.py
    holds them to the longer form's; tests/test_trainer.py counts them)."""
    x = torch.stack([loss.float(), grad_norm.float()]).clamp_min(1e-30).log()  # (2,); .float() of fp32: no op
    # Robust: the median and the median absolute deviation (scaled by MAD_TO_SIGMA), not the mean and
    # standard deviation, so a spike in the history (one under the threshold, or small batches' noise)
    # neither moves the centre nor widens the spread that judges the next step.
    centre = _lower_median(history)
    spread = (MAD_TO_SIGMA * _lower_median((history - centre[:, None]).abs())).clamp_min(MIN_SPREAD)
    above = x - centre  # the logs' distance from the window's median: for the loss, the log of its ratio to it
    z = above / spread
    # isfinite(x).all() in two kernels (isfinite alone is five): x is never -inf (the clamp), each finite
    # x is within [-70, 89] (logs of fp32), so their sum is finite exactly when both are; NaN < inf is False.
    finite = x.sum() < float("inf")
    judged = finite & (count >= window)  # a full window before judging (the module docstring)
    # The norm alone is no spike: early training has gradient-norm excursions of z 25-40 with ordinary
    # losses (a tiny model's steps 24-27, docs/spike_guard.md), which --grad-clip absorbs. With the
    # loss up by half its threshold as well, it is a batch the model does not fit.
    over = z > limits  # [[loss z over its limit, norm z over its], [loss z over half its, -], [over a third, -]]
    # A loss LOSS_RATIO x the window's median is a batch the model does not fit, however wide the spread: early in
    # a run the window holds the loss's fast fall, which widens the MAD (a doubled loss at the debug preset's
    # first judged steps scored z 5.2, issue 78). With the loss z over a third of its limit, so that a noisy run's own
    # scatter is not.
    ratio = above[0] > LOG_LOSS_RATIO
    spike = judged & (over[0, 0] | (over[0, 1] & over[1, 0]) | (ratio & over[2, 0]))
    accept = finite ^ spike  # finite & ~spike: a spike is finite
    shifted = torch.cat([history[:, 1:], x.unsqueeze(1)], dim=1)
    torch.where(accept, shifted, history, out=history)  # elementwise: each element read before it is written
    count.add_(accept).clamp_(max=window)
    # Nothing judged: no z to report. cat promotes the bool spike to 0.0 / 1.0.
    return [spike.unsqueeze(0), torch.where(judged, z, zero)]


def _lower_median(rows: torch.Tensor) -> torch.Tensor:
    """Each row's lower median, as torch.median(dim=1) gives it, from a sort: torch.median's CUDA kernel
    returns indices, which torch.use_deterministic_algorithms (--deterministic) refuses."""
    return rows.sort(dim=1).values[:, (rows.size(1) - 1) // 2]


VERDICT_SIZE = 3
"""How many numbers judge() adds to the step's numbers (StepStats): spike, loss z, norm z."""


def verdict_of(numbers: list[float]) -> Verdict:
    """judge()'s three numbers, read on the host."""
    spike, loss_z, norm_z = numbers
    return Verdict(spike > 0, loss_z, norm_z)


def roll_back(parts: Parts, cfg: RunConfig, dist: Dist, log: RunLog) -> bool:
    """Every rank alike (the decision came from all-reduced numbers): restore the newest checkpoint
    from before the first spike in the window, keep the data position (past the spiking batches),
    move later checkpoints aside. Returns whether it did (parts.step is then the checkpoint's). Raises
    SpikeGuardError once the rollbacks are used up; with no checkpoint before the spikes the run goes
    on skipping (False; the attempt counts toward the bound)."""
    guard, tc = parts.guard, cfg.train
    spikes = list(guard.spikes)  # the rollback's record keeps them: restore cuts the log back past them
    if guard.rollbacks >= guard.max_rollbacks:
        raise SpikeGuardError(
            f"spike guard: {len(spikes)} loss spikes within {guard.window} steps (steps {_steps(spikes)}) after "
            f"{guard.rollbacks} rollbacks (--spike-max-rollbacks {guard.max_rollbacks}): the run stops, as the "
            "spikes come back past the data that caused them. Lower --lr or raise --warmup-steps, check the data "
            "near these steps, then resume from the last checkpoint (or raise --spike-max-rollbacks)"
        )
    # Rank 0 hashes the checkpoint and every rank loads it: a slow phase, under --dist-timeout-s (as a save).
    set_timeout(dist, tc.distributed.dist_timeout_s)
    try:
        return _roll_back_to_checkpoint(parts, cfg, dist, log)
    finally:
        set_timeout(dist, tc.distributed.dist_step_timeout_s)


def _roll_back_to_checkpoint(parts: Parts, cfg: RunConfig, dist: Dist, log: RunLog) -> bool:
    guard, tc = parts.guard, cfg.train
    spikes = list(guard.spikes)
    first, last = spikes[0]["step"], spikes[-1]["step"]
    if dist.is_main and parts.writer is not None:  # a write in flight must land before the directory is read
        if problem := finish_background_write(parts, log):
            log.warn(problem)

    def target_of() -> Path | None:
        try:
            return _target(tc.ckpt.out_dir, first, parts.run_id)
        except OSError as e:  # the directory unreadable: no checkpoint to go back to (said below)
            log.warn(f"spike guard: cannot list {ckpt.checkpoint_dir(tc.ckpt.out_dir)} ({e})")
            return None

    target = rank0_decides(target_of, dist)
    guard.rollbacks += 1
    rollbacks, position = guard.rollbacks, parts.loader.state_dict()
    # Just past the last spike's batches: on CUDA (late reads, gpt2/train/trainer.py run_loop) the loader is a
    # step further on, whose batch the rollback leaves unread; so CPU and CUDA runs roll back alike.
    position["position"] -= (parts.step - last) * parts.loader.G
    guard.spikes.clear()
    if target is None:
        log.record(
            {
                "step": last,
                "spike_guard": "no_checkpoint",
                "spikes": spikes,
                "rollback": rollbacks,
                "max_rollbacks": guard.max_rollbacks,
            }
        )
        guard.probation = guard.window
        log.warn(
            f"spike guard: {len(spikes)} spikes within {guard.window} steps (steps {_steps(spikes)}) but no "
            f"checkpoint of this run from before step {first} to roll back to: going on, skipping spikes "
            f"(attempt {rollbacks} of {guard.max_rollbacks}; a lower --ckpt-interval keeps one close)"
        )
        return False
    point, abandon = target
    moved = resume.set_aside_abandoned(
        resume.StartDecision(point, parts.run_id, abandon=abandon), tc.ckpt.out_dir, dist
    )
    problem = None
    try:
        restore(parts, Path(point.path), cfg, dist, log)  # model, optimizer, scaler, rng, guard; the log cut back
    except ckpt.CheckpointError as e:
        problem = str(e)
    resume.agree_on_step(parts.step, problem, dist)
    parts.loader.load_state_dict(position)  # the data goes on past the batches that spiked
    guard.rollbacks = rollbacks
    guard.probation = guard.window  # the checkpoint's model scores the rest of a poisoned stretch lower
    log.record(
        {
            "step": parts.step,
            "spike_guard": "rollback",
            "from_step": last,
            "spikes": spikes,
            "checkpoint": point.path,
            "data_position": position["position"],
            "rollback": rollbacks,
            "max_rollbacks": guard.max_rollbacks,
            "abandoned": str(moved) if moved else None,
        }
    )
    aside = f"; later checkpoints moved into {moved}/" if moved else ""
    log.warn(
        f"spike guard: {len(spikes)} spikes within {guard.window} steps (steps {_steps(spikes)}): rolled back "
        f"to {Path(point.path).name} (step {parts.step}), the data going on after step {last}'s batches{aside} "
        f"(rollback {rollbacks} of {guard.max_rollbacks}); the loss limit is z {guard.loss_z * PROBATION_FACTOR:g} "
        f"for the next {guard.window} steps"
    )
    return True


def _target(out_dir: str, first_spike: int, run_id: str | None):
    """Rank 0: (ResumePoint, later checkpoint names) of run_id's newest complete checkpoint from before
    step first_spike, or None."""
    for path in ckpt.list_checkpoints(out_dir):  # newest first
        if not (ckpt.looks_complete(path) and ckpt.belongs(path, run_id)):
            continue
        try:
            point = resume._point(path)  # its sidecar's step and hash
            if point.step >= first_spike:
                continue
            ckpt.verify_checkpoint(path)
        except (ckpt.CheckpointError, OSError, ValueError):  # damaged: an older one will do
            continue
        return point, ckpt.later_checkpoints(out_dir, point.step, run_id)
    return None


def _steps(spikes: list[dict]) -> str:
    return ", ".join(str(s["step"]) for s in spikes)
