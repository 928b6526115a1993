"""gpt2/train/spike_guard.py: the verdict on the device, the guard's checkpointed state, and whole runs on
poisoned shards (a stretch of batches replaced by one repeated token): skip, roll back past them, stop
after --spike-max-rollbacks; resume bitwise exact with the guard's state; no false alarm on healthy runs."""

from __future__ import annotations

import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch
from _helpers import assert_same_state, import_train_ddp, load_ckpt, losses, records, tiny_run_flags
from conftest import run_trainer

from gpt2.core.config import SpikeConfig, TrainConfig
from gpt2.data.shards import write_shard
from gpt2.distributed.group import Dist
from gpt2.train.run_log import RunLog
from gpt2.train.spike_guard import SpikeGuard, verdict_of

STEP_TOKENS = 512
"""tiny_run_flags' --total-batch-size: with --data-order sequential, step s reads stream tokens
[(s-1)*512, s*512] whatever the world size."""
POISON_TOKEN = 50000
"""A token the corpus never has: a batch of it is a loss the model cannot fit (~12 against ~6.5)."""


def guard_for(**kw) -> SpikeGuard:
    return SpikeGuard(SpikeConfig(**{"spike_window": 8, **kw}), torch.device("cpu"))


def feed(guard: SpikeGuard, pairs) -> list[list[float]]:
    return [guard.judge(torch.tensor(loss), torch.tensor(norm)).tolist() for loss, norm in pairs]


def healthy(n: int, seed: int = 0) -> list[tuple[float, float]]:
    rng = np.random.default_rng(seed)
    return [(6.5 * float(np.exp(rng.normal(0, 0.02))), float(np.exp(rng.normal(0, 0.1)))) for _ in range(n)]


# ------------------------------------------------------------------ the verdict


def test_a_loss_far_above_a_full_history_is_a_spike_and_stays_out_of_the_history():
    guard = guard_for()
    assert [v[0] for v in feed(guard, healthy(8))] == [0.0] * 8  # nothing judged before the window is full
    before = guard.history.clone()
    spike, loss_z, _ = feed(guard, [(12.0, 1.0)])[0]
    assert spike == 1.0 and loss_z > 20
    assert torch.equal(guard.history, before)  # a spike does not become history
    assert feed(guard, [(6.5, 1.0)])[0][0] == 0.0
    assert not torch.equal(guard.history, before)  # a healthy step does


def test_a_gradient_norm_spike_alone_is_not_one_with_the_loss_up_it_is():
    guard = guard_for()
    feed(guard, healthy(8))
    assert feed(guard, [(6.5, 50.0)])[0][0] == 0.0  # z of the norm ~40, the loss ordinary: clipping's business
    assert feed(guard, [(6.5 * 1.25, 50.0)])[0][0] == 1.0  # the loss 25% up as well (> half the threshold)


def test_a_loss_1_5x_the_windows_median_is_a_spike_where_the_early_fall_widens_the_spread():
    """Issue 78: at the debug preset's first judged steps the window still held the loss's early fall, and a
    doubled loss scored z 5.2, under the limit of 6: trained on. A loss LOSS_RATIO (1.5x) the window's median is a
    spike with its z over a third of the limit (2); a smaller rise, or a wider scatter, is not."""
    from gpt2.train.spike_guard import LOSS_RATIO

    falling = [8.0, 7.2, 6.6, 6.3, 6.0, 5.7, 5.5, 5.3]  # median 6.0, spread (1.4826 MAD of the logs) ~0.13
    guard = guard_for()
    feed(guard, [(loss, 1.0) for loss in falling])
    spike, loss_z, _ = feed(guard, [(2 * 5.3, 1.0)])[0]  # the newest loss doubled: 1.77x the median
    assert 2 * 5.3 / 6.0 > LOSS_RATIO and 3 < loss_z < 6 and spike == 1.0
    spike, loss_z, _ = feed(guard, [(1.3 * 5.3, 1.0)])[0]  # 1.15x the median: ordinary
    assert spike == 0.0 and loss_z < 2
    wide = guard_for()  # the same fall with three times the scatter: 1.6x the median is under 2 sigma of it
    feed(wide, [(6.0 * (loss / 6.0) ** 3, 1.0) for loss in falling])
    spike, loss_z, _ = feed(wide, [(1.6 * 6.0, 1.0)])[0]
    assert loss_z < 2 and spike == 0.0
    spike, loss_z, _ = feed(wide, [(2.3 * 6.0, 1.0)])[0]  # the code corpus's doubled loss at step 101: 2.3x, z 2.4
    assert 2 < loss_z < 3 and spike == 1.0


