"""Learning per token by data order: shuffled windows, sequential, and nanoGPT's random windows.

    python bench/data_order.py                 # ~10 minutes on 2 cores
    python bench/data_order.py --steps 20      # a smoke run

Recipe (nanoGPT's small CPU recipe): 4 layers, 4 heads, 128 wide, block 64, micro-batch 16
(1,024 tokens per step, one process), lr 1e-3 cosine to 1e-4, warmup 20, 200 steps, AdamW (0.9, 0.95),
weight decay 0.1, clip 1.0, fp32, seed 1337. Data: --corpus (default tests/data/tinyshakespeare.txt) through
data_prep
with one document per paragraph and the first 30,000 tokens as val (documents in corpus order, so val
is the beginning of the text). Every row runs the trainer's own build(), train_step() and evaluate();
only the train loader differs:
  shuffled      --data-order shuffled (the default): every window once per epoch, in a random order
  sequential    --data-order sequential: consecutive windows (this project's first loader)
  random (ref)  nanoGPT's get_batch, written here: each row a window at a uniformly random start of
                the train tokens (with replacement), from a generator seeded with the run's seed
The validation loss is over all val tokens, every --eval-every steps.
Goal: shuffled <= random + 0.05 at the last step, and sequential shows the gap that made shuffled the default.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from corpus import add_corpus_flag, prepare_by_paragraph, require_corpus  # bench/corpus.py
from curve import val_curve  # bench/curve.py
from emit import emit  # bench/emit.py (a script's directory is on sys.path)
from flags import NANOGPT_ADAMW, NANOGPT_LR, NANOGPT_SHAPE, NO_OUTPUTS  # bench/flags.py

from gpt2.data.loader import TokenStream, find_shards
from gpt2.train.session import parse_config

RECIPE = [
    *"--device cpu --dtype float32 --compile false".split(),
    *NANOGPT_SHAPE,
    *NANOGPT_LR,
    *NANOGPT_ADAMW,
    *"--seed 1337 --eval-tokens 10000000".split(),
    *NO_OUTPUTS,
]


class RandomWindows:
    """nanoGPT's get_batch as a loader: B windows at uniformly random starts, with replacement."""

    problem: str | None = None  # the trainer's loader interface; data_prep's shards hold GPT-2 ids only

    def __init__(self, data_dir: Path, *, micro_batch_size: int, seq_len: int, seed: int) -> None:
        shards = find_shards(data_dir, "train")
        self.tokens = TokenStream(shards, seed=0, shuffle=False).read(0, shards.total_tokens)
        self.B, self.T = micro_batch_size, seq_len
        self.gen = torch.Generator().manual_seed(seed)

    def micro_batch(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        ix = torch.randint(len(self.tokens) - self.T, (self.B,), generator=self.gen).tolist()
        x = np.stack([self.tokens[i : i + self.T] for i in ix])
        y = np.stack([self.tokens[i + 1 : i + 1 + self.T] for i in ix])
        return torch.from_numpy(x), torch.from_numpy(y)

    def advance(self, tokens: int | None = None) -> None:
        pass


def run(name: str, data_dir: Path, out_dir: Path, steps: int, eval_every: int) -> dict[int, float]:
    order = "sequential" if name == "sequential" else "shuffled"
    cfg = parse_config(
        [
            *RECIPE,
            "--max-steps",
            str(steps),
            "--data-dir",
            str(data_dir),
            "--out-dir",
            str(out_dir),
            "--data-order",
            order,
        ]
    )

    def random_windows(session) -> None:
        session.loader = RandomWindows(data_dir, micro_batch_size=16, seq_len=64, seed=cfg.train.data.seed)

    return val_curve(cfg, name, eval_every, random_windows if name == "random (ref)" else None)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--md", default=None, help="also write the table to this file")
    add_corpus_flag(ap)
    args = ap.parse_args(argv)
    require_corpus(args.corpus, "data_order.py")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shakespeare"
        prepare_by_paragraph(args.corpus, data, "data_order.py")
        names = ["shuffled", "sequential", "random (ref)"]
        results = {n: run(n, data, Path(tmp) / f"run_{i}", args.steps, args.eval_every) for i, n in enumerate(names)}
    steps = sorted(results[names[0]])
    lines = [
        f"val loss by step: tinyshakespeare by paragraph, 4 layers x 128, block 64, 1,024 tokens/step, "
        f"torch {torch.__version__}",
        "",
        "| step | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    lines += [f"| {s} | " + " | ".join(f"{results[n][s]:.4f}" for n in names) + " |" for s in steps]
    last = steps[-1]
    shuffled, sequential, ref = (results[n][last] for n in names)
    lines += [
        "",
        f"- shuffled - random (ref) at step {last}: {shuffled - ref:+.4f} (goal <= +0.05)",
        f"- sequential - random (ref) at step {last}: {sequential - ref:+.4f} (the gap of the sequential order)",
    ]
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
