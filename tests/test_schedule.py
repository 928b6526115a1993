import math

import pytest

from gpt2.core.schedule import grad_accum_steps, lr_at

KW = dict(max_lr=6e-4, min_lr=6e-5, warmup_steps=10, max_steps=100)


def test_warmup_is_linear_and_reaches_max():
    assert lr_at(0, **KW) == pytest.approx(6e-4 / 10)
    assert lr_at(4, **KW) == pytest.approx(6e-4 * 5 / 10)
    assert lr_at(9, **KW) == pytest.approx(6e-4)


def test_decay_is_continuous_at_warmup_end_and_ends_at_min():
    assert lr_at(10, **KW) == pytest.approx(6e-4)
    assert abs(lr_at(10, **KW) - lr_at(9, **KW)) < 1e-12
    assert lr_at(55, **KW) == pytest.approx((6e-4 + 6e-5) / 2)  # cosine midpoint
    assert lr_at(100, **KW) == pytest.approx(6e-5)
    assert lr_at(10_000, **KW) == pytest.approx(6e-5)


def test_decay_is_monotone_and_smooth():
    lrs = [lr_at(s, **KW) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # no jump bigger than the steepest cosine slope allows
    max_step = (6e-4 - 6e-5) * math.pi / 2 / 90
    assert max(a - b for a, b in zip(lrs, lrs[1:])) <= max_step * 1.01


def test_no_warmup():
    assert lr_at(0, max_lr=1.0, min_lr=0.1, warmup_steps=0, max_steps=10) == pytest.approx(1.0)


def test_grad_accum_steps_gpt2_recipe():
    assert grad_accum_steps(524_288, 64, 1024, 8) == 1
    assert grad_accum_steps(524_288, 64, 1024, 4) == 2
    assert grad_accum_steps(524_288, 16, 1024, 1) == 32


def test_grad_accum_steps_rejects_non_dividing_batch_with_the_numbers():
    with pytest.raises(ValueError) as e:
        grad_accum_steps(500_000, 64, 1024, 8)
    msg = str(e.value)
    assert "total_batch_size=500000" in msg and "64*1024*8" in msg and "--micro-batch-size" in msg
    assert "sizes that would divide: --total-batch-size 524288 (multiples of 524288)" in msg


def test_the_refusal_lists_nearby_totals_and_smaller_micro_batches_that_divide():
    with pytest.raises(ValueError) as e:
        grad_accum_steps(5120, 8, 128, 2)  # 2048 per micro-step; 5120 = 20 * 256
    assert str(e.value).endswith(
        "--total-batch-size 4096 or 6144 (multiples of 2048), or --micro-batch-size 1, 2, 4, 5"
    )
    for m in (1, 2, 4, 5):
        grad_accum_steps(5120, m, 128, 2)  # each size it lists does divide
    with pytest.raises(ValueError, match=r"--total-batch-size 1024 \(multiples of 1024\); no smaller"):
        grad_accum_steps(200, 8, 128, 1)  # no zero total is offered
    with pytest.raises(
        ValueError, match=r"less than one sequence per rank .*raise --total-batch-size to a multiple of 128"
    ):
        grad_accum_steps(100, 8, 128, 1)


WSD = dict(max_lr=1.0, min_lr=0.1, warmup_steps=5, max_steps=100, decay_steps=40)


def test_warmup_stable_decay_holds_the_peak_then_decays_linearly_to_min():
    assert lr_at(4, **WSD) == pytest.approx(1.0)  # warmup as with cosine
    assert [lr_at(s, **WSD) for s in (5, 30, 59, 60)] == pytest.approx([1.0] * 4)  # stable until 100 - 40
    assert lr_at(80, **WSD) == pytest.approx(0.55)  # half way down the line
    assert lr_at(100, **WSD) == pytest.approx(0.1) and lr_at(500, **WSD) == pytest.approx(0.1)
    lrs = [lr_at(s, **WSD) for s in range(60, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    # a decay longer than the steps after warmup starts at the end of warmup
    assert lr_at(5, **{**WSD, "decay_steps": 1000}) == pytest.approx(1.0)
    assert lr_at(52, **{**WSD, "decay_steps": 1000}) == pytest.approx(1.0 - 0.9 * 47 / 95)
    assert lr_at(50, **{**WSD, "decay_steps": 0}) == lr_at(50, **{k: v for k, v in WSD.items() if k != "decay_steps"})
