"""--deterministic (gpt2/core/determinism.py): the switch reaches torch, cuBLAS's setting is checked, and
a run with it resumes bit for bit on a CPU (on a GPU: bench/resume_check.py's deterministic row)."""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from _helpers import import_train_ddp, losses, tiny_run_flags

from gpt2.core import compat, determinism


@pytest.fixture
def restore_determinism(monkeypatch):
    """The switch is process-wide: put torch, inductor and the environment back after the test."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), compat.inductor_deterministic_mode())
    yield
    torch.use_deterministic_algorithms(before[0])
    if before[1] is not None:
        inductor_config.deterministic = before[1]


def test_the_flag_reaches_torch_and_a_run_with_it_resumes_bit_for_bit(
    restore_determinism, shakespeare_shards, tmp_path, capsys
):
    """Through train_ddp.py's main: torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG and
    inductor's mode are set (the start-up line reads them back from torch), and a run continued from
    its step-2 checkpoint gives the uninterrupted run's losses exactly."""
    import os

    main = import_train_ddp().main
    flags = [*tiny_run_flags(shakespeare_shards, max_steps=4, ckpt_interval=2), "--deterministic", "true"]
    assert not torch.are_deterministic_algorithms_enabled()
    assert main([*flags, "--out-dir", str(tmp_path / "a")]) == 0
    assert torch.are_deterministic_algorithms_enabled() and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert compat.inductor_deterministic_mode() in (True, None)  # None: a torch without the mode
    said = capsys.readouterr().out
    assert "deterministic torch.are_deterministic_algorithms_enabled() True, CUBLAS_WORKSPACE_CONFIG=:4096:8" in said
    resumed = tmp_path / "a" / "checkpoints" / "step_00000002.pt"
    assert main([*flags, "--out-dir", str(tmp_path / "b"), "--resume", str(resumed)]) == 0
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert sorted(a) == [1, 2, 3, 4] and {s: b[s] for s in (3, 4)} == {s: a[s] for s in (3, 4)}


def test_a_cublas_setting_that_is_not_deterministic_is_refused_in_one_line(
    restore_determinism, monkeypatch, tmp_path, capsys
):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match=r"CUBLAS_WORKSPACE_CONFIG=':0:0' does not make cuBLAS deterministic"):
        determinism.enable()
    assert not torch.are_deterministic_algorithms_enabled()  # nothing turned on
    code = import_train_ddp().main(
        ["--preset", "debug", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "r"), "--deterministic", "true"]
    )
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "unset it (the run sets :4096:8)" in err


DETERMINISTIC_CUDA_STEP = """
import sys, torch
from gpt2.core import determinism
from gpt2.core.config import ModelConfig
from gpt2.model.gpt import GPT
determinism.enable()  # before CUDA's first use, as train_ddp.py does
def grads():
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=256)).cuda()
    idx = torch.randint(0, 50257, (8, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]
a, b = grads(), grads()
same = all(torch.equal(x, y) for x, y in zip(a, b))
print("bitwise" if same else "DIFFERENT", torch.are_deterministic_algorithms_enabled())
sys.exit(0 if same else 1)
"""


@pytest.mark.gpu
def test_on_cuda_a_deterministic_backward_repeats_bit_for_bit():
    """Flash attention's backward and the embedding's (atomics without the switch) give the same
    gradients twice under --deterministic; a fresh process, so that cuBLAS starts with the setting."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run(
        [sys.executable, "-c", DETERMINISTIC_CUDA_STEP],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.split() == ["bitwise", "True"], done.stdout + done.stderr[-3000:]
