"""--compile-scope blocks (gpt2/train/trainer.py build): each transformer block compiled alone and the head
and loss as one more region, the single-process/DDP path's alternative to torch.compile(model). The same
losses as the whole-model compile over a few steps of a tiny model; a bad value is refused in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _helpers import losses, tiny_run_flags
from conftest import REPO

from gpt2.core.config import TrainConfig


def run(data_dir, out_dir, scope: str) -> dict[int, float]:
    flags = tiny_run_flags(data_dir, max_steps=3, ckpt_interval=0, eval_tokens=512)
    flags[flags.index("--compile") + 1] = "true"
    done = subprocess.run(
        [sys.executable, "train_ddp.py", *flags, "--compile-scope", scope, "--out-dir", str(out_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return losses(out_dir)


@pytest.mark.soak  # by hand (`-m soak`): two CPU compiles of a tiny model, 1-3 minutes on 2 cores; passed 2026-11-27
def test_each_block_compiled_gives_the_whole_models_losses(tmp_path, shakespeare_shards):
    whole = run(shakespeare_shards, tmp_path / "model", "model")
    blocks = run(shakespeare_shards, tmp_path / "blocks", "blocks")
    assert sorted(whole) == sorted(blocks) == [1, 2, 3]
    assert blocks == pytest.approx(whole, rel=1e-5, abs=1e-5)


def test_a_compile_scope_other_than_model_or_blocks_is_refused():
    with pytest.raises(ValueError, match=r"compile_scope='layers' must be one of \('model', 'blocks'\)"):
        TrainConfig.of(compile_scope="layers")
    done = subprocess.run(
        [sys.executable, "train_ddp.py", "--data-dir", "d", "--out-dir", "o", "--compile-scope", "layers"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "compile_scope='layers' must be one of ('model', 'blocks')" in done.stderr
