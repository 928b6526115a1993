"""--fp8-head (gpt2/model/fp8.py): the LM head's three matmuls in FP8 with per-tensor scales, training's
loss only. On a CPU the matmuls run in fp32 on the FP8 values (fp8._mm; held here to torch's own CPU `_scaled_mm`
where this torch has it), so the maths is tested here; the speed and the 200-step loss A/B are the GPU's
(bench/fp8_head.py, docs/performance.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _helpers import losses, tiny_run_flags
from conftest import REPO

from gpt2.core.config import ModelConfig, RunConfig, TrainConfig
from gpt2.model import fp8
from gpt2.model.gpt import GPT
from gpt2.plan.hardware import Hardware
from gpt2.plan.loss_choice import choose_loss_impl

pytestmark = pytest.mark.skipif(
    fp8.fp8_problem("cpu") is not None, reason="this torch has no FP8 matmul on a CPU (gpt2/model/fp8.py)"
)
GIB = 2**30


def scaled_mm_problem() -> str | None:
    """Why torch's own CPU `_scaled_mm` cannot run here (None: it can): oneDNN has no FP8 matmul for some CPUs
    (an AVX2-only one: "could not create a primitive descriptor"), where the head runs fp8._mm's fp32 anyway."""
    a, one = torch.zeros(16, 16).to(fp8.E4M3), torch.ones(())
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_the_cpus_fp32_matmul_is_torchs_scaled_mm_in_each_layout_the_head_uses(out_dtype):
    """fp8._mm on a CPU (fp32 on the FP8 values: torch's CPU kernel takes a minute a head matmul on some CPUs)
    against torch._scaled_mm itself, with the operands laid out as the forward and both backward matmuls pass them
    (a row-major, b column-major, as CUDA requires), at shapes small enough for the slow kernel."""
    if (problem := scaled_mm_problem()) is not None:
        pytest.skip(f"torch's CPU _scaled_mm does not run on this CPU ({problem}): nothing to hold fp8._mm to")
    g = torch.Generator().manual_seed(0)
    x, w, grad = torch.randn(32, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(32, 96, generator=g)
    (xq, xs), (wq, ws), (gq, gs) = fp8.to_fp8(x, fp8.E4M3), fp8.to_fp8(w, fp8.E4M3), fp8.to_fp8(grad, fp8.E5M2)
    for a, b, sa, sb in (
        (xq, wq.t(), xs, ws),  # forward: (N, C) @ (C, V)
        (gq, wq.t().contiguous().t(), gs, ws),  # grad_x: (N, V) @ (V, C)
        (gq.t().contiguous(), xq.t().contiguous().t(), gs, xs),  # grad_w: (V, N) @ (N, C)
    ):
        ours = fp8._mm(a, b, sa, sb, out_dtype)
        theirs = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
        assert ours.dtype == theirs.dtype == out_dtype and ours.shape == theirs.shape
        assert rel(ours, theirs) < (1e-6 if out_dtype == torch.float32 else 4e-3), rel(ours, theirs)


def test_fp8_linear_is_the_matmul_to_fp8s_precision_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 32, 64, generator=g, requires_grad=True)
    w = (0.02 * torch.randn(256, 64, generator=g)).requires_grad_()
    up = torch.randn(4, 32, 256, generator=g)  # a gradient from above with a spread of magnitudes
    exact = x @ w.t()
    (exact * up).sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    out = fp8.fp8_linear(x, w, torch.float32)
    (out * up).sum().backward()
    # e4m3 keeps 3 mantissa bits (relative step 2^-4 per element, averaging out over a dot product); the
    # gradient from above goes through e5m2 (2 bits): a few percent either way, far from both exact and wrong
    assert 1e-4 < rel(out, exact) < 0.05
    assert 1e-4 < rel(x.grad, gx) < 0.1 and 1e-4 < rel(w.grad, gw) < 0.1
    assert out.dtype == torch.float32 and w.grad.dtype == torch.float32 and x.grad.shape == x.shape


