"""Time to quality: the wall-clock at which each run first reaches nanoGPT's step-200 validation loss.

    python bench/time_to_loss.py                                    # ~25 min on 2 cores
    python bench/time_to_loss.py --nanogpt /path/to/nanoGPT/clone   # no network: a local clone or mirror
    python bench/time_to_loss.py --shape large --rows speedrun --seeds 1 --nano-runs 1   # 6L/384, 600 steps

--shape large is issue 56's larger shape: 6 layers x 384 (6 heads), block 256, 8 x 256 tokens a step, nanoGPT's
recipe over 600 steps (warmup 60, cosine to lr/10); its recipe rows of ours take the same shape and horizon, the
presets the same shape with their own horizon (200 steps), learning rates and warmups (tuned at the small shape);
--rows horizon runs --preset speedrun with other horizons; --rows optim runs it with each of its optimizer
settings (the two learning rates, Muon's momentum, AdamW's beta2 and weight decay) moved one step alone; --rows
techniques runs it with each of issue 76's techniques alone (Polar Express, Muon's momentum warmup), at --seeds seeds.

The recipe is nanoGPT's small Shakespeare one on GPT-2 tokens (--corpus through data_prep, one document
per paragraph, the first 30,000 tokens as val): 4 layers, 4 heads, 128 wide, block 64, batch 16 (1,024
tokens per step), AdamW 0.9/0.95, weight decay 0.1, clip 1.0, lr 1e-3 warmed up over 20 steps then cosine
to 1e-4 at step 200, eager, fp32 (nanoGPT on a CPU always computes in fp32).
Rows:
  nanoGPT                 its own train.py (`--bias=True --dropout=0.0`, GPT-2's architecture), run twice:
                          before and after ours; its step-200 val loss (first run) is the TARGET
  ours AdamW              the trainer (gpt2.train.session: build, step) on the same recipe
  ours Muon               the same with --optimizer muon at its defaults
  + <change> ...          the ablation: the speed preset's changes added one at a time, cumulatively
  tried, not kept: ...    changes tried on top of the preset's, cumulatively, and left out of it
  --preset speed          the last ablation row is the preset itself (gpt2/core/config.py), at --seeds seeds
One validation estimator for all: the mean cross-entropy over the same fixed windows (the first
--val-tokens val tokens, cut into block-size windows, each predicting its next tokens), fp32, applied
to each run's weights every --eval-every steps: ours from the weights in this process, nanoGPT's from the
checkpoint its train.py writes at every eval_interval (always_save_checkpoint=True; a wrapper keeps each
as ckpt_<iter>.pt instead of overwriting ckpt.pt, train.py itself runs unchanged) loaded into nanoGPT's
own model.py. A run of ours stops once it reaches the target.
Wall-clock counts training steps only, measured the same way for both: each step's whole iteration
(data, forward, backward, clip, update) timed by its own program (nanoGPT's printed per-iteration
`time`; ours time.perf_counter around train_step), summed up to the step. Not counted: start-up, and
the evaluations; nanoGPT's own evaluation-and-checkpoint falls inside its timed iteration 0 and each
iteration at a multiple of eval_interval, so for both programs the first step and those steps count at
the run's median step time. Ours' rows step round-robin (one step of each in turn), so they share the
same load; nanoGPT's two runs bracket them, and its time is the mean of the two. A burst of another
tenant's load lands on some runs and not others and inflates their sums, hardly their medians, so the
table also gives steps-to-target x median s/step for every run and its ratio: the load-robust figure.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nanogpt  # bench/nanogpt.py
import numpy as np
import torch
from corpus import prepare_by_paragraph, require_corpus  # bench/corpus.py
from emit import emit  # bench/emit.py (a script's directory is on sys.path)
from flags import PARITY, PARITY_STEPS, QUIET_RUN, W1_SHAPE  # bench/flags.py

from gpt2.core.config import TRAIN_PRESETS, RunConfig
from gpt2.core.schedule import tokens_before
from gpt2.distributed.group import single_process
from gpt2.model.gpt import GPT
from gpt2.plan import precision_choice
from gpt2.train.session import Session, parse_config

RECIPE_STEPS = PARITY_STEPS
QUIET = ["--device", "cpu", *QUIET_RUN, "--log-interval", "1000"]
RECIPE = PARITY
"""nanoGPT's small Shakespeare recipe (the module docstring) over RECIPE_STEPS steps: bench/flags.py's PARITY."""
NANO_RECIPE = dict(
    n_layer=4,
    n_head=4,
    n_embd=128,
    block_size=64,
    batch_size=16,
    gradient_accumulation_steps=1,
    learning_rate=1e-3,
    min_lr=1e-4,
    warmup_iters=20,
    beta1=0.9,
    beta2=0.95,
    weight_decay=0.1,
    grad_clip=1.0,
    compile=False,
    dtype="float32",
    bias=True,
    dropout=0.0,
    eval_iters=1,
    always_save_checkpoint=True,
    log_interval=1,
)


@dataclass(frozen=True)
class Shape:
    """A recipe's size: ours' flags and nanoGPT's config for it, its steps (nanoGPT's val there is the target)
    and what ours' preset rows add to run at it."""

    recipe: list[str]
    nano: dict
    steps: int
    eval_every: int
    preset_flags: list[str]
    goals: dict[str, float]
    """Each preset's goal at this shape: its wall-clock to the target over nanoGPT's (issues 45 and 56)."""
    horizons: tuple[int, ...] = ()
    """--rows horizon: --preset speedrun at this shape with each of these --max-steps instead of its own 200 (its
    cosine ends there)."""

    @property
    def block(self) -> int:
        return self.nano["block_size"]

    @property
    def tokens_per_step(self) -> int:
        return self.nano["batch_size"] * self.nano["block_size"] * self.nano["gradient_accumulation_steps"]


