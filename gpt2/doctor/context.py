"""What every section of the node check gets: the device, the scale of its checks there, where runs go,
and what earlier sections made (their training runs, the auto dtype)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2.core import precision
from gpt2.core.config import ModelConfig, model_preset
from gpt2.doctor.train_runs import FAST_FLAGS, TrainRun, model_flags, run_train, write_synthetic_shards
from gpt2.plan import precision_choice


@dataclass(frozen=True)
class Scale:
    """The shapes and lengths of the checks on one kind of device."""

    check_model: ModelConfig
    """correctness and resume: small, so that compiling it takes seconds."""
    check_batch: int
    check_steps: int
    model: ModelConfig
    """What a run trains: the attention probe's and the ladder's shape."""
    ladder_batch: int
    ladder_steps: int
    ladder_warmup: int
    train_flags: tuple[str, ...]
    """training and ranks: flags after --preset gpt2 (none on a GPU: the preset itself)."""
    train_steps: int
    train_warmup: int
    """Steps left out of the medians: compilation, allocator and clock warm-up."""
    shard_tokens: int


TINY = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
SCALES = {
    # 124M at build-nanogpt's B=16 for the ladder; the gpt2 preset's 524,288-token step for training.
    # training: 8 steps of the preset's 524,288 tokens (~1 s each on an H100), the medians after 3.
    "cuda": Scale(
        check_model=ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=256),
        check_batch=8,
        check_steps=8,
        model=model_preset("gpt2"),
        ladder_batch=16,
        ladder_steps=5,
        ladder_warmup=2,
        train_flags=(),
        train_steps=8,
        train_warmup=3,
        shard_tokens=2**21,
    ),
    # 512 tokens per step: 8 sequences on one rank, 4 on each of two. Where training's auto takes all 8 at
    # once (the throughput model's choice depends on the measured peak), training compiles the graph
    # correctness's fast run compiled, from inductor's cache (40 s instead of ~90 s on 2 loaded cores).
    "cpu": Scale(
        check_model=TINY,
        check_batch=8,
        check_steps=8,
        model=TINY,
        ladder_batch=4,
        ladder_steps=3,
        ladder_warmup=1,
        train_flags=(*model_flags(TINY), "--total-batch-size", "512"),
        train_steps=12,
        train_warmup=3,
        shard_tokens=200_000,
    ),
}


@dataclass
class Context:
    """What every section gets: the device, its scale, where runs go, and what earlier sections made."""

    device: torch.device
    scale: Scale
    work_dir: Path
    ranks: int
    timeout_s: float
    say: Callable[[str], None]
    fast_flags: tuple[str, ...] = tuple(FAST_FLAGS)
    """The settings checked against the reference (the trainer's defaults; tests pass a wrong one)."""
    runs: dict[str, TrainRun] = field(default_factory=dict)
    _prec: precision.Precision | None = None
    _data: Path | None = None

    def auto_precision(self) -> precision.Precision:
        """--dtype auto on this device, as the trainer resolves it (measured and cached on a CPU)."""
        if self._prec is None:
            self._prec = precision_choice.resolve_precision("auto", self.device)
        return self._prec

    def data_dir(self) -> Path:
        """The synthetic shards, written at first use."""
        if self._data is None:
            self._data = self.work_dir / "data"
            write_synthetic_shards(self._data, self.scale.shard_tokens)
        return self._data

    def train(self, name: str, flags: list[str], *, nproc: int = 1) -> TrainRun:
        self.say(f"running {name} ({'torchrun x' + str(nproc) if nproc > 1 else 'train_ddp.py'})")
        run = run_train(name, flags, self.work_dir, nproc=nproc, timeout_s=self.timeout_s)
        self.runs[name] = run
        self.say(f"{name}: exit {run.returncode} after {run.seconds:.0f} s")
        return run