def test_an_all_zero_operand_gives_zeros_not_nans():
    x = torch.zeros(16, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    out = fp8.fp8_linear(x, w, torch.float32)
    out.sum().backward()
    assert (
        torch.equal(out, torch.zeros(16, 48))
        and torch.isfinite(x.grad).all()
        and torch.equal(w.grad, torch.zeros_like(w))
    )


def tiny(fp8_head: bool) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    return GPT(cfg, loss_impl="full", fp8_head=fp8_head)


def test_training_loss_takes_the_fp8_head_and_evaluation_the_exact_one():
    plain, quant = tiny(False), tiny(True)
    idx = torch.randint(0, 50257, (2, 32))
    tgt = torch.randint(0, 50257, (2, 32))
    _, exact = plain(idx, tgt, return_logits=False)
    _, approx = quant(idx, tgt, return_logits=False)
    assert approx.item() != exact.item() and approx.item() == pytest.approx(exact.item(), abs=0.02)
    approx.backward()
    exact.backward()
    head = quant.lm_head.weight.grad
    assert torch.isfinite(head).all() and rel(head, plain.lm_head.weight.grad) < 0.1
    with torch.no_grad():  # evaluation: the plain head, bit for bit
        assert torch.equal(quant(idx, tgt, return_logits=False)[1], plain(idx, tgt, return_logits=False)[1])
        logits = quant(idx)[0]
        assert torch.isinf(logits[..., 50257:]).all()  # the padded rows never carry probability
    with torch.enable_grad():  # and in training the padded rows still get the -inf bias
        full = quant.head(quant.transformer.ln_f(torch.randn(1, 4, 64)))
        assert torch.isinf(full[..., 50257:]).all() and torch.isfinite(full[..., :50257]).all()


def test_the_fp8_head_needs_the_full_logits_and_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="fp8_head=True computes the full logits: use --loss-impl full or auto"):
        TrainConfig.of(fp8_head=True, loss_impl="chunked")
    with pytest.raises(ValueError, match="fp8_head=True with dtype=float16"):
        TrainConfig.of(fp8_head=True, dtype="float16")
    with pytest.raises(ValueError, match="fp8_head=True with parallel=fsdp is not supported"):
        TrainConfig.of(fp8_head=True, parallel="fsdp")
    with pytest.raises(ValueError, match="needs loss_impl='full'"):
        GPT(ModelConfig(n_layer=1, n_head=1, n_embd=16, block_size=8), loss_impl="chunked", fp8_head=True)


def test_auto_loss_path_is_the_full_one_with_the_fp8_head_and_says_why():
    hw = Hardware(name="cpu-test", memory_bytes=24 * GIB, peak_flops=1e11, device_type="cpu", reserve_bytes=GIB)
    cfg = RunConfig(
        ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64),
        TrainConfig.of(micro_batch_size=4, dtype="float32", compile=False),
    )
    assert choose_loss_impl(cfg, hw).impl == "chunked"  # uncompiled and unmeasured: chunked, without the option
    fp8_cfg = RunConfig(cfg.model, cfg.train.replace(fp8_head=True))
    choice = choose_loss_impl(fp8_cfg, hw)
    assert choice.impl == "full" and choice.reason.startswith("--fp8-head;")


def test_a_gpu_without_fp8_tensor_cores_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    why = fp8.fp8_problem(torch.device("cuda", 0))
    assert why == (
        "--fp8-head needs FP8 tensor cores (compute capability 8.9+: H100, H200, L4, L40); "
        "NVIDIA A100-SXM4-80GB is 8.0: drop --fp8-head"
    )
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fp8.fp8_problem(torch.device("cuda", 0)) is None