def test_a_flat_history_does_not_make_noise_a_spike_and_non_finite_steps_are_not_spikes():
    guard = guard_for()
    feed(guard, [(6.5, 1.0)] * 8)  # zero spread: MIN_SPREAD (1%) is what the z divides by
    assert feed(guard, [(6.5 * 1.05, 1.0)])[0][0] == 0.0  # 5%: z ~5
    assert feed(guard, [(float("nan"), 1.0), (6.5, float("inf"))]) == [[0.0, 0.0, 0.0]] * 2
    assert int(guard.count) == 8


def test_after_a_rollback_the_loss_limit_is_halved_for_a_window_of_steps_and_the_state_keeps_it():
    """Issue 58: after a rollback the restored model scored the rest of a poisoned stretch at z 4.7, under
    the limit of 6, and trained on it. For --spike-window steps after a rollback the limit is 3."""
    guard = guard_for()
    feed(guard, [(6.5, 1.0)] * 8)  # a flat history: z = log ratio / MIN_SPREAD (1%)
    weak = (6.5 * 1.045, 1.0)  # z ~4.4: under 6, over 3
    assert feed(guard, [weak])[0][0] == 0.0
    guard.probation = 3  # what a rollback sets (the window's length)
    assert [v[0] for v in feed(guard, [weak, weak])] == [1.0, 1.0]
    state = guard.state_dict()
    again = guard_for()
    again.load_state_dict(state)  # a resume judges as the run would have
    assert again.probation == guard.probation == 1
    assert [v[0] for v in feed(again, [weak, weak])] == [v[0] for v in feed(guard, [weak, weak])] == [1.0, 0.0]
    old = {k: v for k, v in state.items() if k != "probation"}  # a checkpoint from before the probation
    fresh = guard_for()
    fresh.load_state_dict(old)
    assert fresh.probation == 0


def test_state_round_trips_into_another_window_and_none_leaves_a_fresh_guard():
    guard = guard_for(spike_window=16)
    feed(guard, healthy(20))
    guard.spikes.append({"step": 19, "loss": 9.0, "grad_norm": 1.0, "loss_z": 9.0, "grad_norm_z": 0.0})
    guard.rollbacks = 2
    state = guard.state_dict()
    same = guard_for(spike_window=16)
    same.load_state_dict(state)
    assert torch.equal(same.history, guard.history) and int(same.count) == 16
    assert list(same.spikes) == list(guard.spikes) and same.rollbacks == 2
    smaller = guard_for()  # --spike-window 8 on resume: the newest 8 steps
    smaller.load_state_dict(state)
    assert torch.equal(smaller.history, guard.history[:, -8:]) and int(smaller.count) == 8
    fresh = guard_for()
    fresh.load_state_dict(None)  # a checkpoint from before the guard, or saved with it off
    assert int(fresh.count) == 0 and fresh.rollbacks == 0


def test_observe_counts_spikes_within_the_window_and_says_so(tmp_path, capsys):
    guard = guard_for(spike_rollback_after=2)
    log = RunLog(Dist(0, 0, 1, 1, torch.device("cpu")), tmp_path)
    assert not guard.observe(10, verdict_of([1.0, 9.0, 0.0]), 11.0, 1.0, log)
    assert not guard.observe(19, verdict_of([1.0, 9.0, 0.0]), 11.0, 1.0, log)  # step 10 is out of the window
    assert guard.observe(20, verdict_of([1.0, 9.0, 0.0]), 11.0, 1.0, log)
    out = capsys.readouterr()
    assert "spike guard: step 20's update skipped: loss 11.0000 (z 9.0)" in out.out + out.err
    assert "spike 2 of 2 within 8 steps before a rollback" in out.out + out.err
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["spike_guard"], r["spikes_in_window"]) for r in recs] == [
        (10, "skip", 1),
        (19, "skip", 1),
        (20, "skip", 2),
    ]


