"""The node check's sections: their table order, the order they run in, which are opt-in, and running
each one guarded so that one that raises does not hide the others."""

from __future__ import annotations

import gc
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from gpt2.doctor.check_attention import attention
from gpt2.doctor.check_correctness import correctness, resume
from gpt2.doctor.check_environment import environment
from gpt2.doctor.check_ladder import ladder
from gpt2.doctor.check_training import ranks, training
from gpt2.doctor.context import SCALES, Context
from gpt2.doctor.results import SKIPPED, Section
from gpt2.doctor.sdpa_probe import first_line

OPT_IN = ("ladder",)
"""Sections a plain run leaves out (minutes on a GPU): --full or --only runs them."""
NEEDS = {"resume": "correctness"}
"""A section that continues another's runs: asking for it runs that one too."""


SECTIONS: tuple[tuple[str, Callable[[Context], Section]], ...] = (
    ("environment", environment),
    ("attention", attention),
    ("correctness", correctness),
    ("resume", resume),
    ("training", training),
    ("ranks", ranks),
    ("ladder", ladder),
)
"""In the table's order."""
RUN_ORDER = ("environment", "correctness", "resume", "training", "ranks", "attention", "ladder")
"""The training processes first, while this process has allocated nothing on the GPU: its memory would
be missing from theirs (the ladder's compiled models stay cached here), and a GPU in exclusive-process
mode admits one process with a context at a time."""


def run_section(name: str, fn: Callable[[Context], Section], ctx: Context) -> Section:
    """fn(ctx), or a FAILED section with the error's one line (its traceback in the JSON)."""
    ctx.say(f"{name} ...")
    t0 = time.perf_counter()
    try:
        section = fn(ctx)
    except Exception as e:  # one broken section (no compiler, out of memory) must not hide the others
        section = Section(name)
        section.fail(f"{type(e).__name__}: {first_line(e)}")
        section.data["traceback"] = traceback.format_exc()
    finally:
        release_memory(ctx.device)
    section.seconds = time.perf_counter() - t0
    ctx.say(f"{name}: {section.status} ({section.seconds:.0f} s){': ' + section.reason if section.reason else ''}")
    return section


def release_memory(device: torch.device) -> None:
    """Give cached device memory back between sections: the training runs are other processes on this GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_all(
    device: torch.device,
    left_out: dict[str, str],
    work: Path,
    *,
    ranks: int | None,
    timeout_s: float,
    say: Callable[[str], None],
    on_section: Callable[[list[Section]], None] = lambda _: None,
) -> list[Section]:
    """Every section of RUN_ORDER not left out; on_section(the sections so far, in the table's order)
    after each one. ranks: --ranks (None: every local GPU, one rank on a CPU)."""
    # A CPU's 2 gloo ranks share its cores: the plumbing, not a measure of the node (tests pass --ranks 2).
    n = ranks or (torch.cuda.device_count() if device.type == "cuda" else 1)
    ctx = Context(device, SCALES[device.type], work, n, timeout_s, say)
    functions = dict(SECTIONS)
    done = {name: Section(name, status=SKIPPED, reason=why) for name, why in left_out.items()}
    for name in RUN_ORDER:
        if name not in done:
            done[name] = run_section(name, functions[name], ctx)
            on_section([done[n] for n, _ in SECTIONS if n in done])
    return [done[name] for name, _ in SECTIONS]
