"""The first step's measured memory against the plan (gpt2/train/memory_watch.py): one warning, when far above."""

import sys

import pytest
import torch
from _helpers import import_train_ddp, tiny_run_flags
from conftest import REPO

from gpt2.core import host_memory
from gpt2.plan.hardware import GIB
from gpt2.plan.memory import AUTO_HEADROOM
from gpt2.train.memory_watch import MemoryWatch, far_above

MIB = 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a CPU's resident peak is read from /proc")


def test_far_above_is_one_line_with_both_numbers_and_the_fix():
    assert far_above(None, GIB, 0, "cpu") is None  # not measurable here: nothing said
    assert far_above(int(GIB * AUTO_HEADROOM), GIB, 0, "cuda") is None  # within the plan's margin
    assert far_above(int(GIB * AUTO_HEADROOM) + 1, GIB, GIB, "cuda") is None  # and the reserve's
    line = far_above(11 * GIB, GIB, GIB // 4, "cpu")
    assert line.count("\n") == 0 and "peaked at 11.00 GiB" in line and "11.0x the plan's 1.00 GiB" in line
    assert "resident set" in line and "--micro-batch-size" in line
    assert "max_memory_allocated" in far_above(3 * GIB, GIB, 0, "cuda")


@linux_only
def test_the_watch_measures_what_the_process_comes_to_hold():
    watch = MemoryWatch.start(16 * MIB, 0, torch.device("cpu"))
    # past the high-water mark this test process already has (the watch reads new highs only), + 256 MiB
    above = host_memory.resident_peak_bytes() - host_memory.resident_bytes()
    held = torch.ones((above + 256 * MIB) // 4)  # every page written
    assert watch.measured() >= 256 * MIB
    assert "the first step peaked at" in watch.after_first_step()
    assert MemoryWatch.start(GIB, 0, torch.device("cpu")).after_first_step() is None
    del held


@linux_only
def test_the_watch_never_resets_the_high_water_mark_a_user_reads():
    """Issue 58: the trainer reset VmHWM before the model, so `/usr/bin/time -v` showed 713 MiB of a run
    whose start-up had peaked at 3,516 MiB. Now the mark stands, and growth below it is no news."""
    spike = torch.ones(96 * MIB)  # 384 MiB, then freed (given back: far above glibc's mmap threshold)
    del spike
    high = host_memory.resident_peak_bytes()
    assert high >= host_memory.resident_bytes() + 300 * MIB
    watch = MemoryWatch.start(16 * MIB, 0, torch.device("cpu"))
    assert host_memory.resident_peak_bytes() == high  # not reset
    small = torch.ones(16 * MIB)  # 64 MiB: below the mark
    assert watch.measured() is None and watch.after_first_step() is None
    del small
    assert host_memory.resident_peak_bytes() == high


def test_only_a_measuring_process_resets_the_resident_peak():
    """reset_resident_peak is for gpt2/plan/measure.py's and the benches' own processes, never a run's."""
    users = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "gpt2").rglob("*.py")
        if "reset_resident_peak(" in path.read_text() and path.name != "host_memory.py"
    )
    assert users == ["gpt2/plan/measure.py"]


@linux_only
def test_the_trainer_warns_once_when_its_first_step_holds_far_more_than_the_plan(
    tmp_path, shakespeare_shards, monkeypatch, capsys
):
    """A run that holds 1.5 GiB the plan does not count (what the chunked loss's freed chunks did, issue 41)."""
    import gpt2.train.trainer as trainer

    real, extra = trainer.train_step, []

    def holding(*args, **kwargs):
        if not extra:
            extra.append(torch.ones(384 * MIB))  # 1.5 GiB, kept for the run
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", holding)
    code = import_train_ddp().main(
        [
            *tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=0, eval_tokens=256),
            "--out-dir",
            str(tmp_path / "run"),
        ]
    )
    out = capsys.readouterr()
    assert code == 0
    lines = [ln for ln in (out.out + out.err).splitlines() if "the first step peaked at" in ln]
    assert len(lines) == 1 and "x the plan's" in lines[0]
    monkeypatch.setattr(trainer, "train_step", real)
    assert (
        import_train_ddp().main(
            [
                *tiny_run_flags(shakespeare_shards, max_steps=2, ckpt_interval=0, eval_tokens=256),
                "--out-dir",
                str(tmp_path / "plain"),
            ]
        )
        == 0
    )
    assert "the first step peaked at" not in "".join(capsys.readouterr())  # a run the plan counts: nothing said