def test_a_window_too_short_for_a_spread_is_refused():
    with pytest.raises(ValueError, match="spike_window=4 must be >= 8"):
        TrainConfig.of(spike_window=4)


# ------------------------------------------------------------------ whole runs on poisoned shards


def poisoned(shards, dest, steps: range):
    """A copy of the Shakespeare shards (no manifest: the token check alone) with the batches of `steps`
    (1-based, --data-order sequential) replaced by POISON_TOKEN."""
    dest.mkdir()
    shutil.copy(shards / "val_000000.bin", dest)
    tokens = np.concatenate([np.fromfile(p, dtype=np.uint16, offset=1024) for p in sorted(shards.glob("train_*.bin"))])
    tokens[(steps.start - 1) * STEP_TOKENS : (steps.stop - 1) * STEP_TOKENS + 1] = POISON_TOKEN
    write_shard(dest / "train_000000.bin", tokens)
    return dest


def guarded(data_dir, out_dir, *extra, max_steps: int) -> list[str]:
    return [
        *tiny_run_flags(data_dir, max_steps=max_steps, ckpt_interval=2, eval_tokens=2048),
        "--data-order",
        "sequential",
        "--out-dir",
        str(out_dir),
        "--spike-window",
        "8",
        *extra,
    ]


def decisions(run_dir) -> list[tuple]:
    """The rollbacks' steps, spikes and data positions (not their paths, which name the run directory)."""
    return [(r["step"], r["from_step"], r["spikes"], r["data_position"]) for r in guard_records(run_dir)]


