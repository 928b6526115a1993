"""The train loader alone at GPU-scale batches: tokens/s per rank, page cache warm and cold.

    python bench/loader_throughput.py                      # ~1-2 minutes, ~1.6 GB of shards in a temp dir
    python bench/loader_throughput.py --shards 8 --steps 100 --dir /scratch

Goal: 20x what an A100 consumes training GPT-2 124M (~190k tokens/s per GPU, from
build-nanogpt's ~1.5M tokens/s on 8), so >= 3.8M tokens/s per rank. Layout: rank 0 of 8,
micro-batch 64 x 1024 (524,288 tokens per step, no accumulation), shards of 100M random tokens
(data_prep's default shard size). Each row times --steps calls of micro_batch() + advance() on a
loader at a fresh position, for both data orders:
  warm   the shards were just read whole (`cat` into the page cache)
  cold   the page cache was dropped first (echo 1 > /proc/sys/vm/drop_caches: needs root; the
         table says so when it could not), so every shuffled row is a random 2 KB read from disk
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from gpt2.core.config import GPT2_VOCAB_SIZE
from gpt2.core.schedule import BatchLayout
from gpt2.data.loader import DATA_ORDERS, TrainLoader, find_shards
from gpt2.data.shards import write_shard

B, T, WORLD = 64, 1024, 8
GOAL = 3.8e6


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def time_loader(shards, order: str, steps: int, start_step: int) -> float:
    loader = TrainLoader(
        shards, BatchLayout(B, T, B * T * WORLD, WORLD), rank=0, seed=1337, device=torch.device("cpu"), order=order
    )
    loader.position = start_step * loader.G  # a part of the order no earlier row has read
    t0 = time.perf_counter()
    for _ in range(steps):
        x, y = loader.micro_batch(0)
        loader.advance()
    assert x.shape == (B, T) and torch.equal(x[:, 1:], y[:, :-1])
    return steps * B * T / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8, help="shards of --shard-tokens random tokens")
    ap.add_argument("--shard-tokens", type=int, default=100_000_000)
    ap.add_argument("--steps", type=int, default=50, help="timed steps per row")
    ap.add_argument("--dir", default=None, help="where to write the shards (default: a temp dir)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        gen = np.random.default_rng(0)
        for i in range(args.shards):
            write_shard(
                Path(tmp) / f"bench_train_{i:06d}.bin",
                gen.integers(0, GPT2_VOCAB_SIZE, args.shard_tokens, dtype=np.uint16),
            )
        shards = find_shards(tmp, "train")
        rows = []
        for k, order in enumerate(DATA_ORDERS):
            subprocess.run(["cat", *map(str, shards.paths)], stdout=subprocess.DEVNULL, check=True)
            rows.append((order, "warm", time_loader(shards, order, args.steps, start_step=2 * k * args.steps)))
            dropped = drop_caches()
            rows.append(
                (
                    order,
                    "cold" if dropped else "cold (cache NOT dropped: not root)",
                    time_loader(shards, order, args.steps, start_step=(2 * k + 1) * args.steps),
                )
            )
    total = args.shards * args.shard_tokens
    print(
        f"loader alone: rank 0 of {WORLD}, micro-batch {B} x {T}, {args.steps} steps per row, {args.shards} "
        f"shards of {args.shard_tokens:,} tokens ({total * 2 / 1e9:.1f} GB), torch {torch.__version__}\n"
    )
    print("| order | page cache | tokens/s per rank | vs goal 3.8M |")
    print("|---|---|---:|---:|")
    for order, cache, rate in rows:
        print(f"| {order} | {cache} | {rate / 1e6:,.1f}M | {rate / GOAL:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
