"""The node check's comparisons and run plumbing (gpt2/doctor/train_runs.py): each can fail, and says why."""

from __future__ import annotations

import math

import numpy as np
import torch

from gpt2.core.config import GPT2_VOCAB_SIZE
from gpt2.data.loader import find_shards
from gpt2.data.shards import HEADER_BYTES, TOKEN_DTYPE
from gpt2.doctor.train_runs import (
    LOSS_TOLERANCE_16BIT,
    LOSS_TOLERANCE_FP32,
    PHRASE_TOKENS,
    compare_losses,
    compare_states,
    failure_line,
    flatten_tensors,
    loss_tolerance,
    median_after_warmup,
    write_synthetic_shards,
)


def test_identical_losses_are_bitwise_and_within_any_tolerance():
    ref = {1: 10.8, 2: 10.7, 3: 10.6}
    c = compare_losses(ref, dict(ref), 0.0)
    assert c.ok and c.bitwise and c.steps == [1, 2, 3] and c.max_abs_diff == 0.0
    assert "identical losses (bitwise)" in c.describe()


def test_a_difference_above_the_tolerance_fails_and_names_its_step():
    ref = {1: 10.8, 2: 10.7, 3: 10.6}
    c = compare_losses(ref, {1: 10.8, 2: 10.75, 3: 10.601}, 1e-2)
    assert not c.ok and not c.bitwise and c.worst_step == 2 and math.isclose(c.max_abs_diff, 0.05)
    assert "(step 2) > tolerance 1e-02" in c.describe()
    assert compare_losses(ref, {1: 10.8, 2: 10.705, 3: 10.6}, 1e-2).ok  # within it


def test_missing_steps_and_non_finite_losses_fail():
    ref = {1: 10.8, 2: 10.7, 3: 10.6}
    c = compare_losses(ref, {1: 10.8, 2: 10.7}, 1.0)
    assert not c.ok and c.missing == [3] and "steps [3] missing" in c.describe()
    assert not compare_losses(ref, {1: 10.8, 2: float("nan"), 3: 10.6}, 1.0).ok
    assert not compare_losses(ref, {}, 1.0).ok  # nothing compared is not a pass
    resumed = compare_losses(ref, {2: 10.7, 3: 10.6}, 0.0, steps=range(2, 4))  # a resume's steps only
    assert resumed.ok and resumed.steps == [2, 3]


def test_tolerance_follows_the_fast_runs_matmul_precision():
    assert loss_tolerance("float32", tf32=False) == LOSS_TOLERANCE_FP32
    assert loss_tolerance("float32", tf32=True) == LOSS_TOLERANCE_16BIT  # TF32 keeps 10 mantissa bits
    assert loss_tolerance("bfloat16", tf32=True) == loss_tolerance("float16", tf32=False) == LOSS_TOLERANCE_16BIT


def state(scale: float = 1.0, step: int = 3) -> dict:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=gen) * scale
    return {
        "model": {"w": w, "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"exp_avg": w.clone(), "step": torch.tensor(step)}}, "param_groups": [{"lr": 1e-3}]},
    }


def test_states_compare_every_tensor_by_path():
    assert sorted(flatten_tensors(state())) == [
        "model/b",
        "model/w",
        "optimizer/state/0/exp_avg",
        "optimizer/state/0/step",
    ]
    same = compare_states(state(), state())
    assert same.bitwise and same.tensors == 4 and "all 4 model and optimizer tensors identical" in same.describe()
    near = compare_states(state(), state(scale=1 + 1e-6))
    assert not near.bitwise and near.identical == 2 and 0 < near.max_abs_diff < 1e-5
    assert compare_states(state(), state(step=4)).max_abs_diff == math.inf  # an integer counter that differs
    extra = state()
    extra["model"]["c"] = torch.zeros(1)
    assert compare_states(state(), extra).mismatched == ["model/c"] and not compare_states(state(), extra).bitwise


def test_failure_line_prefers_the_trainers_error_then_the_exception():
    assert (
        failure_line("step 1\ntrain_ddp.py: error: --data-dir x: no such directory\n", 2)
        == "--data-dir x: no such directory"
    )
    traceback = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n'
        "torch._inductor.exc.InductorError: CppCompileError: C++ compile error\n"
    )
    assert failure_line(traceback, 1) == "torch._inductor.exc.InductorError: CppCompileError: C++ compile error"
    assert (
        failure_line("$ python train_ddp.py\ndoctor: killed after 5 s\n", 124)
        == "exit status 124: doctor: killed after 5 s"
    )


def test_median_leaves_out_the_warm_up_steps():
    records = [{"step": s, "tok_per_s": v} for s, v in [(1, 10.0), (2, 100.0), (3, 200.0), (4, 300.0)]]
    assert median_after_warmup(records, "tok_per_s", 1) == 200.0
    assert median_after_warmup(records, "tok_per_s", 2) == 250.0
    assert median_after_warmup(records, "tok_per_s", 4) is None


def test_synthetic_shards_are_valid_learnable_gpt2_tokens(tmp_path):
    write_synthetic_shards(tmp_path, 10_000, val_tokens=1_000)
    train, val = find_shards(tmp_path, "train"), find_shards(tmp_path, "val")
    assert train.sizes == (10_000,) and val.sizes == (1_000,)
    tokens = np.fromfile(train.paths[0], dtype=TOKEN_DTYPE, offset=HEADER_BYTES).astype(np.int64)
    assert tokens.max() < GPT2_VOCAB_SIZE
    # phrases: each 16-token phrase recurs, so most 16-grams at phrase boundaries are repeats
    grams = {tuple(tokens[i : i + PHRASE_TOKENS]) for i in range(0, len(tokens) - PHRASE_TOKENS, PHRASE_TOKENS)}
    assert len(grams) < len(tokens) // PHRASE_TOKENS
    again = tmp_path / "again"
    write_synthetic_shards(again, 10_000, val_tokens=1_000)
    assert (again / train.paths[0].name).read_bytes() == train.paths[0].read_bytes()  # deterministic


def test_the_checks_runs_share_one_compile_cache_in_the_work_directory(tmp_path, monkeypatch):
    """Each run's RUN is new, so RUN/compile-cache would compile every run from scratch: run_train names
    WORK/compile-cache instead (here a run that stops at its data check, seconds, shows the command)."""
    from gpt2.doctor.train_runs import run_train

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # set by conftest; auto would keep it
    run = run_train("no_data", ["--data-dir", str(tmp_path / "missing"), "--device", "cpu"], tmp_path)
    command = run.log.read_text().splitlines()[0]
    assert run.returncode == 2 and f"--compile-cache {tmp_path / 'compile-cache'} " in command, command
