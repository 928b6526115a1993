"""gpt2/distributed/straggler.py: the slowest rank named by its ratio to the others' median, the per-rank
times' records, the test hook; and the step's numbers carrying one time per rank (gpt2/train/trainer.py)."""

from __future__ import annotations

import pytest
import torch

from gpt2.distributed.group import Dist, single_process
from gpt2.distributed.straggler import (
    RECORD_EVERY_LOGS,
    ComputeClock,
    slow_rank_hook,
    slowest,
    straggler_line,
    times_record,
)
from gpt2.train.trainer import StepStats


def test_the_slowest_rank_is_named_over_the_ratio_and_the_gap_only():
    assert slowest([0.10, 0.10, 0.31, 0.11]) == (2, pytest.approx(0.31 / 0.10))
    assert slowest([0.10, 0.14, 0.10, 0.10]) is None  # 1.4x: within a shared node's noise
    assert slowest([0.004, 0.010]) is None  # 2.5x but 6 ms: scheduling noise of a tiny step
    assert slowest([0.2, 0.9]) == (1, pytest.approx(4.5))  # 2 ranks: against the other rank, not the mean
    assert slowest([0.0, 0.9]) is None and slowest([0.5]) is None  # a time not known yet; one rank
    line = straggler_line(7, [0.1, 0.1, 0.1, 0.4])
    assert "straggler: rank 3 computes 400 ms, 4.00x the median 100 ms of the other 3 rank(s)" in line
    assert straggler_line(7, [0.1, 0.1]) is None


def test_per_rank_times_are_recorded_on_a_coarser_interval_or_when_a_rank_is_named():
    times = [0.1, 0.2]
    assert times_record(50, times, RECORD_EVERY_LOGS, named=False) == {"step": 50, "rank_compute_s": times}
    assert times_record(51, times, RECORD_EVERY_LOGS + 1, named=False) is None
    assert times_record(51, times, RECORD_EVERY_LOGS + 1, named=True) is not None
    assert times_record(50, [0.1], RECORD_EVERY_LOGS, named=False) is None  # one rank: nothing to compare


def test_the_test_hook_slows_only_its_rank_and_refuses_a_bad_spec_in_one_line():
    assert slow_rank_hook(1, {"GPT2_TEST_SLOW_RANK": "1:0.5"}) == (0.5, 1.0)
    assert slow_rank_hook(0, {"GPT2_TEST_SLOW_RANK": "1:0.5"}) == (0.0, 1.0)
    assert slow_rank_hook(1, {"GPT2_TEST_SLOW_RANK": "1:4x"}) == (0.0, 4.0)
    assert slow_rank_hook(1, {}) == (0.0, 1.0)
    with pytest.raises(ValueError, match="expected RANK:SECONDS or RANK:FACTORx"):
        slow_rank_hook(1, {"GPT2_TEST_SLOW_RANK": "one"})


def test_the_clock_fills_its_own_slot_of_a_world_sized_vector():
    dist = Dist(rank=2, local_rank=2, world_size=4, local_world_size=4, device=torch.device("cpu"))
    clock = ComputeClock(dist, env={})
    assert clock.slots().tolist() == [0.0] * 4  # nothing measured yet
    clock.start()
    clock.mark()
    slots = clock.slots().tolist()
    assert slots[2] > 0 and slots[:2] + slots[3:] == [0.0, 0.0, 0.0]


def test_step_numbers_carry_every_ranks_time_after_loss_flags_norm_and_the_guards_verdict():
    # loss sum, stop, bad data, norm, the spike guard's (spike, loss z, norm z), rank 0, rank 1
    numbers = torch.tensor([4.0, 0.0, 0.0, 1.5, 1.0, 7.0, 0.5, 0.25, 0.75])
    out = StepStats(3, 1e-3, numbers, world_size=2, scaler_enabled=False).read()
    assert out["loss"] == 2.0 and out["grad_norm"] == 1.5 and out["rank_s"] == [0.25, 0.75] and not out["stop"]
    assert out["guard"].spike and out["guard"].loss_z == 7.0 and out["guard"].norm_z == 0.5


def test_one_process_carries_its_own_time():
    clock = ComputeClock(single_process(), env={})
    clock.start()
    clock.mark()
    assert clock.slots().shape == (1,)
