"""float16 with a GradScaler, end to end on CPU: it learns as fp32 does, an overflow is the scaler's
business (skipped and logged, not a bad step), and the scaler's state resumes exactly.

CPU autocast supports fp16 and torch.amp.GradScaler("cpu") exists, so all of this runs here. fp16
matmuls are emulated on most CPUs (~1 GFLOP/s), so the model is tiny: 16 wide, 32 positions,
128 tokens per step."""

from __future__ import annotations

import json
import math

import pytest
import torch
from _helpers import FP32_CPU, assert_same_state, import_train_ddp, load_ckpt, losses, records, run

FP16_TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "16", "--block-size", "32"]


def flags(data_dir, out_dir, *, dtype: str, max_steps: int, ckpt_interval: int = 0, extra=()) -> list[str]:
    return [
        *FP16_TINY,
        *FP32_CPU,
        "--dtype",
        dtype,
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--micro-batch-size",
        "2",
        "--total-batch-size",
        "128",
        "--max-steps",
        str(max_steps),
        "--warmup-steps",
        "3",
        "--lr",
        "1e-2",
        "--eval-interval",
        "0",
        "--eval-tokens",
        "1024",
        "--ckpt-interval",
        str(ckpt_interval),
        "--keep-checkpoints",
        "100",
        "--log-interval",
        "1",
        *extra,
    ]


@pytest.mark.slow
def test_fp16_with_grad_scaler_tracks_fp32(tmp_path, shakespeare_shards):
    runs = {}
    for dtype in ("float32", "float16"):
        done = run(
            flags(shakespeare_shards, tmp_path / dtype, dtype=dtype, max_steps=30),
            nproc=1,
            log_dir=tmp_path / f"{dtype}_logs",
        )
        assert done.proc.returncode == 0, done.output()
        runs[dtype] = losses(tmp_path / dtype)
    fp32, fp16 = runs["float32"], runs["float16"]
    assert sorted(fp16) == sorted(fp32) == list(range(1, 31))
    assert fp32[30] < fp32[1] - 1.0  # it learns, so tracking is not trivial
    assert any(fp16[s] != fp32[s] for s in fp32)  # and fp16 did compute something else
    for step in fp32:  # measured: within 3e-4 of each other at every step
        assert fp16[step] == pytest.approx(fp32[step], abs=0.01), (step, fp16[step], fp32[step])
    steps = [r for r in records(tmp_path / "float16") if "loss" in r]
    assert all(r["loss_scale"] > 0 and not r["skipped"] for r in steps)
    info = json.loads((tmp_path / "float16" / "config.json").read_text())
    assert info["precision"]["dtype"] == "float16" and info["precision"]["requested"] == "float16"


@pytest.mark.slow
def test_an_overflow_is_skipped_by_the_scaler_and_is_not_a_bad_step(tmp_path, shakespeare_shards, monkeypatch, capsys):
    """A loss scale of 2^40 overflows fp16 for sure; with --max-bad-steps 1 the run would stop at the
    first overflow if overflows counted as non-finite steps. The scaler lowers its scale (by 2^-8
    per overflow here) until the gradients fit, and training goes on."""
    from gpt2.core import precision

    made = []

    def huge_scaler(self, device):
        enabled = self.dtype == "float16"
        made.append(torch.amp.GradScaler("cpu", init_scale=2.0**40, backoff_factor=2.0**-8, enabled=enabled))
        return made[-1]

    monkeypatch.setattr(precision.Precision, "scaler", huge_scaler)
    run_dir = tmp_path / "run"
    code = import_train_ddp().main(
        flags(shakespeare_shards, run_dir, dtype="float16", max_steps=8, extra=["--max-bad-steps", "1"])
    )
    out = capsys.readouterr()
    assert code == 0, out.err
    steps = [r for r in records(run_dir) if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    overflows = [r for r in steps if r["overflow"]]
    assert 1 <= len(overflows) < 8 and overflows[0]["step"] == 1
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in steps)
    scales = [r["loss_scale"] for r in overflows]
    assert scales == sorted(scales, reverse=True) and scales[0] == 2.0**32  # backed off after step 1
    assert not steps[-1]["overflow"] and steps[-1]["loss"] < steps[0]["loss"]  # it trained after
    assert "update skipped by the loss scaler" in out.out


@pytest.mark.slow
def test_fp16_resume_is_bitwise_exact_with_the_scalers_state(tmp_path, shakespeare_shards):
    """Resuming the step-4 checkpoint reproduces the uninterrupted run's step-8 state bitwise, the
    loss scale included (2 ranks, so the scaler's overflow check agrees across ranks too)."""
    whole = tmp_path / "whole"
    done = run(
        flags(shakespeare_shards, whole, dtype="float16", max_steps=8, ckpt_interval=4),
        nproc=2,
        log_dir=tmp_path / "whole_logs",
    )
    assert done.proc.returncode == 0, done.output()
    resumed = tmp_path / "resumed"
    done = run(
        [
            *flags(shakespeare_shards, resumed, dtype="float16", max_steps=8, ckpt_interval=4),
            "--resume",
            str(whole / "checkpoints" / "step_00000004.pt"),
        ],
        nproc=2,
        log_dir=tmp_path / "resumed_logs",
    )
    assert done.proc.returncode == 0, done.output()
    assert "resumed from" in done.stdout
    a, b = load_ckpt(whole, 8), load_ckpt(resumed, 8)
    assert_same_state(a, b)
    assert a["scaler"] == b["scaler"] and a["scaler"]["scale"] > 0
    assert load_ckpt(whole, 4)["scaler"]["_growth_tracker"] == 4  # the state that had to be restored
    assert losses(resumed) == {s: v for s, v in losses(whole).items() if s > 4}
