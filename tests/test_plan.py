import contextlib
import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch
from _helpers import model_body

from gpt2.core.config import MODEL_PRESETS, ModelConfig, model_preset
from gpt2.core.precision import Precision
from gpt2.model.gpt import GPT
from gpt2.plan.hardware import GIB, Hardware, device_hardware, gpu_hardware
from gpt2.plan.measure import measured_peak_bytes
from gpt2.plan.memory import (
    activation_bytes,
    loss_bytes,
    matmul_weight_count,
    max_micro_batch_size,
    memory,
    run_config,
)
from gpt2.plan.planner import check_fits, plan
from gpt2.plan.report import format_plan

CPU = Hardware(name="cpu-test", memory_bytes=24 * GIB, peak_flops=1e11, device_type="cpu", reserve_bytes=GIB)


def run(cfg, mb=1, *, seq_len=None, chunked_loss=True, compiled=False, activation_checkpointing=False, **train):
    """The RunConfig the planner takes, from the values these tests vary (a shorter seq_len: a model of that
    block size; train: run_config's dtype, world_size and TrainConfig fields such as optimizer, parallel,
    total_batch_size)."""
    cfg = cfg if seq_len is None else cfg.replace(block_size=seq_len)
    if train.get("total_batch_size") is None:
        train.pop("total_batch_size", None)
    prec = Precision.from_key(train.pop("dtype", "bf16"))  # the tests name the planner's keys
    return run_config(
        cfg,
        mb,
        prec=prec,
        loss_impl="chunked" if chunked_loss else "full",
        compile=compiled,
        activation_checkpointing="full" if activation_checkpointing else "none",
        **train,
    )


def planned(cfg, *, micro_batch_size, hardware, world_size=1, tokens=None, mfu=0.4, **kw):
    return plan(
        run(cfg, micro_batch_size, world_size=world_size, **kw), hardware, world_size=world_size, tokens=tokens, mfu=mfu
    )


def mem(cfg, B, T, *, device_type="cuda", device_memory=24 * GIB, world_size=1, accum_steps=1, **kw):
    """memory() of cfg at micro-batch B, T tokens long, on a device of this type and size."""
    hw = Hardware(name="test", memory_bytes=device_memory, peak_flops=None, device_type=device_type)
    return memory(
        run(cfg, B, seq_len=T, world_size=world_size, **kw), hw, world_size=world_size, accum_steps=accum_steps
    )


def largest(cfg, T, hw, *, world_size=1, total_batch_size=None, headroom=1.0, **kw):
    """max_micro_batch_size at T tokens; without a total batch, accumulation assumed at every size."""
    return max_micro_batch_size(
        run(cfg, seq_len=T, world_size=world_size, total_batch_size=total_batch_size, **kw),
        hw,
        world_size=world_size,
        headroom=headroom,
        accumulate=True if total_batch_size is None else None,
    )


