"""The first step's measured memory against the plan (gpt2/train/memory_watch.py): one warning, when far above."""

import sys

import pytest
import torch
from _helpers import import_train_ddp, tiny_run_flags

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
    held = torch.ones(64 * MIB)  # 256 MiB, every page written
    assert watch.measured() >= 256 * MIB
    assert "the first step peaked at" in watch.after_first_step()
    assert MemoryWatch.start(GIB, 0, torch.device("cpu")).after_first_step() is None
    del held


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
