"""Seconds per step, ours against nanoGPT itself, side by side in one run on the same tokens and shapes.

    python bench/vs_nanogpt.py                                   # W1 and the quick start's shape, ~30 min
    python bench/vs_nanogpt.py --nanogpt /path/to/nanoGPT/clone  # no network: a local clone or mirror
    python bench/vs_nanogpt.py --shapes w1 --modes compiled --profile

Shapes (the text: --corpus through data_prep, one document per paragraph; nanoGPT reads the same tokens
from a train.bin/val.bin written from our shards):
  w1      6 layers, 6 heads, 384 wide, block 256, micro-batch 8, 2,048 tokens per step (issue 23's W1)
  debug   the quick start's model (`--preset debug`: 4 layers, 4 heads, 128 wide, block 128), 2,048
          tokens per step as 2 micro-batches of 8 x 128 in one process (nanoGPT: batch_size=8,
          gradient_accumulation_steps=2)
  tiny    2 layers, 2 heads, 64 wide, block 32, 2 sequences per step: the smoke test's
Rows per shape and mode (eager / compiled):
  nanoGPT       `python train.py --device=cpu --compile=... --dtype=float32 --bias=True --dropout=0.0 ...`
                (on a CPU nanoGPT always computes in fp32: its autocast context is nullcontext there)
  ours          `python train_ddp.py` at its defaults (--dtype auto, --loss-impl auto: whatever they pick
                on this machine; the start-up line that says so is shown) with only the shape, the step
                count and the mode given
  ours fp32     the same with --dtype float32
Every row is a real process; the rows run round-robin, --rounds times (A B C ..., then ... C B A), so the
shared machine's load falls on all alike. s/step: the median of every round's steps after --warmup
(compilation happens there), each step timed by its own program (nanoGPT's printed `time`, our
metrics.jsonl `step_s`: both the whole iteration, data included). MFU: model FLOPs (gpt2.plan.flops:
6N + 12LhT per token) per second over the matmul peak of the row's dtype (gpt2.plan.matmul_peak.peak_rate,
measured once per machine and cached, the trainer's own MFU reference). Goals (issue 23): ours at
defaults no slower than nanoGPT's best mode at the shape (>= 1.00x), and MFU >= 75% at W1.
--profile: torch.profiler over our trainer's steps (in this process, built as train_ddp.py builds it)
at every shape and mode run, the top ops by self CPU time: where the time goes.

By micro-batch (--micro-batches B1,B2; the GPU mode, `--device cuda`, defaults to the gpt2 shape and 12,16):

    python bench/vs_nanogpt.py --device cuda --nanogpt .gpu/nanogpt --data-dir .gpu/data --steps 20 --warmup 10
    --rounds 1

  gpt2    GPT-2 124M (`--preset gpt2`: 12 layers, 12 heads, 768 wide, block 1024, vocab 50304), compiled
  smoke   tiny, the micro-batch left to auto as --preset gpt2 leaves it (bench/gpu_session.py --cpu-smoke)
Rows, all compiled (--no-compile: eager, for the CPU smoke test), bf16 on CUDA (fp32 on a CPU, where nanoGPT
has no autocast):
  nanoGPT B     `python train.py --device=cuda --dtype=bfloat16 --compile=True --batch_size=B
                --block_size=1024 --gradient_accumulation_steps=1 ...` for each B
  ours B        `train_ddp.py --preset gpt2 --micro-batch-size B --total-batch-size B*1024` (one micro-step
                per step, as nanoGPT's rows), everything else at its defaults (dtype, loss path: auto)
  ours defaults `train_ddp.py --preset gpt2` as it is: auto micro-batch, 524,288 tokens per step (its
                start-up lines, which say what auto took, are shown); last, first or left out
                (--defaults-row); --micro-batches none runs it alone
tokens/s from the median step time; MFU against the device's data-sheet dense peak in the row's dtype
(gpt2/plan/flops.py's table, the device named by torch.cuda.get_device_name; on a CPU the measured peak);
peak memory: ours the largest `mem_mb` of metrics.jsonl (torch.cuda.max_memory_allocated), nanoGPT the
same counter printed at exit by a wrapper around its unchanged train.py (nanogpt.MEASURE_MEMORY); on a
CPU both are the process's max RSS. Goals: ours >= SAME_BATCH_GOAL (1.03x) nanoGPT's tokens/s at the same
micro-batch, and >= 45% MFU at defaults on an H100; a verdict from fewer than SETTLED_ROUNDS rounds is marked
as not settled. --json writes the rows, after every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nanogpt  # bench/nanogpt.py
import torch
from corpus import prepare_by_paragraph, require_corpus  # bench/corpus.py
from emit import emit  # bench/emit.py (a script's directory is on sys.path)
from flags import QUIET_RUN, SMOKE_SHAPE, W1_SHAPE  # bench/flags.py

from gpt2.core import precision
from gpt2.core.config import train_values
from gpt2.plan import matmul_peak, precision_choice
from gpt2.plan.flops import flops_per_token, format_flops, gpu_table_peak
from gpt2.train.session import parse_config, read_metrics

REPO = Path(__file__).resolve().parent.parent
DEADLINE_ENV = "GPU_SESSION_DEADLINE"
"""bench/gpu_session.py's step deadline (time.time() at which the step's limit ends), the default --deadline-s."""


@dataclass(frozen=True)
class Shape:
    name: str
    ours: tuple[str, ...]
    """train_ddp.py flags giving the shape and batch."""
    nano: dict
    """nanoGPT's configurator values for the same."""
    tokens: int
    """Tokens per optimizer step."""

    @property
    def default_compile(self) -> bool:
        """What our trainer does with no --compile flag at this shape (the default, or the preset's)."""
        return parse_config([*self.ours, "--data-dir", "unused", "--out-dir", "unused"]).train.compute.compile


