"""The node check's correctness and resume sections: train_ddp.py in fp32 eager against the fast
defaults, and each continued from its mid-run checkpoint."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from gpt2.ckpt.checkpoint import load_checkpoint
from gpt2.core.config import train_values
from gpt2.doctor.context import Context
from gpt2.doctor.results import Section
from gpt2.doctor.train_runs import (
    QUIET_FLAGS,
    REFERENCE_FLAGS,
    RESUME_TOLERANCE_SHARE,
    VAL_TOKENS,
    TrainRun,
    compare_losses,
    compare_states,
    loss_tolerance,
    model_flags,
)

CHECK_LR = ("--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "2")
"""High enough that the loss falls clearly within the check's steps (a lost update shows)."""


def check_flags(ctx: Context, kind: str) -> list[str]:
    """A correctness run: the small check model, one micro-batch per step, a checkpoint halfway."""
    sc = ctx.scale
    m = sc.check_model
    return [
        *model_flags(m),
        "--device",
        ctx.device.type,
        "--data-dir",
        str(ctx.data_dir()),
        "--micro-batch-size",
        str(sc.check_batch),
        "--total-batch-size",
        str(sc.check_batch * m.block_size),
        "--max-steps",
        str(sc.check_steps),
        "--ckpt-interval",
        str(sc.check_steps // 2),
        *CHECK_LR,
        *QUIET_FLAGS,
        *(REFERENCE_FLAGS + REFERENCE_EVAL if kind == "reference" else ctx.fast_flags),
    ]


REFERENCE_EVAL = ["--eval-interval", "0", "--eval-tokens", str(VAL_TOKENS)]
"""The reference evaluates the fixed val set at step 0 and at its last step (interval 0: only then): its
change is learning alone, where step losses also move with each batch's tokens (about 0.02 nats at the
CPU shape, as large as 8 steps of learning there). The fast run skips it: eval would compile again."""
LEARNS_MARGIN = 0.01
"""The reference's val loss must fall by more than this over the check (3e-3 lr, 8 steps): a lost update
(lr 1e-9) moves it by ~1e-7; learning at the CPU shape by ~0.05-0.1."""


def fast_settings(run: TrainRun, device: torch.device) -> tuple[str, bool]:
    """(dtype, whether TF32 matmuls ran) of a finished run, from its config.json."""
    info = run.info()
    return info["precision"]["dtype"], bool(train_values(info["config"]["train"])["tf32"]) and device.type == "cuda"


def settings_line(info: dict, tf32: bool) -> str:
    """What a finished run computed with, from its config.json: dtype, compile, attention, TF32, loss."""
    train, model = train_values(info["config"]["train"]), info["config"]["model"]
    return (
        f"{info['precision']['dtype']}, {'torch.compile' if train['compile'] else 'eager'}, "
        f"attention {model['attn_impl']}, TF32 {'on' if tf32 else 'off'}, {info['loss']['impl']} loss"
    )


def loss_span(run: TrainRun) -> tuple[float, float]:
    losses = run.losses()
    return losses[min(losses)], losses[max(losses)]


def correctness(ctx: Context) -> Section:
    s = Section("correctness")
    ref = ctx.train("check-reference", check_flags(ctx, "reference"))
    fast = ctx.train("check-fast", check_flags(ctx, "fast"))
    for name, run in (("reference run", ref), ("fast run", fast)):
        if not run.ok:
            s.check(name, False, f"train_ddp.py failed: {run.failure()} (log: {run.log})")
    if not (ref.ok and fast.ok):
        return s
    dtype, tf32 = fast_settings(fast, ctx.device)
    first, last = loss_span(ref)
    s.info(
        "reference",
        f"fp32, eager, explicit attention, no TF32: loss {first:.4f} -> {last:.4f} "
        f"({ctx.scale.check_steps} steps, {ref.seconds:.0f} s)",
    )
    s.info("fast", f"{settings_line(fast.info(), tf32)} ({fast.seconds:.0f} s with compilation)")
    val = ref.val_losses()
    v0, v1 = val.get(0, math.nan), val.get(max(val, default=0), math.nan)
    s.check(
        "training learns",
        v0 - v1 > LEARNS_MARGIN,
        f"reference val loss {v0:.4f} -> {v1:.4f} on the same {VAL_TOKENS:,} tokens (must fall > {LEARNS_MARGIN})",
    )
    cmp = compare_losses(ref.losses(), fast.losses(), loss_tolerance(dtype, tf32))
    s.check("fast = reference", cmp.ok, cmp.describe())
    s.data = {
        "reference": ref.losses(),
        "fast": fast.losses(),
        "reference_val": val,
        "fast_dtype": dtype,
        "tf32": tf32,
        "comparison": dataclasses.asdict(cmp),
        "seconds": {"reference": ref.seconds, "fast": fast.seconds},
    }
    return s


def resume(ctx: Context) -> Section:
    s = Section("resume")
    half, steps = ctx.scale.check_steps // 2, ctx.scale.check_steps
    for kind in ("reference", "fast"):
        run = ctx.runs.get(f"check-{kind}")
        if run is None or not run.ok:
            s.check(kind, False, "needs the correctness section's run, which did not finish")
            continue
        flags = check_flags(ctx, kind)
        if kind == "fast":  # the dtype the run resolved, not auto again: the same program must continue
            flags[flags.index("--dtype") + 1] = fast_settings(run, ctx.device)[0]
        resumed = ctx.train(f"check-{kind}-resumed", [*flags, "--resume", str(run.checkpoint(half))])
        if not resumed.ok:
            s.check(kind, False, f"train_ddp.py --resume failed: {resumed.failure()} (log: {resumed.log})")
            continue
        s.data[kind] = resume_rows(s, kind, run, resumed, ctx.device, range(half + 1, steps + 1))
    return s


def resume_rows(s: Section, kind: str, run: TrainRun, resumed: TrainRun, device: torch.device, steps: range) -> dict:
    """Compare a resumed run's steps and final checkpoint with the uninterrupted run's."""
    last = steps[-1]
    states = compare_states(*(state_of(r.checkpoint(last)) for r in (run, resumed)))
    if kind == "reference":
        losses = compare_losses(run.losses(), resumed.losses(), 0.0, steps=steps)
        val = [r.val_losses().get(last) for r in (run, resumed)]
        same = losses.bitwise and states.bitwise and val[0] == val[1]
        s.check(
            "reference (fp32 eager) continues bitwise",
            same,
            f"from step {steps[0] - 1}: {losses.describe()}; step {last}: {states.describe()}, val loss "
            f"{'identical' if val[0] == val[1] else f'{val[0]} vs {val[1]}'}",
        )
    else:
        dtype, tf32 = fast_settings(run, device)
        tolerance = loss_tolerance(dtype, tf32) * RESUME_TOLERANCE_SHARE
        losses = compare_losses(run.losses(), resumed.losses(), tolerance, steps=steps)
        s.check(
            f"fast ({dtype}, compiled) continues",
            losses.ok,
            f"from step {steps[0] - 1}: {losses.describe()}; step {last}: {states.describe()}",
        )
    return {"losses": dataclasses.asdict(losses), "states": dataclasses.asdict(states)}


def state_of(path: Path) -> dict:
    """A checkpoint's model and optimizer tensors (verified against its sidecar's sha256)."""
    ckpt = load_checkpoint(path)
    return {"model": ckpt["model"], "optimizer": ckpt["optimizer"]}