def in_process(args, capsys) -> tuple[int, str]:
    capsys.readouterr()
    code = import_train_ddp().main(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def guard_records(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if "spike_guard" in r]


def test_spikes_are_skipped_then_rolled_back_past_and_the_rollbacks_are_bounded(tmp_path, shakespeare_shards, capsys):
    """Batches 21-26 poisoned, a rollback after 3 spikes, at most 1: steps 21-23 spike (skipped); the run
    goes back to step 20's checkpoint (22's, after the first spike, moves aside) with the data past step
    23's batches, so steps 21-23 again read batches 24-26, spike again, and the run stops with one line."""
    data = poisoned(shakespeare_shards, tmp_path / "data", range(21, 27))
    run_dir = tmp_path / "run"
    code, out = in_process(
        guarded(data, run_dir, "--spike-rollback-after", "3", "--spike-max-rollbacks", "1", max_steps=28), capsys
    )
    assert code == 1
    error = [line for line in out.splitlines() if line.startswith("train_ddp.py: error:")]
    assert (
        len(error) == 1
        and "spike guard: 3 loss spikes within 8 steps (steps 21, 22, 23) after 1 rollbacks" in error[0]
        and "Lower --lr" in error[0]
    )
    rollback, *after = guard_records(run_dir)
    assert rollback["spike_guard"] == "rollback" and rollback["step"] == 20 and rollback["from_step"] == 23
    assert [s["step"] for s in rollback["spikes"]] == [21, 22, 23] and min(s["loss_z"] for s in rollback["spikes"]) > 6
    assert rollback["data_position"] == 23 * STEP_TOKENS  # the loader's position (tokens): past batch 23
    assert [(r["step"], r["spike_guard"]) for r in after] == [(21, "skip"), (22, "skip"), (23, "skip")]
    # the log reads as one run: the branch left behind (steps 21-23's first pass) is cut, its record kept
    assert [r["step"] for r in records(run_dir) if "loss" in r and "spike_guard" not in r][-3:] == [21, 22, 23]
    (abandoned,) = (run_dir / "checkpoints").glob("abandoned-*")
    assert sorted(p.name for p in abandoned.glob("step_*.pt")) == ["step_00000022.pt"]
    assert "rolled back to step_00000020.pt (step 20), the data going on after step 23's batches" in out
    # the checkpoint written after the rollback (step 22 again) carries the guard's rollback count
    assert load_ckpt(run_dir, 22)["spike_guard"]["rollbacks"] == 1


@pytest.mark.slow  # ~45 s: four runs; the skip and rollback themselves are tested in the default suite
def test_a_rollback_recovers_and_a_resume_with_the_guard_state_is_bitwise_exact(tmp_path, shakespeare_shards, capsys):
    data = poisoned(shakespeare_shards, tmp_path / "data", range(21, 24))
    run_dir = tmp_path / "run"
    args = guarded(data, run_dir, max_steps=26)
    code, out = in_process(args, capsys)
    assert code == 0, out
    assert [r["spike_guard"] for r in guard_records(run_dir)] == ["rollback"]
    assert load_ckpt(run_dir, 24)["spike_guard"]["rollbacks"] == 1
    # resume from step 24 (after the rollback) in a copy: the same steps 25-26 and final state, bit for bit
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    for name in ("step_00000026.pt", "step_00000026.json"):
        (copy / "checkpoints" / name).unlink()
    code, out = in_process([*guarded(data, copy, max_steps=26), "--resume", "auto"], capsys)
    assert code == 0 and "resumed from" in out, out
    assert losses(copy) == losses(run_dir)
    assert_same_state(load_ckpt(copy, 26), load_ckpt(run_dir, 26))


@pytest.mark.slow  # two runs with a rollback each; the rollback itself is in the default suite
def test_a_rollback_with_late_reads_rolls_back_exactly_as_with_reads_at_once(
    tmp_path, shakespeare_shards, capsys, monkeypatch
):
    """CUDA's loop (a step's numbers read after the next step is queued), forced on a CPU: the rollback
    voids the queued step and the data goes on just past the last spike's batch, as at once."""
    data = poisoned(shakespeare_shards, tmp_path / "data", range(21, 24))
    at_once, late = tmp_path / "at_once", tmp_path / "late"
    assert in_process(guarded(data, at_once, max_steps=26), capsys)[0] == 0
    monkeypatch.setattr("gpt2.train.trainer.reads_lag", lambda device: True)
    assert in_process(guarded(data, late, max_steps=26), capsys)[0] == 0
    assert [r["spike_guard"] for r in guard_records(late)] == ["rollback"]
    assert decisions(late) == decisions(at_once)
    assert losses(late) == losses(at_once)


def test_an_old_checkpoint_without_guard_state_resumes_with_a_fresh_guard(tmp_path, shakespeare_shards, capsys):
    run_dir = tmp_path / "run"
    args = [
        *tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=2, eval_tokens=256),
        "--out-dir",
        str(run_dir),
    ]
    assert in_process(args, capsys)[0] == 0
    path = run_dir / "checkpoints" / "step_00000002.pt"
    state = torch.load(path, weights_only=False)
    del state["spike_guard"]  # as every checkpoint written before the guard
    torch.save(state, path)
    from gpt2.ckpt import checkpoint as ckpt

    ckpt.write_sidecar(
        path, {**ckpt.read_sidecar(path), "bytes": path.stat().st_size, "sha256": ckpt.file_sha256(path)}
    )
    code, out = in_process([*args, "--resume", str(path)], capsys)
    assert code == 0 and "resumed from" in out, out
    assert load_ckpt(run_dir, 4)["spike_guard"]["count"] == 2  # a fresh guard's history: steps 3 and 4


def test_no_false_alarm_a_healthy_run_trains_bitwise_the_same_guard_on_or_off(tmp_path, shakespeare_shards, capsys):
    """Default thresholds, the shortest window allowed (8), so the guard judges 6 of the 14 steps."""

    def run(name, *extra):
        args = [
            *tiny_run_flags(shakespeare_shards, max_steps=14, ckpt_interval=14, eval_tokens=256),
            "--out-dir",
            str(tmp_path / name),
            *extra,
        ]
        assert in_process(args, capsys)[0] == 0
        return tmp_path / name

    on, off = run("on", "--spike-window", "8"), run("off", "--spike-guard", "false")
    assert guard_records(on) == []
    assert losses(on) == losses(off)
    a, b = load_ckpt(on, 14), load_ckpt(off, 14)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert "spike_guard" not in b and int(a["spike_guard"]["count"]) == 8


