"""gpt2/train/state.py: what a checkpoint holds and how it is put back; a checkpoint written before the
module existed (tests/data/checkpoint_v1) still resumes, and a new one has the same keys; a --preset speed
(Muon) run from before the architecture options (tests/data/checkpoint_speed_v1) resumes to the losses and
weights the old code gave."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_trainer

from gpt2.ckpt import checkpoint as ckpt
from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
from gpt2.train.run_log import read_metrics
from gpt2.train.state import OptimizerState, RankRng, ScalerState, check_compatible, load_components, rng_state

FIXTURE = Path(__file__).resolve().parent / "data" / "checkpoint_v1"
"""Step 2 of a 4-step run written by the trainer before gpt2/train/state.py (expected.json: the command,
and the losses of all 4 steps of that uninterrupted run)."""

FIXTURE_FLAGS = [
    "--n-layer",
    "1",
    "--n-head",
    "1",
    "--n-embd",
    "4",
    "--block-size",
    "8",
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--compile",
    "false",
    "--micro-batch-size",
    "2",
    "--total-batch-size",
    "16",
    "--max-steps",
    "4",
    "--eval-interval",
    "0",
    "--eval-tokens",
    "0",
    "--ckpt-interval",
    "2",
    "--keep-checkpoints",
    "3",
    "--log-interval",
    "1",
    "--sample-interval",
    "0",
    "--hellaswag-interval",
    "0",
    "--seed",
    "1337",
    "--warmup-steps",
    "1",
    "--lr",
    "1e-3",
    "--plot",
    "false",
    "--async-ckpt",
    "false",
]


def key_shape(state: dict) -> dict:
    """The structure a reader of a checkpoint relies on: keys, not values (config fields may grow)."""
    return {
        "top": sorted(state),
        "model": sorted(state["model"]),
        "optimizer": sorted(state["optimizer"]),
        "param_group": sorted(state["optimizer"]["param_groups"][0]),
        "loader": sorted(state["loader"]),
        "rng": [sorted(r) for r in state["rng"]],
        "config": sorted(state["config"]),
        "scaler": sorted(state["scaler"]),
    }


def test_a_checkpoint_from_before_resumes_and_trains_two_more_steps(tmp_path, shakespeare_shards):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("step_00000002.pt", "step_00000002.json"):
        shutil.copy(FIXTURE / name, run_dir / "checkpoints" / name)
    old = run_dir / "checkpoints" / "step_00000002.pt"
    run = run_trainer(
        [*FIXTURE_FLAGS, "--data-dir", str(shakespeare_shards), "--out-dir", str(run_dir), "--resume", str(old)]
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"resumed from {old} at step 2 (32 tokens)" in run.stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(losses) == [3, 4]
    expected = json.loads((FIXTURE / "expected.json").read_text())["losses"]
    # Bitwise on the machine that wrote the fixture; other CPUs' fp32 kernels may round differently.
    assert [losses[3], losses[4]] == pytest.approx([expected["3"], expected["4"]], abs=1e-5, rel=0)
    new = ckpt.load_checkpoint(run_dir / "checkpoints" / "step_00000004.pt", verify=True)
    before = ckpt.load_checkpoint(old, verify=True)
    assert key_shape(new) == {**key_shape(before), "top": sorted([*before, "spike_guard"])}  # the guard's state is new
    assert new["step"] == 4 and new["world_size"] == 1 and new["loader"]["position"] > before["loader"]["position"]


class Lines:
    """Stands in for RunLog: the lines it would print."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, message: str) -> None:
        self.lines.append(message)


def resumed_lines(saved_flags: dict, step: int, **now) -> list[str]:
    """What check_compatible says when a run of saved_flags, checkpointed at step, resumes with now's flags."""
    model = ModelConfig(n_layer=1, n_head=1, n_embd=8, block_size=8)
    saved = {"config": RunConfig(model, TrainConfig.of(**saved_flags)).to_dict(), "tokenizer": "gpt2", "step": step}
    log = Lines()
    check_compatible(saved, RunConfig(model, TrainConfig.of(**{**saved_flags, **now})), log)
    return log.lines


def test_a_longer_max_steps_on_resume_says_how_the_learning_rate_moves():
    """A finished 50-step cosine run extended to 100 steps: its next step (51 in the log) trains at 5.87e-4,
    not the old horizon's 1e-4 (min_lr), and one line says so with the ways to keep it; no line where
    max_steps is the same, or where the rate at the step is the same (warmup-stable-decay's stable part)."""
    flags = dict(data_dir="d", out_dir="o", max_steps=50, lr=1e-3, min_lr=1e-4, warmup_steps=5)
    lines = resumed_lines(flags, 50, max_steps=100)
    assert lines == [
        "resume: max_steps changed from 50 to 100",
        "resume: --max-steps 50 -> 100 stretches the learning-rate schedule over the new horizon: step 51, the "
        "first after the checkpoint, trains at lr 5.87e-04 where the old one gave 1.00e-04. To keep the old rate "
        "pass --max-steps 50, or a constant one with --lr 0.0001 --min-lr 0.0001; a run meant to be extended can "
        "use --decay-steps N (warmup-stable-decay: --lr until the last N steps, so a longer --max-steps moves "
        "only the decay)",
    ]
    assert resumed_lines(flags, 50, lr=2e-3) == ["resume: lr changed from 0.001 to 0.002"]
    stable = resumed_lines({**flags, "decay_steps": 10}, 30, max_steps=100)
    assert stable == ["resume: max_steps changed from 50 to 100"]