def _with(flags: list[str], **changes) -> list[str]:
    """flags with each `--name value` in changes replaced (names spelled with underscores)."""
    out = list(flags)
    for name, value in changes.items():
        out[out.index("--" + name.replace("_", "-")) + 1] = str(value)
    return out


LARGE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=8)
"""Issue 56's larger shape: 6 layers x 384 (nanoGPT's shakespeare_char model), block 256, 8 x 256 tokens."""
LARGE_STEPS = 600
LARGE_SHAPE = Shape(
    # nanoGPT's recipe at that size over 600 steps: the small recipe's 10% warmup, cosine to lr/10.
    _with(
        RECIPE,
        n_layer=6,
        n_head=6,
        n_embd=384,
        block_size=256,
        micro_batch_size=8,
        total_batch_size=2048,
        warmup_steps=60,
        max_steps=LARGE_STEPS,
    ),
    {**NANO_RECIPE, **LARGE, "warmup_iters": 60},
    LARGE_STEPS,
    20,
    # The presets at that size with their own horizon (200 steps), learning rates and warmups, as tuned at the
    # small shape. Until 2026-12-06 they ran nanoGPT's 600-step horizon here, which left their learning rate high
    # when they read the target: 240 steps (runs of 2026-11-28 and 12-04) against 140 with their own.
    W1_SHAPE,
    {"speedrun": 0.35},
    # --rows horizon, tried on 2026-12-06 (steps to the target, evaluated every 20): 240 -> 180 steps,
    # 180 -> 140, the preset's own 200 -> 140; nanoGPT's 600 -> 240 (the rows of 11-28 and 12-04).
    (600, 240, 180),
)
MUON = ["--optimizer", "muon"]
ABLATION = [
    # (row label, flags added to the row before): cumulative, in order; the last row's flags are the preset.
    ("+ AdamW part lr 4e-3 (embeddings, head, gains)", ["--lr", "4e-3", "--min-lr", "4e-4"]),
    ("+ warmup 20 -> 5 steps", ["--warmup-steps", "5"]),
]
TRIED = [
    # Tried on top of the preset's changes (cumulatively) and not kept: no fewer steps to the target
    # (full run of 2026-11-24: +horizon 80 steps, +warmup-stable-decay 70, against 70 without them).
    ("tried, not kept: + horizon 200 -> 100 steps (decay done by 100)", ["--max-steps", "100"]),
    ("tried, not kept: + warmup-stable-decay (linear decay over the last 40)", ["--decay-steps", "40"]),
]
PRESET = "speed"
MODERN = [
    # (row label, flags added to the row before), cumulative on top of --preset speed: the architecture options
    # (docs/modern.md) and the learning rates re-tuned for them; the last row's flags are --preset speedrun.
    (
        "+ --arch modern (RoPE, QK-norm, ReLU^2, RMSNorm, untied zero-init head and projections, no biases, cap 15)",
        ["--arch", "modern"],
    ),
    ("+ no logit soft-cap", ["--logit-softcap", "none"]),
    ("+ AdamW part lr 4e-3 -> 8e-3", ["--lr", "8e-3", "--min-lr", "8e-4"]),
    ("+ warmup 5 -> 2 steps", ["--warmup-steps", "2"]),
    ("+ Muon lr 0.02 -> 0.01", ["--muon-lr", "0.01"]),
    ("+ attention within documents", ["--doc-attention"]),
]
MODERN_TRIED = [
    # Tried on --preset speedrun's flags (each alone) and not kept. Exploration of 2026-11-28 (steps to the
    # target, evaluated every step): the tied head 40 against 35, LayerNorm 34 at 3% more s/step, beta1 0.8 34,
    # a 50-step horizon 36; also (every 5 steps, not rows here) Muon at 0.04 60 against 50, torch.compile 35 at
    # 0.91x the s/step (its compile, not counted by this bench, took longer than the whole run).
    ("tried, not kept: + tied head", ["--tie-embeddings", "true"]),
    ("tried, not kept: + LayerNorm", ["--norm", "layernorm"]),
    ("tried, not kept: + AdamW beta1 0.8", ["--beta1", "0.8"]),
    ("tried, not kept: + horizon 200 -> 50 steps", ["--max-steps", "50"]),
]
OPTIM_MOVES = [
    # (row label, flags): --preset speedrun's optimizer settings, each moved one step alone (seed 1337). Run of
    # 2026-12-06 (Shakespeare, evaluated every step; docs/performance.md): every row took 34-37 steps against the
    # preset's 35, so the preset sits on a flat optimum of these settings and none was changed.
    ("AdamW part lr 8e-3 -> 1.2e-2", ["--lr", "1.2e-2", "--min-lr", "1.2e-3"]),
    ("AdamW part lr 8e-3 -> 1.6e-2", ["--lr", "1.6e-2", "--min-lr", "1.6e-3"]),
    ("Muon lr 0.01 -> 0.015", ["--muon-lr", "0.015"]),
    ("Muon momentum 0.95 -> 0.9", ["--muon-momentum", "0.9"]),
    ("AdamW beta2 0.95 -> 0.99", ["--beta2", "0.99"]),
    ("AdamW weight decay 0.1 -> 0", ["--weight-decay", "0"]),
]
HALF = "half"
"""In a TECHNIQUES row's flags: half the shape's micro-batch for the preset (technique_rows puts the number in)."""
TECHNIQUES = [
    # (row label, flags): issue 76's techniques, each an opt-in option added alone to --preset speedrun (its seeds).
    ("+ Polar Express (--muon-ortho polar_express)", ["--muon-ortho", "polar_express"]),
    # The record of 2024-11-06 warms Muon's momentum up over 500 of its 3,200 steps: 31 of this preset's 200.
    ("+ Muon momentum warmup 0.85 -> 0.95 over 31 steps", ["--muon-momentum-warmup", "31"]),
    # The records of 2024-12-04 to 12-17 mix 3 tables into 6 of 12 layers' values: 1 table into 2 of these 4.
    ("+ value embeddings (--value-embeds 1)", ["--value-embeds", "1"]),
    ("+ U-net skip connections (--unet-skips)", ["--unet-skips", "true"]),
    # Cautious weight decay gates a decay: beside it the same decay ungated, which the preset does not have.
    ("+ Muon weight decay 0.1", ["--muon-weight-decay", "0.1"]),
    ("+ Muon weight decay 0.1, cautious (--cautious-wd)", ["--muon-weight-decay", "0.1", "--cautious-wd", "true"]),
    # A batch warmup needs 2 micro-steps a step (the presets take theirs in 1): the same halved micro-batch alone
    # first, its control. modded-nanogpt's record of 2026-07-17 grows its batch in thirds over its run; here the
    # first half of the steps to the target take half the batch.
    ("+ micro-batch halved (the batch warmup's control)", ["--micro-batch-size", HALF]),
    (
        "+ batch warmup: half the batch for 16 steps",
        ["--micro-batch-size", HALF, "--batch-warmup-steps", "16", "--batch-warmup-stages", "1"],
    ),
]
MODERN_PRESET = "speedrun"
GOALS = {PRESET: 0.40, MODERN_PRESET: 0.15}
"""Each preset's goal at the small shape, its wall-clock to the target over nanoGPT's (issues 45 and 56)."""
SHAPES = {"small": Shape(RECIPE, NANO_RECIPE, RECIPE_STEPS, 10, [], GOALS), "large": LARGE_SHAPE}


