"""A validation-loss curve from the trainer's own build(), train_step() and evaluate(), on one CPU
process: what bench/data_order.py and bench/optimizers.py compare."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Callable

from gpt2.core.config import RunConfig
from gpt2.distributed.group import single_process
from gpt2.train.run_log import Metrics
from gpt2.train.startup import check_data, configure_backends
from gpt2.train.trainer import build, evaluate, train_step


def val_curve(cfg: RunConfig, out_dir: Path, label: str, eval_every: int,
              adjust: Callable | None = None) -> tuple[dict[int, float], list[float]]:
    """({step: val loss} at step 0, every eval_every steps and the last, [seconds of each step]).

    Trains to cfg.train.max_steps; adjust(parts), if given, changes the built parts before step 0
    (e.g. another train loader). Progress goes to stderr, one line per evaluation."""
    dist = single_process("cpu")
    configure_backends(cfg.train, dist)
    parts = build(cfg, dist, Metrics(dist, out_dir), check_data(cfg, 1))
    if adjust is not None:
        adjust(parts)
    steps = cfg.train.max_steps
    val, times = {0: evaluate(parts, cfg, dist)}, []
    while parts.step < steps:
        t0 = time.perf_counter()
        train_step(parts, cfg, dist, False)
        times.append(time.perf_counter() - t0)
        if parts.step % eval_every == 0 or parts.step == steps:
            val[parts.step] = evaluate(parts, cfg, dist)
            print(f"  {label}: step {parts.step} val {val[parts.step]:.4f} ({sum(times):.0f} s training)",
                  file=sys.stderr, flush=True)
    return val, times
