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


def test_the_flag_reaches_torch_and_a_run_with_it_resumes_bit_for_bit(restore_determinism, shakespeare_shards,
                                                                      tmp_path, capsys):
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


def test_a_cublas_setting_that_is_not_deterministic_is_refused_in_one_line(restore_determinism, monkeypatch,
                                                                            tmp_path, capsys):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match=r"CUBLAS_WORKSPACE_CONFIG=':0:0' does not make cuBLAS deterministic"):
        determinism.enable()
    assert not torch.are_deterministic_algorithms_enabled()  # nothing turned on
    code = import_train_ddp().main(["--preset", "debug", "--data-dir", str(tmp_path), "--out-dir", str(tmp_path / "r"),
                                    "--deterministic", "true"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "unset it (the run sets :4096:8)" in err