@pytest.mark.slow
def test_a_run_with_the_fp8_head_learns_as_the_plain_one(tmp_path, shakespeare_shards):
    """Four steps of the tiny model, eager fp32, with and without --fp8-head: the same start, losses close."""
    got = {}
    # Both take the full-logits loss (tiny_run_flags pins the chunked one): the plain run by name, the FP8 one
    # by --loss-impl auto, whose reason the log must give.
    for name, extra in (("plain", ["--loss-impl", "full"]), ("fp8", ["--fp8-head", "--loss-impl", "auto"])):
        flags = tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=0)
        done = subprocess.run(
            [sys.executable, "train_ddp.py", *flags, *extra, "--out-dir", str(tmp_path / name)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        got[name] = losses(tmp_path / name)
    assert sorted(got["fp8"]) == sorted(got["plain"]) == [1, 2, 3, 4]
    assert got["fp8"] != got["plain"]  # FP8 was used
    assert got["fp8"] == pytest.approx(got["plain"], abs=0.03)
    log = (tmp_path / "fp8" / "train.log").read_text()
    assert "--fp8-head; full-logits peak" in log  # the loss path it took, and why


def test_autotune_reaches_the_blocks_only(monkeypatch):
    from gpt2.train import build as trainer_build

    model = tiny(False)
    seen = []
    for block in model.transformer.h:
        monkeypatch.setattr(block, "compile", lambda **kw: seen.append(kw))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(("head", kw)) or fn)
    trainer_build.compile_sharded(model, autotune=True)
    assert seen == [{"options": {"max_autotune_gemm": True}}] * 2 + [("head", {})]
    assert trainer_build.autotune_options(False) == {}


def test_fp8_bench_verdict_is_the_mean_over_seeds_with_every_seed_shown():
    sys.path.insert(0, str(REPO / "bench"))
    import fp8_head

    row = {"rc": 0, "steps": 200, "train_loss": 2.0, "step_ms": 10.0, "run_s": 30}

    def rows(*pairs):
        out = {}
        for seed, (plain, quant) in enumerate(pairs):
            out[seed, "plain"], out[seed, "fp8"] = {**row, "val_loss": plain}, {**row, "val_loss": quant}
        return out

    # the H200's three seeds (+0.025, -0.007, -0.005): one seed outside 0.02, the mean well inside
    text, ok = fp8_head.report(rows((5.5381, 5.5634), (5.5278, 5.5205), (5.5351, 5.5304)), "cmd", 0.02, [0, 1, 2])
    assert ok and "mean +0.0044, from -0.0073 to +0.0253 (goal: the mean within 0.02): PASS" in text
    assert "| 0 | fp8 | 0 | 200 | 2.0000 | 5.5634 | +0.0253 |" in text
    text, ok = fp8_head.report(rows((2.50, 2.53), (2.50, 2.525)), "cmd", 0.02, [0, 1])
    assert not ok and "mean +0.0275" in text and "FAIL" in text
    text, ok = fp8_head.report(rows((2.50, 2.50), (2.50, None)), "cmd", 0.02, [0, 1])
    assert not ok and "1 of 2 seed(s) measured" in text


def test_shapes_that_scaled_mm_refuses_on_cuda_are_refused_at_start_up_in_one_line():
    """Issue 75: _scaled_mm on CUDA needs n_embd, vocab_size and the micro-step's tokens (the weight gradient's
    inner dimension) to be multiples of 16; the config took any vocab >= 50,257 and the check saw only the
    compute capability, so a run would fail at its first backward on the GPU. Refused before any step, the
    same on every device (a CPU's _scaled_mm does not check: a rehearsal must)."""
    from gpt2.plan.resolve import Target, resolve_choices

    gpt2 = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
    assert fp8.fp8_shape_problem(gpt2, 3) is None  # 3 x 64 tokens
    assert fp8.fp8_shape_problem(gpt2.replace(vocab_size=50257)) == (
        "--fp8-head: torch._scaled_mm needs multiples of 16 in the LM head's matmuls, and vocab_size=50257 is not: "
        "use an --n-embd and a --vocab-size that are multiples of 16 (GPT-2's padded 50304 is), a "
        "--micro-batch-size whose product with --block-size is, or drop --fp8-head"
    )
    odd = ModelConfig(n_layer=2, n_head=2, n_embd=72, block_size=60)
    why = fp8.fp8_shape_problem(odd, 3)
    assert "n_embd=72 and micro_batch_size x block_size = 3 x 60 = 180 tokens are not" in why
    assert fp8.fp8_shape_problem(odd, 4) is not None and fp8.fp8_shape_problem(odd.replace(n_embd=80), 4) is None
    for cfg, mb, what in ((gpt2.replace(vocab_size=50260), 4, "vocab_size=50260"), (odd.replace(n_embd=80), 3, "180")):
        run = RunConfig(cfg, TrainConfig.of(fp8_head=True, micro_batch_size=mb, total_batch_size=mb * cfg.block_size))
        for target in (Target(gpu="H100-80GB"), Target(device=torch.device("cpu"))):
            with pytest.raises(ValueError, match=rf"^--fp8-head: torch._scaled_mm .*{what}[^\n]*$"):
                resolve_choices(run, target)
    fine = RunConfig(gpt2, TrainConfig.of(fp8_head=True, micro_batch_size=3, total_batch_size=3 * 64))
    assert resolve_choices(fine, Target(gpu="H100-80GB")).cfg.train.compute.fp8_head