@pytest.mark.parametrize("name", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("vocab", [50257, 50304])
def test_param_count_equals_module(name, vocab):
    cfg = model_preset(name, vocab_size=vocab)
    with torch.device("meta"):  # gpt2-xl without allocating 6 GB
        model = GPT(cfg)
    p = planned(cfg, micro_batch_size=1, hardware=gpu_hardware("H200", Precision.from_key("bf16")))
    assert p.n_params == sum(t.numel() for t in model.parameters())  # the module, not the counter again
    if cfg.bias and cfg.tie_embeddings and not cfg.rope:  # GPT-2's layout: the closed form is exact
        assert p.n_params_formula == p.n_params


def test_known_gpt2_numbers():
    p = planned(
        model_preset("gpt2", vocab_size=50257),
        micro_batch_size=1,
        hardware=gpu_hardware("A100-80GB", Precision.from_key("bf16")),
    )
    assert p.n_params == 124_439_808  # "124M"
    assert p.memory.weights == 4 * 124_439_808
    assert p.memory.optimizer == 8 * 124_439_808
    assert p.flops_per_token == pytest.approx(6 * (124_439_808 - 1024 * 768) + 12 * 12 * 768 * 1024)


def _autocast(dtype):
    return torch.autocast("cpu", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


@pytest.mark.parametrize("attn_impl", ["sdpa", "sdpa_mask", "explicit"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_saved_tensor_bytes_match_activation_estimate(attn_impl, dtype, dropout):
    # Term-by-term check: the unique storages autograd saves for backward (parameters excluded),
    # minus the autocast weight copies and the loss's fp32 log-probs, are the activations.
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=64, attn_impl=attn_impl, dropout=dropout)
    model = GPT(cfg)
    B, T = 2, 64
    x, y = torch.randint(0, 50257, (2, B, T))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(dtype):
        model(x, y)
    m = mem(cfg, B, T, dtype=dtype, device_type="cpu")
    log_probs = 4 * B * T * cfg.vocab_size
    assert m.autocast_weights == (2 * matmul_weight_count(cfg) if dtype == "bf16" else 0)
    assert sum(saved.values()) - m.autocast_weights - log_probs == pytest.approx(m.activations, rel=0.05)


@pytest.mark.parametrize("attn_impl,dtype", [("sdpa", "bf16"), ("explicit", "fp32")])
def test_activation_estimate_within_25pct_of_measured_peak(attn_impl, dtype):
    # Forward + backward of the transformer body (no LM head, so the activations are the bulk of
    # the memory rather than the 50k-wide logits). Measured: the allocator's peak above the start,
    # which also holds the backward's transients and the gradients as they appear.
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=4, n_head=4, n_embd=128, block_size=256, attn_impl=attn_impl)
    model = GPT(cfg)
    # The tied embedding's dense 50k-row gradient (counted under "gradients" by the planner) would
    # otherwise be the peak, at the end of backward, for a body this small.
    model.transformer.wte.weight.requires_grad_(False)
    B, T = 4, 256
    idx = torch.randint(0, 50257, (B, T))
    grad = torch.randn(B, T, cfg.n_embd)

    def forward_backward():
        with _autocast(dtype):
            out = model_body(model, idx)
        out.backward(grad)

    forward_backward()  # oneDNN primitives and the like are created once, outside the measurement
    model.zero_grad(set_to_none=True)
    measured = measured_peak_bytes(forward_backward, "cpu")
    s = 2 if dtype == "bf16" else 4
    lm_head_input_and_targets = B * T * (s * cfg.n_embd + 8)  # counted by the planner, absent here
    estimate = (
        activation_bytes(cfg, B, T, prec=Precision.from_key(dtype), device_type="cpu", flash=attn_impl != "explicit")
        - lm_head_input_and_targets
    )
    if dtype == "bf16":
        estimate += 2 * (matmul_weight_count(cfg) - cfg.vocab_size * cfg.n_embd)
    assert estimate == pytest.approx(measured, rel=0.25)


@pytest.mark.parametrize("chunked", [True, False])
def test_total_within_25pct_of_measured_training_step_peak(chunked):
    # A whole step (bf16 autocast forward, loss, backward, AdamW) against the planner's total, for
    # each loss path as training calls it (`model(x, y, return_logits=False)`).
    torch.manual_seed(0)
    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=128)
    model = GPT(cfg, loss_impl="chunked" if chunked else "full")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    B, T = 4, 128
    x, y = torch.randint(0, 50257, (2, B, T))

    def step():
        with _autocast("bf16"):
            _, loss = model(x, y, return_logits=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # creates AdamW's moments, which are then live at the start like the parameters
    already_live = sum(p.numel() * 4 for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
    )
    measured = already_live + measured_peak_bytes(step, "cpu")
    estimate = mem(cfg, B, T, dtype="bf16", device_type="cpu", chunked_loss=chunked).total
    assert estimate == pytest.approx(measured, rel=0.25)


def test_max_micro_batch_size_monotonic_and_tight():
    cfg = model_preset("gpt2")
    sizes = [
        largest(cfg, 1024, gpu_hardware(g, Precision.from_key("bf16"))) for g in ("A100-40GB", "A100-80GB", "H200")
    ]
    assert 0 < sizes[0] < sizes[1] < sizes[2]
    by_len = [largest(cfg, t, gpu_hardware("A100-40GB", Precision.from_key("bf16"))) for t in (256, 512, 1024)]
    assert by_len[0] > by_len[1] > by_len[2]
    explicit = largest(cfg.replace(attn_impl="explicit"), 1024, gpu_hardware("A100-40GB", Precision.from_key("bf16")))
    assert explicit < sizes[0]
    fp32 = largest(cfg, 1024, gpu_hardware("A100-40GB", Precision.from_key("fp32")), dtype="fp32")
    assert fp32 < sizes[0]
    hw = gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    b = sizes[0]
    assert planned(cfg, micro_batch_size=b, hardware=hw).fits
    assert not planned(cfg, micro_batch_size=b + 1, hardware=hw).fits
    assert largest(model_preset("gpt2-xl"), 1024, Hardware(name="tiny", memory_bytes=GIB, peak_flops=1e12)) == 0


def test_check_fits_refuses_with_the_fix():
    cfg = model_preset("gpt2")
    hw = gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    check_fits(planned(cfg, micro_batch_size=16, hardware=hw))  # fits: no error
    p = planned(cfg, micro_batch_size=128, hardware=hw, total_batch_size=524288)
    assert p.memory.total > hw.memory_bytes
    with pytest.raises(ValueError, match=rf"--micro-batch-size {p.max_micro_batch_size} or less"):
        check_fits(p)


def test_batch_and_time_arithmetic():
    hw = gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    assert hw.peak_flops == 312e12
    p = planned(
        model_preset("gpt2"),
        micro_batch_size=16,
        hardware=hw,
        world_size=8,
        total_batch_size=524288,
        tokens=10 * 10**9,
        mfu=0.5,
    )
    assert p.tokens_per_micro_step == 16 * 1024 * 8
    assert p.grad_accum_steps == 4
    tokens_per_s = 8 * 312e12 * 0.5 / p.flops_per_token
    assert p.step_time_s == pytest.approx(524288 / tokens_per_s)
    assert p.hours == pytest.approx(1e10 / tokens_per_s / 3600)
    # gradient_as_bucket_view=True: DDP's buckets are the gradients, so 8 ranks cost each device
    # no more than 1 does
    one = planned(model_preset("gpt2"), micro_batch_size=16, hardware=hw, total_batch_size=524288)
    assert p.memory == one.memory
    m = p.memory
    assert m.static == m.weights + m.autocast_weights + m.gradients + m.optimizer
    text = format_plan(p)
    assert "4 accumulation step(s)" in text and "fits       yes" in text and "DDP" not in text


def test_plan_without_a_peak_leaves_the_time_estimates_out():
    """An unlisted GPU has no data-sheet peak (gpt2.plan.flops.device_peak_flops gives None)."""
    a100 = gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    hw = Hardware(name="NVIDIA Future GPU", memory_bytes=a100.memory_bytes, peak_flops=None)
    p = planned(
        model_preset("gpt2"), micro_batch_size=16, hardware=hw, world_size=8, total_batch_size=524288, tokens=10 * 10**9
    )
    assert p.tokens_per_s is None and p.step_time_s is None and p.hours is None
    assert (
        p.memory
        == planned(
            model_preset("gpt2"), micro_batch_size=16, hardware=a100, world_size=8, total_batch_size=524288
        ).memory
    )
    text = format_plan(p)
    assert "no data-sheet peak" in text and "no time estimate" in text and "budget" not in text


def test_plan_rejects_bad_input_with_every_problem():
    # The trainer's own check and text (schedule.grad_accum_steps), with the sizes that would divide.
    with pytest.raises(
        ValueError, match=r"total_batch_size=500000 is not a multiple.*--total-batch-size 393216 or 524288"
    ):
        planned(model_preset("gpt2"), micro_batch_size=16, hardware=CPU, world_size=8, total_batch_size=500000)
    with pytest.raises(ValueError) as e:
        plan(run_config(model_preset("gpt2"), "auto", total_batch_size=524288), CPU, world_size=0, mfu=40, tokens=0)
    assert all(s in str(e.value) for s in ("micro_batch_size='auto'", "world_size=0", "mfu=40", "tokens=0"))
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_hardware("T4", Precision.from_key("bf16"))


def test_cli_runs():
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt2.plan",
            "--preset",
            "gpt2",
            "--micro-batch-size",
            "16",
            "--world-size",
            "8",
            "--gpu",
            "A100-40GB",
            "--total-batch-size",
            "524288",
            "--tokens",
            "10e9",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert "124,475,904" in ok.stdout and "4 accumulation step(s)" in ok.stdout and "h (" in ok.stdout
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpt2.plan",
            "--preset",
            "gpt2",
            "--micro-batch-size",
            "64",
            "--gpu-memory-gb",
            "12",
            "--gpu-peak-tflops",
            "100",
            "--activation-checkpointing",
            "none",
        ],  # auto would recompute to fit it
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1
    assert "fits       NO" in bad.stdout and "--micro-batch-size" in bad.stderr
    # By default the training preset's run: its 524,288-token batch and budget, micro-batch auto
    preset = subprocess.run(
        [sys.executable, "-m", "gpt2.plan", "--preset", "gpt2", "--gpu", "A100-40GB", "--world-size", "32"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert preset.returncode == 0, preset.stderr
    assert (
        "micro_batch_size=16 x seq_len=1024 x world_size=32 = 524,288 tokens/micro-step; "
        "total_batch_size=524,288 -> 1 accumulation step(s)"
    ) in preset.stdout
    assert "micro-batch auto: 16 sequences, the fastest by the throughput model" in preset.stdout  # as a start says
    assert "budget     10.00B tokens: 19,073 steps" in preset.stdout


def test_trainer_helpers():
    hw = device_hardware("cpu", 1e11, processes_per_host=2)
    assert hw.device_type == "cpu" and 0 < hw.memory_bytes < 2**50
    assert device_hardware("cpu", 1e11).memory_bytes == pytest.approx(2 * hw.memory_bytes, abs=1)
    cfg = model_preset("gpt2")
    a100 = gpu_hardware("A100-80GB", Precision.from_key("bf16")).memory_bytes
    assert mem(cfg, 4, 1024, dtype="fp16", device_memory=a100) == mem(cfg, 4, 1024, dtype="bf16", device_memory=a100)
    assert mem(cfg, 4, 1024, dtype="tf32", device_memory=a100) == mem(cfg, 4, 1024, dtype="fp32", device_memory=a100)
    assert gpu_hardware("H100-80GB", Precision.from_key("fp16")).peak_flops == 989e12
    assert gpu_hardware("A100-80GB", Precision.from_key("tf32")).peak_flops == 156e12


def test_loss_bytes_counts_the_chunk_the_model_uses(monkeypatch):
    """The planner's LM head + loss term holds the rows of one chunk of the model's own loss."""
    import gpt2.model.loss

    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=512)  # vocab 50304
    V, h, tokens = cfg.vocab_size, cfg.n_embd, 2 * 512
    seen = []
    real = gpt2.model.loss._cross_entropy_chunks
    monkeypatch.setattr(
        gpt2.model.loss, "_cross_entropy_chunks", lambda *a, **kw: seen.append(a[5]) or real(*a, **kw)
    )  # a[5]: rows per chunk
    model = GPT(cfg)
    model(torch.zeros(2, 512, dtype=torch.long), torch.zeros(2, 512, dtype=torch.long), return_logits=False)
    rows = seen[0]
    assert 0 < rows < tokens  # in several chunks
    # its fp32 logits and logsumexp's exp, the fp32 (V, h) part and its sum, grad_x (the backward's is smaller)
    assert (
        loss_bytes(cfg, tokens, prec=Precision.from_key("fp32"), device_type="cpu")
        == rows * V * 8 + V * h * 8 + tokens * h * 4
    )


def test_cuda_loss_bytes_follow_the_devices_memory():
    from gpt2.model.loss import loss_chunk_logits, loss_chunks

    cfg, tokens = model_preset("gpt2"), 64 * 1024
    V, h = cfg.vocab_size, cfg.n_embd
    for gpu, chunk_rows in (("A100-80GB", 6554), ("A100-40GB", 3277)):
        hw = gpu_hardware(gpu, Precision.from_key("bf16"))
        assert loss_chunks(tokens, loss_chunk_logits("cuda", hw.memory_bytes) // V)[1] == chunk_rows
        expected = chunk_rows * V * 10 + V * h * 6 + tokens * h * 4  # + the bf16 twin; the part in bf16
        assert loss_bytes(cfg, tokens, device_memory=hw.memory_bytes) == expected
        assert planned(cfg, micro_batch_size=64, hardware=hw).memory.logits == expected
    with pytest.raises(ValueError, match="device_memory"):
        loss_bytes(cfg, tokens)  # on cuda the chunk depends on the device: no silent guess
    assert loss_bytes(cfg, tokens, chunked=False) == tokens * V * 12  # the plain loss has no chunks


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_autocast_copies_line_names_the_plans_dtype(dtype):
    """`python -m gpt2.plan --dtype fp16` once printed "autocast bf16 copies"."""
    text = format_plan(
        planned(
            model_preset("gpt2"),
            micro_batch_size=4,
            hardware=gpu_hardware("A100-80GB", Precision.from_key(dtype)),
            dtype=dtype,
        )
    )
    other = {"bf16": "fp16", "fp16": "bf16"}[dtype]
    assert f"autocast {dtype} copies" in text and f"autocast {other}" not in text
    assert "autocast" not in format_plan(
        planned(
            model_preset("gpt2"),
            micro_batch_size=4,
            dtype="fp32",
            hardware=gpu_hardware("A100-80GB", Precision.from_key("fp32")),
        )
    )


def test_measuring_cpu_memory_leaves_no_profiler_lines_on_stderr():
    """kineto printed "USDT: ... profiler_start/profiler_stop" under bench/ladder.py and bench/lm_head_loss.py."""
    code = (
        "import os, torch\nfrom gpt2.plan.measure import measured_peak_bytes\n"
        "print(measured_peak_bytes(lambda: torch.ones(256, 256) @ torch.ones(256, 256), 'cpu'))\n"
        "print(measured_peak_bytes(lambda: torch.ones(64, 64) @ torch.ones(64, 64), 'cpu'))\n"
        "print('KINETO_LOG_LEVEL' in os.environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    first, second, left = run.stdout.split()
    assert int(first) >= 256 * 256 * 4 and int(second) >= 64 * 64 * 4 and left == "False"  # env restored
    assert "USDT" not in run.stderr and "profiler_st" not in run.stderr, run.stderr


# ---- the loss path: choose_loss_impl (--loss-impl auto|chunked|full) ----

W1 = ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256)  # issue 23's workload, micro-batch 8, fp32


def _cpu(gib: float) -> Hardware:
    return Hardware(
        name=f"cpu-{gib:g}", memory_bytes=int(gib * GIB), peak_flops=1e11, device_type="cpu", reserve_bytes=GIB
    )


def _choose(requested, hw, mb=8, cfg=W1, dtype="fp32", compiled=True, measure_eager=None):
    from gpt2.plan.loss_choice import choose_loss_impl

    return choose_loss_impl(
        run_config(cfg, mb, prec=Precision.from_key(dtype), loss_impl=requested, compile=compiled),
        hw,
        measure_eager=measure_eager,
    )


def test_auto_loss_impl_takes_full_logits_on_a_big_device_and_chunks_on_a_small_one():
    from gpt2.plan.loss_choice import FULL_LOSS_MEMORY_SHARE

    assert loss_bytes(W1, 8 * 256, prec=Precision.from_key("fp32"), chunked=False) == 8 * 256 * 50304 * 12  # eager: the
    # log-probs and two gradients, fp32; compiled on a CPU: the logits, their gradient written over them
    peak = loss_bytes(W1, 8 * 256, prec=Precision.from_key("fp32"), chunked=False, compiled=True, device_type="cpu")
    assert peak == 8 * 256 * 50304 * 4
    big = _choose("auto", _cpu(24))  # this workload on a 24 GiB host: 0.38 GiB is 1.7% of 23 GiB usable
    assert big.impl == "full" and "auto: full-logits peak 0.38 GiB at micro-batch 8 <= 1/8 of 23.00 GiB" in big.reason
    small = _choose("auto", _cpu(3))  # 2 GiB usable: 0.38 GiB is more than 1/8
    assert small.impl == "chunked" and "> 1/8 of 2.00 GiB usable" in small.reason
    eager = _choose("auto", _cpu(24), compiled=False)  # uncompiled and nothing measured: the chunked loss
    assert eager.impl == "chunked" and "auto: uncompiled and not measured on cpu-24" in eager.reason
    assert _choose("full", _cpu(24), compiled=False).impl == "full"  # an explicit choice holds either way
    # The share is the boundary, to the byte: usable = 8 x peak takes the full loss, a byte less does not.
    edge = Hardware(
        name="edge",
        memory_bytes=FULL_LOSS_MEMORY_SHARE * peak + GIB,
        peak_flops=None,
        device_type="cpu",
        reserve_bytes=GIB,
    )
    assert _choose("auto", edge).impl == "full"
    assert (
        _choose("auto", dataclasses.replace(edge, memory_bytes=edge.memory_bytes - FULL_LOSS_MEMORY_SHARE)).impl
        == "chunked"
    )


def test_uncompiled_auto_takes_the_full_loss_only_where_it_fits_and_measured_clearly_faster():
    """gpt2/plan/loss_probe.py's times decide an uncompiled run, with FULL_MARGIN against noise; the probe is
    not even asked where the full logits do not fit, and an explicit choice never asks it."""
    from gpt2.plan.loss_probe import FULL_MARGIN, EagerLossTimes

    asked = []

    def times(full_s, chunked_s):
        return lambda: asked.append(1) or EagerLossTimes(full_s, chunked_s, "/cache/x.json")

    faster = _choose("auto", _cpu(24), compiled=False, measure_eager=times(1.2, 1.4))
    assert (
        faster.impl == "full"
        and "fits; uncompiled, measured at this shape: full 1,200 ms vs "
        "chunked 1,400 ms per micro-step's LM head + loss (cached in /cache/x.json)"
        in faster.reason
    )
    near = _choose("auto", _cpu(24), compiled=False, measure_eager=times(FULL_MARGIN * 1.4 + 1e-6, 1.4))
    assert near.impl == "chunked" and "uncompiled, measured at this shape" in near.reason  # within the margin: chunked
    slower = _choose("auto", _cpu(24), compiled=False, measure_eager=times(0.4, 0.3))
    assert slower.impl == "chunked" and "full 400 ms vs chunked 300 ms" in slower.reason
    assert len(asked) == 3
    small = _choose("auto", _cpu(8), compiled=False, measure_eager=times(0.1, 1.0))  # does not fit 1/8
    assert small.impl == "chunked" and "> 1/8" in small.reason
    assert _choose("chunked", _cpu(24), compiled=False, measure_eager=times(0.1, 1.0)).impl == "chunked"
    assert _choose("auto", _cpu(24), measure_eager=times(2.0, 1.0)).impl == "full"  # compiled: not asked
    assert len(asked) == 3


def test_auto_loss_impl_chunks_when_the_full_logits_are_within_the_share_but_the_plan_with_them_does_not_fit():
    from gpt2.plan.loss_choice import FULL_LOSS_MEMORY_SHARE

    cfg = model_preset("gpt2-xl")  # ~23 GiB of weights, gradients and AdamW: the logits are a small part
    chunked = mem(cfg, 2, 1024, dtype="bf16", device_type="cpu", chunked_loss=True)
    hw = Hardware(
        name="tight", memory_bytes=chunked.total + GIB, peak_flops=None, device_type="cpu", reserve_bytes=GIB
    )  # fits exactly with the chunked loss
    full_peak = loss_bytes(cfg, 2 * 1024, prec=Precision.from_key("bf16"), chunked=False)
    assert chunked.logits < full_peak <= chunked.total // FULL_LOSS_MEMORY_SHARE
    choice = _choose("auto", hw, mb=2, cfg=cfg, dtype="bf16", compiled=False)  # eager's peak, full_peak
    assert choice.impl == "chunked" and "is within 1/8" in choice.reason and "does not fit" in choice.reason


def test_explicit_loss_impl_overrides_and_a_full_that_cannot_fit_is_refused():
    assert _choose("chunked", _cpu(24)) == type(_choose("chunked", _cpu(24)))("chunked", "--loss-impl chunked")
    # uncompiled: eager's full-logits peak, 1.15 GiB
    forced = _choose("full", _cpu(8), compiled=False)  # over the share, but the device holds it: taken, and said so
    assert forced.impl == "full" and "--loss-impl full" in forced.reason and "above the 1/8 share" in forced.reason
    assert (
        _choose("full", _cpu(24), compiled=False).reason
        == "--loss-impl full; full-logits peak 1.15 GiB at micro-batch 8"
    )
    # As check_fits refuses an explicit micro-batch: an error only above the device's whole memory.
    with pytest.raises(
        ValueError,
        match=r"--loss-impl full: the plan with the full-logits peak 1.15 GiB at "
        r"micro-batch 8 needs 1.89 GiB per device but cpu-1.5 has 1.50 GiB; use "
        r"--loss-impl chunked \(or auto\), or a smaller --micro-batch-size",
    ):
        _choose("full", _cpu(1.5), compiled=False)
    assert _choose("full", _cpu(1.5)).impl == "full"  # compiled, the same plan holds 0.77 GiB less: it fits
    with pytest.raises(ValueError, match=r"loss_impl='fused' must be one of \('auto', 'chunked', 'full'\)"):
        _choose("fused", _cpu(24))  # the TrainConfig refuses it: choose_loss_impl never sees it


def test_a_compiled_gpu_run_takes_the_fused_full_loss_where_eagers_peak_would_have_chunked_it():
    """The gpt2 preset at micro-batch 16 x 1024 under bf16 on an 80 GB GPU (nanoGPT's setting: one fused
    cross-entropy): compiled it holds 4 bytes per logit (3.1 GiB, within 1/8 of the usable memory) and takes
    the full loss; eager's 14 bytes (10.7 GiB) is over the share and chunks, as every compiled run at
    micro-batch >= 16 did when the planner counted eager's peak for compiled code (then 14 bytes; 12 since
    issue 41, 9.2 GiB: within the share, but uncompiled and unmeasured it stays chunked)."""
    gpt2, a100 = model_preset("gpt2"), gpu_hardware("A100-80GB", Precision.from_key("bf16"))
    compiled = _choose("auto", a100, mb=16, cfg=gpt2, dtype="bf16")
    assert compiled.impl == "full" and "auto: full-logits peak 3.07 GiB at micro-batch 16 <= 1/8" in compiled.reason
    assert _choose("auto", a100, mb=16, cfg=gpt2, dtype="bf16", compiled=False).impl == "chunked"
    assert (
        loss_bytes(gpt2, 16 * 1024, prec=Precision.from_key("bf16"), chunked=False, compiled=True)
        == 16 * 1024 * 50304 * 4
    )
    assert _choose("auto", a100, mb=64, cfg=gpt2, dtype="bf16").impl == "chunked"  # 12.3 GiB: over the share


def test_the_compiled_full_loss_holds_at_most_what_the_planner_counts_per_logit():
    """bench/compiled_loss_memory.py on this CPU (inductor's C++ kernels, fp32): the compiled loss's peak per
    logit, gradients of x and W aside, is within COMPILED_FULL_LOSS_BYTES["cpu"] x 4 bytes, and well under eager's."""
    import importlib.util

    from conftest import REPO

    from gpt2.plan.memory import COMPILED_FULL_LOSS_BYTES

    spec = importlib.util.spec_from_file_location("clm", REPO / "bench" / "compiled_loss_memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch._dynamo.reset()
    compiled = bench.peak_per_logit(torch.compile(bench.head_and_loss), torch.device("cpu"), "fp32", 256, 50304, 32)
    eager = bench.peak_per_logit(bench.head_and_loss, torch.device("cpu"), "fp32", 256, 50304, 32)
    assert compiled <= COMPILED_FULL_LOSS_BYTES["cpu"] * 4 + 0.25 and compiled < eager - 4, (compiled, eager)


def test_the_plan_counts_the_chosen_loss_path_and_the_micro_batch_comes_first():
    from gpt2.core.config import RunConfig, TrainConfig
    from gpt2.plan.resolve import Target, resolve_choices

    def plan_run(cfg, hw):  # the plan of a run on hw, its choices made
        return resolve_choices(cfg, Target(hardware=hw)).plan

    def run(cfg, hw, **train):
        return plan_run(RunConfig(cfg, TrainConfig.of(dtype="float32", **train)), hw)

    full = run(W1, _cpu(24), micro_batch_size=8, total_batch_size=2048)  # compiled (TrainConfig's default)
    assert not full.memory.chunked_loss
    assert full.memory.logits == loss_bytes(
        W1, 2048, prec=Precision.from_key("fp32"), chunked=False, compiled=True, device_type="cpu"
    )
    assert "LM head + loss peak    0.38 GiB  (full logits: all B*T*V at once" in format_plan(full)
    eager = run(W1, _cpu(24), micro_batch_size=8, total_batch_size=2048, compile=False, loss_impl="full")
    assert eager.memory.logits == loss_bytes(W1, 2048, prec=Precision.from_key("fp32"), chunked=False)
    chunked = run(W1, _cpu(24), micro_batch_size=8, total_batch_size=2048, loss_impl="chunked")
    assert chunked.memory.chunked_loss and "(chunked: never all B*T*V logits at once)" in format_plan(chunked)
    assert chunked.memory.total < full.memory.total
    # --micro-batch-size auto: the throughput model's, the same whatever --loss-impl says (it weighs auto's
    # loss at each size); on an A100-80GB that is 16 sequences, where auto takes the fused full loss.
    gpt2, a100 = model_preset("gpt2"), gpu_hardware("A100-80GB", Precision.from_key("bf16"))
    auto = plan_run(RunConfig(gpt2, TrainConfig.of(dtype="bfloat16")), a100)
    forced = plan_run(RunConfig(gpt2, TrainConfig.of(dtype="bfloat16", loss_impl="chunked")), a100)
    assert auto.micro_batch_size == forced.micro_batch_size == 16
    assert not auto.memory.chunked_loss and forced.memory.chunked_loss


@pytest.mark.parametrize("shape", [{}, dict(n_kv_head=2), dict(bias=False, n_kv_head=1)])
def test_weight_counts_are_the_modules(shape):
    """The planner's matmul weights (autocast copies) and Muon's block matrices, derived from
    config.weight_shapes, equal what the module and gpt2/train/optim.py hold, for any head layout."""
    from gpt2.plan.memory import block_matrix_count, optimizer_bytes
    from gpt2.train.optim import is_muon_param

    cfg = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=16, **shape)
    params = dict(GPT(cfg).named_parameters())
    matmul = sum(p.numel() for n, p in params.items() if p.dim() == 2 and n != "transformer.wpe.weight")
    muon = sum(p.numel() for n, p in params.items() if is_muon_param(n, p))
    assert matmul_weight_count(cfg) == matmul and block_matrix_count(cfg) == muon
    n = sum(p.numel() for p in params.values())
    assert optimizer_bytes(cfg, "muon") == 8 * (n - muon) + 4 * muon and optimizer_bytes(cfg) == 8 * n


def test_plan_accumulation_is_the_schedules():
    """One batch-divisibility rule: Plan.grad_accum_steps is schedule.grad_accum_steps."""
    from gpt2.core.schedule import grad_accum_steps

    p = planned(model_preset("debug"), micro_batch_size=2, hardware=CPU, world_size=2, total_batch_size=2048)
    assert p.grad_accum_steps == grad_accum_steps(2048, 2, 128, 2) == 4


# ---- --parallel fsdp: the sharded memory ---------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "gpt2-xl"])
@pytest.mark.parametrize("world", [2, 3, 8, 64])
def test_fsdp_state_per_rank_is_the_padded_shard(name, world):
    """Weights, gradients and AdamW's moments per rank: 1/W of DDP's, plus at most one padding row per
    parameter (FSDP2 pads dim 0 to a multiple of W); the rows are torch.chunk's largest chunk."""
    from gpt2.core.config import weight_shapes
    from gpt2.plan.memory import shard_rows

    cfg = model_preset(name)
    shapes = weight_shapes(cfg).values()
    for rows in {s[0] for s in shapes}:
        assert shard_rows(rows, world) == max(len(c) for c in torch.arange(rows).chunk(world))
    kw = dict(world_size=world, device_memory=24 * GIB)
    ddp = mem(cfg, 1, 1024, **kw)
    fsdp = mem(cfg, 1, 1024, **kw, parallel="fsdp")
    one_row_each = sum(math.prod(s[1:]) for s in shapes)  # the most padding can add per rank
    for term, per_element in (("weights", 4), ("gradients", 4), ("optimizer", 8)):
        full, shard = getattr(ddp, term), getattr(fsdp, term)
        assert full / world <= shard <= full / world + per_element * one_row_each, term
    assert fsdp.shards == world and ddp.shards == 1
    assert (fsdp.activations, fsdp.logits) == (ddp.activations, ddp.logits)  # activations as under DDP
    assert fsdp.autocast_weights == 0 < ddp.autocast_weights  # CUDA's policy gathers bf16 weights: no copies
    # in flight: the root unit (the tied wte/LM head, wpe, ln_f) and two blocks, in bf16
    h, V = cfg.n_embd, cfg.vocab_size
    root = (
        world * shard_rows(V, world) * h
        + world * shard_rows(cfg.block_size, world) * h
        + 2 * world * shard_rows(h, world)
    )
    block = world * sum(
        shard_rows(rows, world) * cols
        for rows, cols in ((3 * h, h), (3 * h, 1), (h, h), (h, 1), (4 * h, h), (4 * h, 1), (h, 4 * h), (h, 1))
    ) + 4 * world * shard_rows(h, world)  # c_attn, c_proj, c_fc, mlp.c_proj (weight, bias); ln_1, ln_2
    assert block >= 12 * h * h + 13 * h
    assert fsdp.gathered == 2 * (root + 2 * block)
    muon = mem(cfg, 1, 1024, **kw, parallel="fsdp", optimizer="muon")
    assert ddp.optimizer / 2 / world < muon.optimizer < fsdp.optimizer


def test_fsdp_at_world_size_1_is_ddp():
    """No process group, no sharding: the trainer runs the plain model, and the plan is DDP's to the byte."""
    cfg = model_preset("gpt2")
    for dtype in ("bf16", "fp32"):
        kw = dict(dtype=dtype, device_memory=40 * GIB)
        assert mem(cfg, 4, 1024, **kw, parallel="fsdp", accum_steps=8) == mem(cfg, 4, 1024, **kw)
    text = format_plan(
        planned(
            cfg, micro_batch_size=4, hardware=gpu_hardware("A100-40GB", Precision.from_key("bf16")), parallel="fsdp"
        )
    )
    assert "fsdp at world size 1: nothing to shard" in text and "gathered" not in text


def test_gpt2_xl_on_8_24gb_cards_fits_with_fsdp_and_not_with_ddp():
    from gpt2.core.config import TRAIN_PRESETS, RunConfig, TrainConfig
    from gpt2.plan.resolve import Target, resolve_choices

    hw = gpu_hardware("RTX4090-24GB", Precision.from_key("bf16"))
    train = dict(TRAIN_PRESETS["gpt2-xl"], data_dir="d", out_dir="o", dtype="bfloat16")
    with pytest.raises(
        ValueError,
        match=r"gpt2-xl does not fit on RTX4090-24GB .* with DDP at world size 8.*"
        r"--parallel fsdp \(state sharded over the 8 ranks",
    ):
        resolve_choices(RunConfig(model_preset("gpt2-xl"), TrainConfig.of(**train)), Target(hardware=hw, world_size=8))
    p = resolve_choices(
        RunConfig(model_preset("gpt2-xl"), TrainConfig.of(**train, parallel="fsdp")), Target(hardware=hw, world_size=8)
    ).plan
    assert p.fits and p.micro_batch_size >= 1 and p.grad_accum_steps > 1
    state = p.memory.weights + p.memory.gradients + p.memory.optimizer
    assert state < 3.0 * GIB  # issue 25: 23.2 GiB of state -> 2.9 GiB per rank over 8
    text = format_plan(p)
    assert "FSDP over 8 ranks" in text and "1/8 shard" in text and "no-sync gradients" in text
    assert "accumulate FSDP no-sync (counted)" in text and "fits as counted" in text


def test_no_sync_accumulation_is_counted_and_the_reduce_scatter_choice_reported():
    """Accumulating under FSDP's no-sync keeps the whole model's unsharded fp32 gradients; a plan that
    only fits with a reduce-scatter per micro-step says so; without accumulation there is nothing kept."""
    from gpt2.core.config import weight_shapes
    from gpt2.plan.memory import gathered_elements

    cfg = model_preset("gpt2-xl")
    a100 = gpu_hardware("A100-40GB", Precision.from_key("bf16"))
    once = planned(cfg, micro_batch_size=8, hardware=a100, world_size=8, parallel="fsdp", total_batch_size=8 * 1024 * 8)
    accum = planned(
        cfg, micro_batch_size=8, hardware=a100, world_size=8, parallel="fsdp", total_batch_size=4 * 8 * 1024 * 8
    )
    assert once.memory.accum_gradients == 0 and once.rs_total == once.memory.total
    assert accum.memory.accum_gradients == 4 * gathered_elements(weight_shapes(cfg).values(), 8)
    assert accum.memory.total - once.memory.total == accum.memory.accum_gradients
    # a device between the two totals: fits only with a reduce-scatter per micro-step
    mid = Hardware(
        name="mid", memory_bytes=(accum.rs_total + accum.memory.total) // 2 + a100.reserve_bytes, peak_flops=None
    )
    p = planned(cfg, micro_batch_size=8, hardware=mid, world_size=8, parallel="fsdp", total_batch_size=4 * 8 * 1024 * 8)
    assert not p.fits and p.rs_total <= p.usable_bytes
    assert "does NOT fit with no-sync but WOULD with a reduce-scatter per micro-step" in format_plan(p)
    # the largest micro-batch: the one without accumulation counts no no-sync gradients
    big = Hardware(name="big", memory_bytes=once.memory.total + a100.reserve_bytes, peak_flops=None)
    assert largest(cfg, 1024, big, world_size=8, parallel="fsdp", total_batch_size=8 * 1024 * 8) == 8
    assert largest(cfg, 1024, big, world_size=8, parallel="fsdp") < 8  # accumulation assumed
    # short sequences: the no-sync gradients outweigh half the micro-batch's activations, so an explicit
    # micro-batch of 4 (two micro-steps) does not fit where 8 (one) does, and the fix says so
    short = dict(seq_len=128, world_size=8, parallel="fsdp", total_batch_size=8 * 128 * 8)
    whole = planned(cfg, micro_batch_size=8, hardware=a100, **short)
    tight = Hardware(name="tight", memory_bytes=whole.memory.total + a100.reserve_bytes, peak_flops=None)
    half = planned(cfg, micro_batch_size=4, hardware=tight, **short)
    assert half.memory.total > tight.memory_bytes and half.max_micro_batch_size == 8
    with pytest.raises(ValueError, match=r"use --micro-batch-size 8 \(one micro-step: no unsharded gradients kept\)"):
        check_fits(half)


def test_plan_cli_says_in_its_first_line_which_gpu_and_that_the_default_is_not_this_machine(capsys):
    """Without --gpu the plan is for an A100-80GB while train_ddp.py --dry-run rehearses on this machine:
    the first line says so, and how to plan for another; with --gpu it names the choice."""
    from gpt2.plan.__main__ import main

    assert main(["--preset", "gpt2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(
        "plan for   1 x A100-80GB, the default --gpu, not this machine's device (--gpu NAME "
        "plans for another: A100-40GB, A100-80GB, H100-80GB"
    ), first
    assert "train_ddp.py --dry-run rehearses on this machine" in first
    assert main(["--preset", "gpt2", "--gpu", "H100-80GB", "--world-size", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "plan for   8 x H100-80GB (--gpu)"
    assert main(["--preset", "gpt2", "--gpu-memory-gb", "24", "--gpu-peak-tflops", "100"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "plan for   1 x custom (--gpu-memory-gb)"


def test_plan_cli_takes_the_training_spellings_the_presets_own_micro_batch_and_a_cpu(capsys):
    """python -m gpt2.plan spelled --dtype bf16 where train_ddp.py spells bfloat16, assumed an auto micro-batch
    (16) for the debug preset, which fixes 8, and had no CPU target. Now it takes train_ddp.py's spellings
    (the short ones stay as aliases), each preset's own micro-batch and optimizer, and --device cpu."""
    from gpt2.plan.__main__ import main

    def plan(*argv: str) -> list[str]:
        assert main(list(argv)) == 0
        return capsys.readouterr().out.splitlines()

    for long, short in (("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32")):
        assert plan("--preset", "gpt2", "--dtype", long) == plan("--preset", "gpt2", "--dtype", short)
    assert (
        plan("--preset", "gpt2", "--dtype", "auto")
        == plan("--preset", "gpt2")
        == plan("--preset", "gpt2", "--dtype", "bf16")
    )
    assert "peak 19.5 TFLOP/s (fp32)" in "\n".join(plan("--dtype", "float32"))  # float32 without TF32, as fp32 was
    debug = plan("--preset", "debug")
    assert not any(line.startswith("micro-batch auto") for line in debug)
    assert "batch      micro_batch_size=8 x seq_len=128 x world_size=1 = 1,024 tokens/micro-step" in "\n".join(debug)
    assert plan("--preset", "debug", "--micro-batch-size", "auto")[1].startswith("micro-batch auto: ")
    assert any(line.startswith("  optimizer (Muon+AdamW)") for line in plan("--preset", "speed"))
    cpu = plan("--preset", "debug", "--device", "cpu")
    assert cpu[0] == "plan for   1 x cpu (--device cpu: this machine's, measured)", cpu[0]
    assert any(line.startswith("hardware   1 x cpu: ") for line in cpu) and "MemAvailable" in "\n".join(cpu)
    assert main(["--device", "cpu", "--gpu", "H200"]) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --device cpu plans for this machine's CPU; --gpu/--gpu-memory-gb/--gpu-peak-tflops plan for a GPU: "
        "drop one"
    )


def test_plan_cli_parallel_fsdp(capsys):
    from gpt2.plan.__main__ import main

    argv = ["--preset", "gpt2-xl", "--gpu", "RTX4090-24GB", "--world-size", "8"]
    assert main(argv) == 2
    assert "--parallel fsdp" in capsys.readouterr().err
    assert main([*argv, "--parallel", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "FSDP over 8 ranks" in out and "fits       yes" in out
    with pytest.raises(SystemExit):
        main([*argv, "--parallel", "zero3"])


def test_docs_training_holds_the_planners_doc_attention_and_fp8_rows_at_every_gpt2_size():
    """Issue 75: the planner's rows for --doc-attention and --fp8-head at gpt2..gpt2-xl on an H100 are in
    docs/training.md, as python -m gpt2.plan gives them now (a change to the plan changes the table)."""
    from conftest import REPO

    from gpt2.plan.__main__ import build_parser, plan_from_args
    from gpt2.plan.hardware import gib

    text = (REPO / "docs" / "training.md").read_text()
    variants = [[], ["--doc-attention"], ["--doc-attention", "--compile", "false"], ["--fp8-head"]]
    variants.append(["--fp8-head", "--compile", "false"])
    for preset in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"):
        for variant in variants:
            p = plan_from_args(build_parser().parse_args(["--preset", preset, "--gpu", "H100-80GB", *variant]))
            m = p.memory
            row = (
                f"| {preset} | {' '.join(variant) or '(defaults)'} | {p.micro_batch_size} x {p.grad_accum_steps} "
                f"| {'chunked' if m.chunked_loss else 'full'} | {'full' if m.checkpointed else 'none'} "
                f"| {gib(m.activations)} | {gib(m.logits)} | {gib(m.total)} | {p.max_micro_batch_size} |"
            )
            assert row in text, row


@pytest.mark.parametrize("preset", ["speedrun", "gpt2-speedrun"])
def test_a_presets_architecture_is_planned_unless_arch_overrides_it(preset):
    """`python -m gpt2.plan --preset gpt2-speedrun` planned GPT-2's architecture (124.48M, tied) where train_ddp.py
    trains the modern one (162.2M untied at 124M's shape): --arch's default laid gpt2's options over the preset's."""
    from gpt2.core.config import param_count
    from gpt2.plan.__main__ import build_parser, plan_from_args
    from gpt2.train.cli import parse_config

    trained = parse_config(["--preset", preset, "--data-dir", "D", "--out-dir", "O"]).model
    planned = plan_from_args(build_parser().parse_args(["--preset", preset, "--gpu", "H100-80GB"]))
    assert planned.cfg == trained and not trained.tie_embeddings and trained.rope
    assert planned.n_params == param_count(trained)
    gpt2_arch = plan_from_args(build_parser().parse_args(["--preset", preset, "--gpu", "H100-80GB", "--arch", "gpt2"]))
    assert gpt2_arch.cfg.tie_embeddings and not gpt2_arch.cfg.rope


def test_the_planner_takes_the_value_embeddings_and_the_unet_skips_as_the_trainer_does():
    """`python -m gpt2.plan --value-embeds 3 --unet-skips` plans the model train_ddp.py's same flags make: its
    parameters (3 tables of 50304 x 768 at GPT-2 size, 6 layers' 2 mixing weights, 6 skip weights), and FLOPs per
    token that grow by 6 per mixing or skip weight only (6N counts every parameter but the lookups, and the tables
    are lookups)."""
    from gpt2.core.config import param_count
    from gpt2.plan.__main__ import build_parser, plan_from_args
    from gpt2.plan.flops import flops_per_token
    from gpt2.train.cli import parse_config

    flags = ["--preset", "gpt2-speedrun", "--value-embeds", "3", "--unet-skips"]
    trained = parse_config([*flags[:-1], "--unet-skips", "true", "--data-dir", "D", "--out-dir", "O"]).model
    planned = plan_from_args(build_parser().parse_args([*flags, "--gpu", "H100-80GB"]))
    plain = plan_from_args(build_parser().parse_args(["--preset", "gpt2-speedrun", "--gpu", "H100-80GB"]))
    assert planned.cfg == trained and (trained.value_embeds, trained.unet_skips) == (3, True)
    assert planned.n_params == param_count(trained) == plain.n_params + 3 * 50304 * 768 + 6 * 2 + 6
    assert flops_per_token(planned.cfg, 1024) - flops_per_token(plain.cfg, 1024) == 6 * (6 * 2 + 6)
