"""--activation-checkpointing (gpt2/model/gpt.py Block, gpt2/plan/ac_choice.py, gpt2/plan/memory.py): the
same losses and gradients with and without it (eager, compiled, DDP and FSDP over 2 gloo ranks), the
planner's activation memory with it against a measured peak, the auto rule, and a resume across a
change of the flag."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _helpers import FP32_CPU, losses, model_body, run, tiny_run_flags
from conftest import TINY_MODEL_FLAGS

from gpt2.core.config import ModelConfig, TrainConfig, model_preset
from gpt2.core.precision import Precision
from gpt2.model.gpt import GPT
from gpt2.plan.ac_choice import choose_activation_checkpointing
from gpt2.plan.hardware import GIB, Hardware, gpu_hardware
from gpt2.plan.measure import measured_peak_bytes
from gpt2.plan.memory import AUTO_HEADROOM, activation_bytes, matmul_weight_count, max_micro_batch_size, run_config
from gpt2.plan.planner import plan
from gpt2.plan.report import format_plan

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16)


def test_the_value_is_validated_in_one_line():
    assert TrainConfig().compute.activation_checkpointing == "auto"
    with pytest.raises(
        ValueError,
        match=r"activation_checkpointing='selective' must be one of "
        r"\('auto', 'none', 'full'\)",
    ):
        TrainConfig.of(activation_checkpointing="selective")


def loss_and_grads(cfg: ModelConfig, checkpointed: bool, compile_as: str | None = None):
    """One fp32 forward and backward of a fresh seeded model: the loss and every parameter's gradient."""
    from gpt2.train.build import compile_sharded

    torch.manual_seed(0)
    model = GPT(cfg, activation_checkpointing=checkpointed)
    train_model = model
    if compile_as == "whole":  # DDP's and one process's way
        train_model = torch.compile(model)
    elif compile_as == "per_block":  # FSDP's way: each block compiled in place, then the head
        compile_sharded(model)
    torch.manual_seed(1)  # the same dropout draws for both (checkpoint restores the RNG for its recompute)
    x, y = torch.randint(0, 50257, (2, 2, cfg.block_size))
    _, loss = train_model(x, y, return_logits=False)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_eager_losses_and_gradients_are_bitwise_equal(dropout):
    cfg = TINY.replace(dropout=dropout)
    (loss, grads), (loss_ac, grads_ac) = loss_and_grads(cfg, False), loss_and_grads(cfg, True)
    assert torch.equal(loss, loss_ac)
    assert grads.keys() == grads_ac.keys()  # the same parameter names: checkpoints load either way
    assert all(torch.equal(grads[n], grads_ac[n]) for n in grads)


@pytest.mark.slow
@pytest.mark.parametrize("compile_as", ["whole", "per_block"])
def test_compiled_losses_and_gradients_match(compile_as):
    """Inductor on CPU, compiled with and without: dynamo traces the checkpoint inside Block.forward as one
    region and the partitioner recomputes it. Measured bitwise equal (torch 2.13); asserted to 1e-6."""
    (loss, grads), (loss_ac, grads_ac) = (
        loss_and_grads(TINY, False, compile_as),
        loss_and_grads(TINY, True, compile_as),
    )
    assert loss_ac.item() == pytest.approx(loss.item(), abs=1e-6)
    for n in grads:
        torch.testing.assert_close(grads_ac[n], grads[n], rtol=0, atol=1e-6)