def test_optimizer_state_keeps_this_runs_hyperparameters():
    w = torch.nn.Parameter(torch.ones(3))
    saved_opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.5)
    w.grad = torch.ones(3)
    saved_opt.step()
    saved = OptimizerState(saved_opt).state_dict()
    now = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1, weight_decay=0.01)
    OptimizerState(now).load_state_dict(saved)
    assert now.param_groups[0]["weight_decay"] == 0.01  # the flag wins
    assert torch.equal(now.state[now.param_groups[0]["params"][0]]["exp_avg"], saved["state"][0]["exp_avg"])


def test_rank_rng_takes_its_own_entry_or_rank_mod_world_size():
    torch.manual_seed(0)
    a = rng_state()
    torch.manual_seed(1)
    b = rng_state()
    RankRng(rank=3).load_state_dict([a, b])  # 4 ranks now, 2 saved: rank 3 takes saved rank 1
    assert torch.equal(torch.get_rng_state(), b["torch"])
    RankRng(rank=0).load_state_dict([a, b])
    assert torch.equal(torch.get_rng_state(), a["torch"])


def test_scaler_state_is_restored_only_when_fp16_is_on_now():
    off = torch.amp.GradScaler("cpu", enabled=False)
    ScalerState(off).load_state_dict({"scale": 8.0})  # bf16/fp32 now: nothing to restore, no error
    on = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ScalerState(on).load_state_dict({})  # fp16 now, not before: starts at its own scale
    assert on.get_scale() == 2.0**16


def test_a_refused_loader_position_names_the_checkpoint():
    class Refuses:
        def load_state_dict(self, state):
            raise ValueError("the train shards differ")

    with pytest.raises(ckpt.CheckpointError, match=r"^/x/step_00000002.pt: the train shards differ$"):
        load_components({"loader": Refuses()}, {"loader": {}}, Path("/x/step_00000002.pt"))
    with pytest.raises(ValueError) as e:  # another component's ValueError is not reworded
        load_components({"model": Refuses()}, {"model": {}}, Path("/x/step_00000002.pt"))
    assert not isinstance(e.value, ckpt.CheckpointError)


def test_cuda_generator_is_saved_and_restored_only_for_a_cuda_run(monkeypatch):
    """A --device cpu run on a GPU node never asks CUDA (which would open a context on GPU 0 in every
    rank); a CUDA run saves it; an older checkpoint holding a CUDA state still loads into a CPU run."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: calls.append("get") or torch.zeros(8, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: calls.append("set"))
    cpu = RankRng(rank=0).state_dict()
    assert "cuda" not in cpu and calls == []
    old = {**cpu, "cuda": torch.zeros(8, dtype=torch.uint8)}  # what every run saved before, CUDA present
    RankRng(rank=0).load_state_dict([old])
    assert calls == []
    gpu = RankRng(rank=0, cuda=True).state_dict()
    assert "cuda" in gpu and calls == ["get"]
    RankRng(rank=0, cuda=True).load_state_dict([gpu])
    assert calls == ["get", "set"]


SPEED_FIXTURE = Path(__file__).resolve().parent / "data" / "checkpoint_speed_v1"
"""Step 2 of a 4-step `--preset speed` run (Muon) written before the architecture options of issue 56
(expected.json: the command, the losses of all 4 steps and each parameter's sum of |w| at step 4)."""


@pytest.mark.torch_feature("muon")
def test_a_speed_preset_run_from_before_the_architecture_options_resumes_as_it_would_have(tmp_path, shakespeare_shards):
    """Its checkpoint holds no architecture keys: it loads as GPT-2's layout under today's `--preset speed`
    (whose shape flags the test repeats), and steps 3-4 give the losses and weights the old code gave."""
    expected = json.loads((SPEED_FIXTURE / "expected.json").read_text())
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("step_00000002.pt", "step_00000002.json"):
        shutil.copy(SPEED_FIXTURE / name, run_dir / "checkpoints" / name)
    old = run_dir / "checkpoints" / "step_00000002.pt"
    assert not {"rope", "qk_norm", "tie_embeddings"} & set(ckpt.load_checkpoint(old)["config"]["model"])
    flags = ["--preset", "speed", *(f for f in FIXTURE_FLAGS if f not in ("--lr", "1e-3"))]
    flags = [f for i, f in enumerate(flags) if f != "--warmup-steps" and flags[i - 1] != "--warmup-steps"]
    run = run_trainer([*flags, "--data-dir", str(shakespeare_shards), "--out-dir", str(run_dir), "--resume", str(old)])
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"resumed from {old} at step 2 (32 tokens)" in run.stdout
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    assert sorted(losses) == [3, 4]
    # Bitwise on the machine that wrote the fixture; other CPUs' fp32 kernels may round differently.
    assert [losses[3], losses[4]] == pytest.approx([expected["losses"]["3"], expected["losses"]["4"]], abs=1e-5)
    new = ckpt.load_checkpoint(run_dir / "checkpoints" / "step_00000004.pt", verify=True)
    assert new["config"]["train"]["optim"]["optimizer"] == "muon"
    sums = {k: float(v.double().abs().sum()) for k, v in new["model"].items()}
    # abs: a near-zero sum (a LayerNorm bias's 0.006 after 4 steps) moves by 1.4e-7 on an avx512_bf16 CPU,
    # 2.3e-5 of itself; a wrong resume moves every sum by far more than either tolerance.
    assert sums == pytest.approx(expected["weights_abs_sum"], rel=1e-5, abs=1e-6)