# ------------------------------------------------------------------ slow: presets, val loss, 2 ranks


def parity_recipe(monkeypatch) -> list[str]:
    """The learning-parity recipe ours runs beside nanoGPT (bench/time_to_loss.py: 200 steps, 4 layers)."""
    import importlib.util

    from conftest import REPO

    monkeypatch.syspath_prepend(str(REPO / "bench"))  # its own imports (bench/nanogpt.py)
    spec = importlib.util.spec_from_file_location("time_to_loss", REPO / "bench" / "time_to_loss.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "time_to_loss", module)  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.RECIPE


@pytest.mark.soak  # 2 x 150 (debug), 2 x 200 (speed, parity) steps: longer than CI's budget
@pytest.mark.parametrize("preset", ["debug", "speed", "parity"])
def test_the_presets_train_bitwise_the_same_with_the_guard_at_its_defaults(
    tmp_path, shakespeare_shards, preset, monkeypatch
):
    """The quick start's debug preset (150 steps: the default window of 100 judges the last 50), the speed
    preset (200 steps, Muon: the host-side skip) and the learning-parity recipe against nanoGPT (200 steps)."""
    runs = {}
    recipe = parity_recipe(monkeypatch) if preset == "parity" else ["--preset", preset, "--dtype", "float32"]
    for name, extra in (("on", []), ("off", ["--spike-guard", "false"])):
        out = tmp_path / name
        r = run_trainer(
            [
                *recipe,
                "--data-dir",
                str(shakespeare_shards),
                "--out-dir",
                str(out),
                "--device",
                "cpu",
                "--sample-interval",
                "0",
                "--plot",
                "false",
                "--log-interval",
                "1",
                *extra,
            ],
            timeout=1800,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = out
    assert guard_records(runs["on"]) == []
    assert losses(runs["on"]) == losses(runs["off"])


def final_val(run_dir) -> float:
    return [r["val_loss"] for r in records(run_dir) if "val_loss" in r][-1]


POISON_STEPS = range(25, 31)
"""The last 6 of 30 steps: the run without the guard ends on them."""
POISONED_RUN = [
    "--max-steps",
    "30",
    "--warmup-steps",
    "3",
    "--data-order",
    "sequential",
    "--spike-window",
    "10",
    "--ckpt-interval",
    "10",
]
HIGH_LR = ["--lr", "5e-3", "--min-lr", "5e-3"]
"""A constant, raised lr (the issue's "a raised lr for those steps"): Adam moves every weight by about lr
a step whatever the gradient's size, so 6 consistent steps of one token move weights of std 0.02 by up to
0.03. At the tiny recipe's own decaying lr (3e-3 to 3e-4) the same poison hurts far less. This small-batch
recipe spikes by itself too (step 15's loss is 9.42 between 6.67 and 6.57), which the median and MAD the
guard judges by leave out of the spread (a standard deviation did not: the poison's first batch, 12.0,
scored under 6)."""
HURT = 1.0
"""How much worse the unguarded run's final val loss is at least at the high lr (nats): 9.85 against the
clean run's 6.88 on 1, 2 and 4 processes (the 2-core test machine)."""
CLEAN_MARGIN = 0.05
"""Issue 54's goal at the high lr: the guarded run within this of the clean run's final val loss."""
GUARD_COST = 0.005
"""Issue 54's goal at the default lr: the guarded run at most this above the unguarded one."""


# 3 runs of 30 steps per case: CI's long pass takes the 2-rank one, the rest are soak (by hand; a function-level
# slow mark would let `-m "slurm or slow"` select them too)
@pytest.mark.parametrize(
    "nproc,lr",
    [
        pytest.param(1, "high", marks=pytest.mark.soak),
        pytest.param(2, "high", marks=pytest.mark.slow),
        pytest.param(4, "high", marks=pytest.mark.soak),
        pytest.param(1, "default", marks=pytest.mark.soak),
    ],
)
def test_a_poisoned_stretch_hurts_without_the_guard_and_not_with_it(tmp_path, shakespeare_shards, nproc, lr):
    """The same 512 tokens a step on every rank count (4 ranks: micro-batches of 2), the same poisoned steps.
    The guard skips the poisoned steps it meets, rolls back past them and meets the rest under its halved
    limit (PROBATION_FACTOR), skipping and rolling back again: the run ends with all 30 updates made on clean
    batches, none on poison, where skipping alone (measured, docs/spike_guard.md) ends 6 updates short."""
    poison = poisoned(shakespeare_shards, tmp_path / "data", POISON_STEPS)
    vals = {}
    off = ["--spike-guard", "false"]
    for name, data, extra in (("clean", shakespeare_shards, off), ("off", poison, off), ("on", poison, [])):
        out = tmp_path / name
        args = [
            *tiny_run_flags(data, max_steps=30, ckpt_interval=10, eval_tokens=8192),
            *POISONED_RUN,
            *(HIGH_LR if lr == "high" else []),
            *(["--micro-batch-size", "2"] if nproc == 4 else []),
            "--out-dir",
            str(out),
            *extra,
        ]
        r = run_trainer(args, nproc=nproc, timeout=1800)
        assert r.returncode == 0, r.stderr[-3000:]
        vals[name] = final_val(out)
    print(f"final val loss, {nproc} process(es), {lr} lr: {vals}")
    rollbacks = [r for r in guard_records(tmp_path / "on") if r["spike_guard"] == "rollback"]
    assert len(rollbacks) == 2, guard_records(tmp_path / "on")
    assert abs(vals["on"] - vals["clean"]) < CLEAN_MARGIN, vals
    assert vals["on"] <= vals["off"] + GUARD_COST, vals
    if lr == "high":
        assert vals["off"] > vals["clean"] + HURT, vals  # visibly hurt


@pytest.mark.parametrize("n", [8, 9, 100])
def test_the_guards_median_is_torch_medians_from_a_sort(n):
    """torch.median(dim) returns indices, which --deterministic (use_deterministic_algorithms) refuses on CUDA:
    the guard takes the same lower median from a sort, bit for bit."""
    from gpt2.train.spike_guard import _lower_median

    rows = torch.randn(2, n, generator=torch.Generator().manual_seed(n))
    assert torch.equal(_lower_median(rows), rows.median(dim=1).values)


def _judge_before(guard: SpikeGuard, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """judge as it was before its ops were cut (60 a step): the reference its bits are held to."""
    from gpt2.train.spike_guard import LOSS_RATIO, MAD_TO_SIGMA, MIN_SPREAD, RATIO_Z_SHARE, _lower_median

    x = torch.stack([loss.float(), grad_norm.float()]).clamp_min(1e-30).log()
    centre = _lower_median(guard.history)
    spread = (MAD_TO_SIGMA * _lower_median((guard.history - centre[:, None]).abs())).clamp_min(MIN_SPREAD)
    z = (x - centre) / spread
    finite = torch.isfinite(x).all()
    full = guard.count >= guard.window
    ratio = (x[0] - centre[0]) > math.log(LOSS_RATIO)  # the loss 1.5x the window's median (issue 78)
    spike = (z[0] > guard.loss_z) | ((z[1] > guard.norm_z) & (z[0] > guard.loss_z / 2))
    spike = full & finite & (spike | (ratio & (z[0] > guard.loss_z / RATIO_Z_SHARE)))
    accept = finite & ~spike
    shifted = torch.cat([guard.history[:, 1:], x.unsqueeze(1)], dim=1)
    guard.history.copy_(torch.where(accept, shifted, guard.history))
    guard.count.add_(accept.long()).clamp_(max=guard.window)
    z = torch.where(full & finite, z, torch.zeros_like(z))
    return torch.cat([spike.float().unsqueeze(0), z])


def test_the_verdict_and_history_are_bitwise_the_old_judges_on_every_kind_of_step():
    """Spikes, norm-only excursions, NaN, +-inf, zero, a filling window: the same bits as before."""
    steps = healthy(12) + [(20.0, 1.0), (6.5, 50.0), (13.0, 50.0), (float("nan"), 1.0), (6.5, float("inf"))]
    steps += [(float("-inf"), 1.0), (0.0, 0.0), (6.5, float("nan")), (1e-38, 1e38)] + healthy(6, seed=1)
    wide = [(6.5 * float(np.exp(0.2 * np.sin(i))), 1.0) for i in range(10)]  # a spread of ~0.2: the ratio decides
    steps += wide + [(6.5 * 1.55, 1.0), (6.5 * 1.45, 1.0), (6.5 * 2.2, 1.0), (6.5 * 1.55, 30.0)]
    limits = {"spike_loss_z": 2.7, "spike_norm_z": 3.3}  # not whole: compared in fp32 either way
    for new, old in ((guard_for(), guard_for()), (guard_for(**limits), guard_for(**limits))):
        _judge_both(new, old, steps)


def _judge_both(new: SpikeGuard, old: SpikeGuard, steps) -> None:
    for loss, norm in steps:
        a = new.judge(torch.tensor(loss), torch.tensor(norm))
        b = _judge_before(old, torch.tensor(loss), torch.tensor(norm))
        assert a.dtype == b.dtype and a.view(torch.int32).tolist() == b.view(torch.int32).tolist(), (loss, norm)
        assert torch.equal(new.history, old.history) and int(new.count) == int(old.count)


def test_the_fused_verdict_decides_as_the_eager_one():
    """fuse() (the trainer's on CUDA with a compiled model), compiled here on the CPU: the same spikes,
    skips and history counts; the z-scores to inductor's rounding (its log), not bitwise."""
    steps = healthy(12) + [(20.0, 1.0), (6.5, 50.0), (13.0, 50.0), (float("nan"), 1.0), (6.5, float("inf"))]
    steps += [(float("-inf"), 1.0), (0.0, 0.0), (6.5, float("nan"))] + healthy(6, seed=1)
    eager, fused = guard_for(), guard_for()
    fused.fuse()
    for loss, norm in steps:
        a = eager.judge(torch.tensor(loss), torch.tensor(norm))
        b = fused.judge(torch.tensor(loss), torch.tensor(norm))
        assert a[0] == b[0] and int(eager.count) == int(fused.count), (loss, norm)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4) and torch.allclose(eager.history, fused.history, rtol=1e-5)


@pytest.mark.parametrize("last", [(2 * 5.3, 1.0), (1.3 * 5.3, 1.0), (13.0, 1.0), (6.0, 40.0), (7.0, 40.0)])
def test_bench_spike_stat_replays_the_guards_rule(last, monkeypatch):
    """bench/spike_stat.py judges logged runs by a copy of the guard's rule in numpy (docs/spike_guard.md's table):
    on the same steps it decides as the guard does, with the same z."""
    from conftest import REPO

    from gpt2.train.spike_guard import LOSS_RATIO, RATIO_Z_SHARE

    monkeypatch.syspath_prepend(str(REPO / "bench"))
    import spike_stat

    falling = [8.0, 7.2, 6.6, 6.3, 6.0, 5.7, 5.5, 5.3]
    guard = guard_for()
    spike, loss_z, norm_z = feed(guard, [(loss, 1.0) for loss in falling] + [last])[-1]
    rows = [
        {"step": i + 1, "loss": loss, "grad_norm": norm}
        for i, (loss, norm) in enumerate([*[(x, 1.0) for x in falling], last])
    ]
    z = spike_stat.replay(rows, window=8)[9]
    assert spike_stat.spike_now(z) == (spike == 1.0)
    assert z[0] == pytest.approx(loss_z, rel=1e-5) and z[1] == pytest.approx(norm_z, rel=1e-5, abs=1e-5)
    assert (spike_stat.LOSS_RATIO, spike_stat.RATIO_Z_SHARE) == (LOSS_RATIO, RATIO_Z_SHARE)
