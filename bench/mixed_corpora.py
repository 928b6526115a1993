"""Data mixtures (--data-dir A,B --data-weights): what one costs per step, how closely each source gets its
weight, and what mixing does to each source's validation loss (docs/data.md, "Mixtures").

    python bench/mixed_corpora.py                               # the three tables (~15 min on 2 busy cores)
    python bench/mixed_corpora.py --tables cost,shares              # the first two (~3 min)
    python bench/mixed_corpora.py --tables learning --steps 200     # Shakespeare + code, 0.5/0.5, against each alone

cost: the same tokens (tests/data/tinyshakespeare.txt, or --corpus) as 1 source, or cut into 2 or 8 sources
    mixed at equal weights. Per optimizer step: the train loader's own host time (every micro-batch of the
    step read, then advance: what the trainer asks of it, rank 0 of 1) and the trainer's whole step
    (gpt2/train/session.py, eager fp32 on this CPU), at the debug shape (4L 128w, block 128, 8 x 128, 2,048
    tokens a step) and W1 (6L 6H 384w, block 256, 8 x 256, 2,048 tokens). The mixture's cost is its loader
    time above one source's, as a share of the one-source step: the schedule's work, not the step's noise.
shares: the schedule itself (gpt2/data/mixture.py pick): each source's realised share after 1,000 and after
    100,000 sequences against its weight, and the largest distance from weight x n over every prefix n.
learning: the speed preset's recipe (--steps steps) on Shakespeare alone, on a code corpus alone (this Python's
    standard library, every .py file a document) and on both at 0.5/0.5; then each run's final checkpoint
    scored on both val splits (`python -m gpt2.eval loss --data-dir A,B`, --eval-tokens each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from emit import emit

from gpt2.core.schedule import BatchLayout
from gpt2.data.loader import find_shards
from gpt2.data.mixture import MixedShards, pick, quantize, train_loader
from gpt2.data.shards import write_shard
from gpt2.distributed.group import single_process
from gpt2.model.tokenizer import encode
from gpt2.train.session import Session, parse_config

REPO = Path(__file__).resolve().parent.parent
SHAPES = {
    "debug": dict(n_layer=4, n_head=4, n_embd=128, block_size=128, micro_batch_size=8, total_batch_size=2048),
    "W1 6L/384": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, micro_batch_size=8, total_batch_size=2048),
}
SOURCES = (1, 2, 8)
SHARE_WEIGHTS = {
    "0.75 / 0.25": (0.75, 0.25),
    "0.5 / 0.3 / 0.2": (0.5, 0.3, 0.2),
    "1 / 1 / 1": (1, 1, 1),
    "8 sources, 0.3 ... 0.05": (0.3, 0.2, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05),
}


def write_sources(tokens: np.ndarray, k: int, root: Path) -> list[Path]:
    """The corpus cut into k contiguous sources, each a directory with one train shard."""
    dirs = []
    for i, part in enumerate(np.array_split(tokens, k)):
        d = root / f"k{k}" / f"part{i}"
        d.mkdir(parents=True)
        write_shard(d / "train_000000.bin", part.astype(np.uint16))
        dirs.append(d)
    return dirs


def loader_ms(dirs: list[Path], shape: dict, steps: int) -> float:
    """The loader's host time per optimizer step: the mean over `steps` after 5 warm-up steps (a mean: the
    window ids worked out ahead for hundreds of micro-batches at once cost one step in many)."""
    sets = tuple(find_shards(d, "train") for d in dirs)
    shards = sets[0] if len(sets) == 1 else MixedShards(tuple(d.name for d in dirs), tuple(map(str, dirs)), sets)
    layout = BatchLayout(shape["micro_batch_size"], shape["block_size"], shape["total_batch_size"], 1)
    weights = (1.0 / len(dirs),) * len(dirs)
    loader = train_loader(shards, layout, changes=[(0, weights)], rank=0, seed=1337, device=torch.device("cpu"))
    times = []
    with loader:
        for step in range(steps + 5):
            t0 = time.perf_counter()
            for m in range(loader.accum_steps):
                loader.micro_batch(m)
            loader.advance()
            if hasattr(loader, "at_step"):  # a mixture's weights of the next step, as the trainer asks
                loader.at_step(step + 1)
            times.append(time.perf_counter() - t0)
    return statistics.mean(times[5:]) * 1000


def step_ms(dirs: list[Path], shape: dict, steps: int, out: Path) -> float:
    """The trainer's step (train_step through a Session) with these sources: median ms over `steps`."""
    flags = ["--device", "cpu", "--dtype", "float32", "--compile", "false", "--eval-tokens", "0"]
    flags += ["--sample-interval", "0", "--loss-impl", "chunked", "--activation-checkpointing", "none"]
    flags += ["--warmup-steps", "1", "--plot", "false"]
    flags += ["--data-dir", ",".join(map(str, dirs)), "--out-dir", str(out), "--max-steps", str(steps + 3)]
    if len(dirs) > 1:
        flags += ["--data-weights", ",".join(["1"] * len(dirs))]
    for key, value in shape.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    session = Session(parse_config(flags), single_process("cpu"))
    try:
        for _ in range(steps + 3):
            float(session.step()["loss"])
        return statistics.median(session.step_s[3:]) * 1000
    finally:
        session.close()


