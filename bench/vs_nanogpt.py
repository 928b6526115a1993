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
metrics.jsonl `step_s`: both the whole iteration, data included). MFU: model FLOPs (gpt2.flops:
6N + 12LhT per token) per second over the matmul peak of the row's dtype (gpt2.precision.peak_rate,
measured once per machine and cached, the trainer's own MFU reference). Goals (issue 23): ours at
defaults no slower than nanoGPT's best mode at the shape (>= 1.00x), and MFU >= 75% at W1.
--profile: torch.profiler over our trainer's steps (in this process, built as train_ddp.py builds it)
at every shape and mode run, the top ops by self CPU time: where the time goes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gpt2 import precision
from gpt2.cli import parse_config
from gpt2.flops import flops_per_token
from gpt2.metrics import read_metrics

import nanogpt  # bench/nanogpt.py
from corpus import prepare_by_paragraph, require_corpus  # bench/corpus.py
from report import emit  # bench/report.py (a script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent


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
        return parse_config([*self.ours, "--data-dir", "unused", "--out-dir", "unused"]).train.compile


SHAPES = {
    "w1": Shape("W1: 6L 6H 384w, block 256, 8 x 256", ("--n-layer", "6", "--n-head", "6", "--n-embd", "384",
                "--block-size", "256", "--micro-batch-size", "8", "--total-batch-size", "2048"),
                dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=8, gradient_accumulation_steps=1),
                2048),
    "debug": Shape("quick start: --preset debug, 4L 4H 128w, block 128, 2 x 8 x 128", ("--preset", "debug"),
                   dict(n_layer=4, n_head=4, n_embd=128, block_size=128, batch_size=8, gradient_accumulation_steps=2),
                   2048),
    "tiny": Shape("tiny: 2L 2H 64w, block 32, 2 x 32", ("--n-layer", "2", "--n-head", "2", "--n-embd", "64",
                  "--block-size", "32", "--micro-batch-size", "2", "--total-batch-size", "64"),
                  dict(n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=2, gradient_accumulation_steps=1),
                  64),
}
QUIET = ("--device", "cpu", "--eval-interval", "0", "--eval-tokens", "0", "--sample-interval", "0",
         "--ckpt-interval", "0", "--plot", "false", "--log-interval", "1", "--seed", "1337")
NANO_FIXED = dict(dtype="float32", bias=True, dropout=0.0, eval_interval=1_000_000, eval_iters=1, log_interval=1,
                  always_save_checkpoint=False, warmup_iters=2, learning_rate=6e-4, min_lr=6e-5)


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

    @property
    def name(self) -> str:
        return f"{self.who} {self.mode}"

    @property
    def step_s(self) -> float:
        return statistics.median(self.times)


def run_ours(row: Row, shape: Shape, data: Path, out: Path, steps: int) -> tuple[list[float], str, str]:
    """A real `python train_ddp.py` run: (per-step seconds from metrics.jsonl, its dtype, its auto lines)."""
    flags = [*shape.ours, *QUIET, "--max-steps", str(steps), "--data-dir", str(data), "--out-dir", str(out)]
    if row.mode == "eager" and shape.default_compile or row.mode == "compiled" and not shape.default_compile:
        flags += ["--compile", str(row.mode == "compiled").lower()]
    if row.who == "ours fp32":
        flags += ["--dtype", "float32"]
    done = subprocess.run([sys.executable, "train_ddp.py", *flags], cwd=REPO, capture_output=True, text=True,
                          timeout=7200)
    if done.returncode:
        raise RuntimeError(f"train_ddp.py {' '.join(flags)} failed: {done.stderr.strip()[-2000:]}")
    records = [r for r in read_metrics(out / "metrics.jsonl") if "step_s" in r]
    conf = json.loads((out / "config.json").read_text())
    if conf["config"]["train"]["compile"] != (row.mode == "compiled"):  # the row is what its name says
        raise RuntimeError(f"{row.name}: train_ddp.py ran with compile={conf['config']['train']['compile']}")
    said = [line.split("]", 1)[-1].strip() for line in (done.stdout + done.stderr).splitlines()
            if "precision  " in line or "loss       " in line]
    return [r["step_s"] for r in sorted(records, key=lambda r: r["step"])], conf["config"]["train"]["dtype"], " / ".join(said)