def ablation_rows(recipe: list[str] = RECIPE) -> list[tuple[str, list[str]]]:
    """(label, full flags) of the Muon row and each cumulative ablation row after it; the last is the preset."""
    rows, flags = [("ours Muon at its defaults", recipe + MUON)], recipe + MUON
    for label, extra in ABLATION:
        flags = flags + extra
        rows.append((label, flags))
    return rows


def tried_rows(recipe: list[str] = RECIPE) -> list[tuple[str, list[str]]]:
    """(label, full flags) of the changes tried on top of the preset's and left out of it."""
    rows, flags = [], ablation_rows(recipe)[-1][1]
    for label, extra in TRIED:
        flags = flags + extra
        rows.append((label, flags))
    return rows


def modern_rows(shape_flags: list[str] = ()) -> list[tuple[str, list[str]]]:
    """(label, full flags) of the modern ablation's cumulative rows (the last is --preset speedrun's flags) and
    the changes tried on the preset and left out; shape_flags (a Shape's preset_flags) follow each preset."""
    rows, flags = [], ["--preset", PRESET, *shape_flags]
    for label, extra in MODERN:
        flags = flags + extra
        rows.append((label, flags))
    tried = [(label, ["--preset", MODERN_PRESET, *shape_flags, *extra]) for label, extra in MODERN_TRIED]
    return rows[:-1] + tried


