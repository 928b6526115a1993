"""gpt2/train/trainer.py: due(), what each step owes (log, evaluate, HellaSwag, sample, save, stop), pure, and
decided once a step; the step's device-side skip (step_unless); run_loop's late reads of a step's numbers
(CUDA's), forced on CPU."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from _helpers import import_train_ddp, inject_nan, load_ckpt, losses, records, tiny_run_flags

from gpt2.core.config import TrainConfig
from gpt2.train.trainer import Actions, due

TC = TrainConfig.of(
    max_steps=10,
    log_interval=2,
    eval_interval=4,
    hellaswag_interval=5,
    hellaswag_file="hs.jsonl",
    sample_interval=3,
    ckpt_interval=6,
)


def steps_where(what: str, tc: TrainConfig = TC, **kwargs) -> list[int]:
    return [s for s in range(1, tc.schedule.max_steps + 1) if getattr(due(s, tc, **kwargs), what)]


def test_each_action_at_its_interval_and_all_at_the_last_step():
    assert steps_where("log") == [2, 4, 6, 8, 10]
    assert steps_where("evaluate") == [4, 8, 10]
    assert steps_where("hellaswag", has_hellaswag=True) == [5, 10]
    assert steps_where("sample") == [3, 6, 9, 10]
    assert steps_where("save") == [6, 10]
    assert steps_where("final") == [10]
    assert steps_where("stop") == []


def test_a_stop_vote_read_later_gives_the_actions_due_would_have_given():
    """run_loop decides a step's actions once and applies the stop vote when it reads it (voted_stop):
    the same actions as due(step, stop_requested=...), at every step (the last included: no stop there)."""
    for step in range(1, TC.schedule.max_steps + 1):
        for vote in (False, True):
            assert due(step, TC).voted_stop(vote) == due(step, TC, stop_requested=vote), (step, vote)


def test_zero_intervals_mean_never_but_the_last_step_still_evaluates_samples_and_saves():
    tc = TC.replace(eval_interval=0, ckpt_interval=0, sample_interval=0, hellaswag_interval=0)
    assert steps_where("evaluate", tc) == [10]
    assert steps_where("save", tc) == [10]
    assert steps_where("sample", tc) == []  # --sample-interval 0: no samples at all
    assert steps_where("hellaswag", tc) == []


def test_without_a_val_set_or_hellaswag_nothing_is_evaluated():
    assert steps_where("evaluate", has_val=False) == []
    assert steps_where("hellaswag", has_hellaswag=False) == []


def test_a_stop_request_saves_and_stops_except_at_the_last_step():
    act = due(7, TC, stop_requested=True)
    assert act.stop and act.save and not act.final and act.slow
    last = due(10, TC, stop_requested=True)  # the run is complete: no requeue
    assert not last.stop and last.save and last.final


def test_an_unusual_step_is_logged_off_the_interval():
    assert not due(3, TC).log
    assert due(3, TC, unusual=True).log


def test_slow_is_any_work_that_keeps_a_rank_from_the_next_step():
    assert due(2, TC) == Actions(
        log=True, evaluate=False, hellaswag=False, sample=False, save=False, final=False, stop=False
    )
    assert not due(2, TC).slow
    assert due(3, TC).slow  # rank 0 samples alone


def _adamw_run(found_inf: list[float | None]):
    """Fused AdamW over fixed random gradients; each entry None (a plain step) or step_unless's flag."""
    from gpt2.train.trainer import step_unless

    torch.manual_seed(0)
    params = [torch.randn(40, 8, requires_grad=True), torch.randn(8, requires_grad=True)]
    opt = torch.optim.AdamW(
        [{"params": params[:1], "weight_decay": 0.1}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2, fused=True
    )
    gen = torch.Generator().manual_seed(1)
    for flag in found_inf:
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step() if flag is None else step_unless(opt, torch.tensor(flag))
    return params, [opt.state[p] for p in params], opt


def test_step_unless_is_bitwise_a_plain_step_at_0_and_changes_nothing_at_1():
    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and all(
            torch.equal(sa[k], sb[k]) for sa, sb in zip(a[1], b[1]) for k in sa
        )

    assert same(_adamw_run([None] * 4), _adamw_run([0.0] * 4))
    skipped = _adamw_run([None, None, None, 1.0])  # the 4th update skipped: as if only 3 were taken
    assert same(skipped, _adamw_run([None] * 3))
    assert [s["step"].item() for s in skipped[1]] == [3.0, 3.0]
    assert not same(skipped, _adamw_run([None] * 4))
    assert not hasattr(skipped[2], "found_inf")  # GradScaler's protocol: the attribute is removed after step


def _run(tmp_path, shards, name, monkeypatch, *, lag: bool, extra=(), max_steps=6, ckpt_interval=3):
    import gpt2.train.trainer as trainer

    monkeypatch.setattr(trainer, "reads_lag", lambda device: lag)
    run_dir = tmp_path / name
    code = import_train_ddp().main(
        [
            *tiny_run_flags(shards, max_steps=max_steps, ckpt_interval=ckpt_interval, eval_tokens=256),
            "--out-dir",
            str(run_dir),
            *extra,
        ]
    )
    return code, run_dir


@pytest.mark.slow
def test_late_reads_train_and_checkpoint_exactly_as_reads_at_once(tmp_path, shakespeare_shards, monkeypatch):
    """CUDA's loop (each step's numbers read after the next step is queued) on a CPU: the same losses,
    every step logged once, the same checkpoints; a NaN step is skipped on the device and logged late.
    Either way the loop decides each step's actions once (one due() call a step)."""
    import gpt2.train.trainer as trainer

    decided = []
    monkeypatch.setattr(trainer, "due", lambda step, *a, **kw: decided.append(step) or due(step, *a, **kw))
    inject_nan(monkeypatch, 1)
    assert _run(tmp_path, shakespeare_shards, "now", monkeypatch, lag=False)[0] == 0
    assert decided == [1, 2, 3, 4, 5, 6]
    code, late = _run(tmp_path, shakespeare_shards, "late", monkeypatch, lag=True)
    assert code == 0 and decided == [1, 2, 3, 4, 5, 6] * 2
    assert losses(late) == losses(tmp_path / "now") and sorted(losses(late)) == list(range(1, 7))
    assert [r["step"] for r in records(late) if r.get("skipped")] == [2]
    for step in (3, 6):
        a, b = load_ckpt(late, step), load_ckpt(tmp_path / "now", step)
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_late_reads_still_stop_on_consecutive_bad_steps_before_any_checkpoint_of_them(
    tmp_path, shakespeare_shards, monkeypatch, capsys
):
    inject_nan(monkeypatch, 1)  # step 2 (counted from 1); its numbers are read after step 3 is queued
    code, run_dir = _run(tmp_path, shakespeare_shards, "run", monkeypatch, lag=True, extra=("--max-bad-steps", "1"))
    assert code == 1
    assert "1 consecutive steps had a non-finite loss or gradient norm (last: step 2)" in capsys.readouterr().err
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").glob("step_*"))


@pytest.mark.parametrize("lag", [False, True])
def test_a_signal_stops_at_a_step_boundary_with_a_checkpoint_whether_reads_are_late_or_not(
    tmp_path, shakespeare_shards, monkeypatch, lag
):
    """The stop vote travels in a step's numbers: read late, the run stops one step later, still at a
    boundary every rank reaches alike, with a checkpoint and RUN/requeue naming it."""
    import gpt2.train.trainer as trainer

    plain = trainer.train_step

    def signalled(parts, *args, **kwargs):
        if parts.step == 2:  # during step 3: its vote is False (asked before), step 4 carries it
            os.kill(os.getpid(), signal.SIGUSR1)
        return plain(parts, *args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", signalled)
    code, run_dir = _run(tmp_path, shakespeare_shards, "run", monkeypatch, lag=lag, max_steps=8, ckpt_interval=0)
    marker = json.loads((run_dir / "requeue").read_text())
    assert code == 3 and marker["step"] == (5 if lag else 4), marker
    assert sorted(losses(run_dir)) == list(range(1, marker["step"] + 1))
    assert load_ckpt(run_dir, marker["step"])["step"] == marker["step"]


class FakeTime:
    """The loop's clock in the timing test: it moves only where the test says work happens."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


STEP_S, READ_S, SLOW_WORK_S = 1.0, 0.01, 7.0
"""A step's own work, the loop's read and logging of a step, an evaluation/checkpoint (fake seconds)."""


@pytest.mark.parametrize("ending", ["stop", "last"])
def test_every_step_is_timed_right_with_late_reads_eval_checkpoint_stop_and_last_step_included(
    tmp_path, shakespeare_shards, monkeypatch, capsys, ending
):
    """CUDA's late reads on a CPU with a fake clock: each step takes STEP_S, each read READ_S, each
    evaluation or checkpoint SLOW_WORK_S. Every logged step's time is its own (STEP_S, plus a read made
    between it and the previous step), never a read's few ms (the H100 run's last step: 1.9 ms) nor two
    steps' work. Eval at steps 2/4/6, checkpoints at 3/6, then either a stop signal read at step 8 or
    the last step 8. An impossible MFU against a data-sheet peak (step 3 faked as taking 1e-9 s) leaves
    out that step's MFU alone, and the peak stays for the next steps."""
    import gpt2.train.trainer as trainer
    from gpt2.train.step_clock import StepClock

    clock = FakeTime()
    plain_step, plain_report, plain_perform, plain_loop = (
        trainer.train_step,
        trainer.report,
        trainer.perform,
        trainer.run_loop,
    )

    def step(parts, *args, **kwargs):
        if parts.step == 5 and ending == "stop":  # during step 6: step 7 votes, read late at step 8
            os.kill(os.getpid(), signal.SIGUSR1)
        out = plain_step(parts, *args, **kwargs)
        clock.t += 1e-9 if parts.step == 3 else STEP_S  # step 3 "impossibly" fast: its MFU alone left out
        return out

    def report(run, *args):
        clock.t += READ_S
        return plain_report(run, *args)

    def perform(run, act):
        plain_perform(run, act)
        clock.t += SLOW_WORK_S if act.slow else 0.0

    def loop(run):
        run.clock = StepClock(run.dist.device, now=clock)
        run.peak = 1e12  # taken as a data-sheet peak (measured_peak below): an MFU of ~1% here
        return plain_loop(run)

    monkeypatch.setattr(trainer, "train_step", step)
    monkeypatch.setattr(trainer, "report", report)
    monkeypatch.setattr(trainer, "perform", perform)
    monkeypatch.setattr(trainer, "run_loop", loop)
    monkeypatch.setattr(trainer, "measured_peak", lambda device: False)
    code, run_dir = _run(
        tmp_path,
        shakespeare_shards,
        "run",
        monkeypatch,
        lag=True,
        max_steps=12 if ending == "stop" else 8,
        ckpt_interval=3,
        extra=("--eval-interval", "2"),
    )
    assert code == (3 if ending == "stop" else 0)
    rows = {r["step"]: r for r in records(run_dir) if "loss" in r}
    assert sorted(rows) == list(range(1, 9))
    assert [r["step"] for r in records(run_dir) if "val_loss" in r] == [0, 2, 4, 6, 8]
    for s, r in rows.items():
        if s == 3:
            assert r["step_s"] < 1e-6 and r["mfu"] is None
            continue
        if s in (1, 2, 3, 4, 5, 7):  # the run's first; after the first step's checks; after an eval/save
            assert r["step_s"] == pytest.approx(STEP_S, abs=1e-9), (s, r)  # from its own start
        else:  # from the previous step's end, perhaps with a read in between
            assert r["step_s"] in (pytest.approx(STEP_S, abs=1e-9), pytest.approx(STEP_S + READ_S, abs=1e-9))
        assert r["mfu"] is not None and r["mfu"] < 0.05, (s, r)
    err = capsys.readouterr()
    assert "step      3 | mfu n/a: MFU" in err.err and "impossible" in err.err and "CPU" not in err.err
    assert "steps 2-8: median 1000.0 ms/step" in err.out