SHAPES = {
    "w1": Shape(
        "W1: 6L 6H 384w, block 256, 8 x 256",
        tuple(W1_SHAPE),
        dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=8, gradient_accumulation_steps=1),
        2048,
    ),
    "debug": Shape(
        "quick start: --preset debug, 4L 4H 128w, block 128, 2 x 8 x 128",
        ("--preset", "debug"),
        dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=8, gradient_accumulation_steps=2),
        2048,
    ),
    "gpt2": Shape(
        "GPT-2 124M: --preset gpt2, 12L 12H 768w, block 1024, vocab 50304",
        ("--preset", "gpt2"),
        dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=12, gradient_accumulation_steps=1),
        524_288,
    ),
    "tiny": Shape(
        "tiny: 2L 2H 64w, block 32, 2 x 32",
        tuple("--n-layer 2 --n-head 2 --n-embd 64 --block-size 32 --micro-batch-size 2 --total-batch-size 64".split()),
        dict(n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=2, gradient_accumulation_steps=1),
        64,
    ),
    # The GPU session's smoke test (bench/gpu_session.py --cpu-smoke): tiny, with the micro-batch left to
    # auto as --preset gpt2 leaves it, 8 sequences per step for auto to split.
    "smoke": Shape(
        "smoke: 2L 2H 64w, block 32, micro-batch auto of 8 x 32",
        tuple(SMOKE_SHAPE),
        dict(n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=2, gradient_accumulation_steps=1),
        256,
    ),
}
QUIET = ("--device", "cpu", *QUIET_RUN, "--log-interval", "1", "--seed", "1337")
SAME_BATCH_GOAL = 1.03
"""Ours against nanoGPT's own train.py at the same micro-batch: at least this ratio of tokens/s (the second H100
lease's bar, docs/performance.md; the first lease's was 1.00x)."""
SETTLED_ROUNDS = 3
"""A same-micro-batch verdict is settled by the median of at least this many alternated rounds: one round's
1.09x on the second H100 lease read 1.03x in the profiled pair of the same call (docs/performance.md)."""
BY_BATCH_ONLY = ("gpt2", "smoke")
"""Shapes whose nanoGPT batch differs from ours' global batch: compared by micro-batch only."""
NANO_FIXED = dict(
    dtype="float32",
    bias=True,
    dropout=0.0,
    eval_interval=1_000_000,
    eval_iters=1,
    log_interval=1,
    always_save_checkpoint=False,
    warmup_iters=2,
    learning_rate=6e-4,
    min_lr=6e-5,
)


@dataclass
class Row:
    shape: str
    mode: str
    """eager or compiled"""
    who: str
    """nanoGPT, ours, ours fp32"""
    times: list[float] = field(default_factory=list)
    dtype: str = "float32"
    note: str = ""
    """ours: the start-up lines that say which precision and loss path auto took."""
    micro_batch: int | None = None
    """By micro-batch: the row's fixed micro-batch; None for ours at defaults (auto) and the modes layout."""
    resolved_batch: str = ""
    """By micro-batch: what ran, 'B x accumulation' (ours at defaults: what auto took)."""
    tokens: int = 0
    """By micro-batch: tokens per optimizer step."""
    peak_mib: float | None = None
    """By micro-batch: the largest peak memory of its runs (the module docstring says how each is read)."""
    error: str = ""
    """By micro-batch: why the row has no numbers (a failed run), kept so the other rows still report."""
    extra: tuple[str, ...] = ()
    """By micro-batch: train_ddp.py flags added to ours' row (--extra-row), e.g. --compile-scope=blocks."""
    priority: bool = True
    """By micro-batch: runs whatever the deadline; a row without it is skipped when it would not fit."""
    skipped: str = ""
    """By micro-batch: why the row was not run (the deadline), not a failure."""
    first_s: float | None = None
    """By micro-batch: the first step's seconds (compilation happens there) of the row's first run."""
    run_s: float | None = None
    """By micro-batch: the wall seconds of the row's runs, process start to exit, all together."""

    @property
    def name(self) -> str:
        if self.mode == "by-batch":
            name = f"{self.who} B={self.micro_batch}" if self.micro_batch else f"{self.who} defaults"
            return name + (f" {' '.join(self.extra)}" if self.extra else "")
        return f"{self.who} {self.mode}"

    @property
    def step_s(self) -> float:
        return statistics.median(self.times)