def horizon_rows(shape: Shape) -> list[tuple[str, list[str]]]:
    """(label, full flags) of --preset speedrun at the shape with each of its other horizons (seed 1337)."""
    own = TRAIN_PRESETS[MODERN_PRESET]["max_steps"]
    return [
        (
            f"horizon {own} -> {h} steps (--preset {MODERN_PRESET} --max-steps {h}, decay done by {h})",
            ["--preset", MODERN_PRESET, *shape.preset_flags, "--max-steps", str(h), "--seed", "1337"],
        )
        for h in shape.horizons
    ]


def optim_rows(shape: Shape) -> list[tuple[str, list[str]]]:
    """(label, full flags) of --preset speedrun at the shape with each of OPTIM_MOVES alone (seed 1337); the
    labels do not start with --preset, so the rows do not count toward the preset's goal."""
    return [
        (
            f"{label} (--preset {MODERN_PRESET}, seed 1337)",
            ["--preset", MODERN_PRESET, *shape.preset_flags, *extra, "--seed", "1337"],
        )
        for label, extra in OPTIM_MOVES
    ]


@dataclass
class Contender:
    label: str
    cfg: RunConfig
    session: Session | None = None
    times: list = field(default_factory=list)
    val: dict = field(default_factory=dict)
    """{step: val loss}"""
    reached: int | None = None