def cost_table(args, work: Path) -> str:
    tokens = np.array(encode(Path(args.corpus).read_text()), dtype=np.int64)
    dirs = {k: write_sources(tokens, k, work / "cost") for k in SOURCES}
    loads: dict = {}
    steps: dict = {}
    for shape_name, shape in SHAPES.items():
        if shape_name not in args.shapes:
            continue
        for r in range(args.rounds):  # round-robin: the machine's load falls on every row alike
            for k in SOURCES:
                loads.setdefault((shape_name, k), []).append(loader_ms(dirs[k], shape, args.loader_steps))
                steps.setdefault((shape_name, k), []).append(
                    step_ms(dirs[k], shape, args.train_steps, work / "runs" / f"{shape_name[:2]}-{k}-{r}")
                )
    lines = [
        f"cost of a mixture: {len(tokens):,} tokens as 1, 2 or 8 sources at equal weights; loader: mean of "
        f"{args.loader_steps} steps, step: median of {args.train_steps} trainer steps (eager fp32); medians of "
        f"{args.rounds} round(s); torch {torch.__version__}, {os.cpu_count()} CPU(s)",
        "",
        "| shape | sources | loader ms/step | trainer ms/step | mixture's loader cost vs 1 source's step |",
        "|---|---:|---:|---:|---:|",
    ]
    for shape_name in SHAPES:
        if (shape_name, 1) not in loads:
            continue
        base_load = statistics.median(loads[(shape_name, 1)])
        base_step = statistics.median(steps[(shape_name, 1)])
        for k in SOURCES:
            load, step = statistics.median(loads[(shape_name, k)]), statistics.median(steps[(shape_name, k)])
            cost = "-" if k == 1 else f"{(load - base_load) / base_step:+.3%}"
            lines.append(f"| {shape_name} | {k} | {load:.2f} | {step:,.0f} | {cost} |")
    return "\n".join(lines)


def shares_table() -> str:
    lines = [
        "realised shares of the schedule (gpt2/data/mixture.py pick): the largest |share - weight| over the sources",
        "",
        "| weights | after 1,000 | after 100,000 | largest distance from weight x n, any n <= 100,000 |",
        "|---|---:|---:|---:|",
    ]
    for name, weights in SHARE_WEIGHTS.items():
        source, _ = pick(quantize(weights), np.arange(100_000))
        counts = np.stack([np.cumsum(source == k) for k in range(len(weights))])
        share = np.array(weights) / sum(weights)
        at = {n: np.abs(counts[:, n - 1] / n - share).max() for n in (1000, 100_000)}
        far = np.abs(counts - np.outer(share, np.arange(1, 100_001))).max()
        lines.append(f"| {name} | {at[1000]:.3%} | {at[100_000]:.4%} | {far:.2f} sequences |")
    return "\n".join(lines)