def test_checkpointed_model_loads_a_plain_models_state_dict():
    plain, checkpointed = GPT(TINY), GPT(TINY, activation_checkpointing=True)
    assert list(plain.state_dict()) == list(checkpointed.state_dict())
    checkpointed.load_state_dict(plain.state_dict())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_bytes_with_it_within_15pct_of_measured_peak(dtype):
    """As tests/test_plan.py checks the uncheckpointed count: forward + backward of the body, the CPU
    allocator's peak above the start (transients included). Measured 0.96 (fp32, 4 layers), 0.91 (fp32,
    8 layers) and 1.02 (bf16, 6 layers) of it; the uncheckpointed body is 2.9x (bf16) to 3.3x (fp32) more at 6
    layers."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=6, n_head=4, n_embd=128, block_size=256)
    model = GPT(cfg, activation_checkpointing=True)
    model.transformer.wte.weight.requires_grad_(False)  # its 50k-row gradient would be the peak
    B, T = 4, 256
    idx, grad = torch.randint(0, 50257, (B, T)), torch.randn(B, T, cfg.n_embd)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()

    def forward_backward():
        with autocast:
            out = model_body(model, idx)
        out.backward(grad)

    forward_backward()
    model.zero_grad(set_to_none=True)
    measured = measured_peak_bytes(forward_backward, "cpu")
    s = 2 if dtype == "bf16" else 4
    estimate = activation_bytes(
        cfg, B, T, prec=Precision.from_key(dtype), device_type="cpu", checkpointed=True
    ) - B * T * (s * cfg.n_embd + 8)  # the LM head's input and the targets: not in the body
    if dtype == "bf16":  # autocast's cached bf16 weight copies, alive until the forward's autocast ends
        estimate += 2 * (matmul_weight_count(cfg) - cfg.vocab_size * cfg.n_embd)
    assert estimate == pytest.approx(measured, rel=0.15)
    plain = activation_bytes(cfg, B, T, prec=Precision.from_key(dtype), device_type="cpu")
    assert plain > 2 * activation_bytes(cfg, B, T, prec=Precision.from_key(dtype), device_type="cpu", checkpointed=True)


def test_the_planner_counts_its_memory_and_recompute():
    cfg, hw = model_preset("gpt2-xl"), gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    off = plan(run_config(cfg, 4, activation_checkpointing="none"), hw)
    on = plan(run_config(cfg, 4, activation_checkpointing="full"), hw)
    assert not off.fits and on.fits  # issue 34: 38.9 GiB at micro-batch 4 without it
    assert on.memory.activations == on.memory.activations_checkpointed < off.memory.activations / 5
    assert on.max_micro_batch_size > 4 * off.max_micro_batch_size
    assert on.flops_per_token == off.flops_per_token  # model FLOPs: what MFU counts
    assert on.recompute_flops_per_token / on.flops_per_token == pytest.approx(0.32, abs=0.01)
    assert on.step_time_s == pytest.approx(off.step_time_s * 1.32, rel=0.01)
    report = format_plan(on)
    assert "activations, full AC" in report and "recompute  activation checkpointing full: +" in report
    assert "recomputed, not in MFU" in report and "logged MFU would be 30%" in report


def choice(cfg, requested="auto", *, mb="auto", hw, total=524_288, world_size=1):
    run = run_config(cfg, mb, world_size=world_size, total_batch_size=total, activation_checkpointing=requested)
    return choose_activation_checkpointing(run, hw, world_size=world_size)


def test_auto_picks_none_where_a_micro_batch_fits_and_full_where_none_does():
    cfg = model_preset("gpt2-xl")
    roomy = gpu_hardware("A100-80GB", Precision.from_key("bf16"))
    assert choice(cfg, hw=roomy, total=524_288).mode == "none"
    assert choice(cfg, mb=4, hw=roomy, total=524_288).mode == "none"
    # Room for one sequence with it (and a little more), with auto's margin, not without: nothing fits without it.
    one = plan(run_config(cfg, 1, activation_checkpointing="full"), roomy).memory.total
    tight = Hardware(
        name="tight",
        memory_bytes=int(one * AUTO_HEADROOM) + GIB + GIB // 4,
        peak_flops=1e14,
        device_type="cuda",
        reserve_bytes=GIB,
    )
    assert max_micro_batch_size(run_config(cfg, 1), tight, headroom=AUTO_HEADROOM) == 0
    auto = choice(cfg, hw=tight, total=524_288)
    assert auto.mode == "full" and auto.reason.startswith("auto: no micro-batch fits without it, up to ")
    assert "+32% FLOPs recomputed, not in MFU" in auto.describe()
    # An explicit micro-batch whose plan does not fit without it (issue 34's 38.9 of 37.4 GiB usable): full.
    a100 = gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    assert choice(cfg, mb=4, hw=a100, total=524_288).mode == "full"
    assert choice(cfg, mb=1, hw=a100, total=524_288).mode == "none"
    assert choice(cfg, "none", hw=tight).mode == "none" and choice(cfg, "full", hw=roomy).mode == "full"
    # The state alone overflows (gpt2-xl under DDP on a 24 GB card): it cannot help, and auto says so.
    assert (
        choice(cfg, hw=gpu_hardware("RTX4090-24GB", Precision.from_key("bf16")), total=524_288).reason
        == "auto: no micro-batch fits even with it"
    )


def test_plan_cli_shows_it_fitting(capsys):
    from gpt2.plan.__main__ import main

    assert (
        main(
            [
                "--preset",
                "gpt2-xl",
                "--gpu",
                "A100-40GB",
                "--micro-batch-size",
                "4",
                "--activation-checkpointing",
                "none",
            ]
        )
        == 0
    )  # over the reserve only: allowed, says NO
    assert "fits       NO" in capsys.readouterr().out
    assert main(["--preset", "gpt2-xl", "--gpu", "A100-40GB", "--micro-batch-size", "4"]) == 0  # auto
    out = capsys.readouterr().out
    assert "fits       yes" in out and "activations, full AC" in out and "recomputed, not in MFU" in out


def _flags(data_dir, out_dir, *extra):
    return [
        *TINY_MODEL_FLAGS,
        *FP32_CPU,
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--micro-batch-size",
        "4",
        "--total-batch-size",
        "1024",
        "--max-steps",
        "6",
        "--warmup-steps",
        "2",
        "--lr",
        "3e-3",
        "--eval-interval",
        "0",
        "--eval-tokens",
        "1024",
        "--ckpt-interval",
        "0",
        "--log-interval",
        "1",
        *extra,
    ]


@pytest.mark.torch_feature("fsdp")
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.slow
def test_two_ranks_train_the_same_with_and_without_it(tmp_path, shakespeare_shards, parallel):
    """2 gloo ranks, fp32 eager, 2 micro-steps per step (FSDP's no-sync on the first): the same losses with
    --activation-checkpointing full as with none, to the last bit, and the start-up line says so."""
    out = {}
    for mode in ("none", "full"):
        launched = run(
            _flags(shakespeare_shards, tmp_path / mode, "--parallel", parallel, "--activation-checkpointing", mode),
            nproc=2,
            log_dir=tmp_path / f"log_{mode}",
        )
        assert launched.proc.returncode == 0, launched.output()
        out[mode] = launched.stdout
    assert losses(tmp_path / "full") == losses(tmp_path / "none")
    assert "activation checkpointing full: every block recomputed in the backward, +" in out["full"]
    assert "FLOPs recomputed, not in MFU (--activation-checkpointing full)" in out["full"]
    # none changes nothing: a start-up detail, in RUN/train.log (and on the console with --verbose)
    assert "activation checkpointing none" not in out["none"]
    assert (
        "activation checkpointing none (--activation-checkpointing none)"
        in (tmp_path / "none" / "train.log").read_text()
    )


def test_a_run_resumes_across_a_change_of_the_flag(tmp_path, shakespeare_shards, capsys):
    """A run-time knob, not a model change: a checkpoint of a run without it resumes with it (and the
    state dict's names are the same), logged as a changed setting, and the run continues exactly."""
    from _helpers import import_train_ddp

    train = import_train_ddp()
    base = tmp_path / "base"
    assert (
        train.main(
            [
                *tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=2, eval_tokens=256),
                "--out-dir",
                str(base),
                "--activation-checkpointing",
                "none",
            ]
        )
        == 0
    )
    resumed = tmp_path / "resumed"
    capsys.readouterr()
    assert (
        train.main(
            [
                *tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=2, eval_tokens=256),
                "--out-dir",
                str(resumed),
                "--activation-checkpointing",
                "full",
                "--resume",
                str(base / "checkpoints" / "step_00000002.pt"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "resume: activation_checkpointing changed from 'none' to 'full'" in out
    assert "activation checkpointing full: every block recomputed" in out
    assert losses(resumed) == {s: v for s, v in losses(base).items() if s > 2}