def val_windows(data: Path, tokens: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed validation windows: the first `tokens` val tokens as (x, y) rows of block tokens."""
    val = nanogpt.shard_tokens(data, "val").astype(np.int64)
    n = min(tokens, len(val) - 1) // block
    if n < 1:
        raise ValueError(f"--val-tokens {tokens} is less than one window of {block} tokens")
    x = torch.from_numpy(val[: n * block].reshape(n, block))
    y = torch.from_numpy(val[1 : n * block + 1].reshape(n, block))
    return x, y


@torch.no_grad()
def estimate(forward, windows: tuple[torch.Tensor, torch.Tensor], batch: int = 32) -> float:
    """Mean next-token cross-entropy over every window; forward(x, y) returns a batch's mean loss."""
    x, y = windows
    total = 0.0
    for i in range(0, len(x), batch):
        total += forward(x[i : i + batch], y[i : i + batch]).double().item() * len(x[i : i + batch])
    return total / len(x)


def ours_forward(model: torch.nn.Module):
    return lambda x, y: model(x, y, return_logits=False)[1]


def nano_forward(model: torch.nn.Module):
    return lambda x, y: model(x, y)[1]


def counted_times(times: list[float], uncounted: set[int]) -> list[float]:
    """Per-step seconds with the steps at the indices `uncounted` (start-up or evaluation inside them)
    replaced by the median of the others."""
    rest = [t for i, t in enumerate(times) if i not in uncounted] or times
    med = statistics.median(rest)
    return [med if i in uncounted else t for i, t in enumerate(times)]


def first_reach(val: dict[int, float], target: float) -> int | None:
    return next((s for s in sorted(val) if s > 0 and val[s] <= target), None)


def run_nanogpt(tree: Path, dataset: str, out: Path, steps: int, every: int, windows, nano: dict = NANO_RECIPE) -> dict:
    """nanoGPT's train.py on the recipe (nano: its config): {step: val} by the shared estimator and the counted
    step times."""
    flags = {**nano, "dataset": dataset, "max_iters": steps, "lr_decay_iters": steps, "eval_interval": every}
    r = nanogpt.run(tree, flags, out, wrapper=nanogpt.KEEP_CHECKPOINTS)
    times = r.step_s[:steps]  # iterations 0..steps-1 are steps 1..steps (train.py runs one more, after its last eval)
    val = {}
    for ckpt in sorted(out.glob("ckpt_*.pt")):
        step = int(ckpt.stem.split("_")[1])
        val[step] = estimate(nano_forward(nanogpt.load_model(tree, ckpt)), windows)
    return {"val": val, "times": counted_times(times, {i for i in range(len(times)) if i % every == 0})}


def progress_line(nano: dict, target: float) -> str:
    """nanoGPT's run as soon as it ends (a long bench stopped before its table keeps these): its val by step
    and its counted step times."""
    t = nano["times"]
    return (
        f"  nanoGPT run 1: val {dict(sorted(nano['val'].items()))}; target {target:.4f}; {len(t)} steps, median "
        f"{statistics.median(t):.3f} s/step, {sum(t):.1f} s counted"
    )


def make_contender(label: str, flags: list[str], data: Path, out: Path, dist) -> Contender:
    cfg = parse_config(flags + QUIET + ["--data-dir", str(data), "--out-dir", str(out)])
    return Contender(label, cfg, Session(cfg, dist))


def evaluate_ours(c: Contender, windows) -> float:
    model = c.session.model
    eval_model = GPT(c.cfg.model, loss_impl="full")
    eval_model.load_state_dict(model.state_dict())
    return estimate(ours_forward(eval_model.eval()), windows)


def run_ours(contenders: list[Contender], windows, target: float | None, every: int) -> None:
    """Step every contender in turn (one step each, round-robin) until each reaches the target or its
    last step; evaluate every `every` steps (untimed)."""
    live = list(contenders)
    for c in live:
        c.val[0] = evaluate_ours(c, windows)
    while live:
        for c in list(live):
            t0 = time.perf_counter()
            c.session.step()
            c.times.append(time.perf_counter() - t0)
            step = c.session.steps
            if step % every == 0 or step == c.cfg.train.schedule.max_steps:
                c.val[step] = evaluate_ours(c, windows)
                print(
                    f"  {c.label}: step {step} val {c.val[step]:.4f} ({sum(c.times):.0f} s, median "
                    f"{statistics.median(c.times):.3f} s/step)",
                    file=sys.stderr,
                    flush=True,
                )
                if target is not None and c.val[step] <= target:
                    c.reached = step
            if c.reached is not None or step >= c.cfg.train.schedule.max_steps:
                live.remove(c)
                c.session.close()
                c.session = None  # free the model and optimizer


def time_to(times: list[float], step: int | None) -> float | None:
    return None if step is None else sum(times[:step])


def seed_rows(preset: str, note: str, shape: Shape, seeds: int) -> list[tuple[str, list[str]]]:
    """(label, full flags) of --preset at the shape with seeds 1337, 1338, ...: the rows judged by the goal."""
    return [
        (f"--preset {preset}{note}, seed {seed}", ["--preset", preset, *shape.preset_flags, "--seed", str(seed)])
        for seed in range(1337, 1337 + seeds)
    ]


def tokens_to(cfg: RunConfig, steps: int) -> int:
    """The tokens a run's first `steps` steps read (less than steps x the batch in a --batch-warmup-steps)."""
    b = cfg.train.batch
    return tokens_before(
        steps, total=b.total_batch_size, warmup_steps=b.batch_warmup_steps, stages=b.batch_warmup_stages
    )


def technique_rows(shape: Shape, seeds: int) -> list[tuple[str, list[str]]]:
    """(label, full flags) of --preset speedrun at the shape with each of TECHNIQUES alone, at each seed; the labels
    do not start with --preset, so the rows do not count toward the preset's goal."""
    preset = ["--preset", MODERN_PRESET, *shape.preset_flags]
    half = str(parse_config([*preset, "--data-dir", "-", "--out-dir", "-"]).train.batch.micro_batch_size // 2)
    return [
        (f"{label} (--preset {MODERN_PRESET}, seed {seed})", [*preset, *extra, "--seed", str(seed)])
        for label, flags in TECHNIQUES
        for extra in [[half if f == HALF else f for f in flags]]
        for seed in range(1337, 1337 + seeds)
    ]


def planned_rows(rows: set[str], shape: Shape, seeds: int) -> list[tuple[str, list[str]]]:
    """(label, full flags) of every row of ours asked for, in the table's order."""
    plan: list[tuple[str, list[str]]] = []
    if "adamw" in rows:
        plan.append(("ours AdamW (nanoGPT's recipe)", shape.recipe))
    abl = ablation_rows(shape.recipe)
    if "muon" in rows:
        plan.append(abl[0])
    if "ablation" in rows:
        plan += abl[1:-1] + tried_rows(shape.recipe)
    if "preset" in rows:
        plan += seed_rows(PRESET, f" ({ABLATION[-1][0]})", shape, seeds)
    if "modern" in rows:
        plan += modern_rows(shape.preset_flags)
    if "horizon" in rows:
        plan += horizon_rows(shape)
    if "optim" in rows:
        plan += optim_rows(shape)
    if "techniques" in rows:
        plan += technique_rows(shape, seeds)
    if "speedrun" in rows:
        plan += seed_rows(MODERN_PRESET, "", shape, seeds)
    return plan


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="small",
        help="small: nanoGPT's 4L/128, block 64, 16 x 64 tokens, 200 steps; large: 6L/384, block 256, 8 x 256, "
        "600 steps (the presets run at that shape with their own horizon and learning rates)",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="the recipe's steps (default the shape's: 200 or 600; nanoGPT's and the recipe rows'; the target is "
        "nanoGPT's val there); other values only for a smoke run: every row of ours then stops there too",
    )
    ap.add_argument(
        "--eval-every", type=int, default=None, help="steps between evaluations of every run (default 10 or 20)"
    )
    ap.add_argument("--val-tokens", type=int, default=8192, help="val tokens of the shared estimator's windows")
    ap.add_argument("--seeds", type=int, default=3, help="seeds of the final (preset) row")
    ap.add_argument(
        "--rows",
        default="adamw,muon,ablation,preset",
        help="which rows of ours: adamw, muon, ablation (the cumulative changes), preset (--preset speed's seeds), "
        "modern (the architecture options' cumulative changes), speedrun (--preset speedrun's seeds), "
        "horizon (--preset speedrun with each of the shape's other --max-steps; --shape large), optim (--preset "
        "speedrun with each of its optimizer settings moved one step, seed 1337), techniques (--preset speedrun "
        "with each of issue 76's techniques alone, at each seed)",
    )
    ap.add_argument(
        "--nano-runs",
        type=int,
        choices=(1, 2),
        default=2,
        help="nanoGPT runs: 2 brackets ours (before and after), 1 runs it before ours only",
    )
    ap.add_argument(
        "--target",
        type=float,
        default=None,
        help="the target val loss when nanoGPT is not run (--nanogpt none); else nanoGPT's",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="keep the rows of ours whose label contains TEXT (repeatable: any of them), e.g. --only 'batch warmup'",
    )
    nanogpt.add_side_by_side_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "time_to_loss.py"
    shape = SHAPES[args.shape]
    args.steps = shape.steps if args.steps is None else args.steps
    args.eval_every = shape.eval_every if args.eval_every is None else args.eval_every
    rows = set(args.rows.split(","))
    if bad := rows - {"adamw", "muon", "ablation", "preset", "modern", "speedrun", "horizon", "optim", "techniques"}:
        print(
            f"{prog}: error: unknown rows {sorted(bad)}: choose from adamw, muon, ablation, preset, modern, speedrun, "
            "horizon, optim, techniques",
            file=sys.stderr,
        )
        return 2
    if "horizon" in rows and not shape.horizons:
        print(f"{prog}: error: --rows horizon needs --shape large (the small shape has no horizons)", file=sys.stderr)
        return 2
    if args.nanogpt == "none" and args.target is None:
        print(f"{prog}: error: without nanoGPT (--nanogpt none) give the target: --target LOSS", file=sys.stderr)
        return 2
    if min(args.steps, args.eval_every, args.seeds, args.val_tokens) < 1:
        print(f"{prog}: error: --steps, --eval-every, --seeds and --val-tokens must be at least 1", file=sys.stderr)
        return 2
    plan = [row for row in planned_rows(rows, shape, args.seeds) if any(t in row[0] for t in args.only or [""])]
    if not plan:
        only = " ".join(f"--only {t!r}" for t in args.only)
        print(f"{prog}: error: {only} keeps none of the rows of --rows {args.rows}", file=sys.stderr)
        return 2
    require_corpus(args.corpus, prog)
    tree = nanogpt.tree_or_exit(args.nanogpt, args.nanogpt_commit, prog)
    command = "python bench/time_to_loss.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load0 = os.getloadavg()[0]
    torch.set_num_threads(os.cpu_count() or 1)
    smoke = (
        []
        if args.steps == shape.steps
        else ["--max-steps", str(args.steps), "--warmup-steps", "1", "--decay-steps", "0"]
    )
    nano_runs = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shakespeare"
        prepare_by_paragraph(args.corpus, data, prog)
        windows = val_windows(data, args.val_tokens, shape.block)
        dataset = nanogpt.write_dataset(tree, f"ttl-{os.getpid()}", data) if tree else ""
        try:
            if tree:
                nano_runs.append(
                    run_nanogpt(tree, dataset, Path(tmp) / "nano0", args.steps, args.eval_every, windows, shape.nano)
                )
                print(progress_line(nano_runs[0], target=nano_runs[0]["val"][args.steps]), file=sys.stderr, flush=True)
            target = nano_runs[0]["val"][args.steps] if nano_runs else args.target
            dist = single_process("cpu")
            contenders = [
                make_contender(label, flags + smoke, data, Path(tmp) / f"ours{i}", dist)
                for i, (label, flags) in enumerate(plan)
            ]
            run_ours(contenders, windows, target, args.eval_every)
            if tree and args.nano_runs == 2:
                nano_runs.append(
                    run_nanogpt(tree, dataset, Path(tmp) / "nano1", args.steps, args.eval_every, windows, shape.nano)
                )
        finally:
            if tree:
                import shutil

                shutil.rmtree(tree / "data" / dataset, ignore_errors=True)
    lines = header(command, load0, target, tree, args)
    lines += table(nano_runs, contenders, target, args.steps, shape)
    emit("\n".join(lines), args.md)
    return 0


def shape_line(shape: Shape) -> str:
    n = shape.nano
    return (
        f"{n['n_layer']}L/{n['n_embd']}, block {n['block_size']}, {n['batch_size']} x {n['block_size']} tokens a step, "
        f"{shape.steps} steps"
    )


def header(command: str, load0: float, target: float, tree, args) -> list[str]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return [
        f"command: `{command.strip()}`",
        f"date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; {platform.machine()}, {os.cpu_count()} cores, "
        f"avx512_bf16: {precision_choice.cpu_bf16_instructions()}; nanoGPT "
        + (nanogpt.PINNED[:12] if tree else "not run (--nanogpt none)")
        + f"; load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end",
        f"target: val {target:.4f} ("
        + (f"nanoGPT's at step {args.steps}" if tree else "--target")
        + f"); estimator: the first "
        f"{args.val_tokens:,} val tokens in {SHAPES[args.shape].block}-token windows, every {args.eval_every} steps; "
        f"shape {args.shape}: {shape_line(SHAPES[args.shape])}",
        "",
    ]


def table(
    nano_runs: list[dict], contenders: list[Contender], target: float, steps: int, shape: Shape | None = None
) -> list[str]:
    shape = shape or SHAPES["small"]
    goals = shape.goals
    # The last two columns: steps x the median step, robust to the shared machine's bursts (a burst
    # inflates a run's sum but hardly its median); the time columns sum every step as measured.
    lines = [
        "| run | steps to target | s/step (median) | training s to target | time vs nanoGPT | "
        "val at the last step run | steps x median s | vs nanoGPT (steps x median) | tokens to target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = robust_base = None
    if nano_runs:
        reach = [first_reach(r["val"], target) for r in nano_runs]
        secs = [time_to(r["times"], s) for r, s in zip(nano_runs, reach)]
        med = statistics.median(t for r in nano_runs for t in r["times"])
        base = statistics.mean(s for s in secs if s is not None) if any(s is not None for s in secs) else None
        runs = "2 runs, before and after ours" if len(nano_runs) == 2 else "1 run, before ours"
        robust_base = reach[0] * med if reach[0] is not None else None
        lines.append(
            f"| nanoGPT train.py ({runs}) | {reach[0]} | {med:.3f} | "
            + " / ".join("-" if s is None else f"{s:.1f}" for s in secs)
            + " | 1.00x | "
            f"{nano_runs[0]['val'][max(nano_runs[0]['val'])]:.4f} | "
            f"{'-' if robust_base is None else f'{robust_base:.1f}'} | 1.00x | "
            f"{'-' if reach[0] is None else f'{reach[0] * shape.tokens_per_step:,}'} |"
        )
    preset_times, preset_robust = {p: [] for p in goals}, {p: [] for p in goals}
    for c in contenders:
        t = counted_times(c.times, {0}) if c.times else []
        secs = time_to(t, c.reached)
        ratio = "-" if secs is None or base is None else f"{secs / base:.2f}x"
        preset = c.label.split()[1].rstrip(",") if c.label.startswith("--preset") else None
        if preset in goals and secs is not None and base is not None:
            preset_times[preset].append(secs / base)
        last = max(c.val)
        robust = c.reached * statistics.median(t) if c.reached is not None and t else None
        robust_ratio = "-" if robust is None or not robust_base else f"{robust / robust_base:.2f}x"
        if preset in goals and robust is not None and robust_base:
            preset_robust[preset].append(robust / robust_base)
        lines.append(
            f"| {c.label} | {c.reached if c.reached is not None else f'not by {last}'} | "
            f"{statistics.median(t) if t else math.nan:.3f} | {'-' if secs is None else f'{secs:.1f}'} | "
            f"{ratio} | {c.val[last]:.4f} | {'-' if robust is None else f'{robust:.1f}'} | {robust_ratio} | "
            f"{'-' if c.reached is None else f'{tokens_to(c.cfg, c.reached):,}'} |"
        )
    summary = [
        f"- --preset {preset} over {len(ratios)} seed(s), {what} vs nanoGPT: "
        f"{statistics.mean(ratios):.2f}x (min {min(ratios):.2f}x, max {max(ratios):.2f}x); "
        f"goal <= {goal:.2f}x: {'met' if max(ratios) <= goal else 'NOT met'}"
        for preset, goal in goals.items()
        for what, ratios in (("time", preset_times[preset]), ("steps x median s/step", preset_robust[preset]))
        if ratios
    ]
    return lines + ([""] + summary if summary else [])


if __name__ == "__main__":
    sys.exit(main())