@dataclass(frozen=True)
class OursRun:
    step_s: list[float]
    """Per-step seconds from metrics.jsonl, step 1 first."""
    train: dict
    """config.json's resolved train config (dtype, micro_batch_size, compile... as auto made them)."""
    said: str
    """The start-up lines that say what auto took (precision, micro-batch, loss path), joined."""
    peak_mib: float | None
    """The largest mem_mb of the run's metrics records."""


def run_train(flags: list[str], out: Path, timeout: int = 7200) -> OursRun:
    """A real `python train_ddp.py FLAGS` run, read back from its metrics.jsonl, config.json and log."""
    done = subprocess.run(
        [sys.executable, "train_ddp.py", *flags], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode:
        raise RuntimeError(
            f"train_ddp.py {' '.join(flags)} failed (exit {done.returncode}): "
            f"{(done.stdout + done.stderr).strip()[-2000:]}"
        )
    records = sorted((r for r in read_metrics(out / "metrics.jsonl") if "step_s" in r), key=lambda r: r["step"])
    conf = json.loads((out / "config.json").read_text())
    log = out / "train.log"  # every start-up line; the console has only the short start-up
    return OursRun(
        [r["step_s"] for r in records],
        train_values(conf["config"]["train"]),
        startup_said(log.read_text() if log.is_file() else done.stdout + done.stderr),
        max((r["mem_mb"] for r in records if r.get("mem_mb") is not None), default=None),
    )


def startup_said(log: str) -> str:
    """The start-up lines of a train_ddp.py log that say which precision, micro-batch and loss path auto took."""
    return " / ".join(
        line.split("]", 1)[-1].strip()
        for line in log.splitlines()
        if "precision  " in line or "loss       " in line or "micro-batch auto:" in line
    )


def run_ours(row: Row, shape: Shape, data: Path, out: Path, steps: int) -> tuple[list[float], str, str]:
    """A real `python train_ddp.py` run: (per-step seconds from metrics.jsonl, its dtype, its auto lines)."""
    flags = [*shape.ours, *QUIET, "--max-steps", str(steps), "--data-dir", str(data), "--out-dir", str(out)]
    if row.mode == "eager" and shape.default_compile or row.mode == "compiled" and not shape.default_compile:
        flags += ["--compile", str(row.mode == "compiled").lower()]
    if row.who == "ours fp32":
        flags += ["--dtype", "float32"]
    run = run_train(flags, out)
    if run.train["compile"] != (row.mode == "compiled"):  # the row is what its name says
        raise RuntimeError(f"{row.name}: train_ddp.py ran with compile={run.train['compile']}")
    return run.step_s, run.train["dtype"], run.said


def run_nano(row: Row, shape: Shape, tree: Path, dataset: str, out: Path, steps: int) -> list[float]:
    flags = {
        **NANO_FIXED,
        **shape.nano,
        "dataset": dataset,
        "compile": row.mode == "compiled",
        "max_iters": steps - 1,
    }  # iterations 0..max_iters: `steps` of them
    return nanogpt.run(tree, flags, out).step_s


def measure(
    rows: list[Row],
    shapes: dict[str, Shape],
    data: Path,
    tree: Path | None,
    dataset: str,
    tmp: Path,
    *,
    steps: int,
    warmup: int,
    rounds: int,
) -> None:
    """Every row `rounds` times, alternately; each run's steps after the warm-up go into its row."""
    for i in range(rounds):
        for j, row in enumerate(rows if i % 2 == 0 else rows[::-1]):
            out = tmp / f"r{i}_{j}"
            shape = shapes[row.shape]
            if row.who == "nanoGPT":
                times = run_nano(row, shape, tree, dataset, out, warmup + steps)
            else:
                times, row.dtype, row.note = run_ours(row, shape, data, out, warmup + steps)
            row.times += times[warmup:]
            print(
                f"  round {i + 1}/{rounds}: {row.shape} {row.name}: {statistics.median(times[warmup:]):.3f} s/step",
                file=sys.stderr,
                flush=True,
            )


def peak(dtype: str) -> float:
    return matmul_peak.peak_rate("cpu", precision.Precision(dtype, dtype).torch_dtype)


def report_lines(rows: list[Row], shapes: dict[str, Shape], key: str) -> list[str]:
    shape = shapes[key]
    mine = [r for r in rows if r.shape == key]
    cfg = parse_config([*shape.ours, "--data-dir", "unused", "--out-dir", "unused"])
    flops_step = flops_per_token(cfg.model) * shape.tokens
    nano = {r.mode: r for r in mine if r.who == "nanoGPT"}
    best = min(nano.values(), key=lambda r: r.step_s) if nano else None
    lines = [
        f"**{shape.name}** ({flops_step / shape.tokens / 1e6:.1f} MFLOP/token, {shape.tokens:,} tokens/step)",
        "",
        "| row | dtype | s/step | tokens/s | speed vs nanoGPT same mode | vs nanoGPT's best | MFU (own dtype peak) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in mine:
        same = nano.get(r.mode)
        vs = f"{same.step_s / r.step_s:.2f}x" if same else "-"
        vs_best = f"{best.step_s / r.step_s:.2f}x" if best else "-"
        mfu = flops_step / r.step_s / peak(r.dtype)
        lines.append(
            f"| {r.name} | {precision.SHORT_NAMES.get(r.dtype, r.dtype)} | {r.step_s:.3f} | "
            f"{shape.tokens / r.step_s:,.0f} | {vs} | {vs_best} | {mfu:.1%} |"
        )
    default_mode = "compiled" if shape.default_compile else "eager"
    ours = next((r for r in mine if r.who == "ours" and r.mode == default_mode), None)
    notes = [f"- ours at defaults here is `{default_mode}` (train_ddp.py with no --compile flag at this shape)"]
    notes += [f"- {r.name}: its start-up said: {r.note}" for r in mine if r.who == "ours" and r.note]
    if ours and best:
        ratio = best.step_s / ours.step_s
        notes.append(
            f"- ours at defaults ({default_mode}) against nanoGPT's best ({best.name}): **{ratio:.2f}x** "
            f"speed (goal >= 1.00x): {'met' if ratio >= 1 else 'NOT met'}"
        )
    if ours and key == "w1":
        mfu = flops_step / ours.step_s / peak(ours.dtype)
        notes.append(
            f"- MFU of ours at defaults: **{mfu:.1%}** of the measured {ours.dtype} matmul peak "
            f"({peak(ours.dtype) / 1e9:,.0f} GFLOP/s) (goal >= 75%): {'met' if mfu >= 0.75 else 'NOT met'}"
        )
    return lines + [""] + [n for n in notes if n]


def profile_ours(shape: Shape, mode: str, data: Path, out: Path, steps: int, top: int) -> list[str]:
    """Top ops by self CPU time over `steps` steps of our trainer at its defaults (after 2 warm-up steps)."""
    from torch.profiler import ProfilerActivity, profile

    from gpt2.distributed.group import single_process
    from gpt2.train.session import Session

    flags = [
        *shape.ours,
        *QUIET,
        "--max-steps",
        str(steps + 2),
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--compile",
        str(mode == "compiled").lower(),
    ]
    torch._dynamo.reset()
    session = Session(parse_config(flags), single_process("cpu"))
    cfg = session.cfg
    for _ in range(2):
        session.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            session.step()
    session.close()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return [
        f"profile: ours at defaults, {mode}, {shape.name} ({cfg.train.compute.dtype}, loss "
        f"{cfg.train.compute.loss_impl}), "
        f"{steps} steps, top {top} ops by self CPU time:",
        "",
        "```",
        table.strip(),
        "```",
    ]


# ---- By micro-batch (the GPU mode): nanoGPT B, ours B, ours at defaults; every row compiled ----


def quiet_flags(device: str) -> list[str]:
    """QUIET on `device`: no evaluation, samples, plot or periodic checkpoint; every step logged."""
    flags = list(QUIET)
    flags[flags.index("--device") + 1] = device
    return flags


def by_batch_rows(
    shape: str, batches: list[int], with_nano: bool, defaults: str = "last", extra: list[tuple[str, ...]] = ()
) -> list[Row]:
    """nanoGPT B and ours B for each B; ours at defaults last, first (the row that matters most, where
    a time limit may cut the rows after it) or not at all (defaults: last, first, none); then one row of
    ours at the first B (or at defaults) for each of `extra`'s flag sets. The rows that run whatever the
    deadline (priority): the defaults row, and the first B's pair unless the defaults row comes first
    (gpu_session's defaults step: there the B rows are the extras); the others only where they fit."""
    rows = []
    for i, b in enumerate(batches):
        main = i == 0 and defaults != "first"
        rows += ([Row(shape, "by-batch", "nanoGPT", micro_batch=b, priority=main)] if with_nano else []) + [
            Row(shape, "by-batch", "ours", micro_batch=b, priority=main)
        ]
    default = [Row(shape, "by-batch", "ours")]
    rows = {"first": default + rows, "last": rows + default, "none": rows}[defaults]
    base = batches[0] if batches else None
    return rows + [Row(shape, "by-batch", "ours", micro_batch=base, extra=tuple(x), priority=False) for x in extra]


def row_fits(now: float, deadline: float | None, finished_s: list[float]) -> tuple[bool, str]:
    """Whether a low-priority row is expected to finish before the deadline (time.time() values): its
    expected duration is the slowest finished row's (each row compiles in its own process; the first rows
    are the slow ones to compile). No deadline, or no row finished yet to estimate from: it runs."""
    if deadline is None or not finished_s:
        return True, ""
    expected = max(finished_s)
    left = deadline - now
    if expected <= left:
        return True, ""
    return False, f"skipped: time ({left:.0f} s left before the step's deadline, a row takes ~{expected:.0f} s)"


def nano_batch_flags(shape: Shape, batch: int, *, device: str, dataset: str, steps: int, compile: bool = True) -> dict:
    """nanoGPT's train.py flags for one micro-batch row: compiled, bf16 on CUDA (fp32 on a CPU, where its
    autocast is nullcontext anyway), one micro-step per iteration, `steps` iterations."""
    return {
        **NANO_FIXED,
        **shape.nano,
        "device": device,
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "compile": compile,
        "batch_size": batch,
        "gradient_accumulation_steps": 1,
        "dataset": dataset,
        "max_iters": steps - 1,
    }  # iterations 0..max_iters: `steps` of them


def ours_batch_flags(
    shape: Shape, batch: int | None, *, device: str, data: Path, out: Path, steps: int, compile: bool = True
) -> list[str]:
    """train_ddp.py's flags for one micro-batch row: the shape at its defaults (compiled, dtype and loss
    auto), on `device`; batch fixes the micro-batch at one micro-step per step, None leaves it all to auto."""
    flags = [
        *shape.ours,
        *quiet_flags(device),
        "--max-steps",
        str(steps),
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--compile",
        str(compile).lower(),
    ]
    if batch is not None:
        flags += ["--micro-batch-size", str(batch), "--total-batch-size", str(batch * shape.nano["block_size"])]
    return flags


@dataclass(frozen=True)
class BatchRuns:
    """What every run of the micro-batch comparison shares: where it runs, on which tokens, how long."""

    device: str
    data: Path
    """Our shards."""
    tree: Path | None
    """nanoGPT's checkout (None: its rows are not run)."""
    dataset: str
    """The same tokens under nanoGPT's data/."""
    steps: int
    warmup: int
    compile: bool = True


def run_by_batch_row(row: Row, shape: Shape, runs: BatchRuns, out: Path) -> None:
    """One run of a micro-batch row; its timed steps, tokens per step, dtype and peak memory go into the row."""
    block = shape.nano["block_size"]
    device, data, tree, dataset = runs.device, runs.data, runs.tree, runs.dataset
    steps, warmup, compile = runs.steps, runs.warmup, runs.compile
    if row.who == "nanoGPT":
        flags = nano_batch_flags(
            shape, row.micro_batch, device=device, dataset=dataset, steps=warmup + steps, compile=compile
        )
        nano = nanogpt.run(tree, flags, out, wrapper=nanogpt.MEASURE_MEMORY)
        times, row.dtype, peak = nano.step_s, flags["dtype"], nano.peak_mib
        row.tokens, row.resolved_batch = row.micro_batch * block, f"{row.micro_batch} x 1"
    else:
        flags = ours_batch_flags(
            shape, row.micro_batch, device=device, data=data, out=out, steps=warmup + steps, compile=compile
        )
        ours = run_train([*flags, *row.extra], out)
        if ours.train["compile"] != compile:
            raise RuntimeError(f"{row.name}: train_ddp.py ran with compile={ours.train['compile']}")
        times, row.dtype, row.note, peak = ours.step_s, ours.train["dtype"], ours.said, ours.peak_mib
        mb, total = ours.train["micro_batch_size"], ours.train["total_batch_size"]
        row.tokens, row.resolved_batch = total, f"{mb} x {total // (mb * block)}"
    row.times += times[warmup:]
    if row.first_s is None and times:
        row.first_s = times[0]
    if peak is not None:
        row.peak_mib = max(peak, row.peak_mib or 0.0)


def measure_by_batch(
    rows: list[Row],
    shape: Shape,
    runs: BatchRuns,
    *,
    tmp: Path,
    rounds: int,
    after_row=None,
    deadline: float | None = None,
) -> None:
    """Every row `rounds` times, alternately, as measure(); a row whose run fails keeps its error and the
    others go on. after_row(): called after every run (the partial report is written there). deadline
    (time.time()): a row without priority that would not finish before it is skipped (row_fits)."""
    finished: list[float] = []
    for i in range(rounds):
        for j, row in enumerate(rows if i % 2 == 0 else rows[::-1]):
            if row.error or row.skipped:
                continue
            if not row.priority:
                fits, why = row_fits(time.time(), deadline, finished)
                if not fits:
                    row.skipped = why
                    print(f"  round {i + 1}/{rounds}: {row.name}: {why}", file=sys.stderr, flush=True)
                    if after_row:
                        after_row()
                    continue
            t0 = time.time()
            try:
                run_by_batch_row(row, shape, runs, tmp / f"b{i}_{j}")
                said = f"{statistics.median(row.times):.4f} s/step"
                finished.append(time.time() - t0)
            except (RuntimeError, nanogpt.NanoGPTError, subprocess.TimeoutExpired, OSError, KeyError) as e:
                row.error = " ".join(str(e).split())[-300:] or type(e).__name__  # the end says why
                said = f"FAILED: {row.error}"
            row.run_s = (row.run_s or 0.0) + time.time() - t0
            print(f"  round {i + 1}/{rounds}: {row.name}: {said}", file=sys.stderr, flush=True)
            if after_row:
                after_row()


@dataclass(frozen=True)
class Device:
    kind: str
    """cuda or cpu"""
    name: str
    """torch.cuda.get_device_name(), or the CPU's model name."""


def probe_device(kind: str) -> Device:
    """The device's name, asked in a child process so that this one never holds a CUDA context beside
    the rows' processes."""
    if kind == "cpu":
        return Device("cpu", platform.processor() or platform.machine())
    code = "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    name = done.stdout.strip()
    if done.returncode or not name:
        raise RuntimeError(f"--device cuda: no CUDA device here ({(done.stderr.strip() or 'none visible')[-300:]})")
    return Device("cuda", name)


def row_peak(device: Device, dtype: str) -> float | None:
    """The FLOP/s a row's MFU divides by: the data-sheet dense peak of the row's dtype on CUDA (None: the
    GPU is not in gpt2/plan/flops.py's table), the measured matmul peak on a CPU."""
    if device.kind == "cuda":
        return gpu_table_peak(device.name, precision.Precision(dtype, dtype).torch_dtype)
    return peak(dtype)


def by_batch_report(
    rows: list[Row], shape: Shape, device: Device, peaks: dict[str, float | None], *, rounds: int = SETTLED_ROUNDS
) -> list[str]:
    """The table and the goals of the micro-batch layout (rows without numbers say why); rounds: how many
    alternated rounds the rows' medians come from (fewer than SETTLED_ROUNDS: the speed verdict is not settled)."""
    cfg = parse_config([*shape.ours, "--data-dir", "unused", "--out-dir", "unused"])
    per_token = flops_per_token(cfg.model)
    done = [r for r in rows if r.times]
    nano = {r.micro_batch: r for r in done if r.who == "nanoGPT"}
    lines = [
        f"**{shape.name}** on {device.name} ({per_token / 1e6:.1f} MFLOP/token; MFU against "
        + (
            "the data-sheet dense peak of the row's dtype)"
            if device.kind == "cuda"
            else "the measured matmul peak of the row's dtype)"
        ),
        "",
        "| row | micro-batch x accum | dtype | s/step | tokens/s | vs nanoGPT same micro-batch | MFU | peak memory "
        "MiB | first step s | run s |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def tok_s(r: Row) -> float:
        return r.tokens / r.step_s

    for r in rows:
        if not r.times:
            lines.append(f"| {r.name} | - | - | - | - | - | - | - | - | - |  ← {r.skipped or r.error or 'not run'}")
            continue
        same = nano.get(r.micro_batch) if r.who == "ours" else r
        vs = f"{tok_s(r) / tok_s(same):.2f}x" if same else "-"
        pk = peaks.get(r.dtype)
        mfu = f"{tok_s(r) * per_token / pk:.1%}" if pk else "n/a"
        mem = f"{r.peak_mib:,.0f}" if r.peak_mib is not None else "-"
        first = f"{r.first_s:.1f}" if r.first_s is not None else "-"
        wall = f"{r.run_s:.0f}" if r.run_s is not None else "-"
        lines.append(
            f"| {r.name} | {r.resolved_batch} | {precision.SHORT_NAMES.get(r.dtype, r.dtype)} | "
            f"{r.step_s:.4f} | {tok_s(r):,.0f} | {vs} | {mfu} | {mem} | {first} | {wall} |"
        )
    notes = [
        "- peak FLOP/s: "
        + ", ".join(
            f"{precision.SHORT_NAMES.get(d, d)} " + (format_flops(p) if p else "not in gpt2/plan/flops.py's table")
            for d, p in peaks.items()
        )
    ]
    for r in done:
        if r.who == "ours" and r.micro_batch in nano and not r.extra:
            ratio = tok_s(r) / tok_s(nano[r.micro_batch])
            notes.append(
                f"- ours B={r.micro_batch} against nanoGPT B={r.micro_batch}: **{ratio:.2f}x** tokens/s "
                f"(goal >= {SAME_BATCH_GOAL:.2f}x): {'met' if ratio >= SAME_BATCH_GOAL else 'NOT met'}"
                + (
                    ""
                    if rounds >= SETTLED_ROUNDS
                    else f" in {rounds} round(s): not settled (the median of >= {SETTLED_ROUNDS} alternated rounds is)"
                )
            )
    default = next((r for r in done if r.who == "ours" and r.micro_batch is None and not r.extra), None)
    if default:
        pk = peaks.get(default.dtype)
        if pk is None:
            notes.append("- MFU of ours at defaults: n/a (no data-sheet peak for this device and dtype)")
        else:
            mfu = tok_s(default) * per_token / pk
            h100 = device.kind == "cuda" and "h100" in device.name.lower()
            notes.append(
                f"- MFU of ours at defaults: **{mfu:.1%}** (goal >= 45% on an H100): "
                + (("met" if mfu >= 0.45 else "NOT met") if h100 else f"not judged: this is {device.name}")
            )
    notes += [f"- {r.name}: its start-up said: {r.note}" for r in done if r.note]
    notes.append(
        "- first step s: the first step of the row's run, compilation included (ours: metrics.jsonl's step_s; "
        "nanoGPT: its iter 0 time); run s: the row's process, start to exit"
    )
    notes.append(
        "- peak memory: ours the largest mem_mb of metrics.jsonl, nanoGPT printed at exit by a wrapper "
        "around its unchanged train.py: "
        + ("torch.cuda.max_memory_allocated() in both" if device.kind == "cuda" else "the process's max RSS in both")
    )
    return lines + [""] + notes


def rows_json(rows: list[Row], device: Device, peaks: dict[str, float | None], meta: dict) -> str:
    return json.dumps(
        {
            **meta,
            "device": device.name,
            "peaks": peaks,
            "rows": [
                {
                    "name": r.name,
                    "who": r.who,
                    "micro_batch": r.micro_batch,
                    "resolved_batch": r.resolved_batch,
                    "dtype": r.dtype,
                    "tokens_per_step": r.tokens,
                    "step_s": r.times,
                    "median_step_s": r.step_s if r.times else None,
                    "tokens_per_s": r.tokens / r.step_s if r.times else None,
                    "peak_mib": r.peak_mib,
                    "startup": r.note,
                    "error": r.error,
                    "skipped": r.skipped,
                    "extra": list(r.extra),
                    "first_step_s": r.first_s,
                    "run_s": r.run_s,
                }
                for r in rows
            ],
        },
        indent=1,
    )


def main_by_batch(args, shape_key: str, tree: Path | None, command: str) -> int:
    """The micro-batch layout (module docstring): one shape, every row compiled, a partial report after each run."""
    shape = SHAPES[shape_key]
    device = probe_device(args.device)
    batches = parse_batches(args.micro_batches)
    rows = by_batch_rows(
        shape_key, batches, tree is not None, args.defaults_row, [tuple(shlex.split(x)) for x in args.extra_row]
    )
    deadline = time.time() + args.deadline_s if args.deadline_s is not None else None
    if deadline is None and os.environ.get(DEADLINE_ENV):
        deadline = float(os.environ[DEADLINE_ENV])
    meta = {
        "command": command,
        "torch": torch.__version__,
        "nanogpt": nanogpt.PINNED if tree else None,
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
    }
    dtypes = ["bfloat16"] if args.device == "cuda" else ["float32"]
    peaks: dict[str, float | None] = {}

    def report() -> str:
        for d in {*dtypes, *(r.dtype for r in rows if r.times)}:
            if d not in peaks:
                peaks[d] = row_peak(device, d)
        now = datetime.datetime.now(datetime.timezone.utc)
        head = [
            f"command: `{command.strip()}`",
            f"date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; {device.name}; nanoGPT "
            + (f"{nanogpt.PINNED[:12]}" if tree else "not run (--nanogpt none)"),
            f"median of {args.rounds} x {args.steps} steps per row after {args.warmup} warm-up steps per run "
            "(compilation happens there); each step timed by its own program"
            + ("" if args.compile else "; every row EAGER (--no-compile: a smoke test, not a measurement)"),
            "",
        ]
        text = "\n".join(head + by_batch_report(rows, shape, device, peaks, rounds=args.rounds))
        if args.json:
            Path(args.json).write_text(rows_json(rows, device, peaks, meta) + "\n")
        if args.md:
            Path(args.md).write_text(text + "\n")
        return text

    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp) / "shakespeare"
        if args.data_dir is None:
            prepare_by_paragraph(args.corpus, data, "vs_nanogpt.py")
        dataset = nanogpt.write_dataset(tree, f"bench-{os.getpid()}", data) if tree else ""
        report()  # every row "not run" yet: a report exists from the start
        try:
            runs = BatchRuns(args.device, data, tree, dataset, args.steps, args.warmup, args.compile)
            measure_by_batch(rows, shape, runs, tmp=Path(tmp), rounds=args.rounds, after_row=report, deadline=deadline)
        finally:
            if tree:
                subprocess.run(["rm", "-rf", str(tree / "data" / dataset)])
    emit(report(), args.md)
    return 0 if all(r.times or r.skipped for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shapes", default=None, help=f"comma-separated, of {list(SHAPES)} (default w1,debug; with --device cuda gpt2)"
    )
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the micro-batch layout (module docstring) on the GPU, bf16, compiled",
    )
    ap.add_argument(
        "--micro-batches",
        default=None,
        help="comma-separated micro-batches: compare by micro-batch, one shape, every row compiled "
        "(default with --device cuda: 12,16; none: only the row at the shape's defaults)",
    )
    ap.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="token shards already prepared (e.g. .gpu/data from scripts/gpu_prepare.sh) instead of "
        "preparing --corpus; nanoGPT's train.bin/val.bin are written from them",
    )
    ap.add_argument("--json", type=Path, default=None, help="micro-batch layout: also write the rows as JSON here")
    ap.add_argument(
        "--defaults-row",
        choices=("last", "first", "none"),
        default="last",
        help="micro-batch layout: where the row of ours at the shape's defaults (auto micro-batch) goes",
    )
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="micro-batch layout: compile every row (--no-compile: the CPU smoke test of the commands)",
    )
    ap.add_argument(
        "--extra-row",
        action="append",
        default=[],
        metavar="FLAGS",
        help="micro-batch layout: one more row of ours at the first micro-batch with these train_ddp.py flags "
        "(e.g. --extra-row=--compile-scope=blocks), last and low priority (skipped when the deadline is near)",
    )
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="micro-batch layout: seconds from now by which the rows must end: a row after the first micro-batch's "
        f"pair and the defaults row is skipped when it would not fit (default ${DEADLINE_ENV}, a time.time() value, "
        "where set)",
    )
    ap.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first in every run (compilation)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every row, alternating (A B C, C B A, ...)")
    ap.add_argument("--profile", action="store_true", help="also profile our rows' steps (torch.profiler top ops)")
    ap.add_argument("--profile-top", type=int, default=12)
    nanogpt.add_side_by_side_flags(ap)
    return ap


