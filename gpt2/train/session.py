"""The trainer as a benchmark drives it: build a run from a RunConfig and a Dist, step it, read its
numbers (loss, step time, tokens/s, memory), close it. The one door from bench/ into gpt2/train/
(tests/test_architecture.py holds bench/ to it), so the trainer's internals can change without
breaking the scripts that back the docs' numbers.

    session = Session(parse_config([...flags...]), single_process("cpu"))
    stats = session.step()                     # one optimizer step, exactly the trainer's train_step
    print(stats["loss"], session.step_s[-1], session.tokens_per_s(), session.memory_mb())
    session.close()

A Session runs the steps without the loop's bookkeeping (logging, evaluation, checkpoints, stop
votes): what a benchmark times is the training step itself.
"""

from __future__ import annotations

import time

import torch

from gpt2.core.config import RunConfig
from gpt2.distributed.group import Dist
from gpt2.train.cli import parse_config
from gpt2.train.optim import make_optimizer, param_groups
from gpt2.train.run_log import RunLog, read_metrics
from gpt2.train.startup import start
from gpt2.train.state import Parts
from gpt2.train.trainer import StepStats, close_run, evaluate, memory_mb, step_tokens, train_step

__all__ = ["Session", "parse_config", "read_metrics", "make_optimizer", "param_groups"]


class Session:
    """One run as the trainer starts it (gpt2/train/startup.py start: the same decisions, plan and build),
    stepped on demand."""

    def __init__(self, cfg: RunConfig, dist: Dist) -> None:
        """The trainer's start-up, whole: threads and backends, the checks, every `auto` flag decided as a
        real start decides it (--dtype, --micro-batch-size, --loss-impl, ...), the plan, the build; its lines
        go to RUN/train.log, not the console (warnings still reach stderr). A directory holding a checkpoint of
        this run resumes it, as train_ddp.py would."""
        quiet = RunLog(dist, cfg.train.ckpt.out_dir, verbose=False, log_file=True, console=False)  # train.log alone
        run = start(cfg, dist, log=quiet)
        if run is None:
            raise ValueError(
                f"{cfg.train.ckpt.out_dir} already finished --max-steps {cfg.train.schedule.max_steps}: nothing to step"
            )
        self.dist, self.log, self.cfg, self.decided = dist, run.log, run.cfg, run.decided
        self.parts: Parts | None = run.parts
        self.step_s: list[float] = []
        """Each step's wall time (s), as step() measured it: on CUDA the queueing time unless it was read."""

    def step(self) -> StepStats:
        """One optimizer step (train_step, no stop vote). Its numbers stay on the device until read
        (stats["loss"], stats["grad_norm"]): reading them waits for the step."""
        t0 = time.perf_counter()
        stats = train_step(self.parts, self.cfg.train, self.dist, False)
        self.step_s.append(time.perf_counter() - t0)
        return stats

    def evaluate(self) -> float:
        """Mean validation loss per token over --eval-tokens, reduced over ranks (the trainer's evaluation)."""
        return evaluate(self.parts, self.dist)

    @property
    def steps(self) -> int:
        """Optimizer steps taken."""
        return self.parts.step

    @property
    def model(self) -> torch.nn.Module:
        """The raw model (what checkpoints hold and evaluation and sampling run)."""
        return self.parts.model

    @property
    def train_model(self) -> torch.nn.Module:
        """What each micro-step calls: the compiled and DDP/FSDP-wrapped model. Assignable, for
        benchmarks that compare another wrapping or compile order."""
        return self.parts.train_model

    @train_model.setter
    def train_model(self, module: torch.nn.Module) -> None:
        self.parts.train_model = module

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """What each step updates with. Assignable, for benchmarks that compare another optimizer."""
        return self.parts.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.parts.optimizer = optimizer

    @property
    def loader(self):
        """The rank's train loader (assignable: a benchmark that compares another data order)."""
        return self.parts.loader

    @loader.setter
    def loader(self, loader) -> None:
        self.parts.loader, self.parts.prefetched = loader, None

    @property
    def accum_steps(self) -> int:
        return self.parts.accum_steps

    def tokens_per_s(self, last: int | None = None) -> float:
        """--total-batch-size tokens over the median of the last `last` step times (default: all); with a
        batch warmup, the median of the steps' own rates (each step's tokens over its time)."""
        batch, first = self.cfg.train.batch, max(0, len(self.step_s) - (last or len(self.step_s)))
        if not batch.batch_warmup_steps:
            times = sorted(self.step_s[first:])
            return batch.total_batch_size / times[len(times) // 2]
        start = self.parts.step - len(self.step_s)  # the 0-based step of step_s[0]
        rates = sorted(step_tokens(batch, start + i) / s for i, s in enumerate(self.step_s) if i >= first)
        return rates[len(rates) // 2]

    def memory_mb(self) -> float:
        """Peak memory so far: CUDA's allocated peak, or the process's resident peak on a CPU."""
        return memory_mb(self.dist.device)

    def close(self) -> None:
        """The log and the loaders' open shard files; the model and optimizer are freed with the session."""
        if self.parts is not None:
            close_run(self.parts, self.dist, self.log)
            self.parts = None