def _skip_before(numbers: torch.Tensor) -> torch.Tensor:
    """update's skip flag as it was (19 ops): the reference skip_flag is held to."""
    bad = ~(torch.isfinite(numbers[0]) & torch.isfinite(numbers[3])) | (numbers[2] > 0) | (numbers[4] > 0)
    return bad.float()


def test_the_skip_flag_is_the_old_ones_for_non_finite_losses_and_norms_bad_tokens_and_spikes():
    from itertools import product

    from gpt2.train.trainer import skip_flag

    nan, inf = float("nan"), float("inf")
    # loss sum, stop votes, bad-token ranks, norm, spike, loss z, norm z (a rank's time after: ignored)
    for loss, stop, bad, norm, spike in product(
        (6.5, 0.0, 3e38, nan, inf, -inf), (0.0, 1.0, 2.0), (0.0, 1.0, 3.0), (1.2, 0.0, 3e38, nan, inf), (0.0, 1.0)
    ):
        numbers = torch.tensor([loss, stop, bad, norm, spike, 7.0, -2.0, 0.25])
        assert torch.equal(skip_flag(numbers), _skip_before(numbers)), (loss, stop, bad, norm, spike)


BOOKKEEPING_OPS = 44
"""The non-view aten ops one steady-state train_step dispatches outside the model's forward and backward and
the optimizer's step and zero_grad, one rank, no accumulation, the guard on (bench/step_overhead.py's
bookkeeping row; 76 before the per-step bookkeeping was cut: clock, flags, clip, stats, guard, skip flag; 41
before the guard's loss-ratio rule, issue 78: its comparison, an `and` and an `or`)."""
GUARD_OPS = 28
"""Of those, the spike guard's (its verdict and history update), eager."""


def test_the_steps_bookkeeping_stays_within_its_op_count(tmp_path, shakespeare_shards):
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from step_overhead import bookkeeping_ops
    finally:
        sys.path.remove(str(REPO / "bench"))
    counts = bookkeeping_ops(shakespeare_shards, tmp_path)
    assert counts["ops"] <= BOOKKEEPING_OPS, counts
    assert counts["guard off"] <= BOOKKEEPING_OPS - GUARD_OPS, counts  # the guard's kernels are its alone