def layout_problem(args, shapes: list[str]) -> str | None:
    """Why the flags do not make one of the two layouts (module docstring), or None."""
    if args.micro_batches is None:
        if args.device == "cuda":
            return "--device cuda compares by micro-batch: give --micro-batches (default 12,16)"
        if by_batch := [s for s in shapes if s in BY_BATCH_ONLY]:
            return f"shape {by_batch[0]} is compared by micro-batch only: give --micro-batches (e.g. 12,16)"
        return None
    if len(shapes) != 1:
        return f"--micro-batches compares one shape at a time, not {shapes}"
    try:
        batches = parse_batches(args.micro_batches)
    except ValueError:
        batches = [0]
    if (not batches and args.micro_batches != "none") or min(batches, default=1) < 1:
        return f"--micro-batches {args.micro_batches!r} must be positive integers, comma-separated (or none)"
    if not batches and args.defaults_row == "none":
        return "--micro-batches none with --defaults-row none leaves no row to run"
    if args.profile:
        return "--profile profiles the eager/compiled layout, not --micro-batches"
    return None


def parse_batches(text: str) -> list[int]:
    """--micro-batches: '12,16' -> [12, 16]; 'none' (only the defaults row) -> []."""
    return [] if text == "none" else [int(b) for b in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "vs_nanogpt.py"
    if args.micro_batches is None and args.device == "cuda":
        args.micro_batches = "12,16"
    if args.shapes is None:
        args.shapes = "gpt2" if args.device == "cuda" else "w1,debug"
    shapes, modes = args.shapes.split(","), args.modes.split(",")
    if bad := [s for s in shapes if s not in SHAPES] + [m for m in modes if m not in ("eager", "compiled")]:
        print(
            f"{prog}: error: unknown shape or mode {bad}: shapes {list(SHAPES)}, modes eager,compiled", file=sys.stderr
        )
        return 2
    if min(args.steps, args.warmup, args.rounds) < 1:
        print(f"{prog}: error: --steps, --warmup and --rounds must be at least 1", file=sys.stderr)
        return 2
    if problem := layout_problem(args, shapes):
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    if args.data_dir is None:
        require_corpus(args.corpus, prog)
    elif not any(args.data_dir.glob("*train*.bin")):
        print(
            f"{prog}: error: --data-dir {args.data_dir} holds no *train*.bin shards: run bash "
            "scripts/gpu_prepare.sh, or leave --data-dir out to prepare --corpus",
            file=sys.stderr,
        )
        return 2
    tree = nanogpt.tree_or_exit(args.nanogpt, args.nanogpt_commit, prog)
    command = "python bench/vs_nanogpt.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.micro_batches is not None:
        return main_by_batch(args, shapes[0], tree, command)
    load0 = os.getloadavg()[0]
    whos = (["nanoGPT"] if tree else []) + ["ours", "ours fp32"]
    rows = [Row(s, m, w) for s in shapes for m in modes for w in whos]
    extra = []
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data_dir or Path(tmp) / "shakespeare"
        if args.data_dir is None:
            prepare_by_paragraph(args.corpus, data, prog)
        dataset = nanogpt.write_dataset(tree, f"bench-{os.getpid()}", data) if tree else ""
        try:
            measure(
                rows, SHAPES, data, tree, dataset, Path(tmp), steps=args.steps, warmup=args.warmup, rounds=args.rounds
            )
            if args.profile:
                for s in shapes:
                    for m in modes:
                        extra += profile_ours(
                            SHAPES[s], m, data, Path(tmp) / f"prof_{s}_{m}", args.steps, args.profile_top
                        ) + [""]
        finally:
            if tree:
                subprocess.run(["rm", "-rf", str(tree / "data" / dataset)])
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [
        f"command: `{command.strip()}`",
        f"date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; {platform.machine()}, {os.cpu_count()} "
        f"cores, avx512_bf16: {precision_choice.cpu_bf16_instructions()}; nanoGPT "
        + (f"{nanogpt.PINNED[:12]}" if tree else "not run (--nanogpt none)"),
        f"median of {args.rounds} x {args.steps} steps per row after {args.warmup} warm-up steps per run; "
        f"rows round-robin; load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end",
        "",
    ]
    for s in shapes:
        lines += report_lines(rows, SHAPES, s) + [""]
    emit("\n".join(lines + extra).rstrip(), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