def run_nano(row: Row, shape: Shape, tree: Path, dataset: str, out: Path, steps: int) -> list[float]:
    flags = {**NANO_FIXED, **shape.nano, "dataset": dataset, "compile": row.mode == "compiled",
             "max_iters": steps - 1}  # iterations 0..max_iters: `steps` of them
    return nanogpt.run(tree, flags, out).step_s


def measure(rows: list[Row], shapes: dict[str, Shape], data: Path, tree: Path | None, dataset: str, tmp: Path, *,
            steps: int, warmup: int, rounds: int) -> None:
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
            print(f"  round {i + 1}/{rounds}: {row.shape} {row.name}: {statistics.median(times[warmup:]):.3f} s/step",
                  file=sys.stderr, flush=True)


def peak(dtype: str) -> float:
    return precision.peak_rate("cpu", precision.torch_dtype(dtype))


def report_lines(rows: list[Row], shapes: dict[str, Shape], key: str) -> list[str]:
    shape = shapes[key]
    mine = [r for r in rows if r.shape == key]
    cfg = parse_config([*shape.ours, "--data-dir", "unused", "--out-dir", "unused"])
    flops_step = flops_per_token(cfg.model) * shape.tokens
    nano = {r.mode: r for r in mine if r.who == "nanoGPT"}
    best = min(nano.values(), key=lambda r: r.step_s) if nano else None
    lines = [f"**{shape.name}** ({flops_step / shape.tokens / 1e6:.1f} MFLOP/token, {shape.tokens:,} tokens/step)", "",
             "| row | dtype | s/step | tokens/s | speed vs nanoGPT same mode | vs nanoGPT's best | MFU (own dtype peak) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in mine:
        same = nano.get(r.mode)
        vs = f"{same.step_s / r.step_s:.2f}x" if same else "-"
        vs_best = f"{best.step_s / r.step_s:.2f}x" if best else "-"
        mfu = flops_step / r.step_s / peak(r.dtype)
        lines.append(f"| {r.name} | {precision.SHORT_NAMES.get(r.dtype, r.dtype)} | {r.step_s:.3f} | "
                     f"{shape.tokens / r.step_s:,.0f} | {vs} | {vs_best} | {mfu:.1%} |")
    default_mode = "compiled" if shape.default_compile else "eager"
    ours = next((r for r in mine if r.who == "ours" and r.mode == default_mode), None)
    notes = [f"- ours at defaults here is `{default_mode}` (train_ddp.py with no --compile flag at this shape)"]
    notes += [f"- {r.name}: its start-up said: {r.note}" for r in mine if r.who == "ours" and r.note]
    if ours and best:
        ratio = best.step_s / ours.step_s
        notes.append(f"- ours at defaults ({default_mode}) against nanoGPT's best ({best.name}): **{ratio:.2f}x** "
                     f"speed (goal >= 1.00x): {'met' if ratio >= 1 else 'NOT met'}")
    if ours and key == "w1":
        mfu = flops_step / ours.step_s / peak(ours.dtype)
        notes.append(f"- MFU of ours at defaults: **{mfu:.1%}** of the measured {ours.dtype} matmul peak "
                     f"({peak(ours.dtype) / 1e9:,.0f} GFLOP/s) (goal >= 75%): {'met' if mfu >= 0.75 else 'NOT met'}")
    return lines + [""] + [n for n in notes if n]


def profile_ours(shape: Shape, mode: str, data: Path, out: Path, steps: int, top: int) -> list[str]:
    """Top ops by self CPU time over `steps` steps of our trainer at its defaults (after 2 warm-up steps)."""
    from torch.profiler import ProfilerActivity, profile

    from gpt2.dist import single_process
    from gpt2.metrics import Metrics
    from gpt2.startup import check_data, configure_backends, resolve_auto
    from gpt2.trainer import build, train_step

    flags = [*shape.ours, *QUIET, "--max-steps", str(steps + 2), "--data-dir", str(data), "--out-dir", str(out),
             "--compile", str(mode == "compiled").lower()]
    dist = single_process("cpu")
    log = Metrics(dist, out)
    cfg, _, _ = resolve_auto(parse_config(flags), dist, log)
    configure_backends(cfg.train, dist)
    torch._dynamo.reset()
    parts = build(cfg, dist, log, check_data(cfg, 1))
    for _ in range(2):
        train_step(parts, cfg, dist, False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            train_step(parts, cfg, dist, False)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return [f"profile: ours at defaults, {mode}, {shape.name} ({cfg.train.dtype}, loss {cfg.train.loss_impl}), "
            f"{steps} steps, top {top} ops by self CPU time:", "", "```", table.strip(), "```"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="w1,debug", help=f"comma-separated, of {list(SHAPES)}")
    ap.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per run (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first in every run (compilation)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every row, alternating (A B C, C B A, ...)")
    ap.add_argument("--profile", action="store_true", help="also profile our rows' steps (torch.profiler top ops)")
    ap.add_argument("--profile-top", type=int, default=12)
    nanogpt.add_side_by_side_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "vs_nanogpt.py"
    shapes, modes = args.shapes.split(","), args.modes.split(",")
    if bad := [s for s in shapes if s not in SHAPES] + [m for m in modes if m not in ("eager", "compiled")]:
        print(f"{prog}: error: unknown shape or mode {bad}: shapes {list(SHAPES)}, modes eager,compiled", file=sys.stderr)
        return 2
    if min(args.steps, args.warmup, args.rounds) < 1:
        print(f"{prog}: error: --steps, --warmup and --rounds must be at least 1", file=sys.stderr)
        return 2
    require_corpus(args.corpus, prog)
    tree = nanogpt.tree_or_exit(args.nanogpt, args.nanogpt_commit, prog)
    command = "python bench/vs_nanogpt.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load0 = os.getloadavg()[0]
    whos = (["nanoGPT"] if tree else []) + ["ours", "ours fp32"]
    rows = [Row(s, m, w) for s in shapes for m in modes for w in whos]
    extra = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shakespeare"
        prepare_by_paragraph(args.corpus, data, prog)
        dataset = nanogpt.write_dataset(tree, f"bench-{os.getpid()}", data) if tree else ""
        try:
            measure(rows, SHAPES, data, tree, dataset, Path(tmp), steps=args.steps, warmup=args.warmup,
                    rounds=args.rounds)
            if args.profile:
                for s in shapes:
                    for m in modes:
                        extra += profile_ours(SHAPES[s], m, data, Path(tmp) / f"prof_{s}_{m}", args.steps,
                                              args.profile_top) + [""]
        finally:
            if tree:
                subprocess.run(["rm", "-rf", str(tree / "data" / dataset)])
    now = datetime.datetime.now(datetime.timezone.utc)
    lines = [f"command: `{command.strip()}`",
             f"date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; {platform.machine()}, {os.cpu_count()} "
             f"cores, avx512_bf16: {precision.cpu_bf16_instructions()}; nanoGPT "
             + (f"{nanogpt.PINNED[:12]}" if tree else "not run (--nanogpt none)"),
             f"median of {args.rounds} x {args.steps} steps per row after {args.warmup} warm-up steps per run; "
             f"rows round-robin; load average {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end", ""]
    for s in shapes:
        lines += report_lines(rows, SHAPES, s) + [""]
    emit("\n".join(lines + extra).rstrip(), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
