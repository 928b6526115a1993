"""Which SDPA kernel the model's attention runs, found by running it (gpt2/doctor/sdpa_probe.py)."""

from __future__ import annotations

import os

import pytest
import torch

from gpt2.core.config import ModelConfig
from gpt2.doctor.sdpa_probe import FORWARD_OPS, backends_of_ops, probe, relative_difference, tolerance
from gpt2.plan.measure import KINETO_QUIET_LEVEL

TINY = ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=64)


@pytest.fixture(autouse=True)
def _quiet_profiler(monkeypatch):
    monkeypatch.setenv("KINETO_LOG_LEVEL", os.environ.get("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL))


def test_operators_name_the_backend():
    assert backends_of_ops(
        [
            "aten::scaled_dot_product_attention",
            "aten::_scaled_dot_product_flash_attention",
            "aten::_scaled_dot_product_flash_attention_backward",
        ]
    ) == ["flash"]
    assert backends_of_ops(["aten::_scaled_dot_product_efficient_attention"]) == ["memory-efficient"]
    assert backends_of_ops(["aten::_scaled_dot_product_cudnn_attention"]) == ["cudnn"]
    assert backends_of_ops(["aten::_scaled_dot_product_attention_math", "aten::mm"]) == ["math"]
    assert backends_of_ops(["aten::mm"]) == []
    assert set(FORWARD_OPS.values()) >= {"flash", "flash (cpu)", "memory-efficient", "cudnn", "math"}


def test_cpu_probe_reports_the_kernel_the_dispatch_ran():
    report = probe(TINY, 2, torch.device("cpu"), torch.float32)
    trials = {t.name: t for t in report.trials}
    assert report.dispatched in (["flash (cpu)"], ["math"])  # what torch 2.x runs on a CPU
    assert all(op in report.ops for op, name in FORWARD_OPS.items() if name in report.dispatched)
    assert trials["math"].runs and trials["math"].agrees and trials["math"].rel_diff < 1e-5
    assert not trials["memory-efficient"].runs and "No viable backend" in trials["memory-efficient"].reason
    assert report.problems == [] and report.shape == (2, 2, 64, 32)


def test_forcing_the_math_backend_is_what_the_probe_then_sees():
    """Not assumed: with only the math kernel allowed around the probe, the profiled dispatch says math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.MATH]):
        report = probe(TINY, 2, torch.device("cpu"), torch.float32)
    assert report.dispatched == ["math"]


def test_a_wrong_kernel_is_outside_the_tolerance():
    gen = torch.Generator().manual_seed(0)
    ref = [torch.randn(4, 8, generator=gen) for _ in range(2)]
    bf16 = [t.bfloat16().float() for t in ref]  # one rounding to bf16: what a correct kernel differs by
    assert relative_difference(bf16, ref) < tolerance(torch.bfloat16)
    assert relative_difference([ref[0], ref[1].flip(0)], ref) > tolerance(torch.bfloat16)  # wrong rows
    assert relative_difference(bf16, ref) > tolerance(torch.float32)  # fp32's bound is far tighter
