"""A validation-loss curve from the trainer's own steps and evaluation (gpt2/train/session.py), on one
CPU process: what bench/data_order.py and bench/optimizers.py compare."""

from __future__ import annotations

import sys
from collections.abc import Callable

from gpt2.core.config import RunConfig
from gpt2.distributed.group import single_process
from gpt2.train.session import Session


def val_curve(
    cfg: RunConfig, label: str, eval_every: int, adjust: Callable | None = None
) -> tuple[dict[int, float], list[float]]:
    """({step: val loss} at step 0, every eval_every steps and the last, [seconds of each step]).

    Trains to cfg.train.schedule.max_steps in cfg.train.ckpt.out_dir; adjust(session), if given, changes the built
    session before step 0 (e.g. another train loader). Progress goes to stderr, one line per evaluation."""
    session = Session(cfg, single_process("cpu"))
    if adjust is not None:
        adjust(session)
    steps = cfg.train.schedule.max_steps
    val = {0: session.evaluate()}
    while session.steps < steps:
        session.step()
        if session.steps % eval_every == 0 or session.steps == steps:
            val[session.steps] = session.evaluate()
            print(
                f"  {label}: step {session.steps} val {val[session.steps]:.4f} ({sum(session.step_s):.0f} s training)",
                file=sys.stderr,
                flush=True,
            )
    times = list(session.step_s)
    session.close()
    return val, times