def prepare(work: Path, corpus: str) -> tuple[Path, Path]:
    """Shakespeare (by paragraph, as README prepares it) and a code corpus: this Python's standard library."""
    shakespeare, code = work / "shakespeare", work / "code"
    prep = [sys.executable, "-m", "data_prep", "--no-progress", "--val-tokens", "16384"]
    if not shakespeare.exists():
        subprocess.run(
            [*prep, "--source", corpus, "--txt-sample-by", "paragraph", "--out", str(shakespeare)],
            check=True,
            cwd=REPO,
            capture_output=True,
        )
    if not code.exists():
        with open(work / "code.jsonl", "w") as f:
            for path in sorted(Path(os.__file__).parent.glob("*.py")):
                f.write(json.dumps({"text": path.read_text(errors="replace")}) + "\n")
        subprocess.run(
            [*prep, "--source", str(work / "code.jsonl"), "--out", str(code)], check=True, cwd=REPO, capture_output=True
        )
    return shakespeare, code


def learning_table(args, work: Path) -> str:
    shakespeare, code = prepare(work, args.corpus)
    runs = {
        "Shakespeare alone": [str(shakespeare)],
        "code alone": [str(code)],
        "mixture 0.5 / 0.5": [f"{shakespeare},{code}", "--data-weights", "0.5,0.5"],
    }
    rows = []
    for name, data in runs.items():
        out = work / "learn" / name.split()[0].lower()
        train = [sys.executable, "train_ddp.py", "--preset", "speed", "--device", "cpu", "--data-dir", *data]
        train += ["--out-dir", str(out), "--max-steps", str(args.steps), "--eval-tokens", str(args.eval_tokens)]
        train += ["--sample-interval", "0", "--plot", "false", "--resume", "never"]
        t0 = time.perf_counter()
        subprocess.run(train, check=True, cwd=REPO, capture_output=True)
        seconds = time.perf_counter() - t0
        score = [sys.executable, "-m", "gpt2.eval", "loss", "--checkpoint", str(out), "--device", "cpu"]
        score += ["--data-dir", f"{shakespeare},{code}", "--eval-tokens", str(args.eval_tokens), "--json"]
        result = json.loads(subprocess.run(score, check=True, cwd=REPO, capture_output=True, text=True).stdout)
        rows.append((name, result["sources"]["shakespeare"]["loss"], result["sources"]["code"]["loss"], seconds))
    lines = [
        f"learning: the speed preset, {args.steps} steps of 1,024 tokens, each run's final checkpoint scored on "
        f"{args.eval_tokens:,} val tokens of each source",
        "",
        "| trained on | val loss, Shakespeare | val loss, code | train s |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {name} | {a:.4f} | {b:.4f} | {s:.0f} |" for name, a, b, s in rows]
    (_, sa, ca, _), (_, sb, cb, _), (_, sm, cm, _) = rows
    between = min(sa, sb) <= sm <= max(sa, sb) and min(ca, cb) <= cm <= max(ca, cb)
    lines += ["", f"the mixture's loss on each source lies between the two single-source runs': {between}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tables", default="cost,shares,learning", help="which tables: cost, shares, learning")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"the cost table's shapes: {', '.join(SHAPES)}")
    ap.add_argument("--corpus", default=str(REPO / "tests" / "data" / "tinyshakespeare.txt"))
    ap.add_argument("--loader-steps", type=int, default=200, help="loader steps timed per row")
    ap.add_argument("--train-steps", type=int, default=8, help="trainer steps timed per row")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="the learning table's optimizer steps per run")
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--work", default=None, help="where to prepare data and runs (default: a temp dir)")
    ap.add_argument("--md", default=None, help="also write the tables to this file")
    args = ap.parse_args(argv)
    if not Path(args.corpus).is_file():
        print(f"mixture.py: error: --corpus {args.corpus}: no such file", file=sys.stderr)
        return 2
    tables = args.tables.split(",")
    args.shapes = args.shapes.split(",")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        work = Path(tmp)
        parts = []
        if "cost" in tables:
            parts.append(cost_table(args, work))
        if "shares" in tables:
            parts.append(shares_table())
        if "learning" in tables:
            parts.append(learning_table(args, work))
    emit("\n\n".join(parts), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
