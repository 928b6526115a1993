"""Where a training step's time goes, ours against nanoGPT's, at issue 56's larger shape on a CPU.

    python bench/step_parts.py --nanogpt /path/to/nanoGPT/clone     # ~4 minutes on 2 cores
    python bench/step_parts.py --nanogpt none --steps 2              # ours only, a smoke

bench/time_to_loss.py --shape large found each of `--preset speedrun`'s steps ~1.3-1.4x nanoGPT's (at the small
shape 0.89x). This takes a step apart at that shape (6 layers x 384, 6 heads, block 256, 8 x 256 tokens of the
corpus, float32, eager: what both programs run on a CPU) into forward with the loss, backward, and the update
(clip, optimizer step, zero_grad), each timed with time.perf_counter, the median over --steps steps after one
untimed step. The rows step round-robin (one step of each in turn), so they share the machine's load; the
trainer row's start-up configures the whole process (gpt2/core/host_memory.py among others) and slows every
row in it, so --rows R runs one alone:
  nanoGPT                      its own model.py (GPT-2's architecture, biases, tied head) and its own
                               configure_optimizers (AdamW, weight decay on the 2-D weights), clip 1.0
  ours, GPT-2 architecture     gpt2.model.GPT with nanoGPT's architecture and AdamW (fused where torch has it)
  ours, modern + AdamW         --preset speedrun's architecture (docs/modern.md) with AdamW
  ours, modern + Muon          --preset speedrun's architecture and optimizer (Muon on the blocks' matrices)
  ours, modern + Muon, no doc mask   the same, attention causal only (--doc-attention false)
  the trainer's train_step      --preset speedrun at this shape through gpt2.train.session (what
                               bench/time_to_loss.py --shape large times): its loss path as auto chose it
                               (named in the row), its clip, spike guard and bookkeeping; one number a step
Each of ours takes --loss-impl as given (default full: the (B, T, V) logits and F.cross_entropy, nanoGPT's path).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import nanogpt  # bench/nanogpt.py
import numpy as np
import torch
from corpus import prepare_by_paragraph, require_corpus  # bench/corpus.py
from emit import emit  # bench/emit.py

from gpt2.core.config import ARCHS, MODEL_PRESETS, ModelConfig, OptimConfig
from gpt2.core.precision import FLOAT32
from gpt2.distributed.group import single_process
from gpt2.model.gpt import GPT
from gpt2.train.session import Session, make_optimizer, parse_config

SHAPE = dict(n_layer=6, n_head=6, n_embd=384, block_size=256)
BATCH = 8
LR = 1e-3
PHASES = ("forward + loss", "backward", "update")
TRAINER_FLAGS = [
    *("--preset", "speedrun", "--n-layer", "6", "--n-head", "6", "--n-embd", "384", "--block-size", "256"),
    *("--micro-batch-size", "8", "--total-batch-size", "2048", "--max-steps", "600", "--device", "cpu"),
    *("--eval-interval", "0", "--eval-tokens", "0", "--sample-interval", "0", "--ckpt-interval", "0"),
    *("--plot", "false", "--log-interval", "1000"),
]
"""bench/time_to_loss.py --shape large's --preset speedrun row (its QUIET flags and the shape's)."""


@dataclass
class Row:
    name: str
    model: torch.nn.Module
    optimizer: object
    forward: object  # (x, y) -> loss
    times: dict[str, list[float]]


def ours(name: str, cfg: ModelConfig, optimizer: str, loss_impl: str) -> Row:
    model = GPT(cfg, loss_impl=loss_impl).train()
    opt = make_optimizer(model, OptimConfig(optimizer=optimizer), torch.device("cpu"), peak_lr=LR, prec=FLOAT32)
    return Row(name, model, opt, lambda x, y: model(x, y, return_logits=False)[1], {p: [] for p in PHASES})


def nano(tree: Path) -> Row:
    import importlib.util

    spec = importlib.util.spec_from_file_location("nanogpt_model", tree / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with contextlib.redirect_stdout(io.StringIO()):  # its parameter-count lines
        model = module.GPT(module.GPTConfig(**SHAPE, vocab_size=50304, bias=True, dropout=0.0)).train()
        opt = model.configure_optimizers(0.1, LR, (0.9, 0.95), "cpu")
    return Row("nanoGPT model.py + its AdamW", model, opt, lambda x, y: model(x, y)[1], {p: [] for p in PHASES})


def step(row: Row, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    t0 = time.perf_counter()
    loss = row.forward(x, y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(row.model.parameters(), 1.0)
    row.optimizer.step()
    row.optimizer.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return dict(zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5, help="timed steps of each row (median), after one untimed")
    ap.add_argument("--loss-impl", choices=("full", "chunked"), default="full", help="ours' loss path")
    ap.add_argument(
        "--rows",
        default="nano,gpt2,modern-adamw,modern-muon,no-doc,trainer",
        help="which rows, stepped round-robin: nano, gpt2, modern-adamw, modern-muon, no-doc, trainer (one alone: "
        "without the others' allocations in the same process)",
    )
    ap.add_argument("--work", type=Path, default=Path("runs/step_parts"), help="the corpus's shards go here")
    nanogpt.add_side_by_side_flags(ap)
    args = ap.parse_args(argv)
    prog = "step_parts.py"
    require_corpus(args.corpus, prog)
    tree = nanogpt.tree_or_exit(args.nanogpt, args.nanogpt_commit, prog) if args.nanogpt != "none" else None
    data = args.work / "data"
    if not any(data.glob("*train*.bin")):
        prepare_by_paragraph(args.corpus, data, prog)
    tokens = nanogpt.shard_tokens(data, "train").astype(np.int64)

    torch.manual_seed(0)
    gpt2_arch = ModelConfig(**SHAPE, vocab_size=50304, **ARCHS["gpt2"])
    speedrun = {k: v for k, v in MODEL_PRESETS["speedrun"].items() if k not in SHAPE}
    modern = ModelConfig(**SHAPE, vocab_size=50304, **speedrun)
    makers = {
        "nano": lambda: nano(tree),
        "gpt2": lambda: ours("ours, GPT-2 architecture + AdamW", gpt2_arch, "adamw", args.loss_impl),
        "modern-adamw": lambda: ours("ours, modern + AdamW", modern, "adamw", args.loss_impl),
        "modern-muon": lambda: ours("ours, modern + Muon (--preset speedrun)", modern, "muon", args.loss_impl),
        "no-doc": lambda: ours(
            "ours, modern + Muon, no doc mask", replace(modern, doc_attention=False), "muon", args.loss_impl
        ),
    }
    wanted = [r for r in args.rows.split(",") if r]
    if bad := set(wanted) - {*makers, "trainer"}:
        ap.error(f"--rows: unknown {sorted(bad)}; choose from {[*makers, 'trainer']}")
    rows = [makers[r]() for r in wanted if r in makers and (r != "nano" or tree)]
    session = (
        Session(
            parse_config([*TRAINER_FLAGS, "--data-dir", str(data), "--out-dir", str(args.work / "run")]),
            single_process("cpu"),
        )
        if "trainer" in wanted
        else None
    )
    trainer_s: list[float] = []
    rng = np.random.default_rng(0)
    T = SHAPE["block_size"]
    for i in range(args.steps + 1):
        starts = rng.integers(0, len(tokens) - T - 1, BATCH)
        x = torch.from_numpy(np.stack([tokens[s : s + T] for s in starts]))
        y = torch.from_numpy(np.stack([tokens[s + 1 : s + T + 1] for s in starts]))
        for row in rows:
            took = step(row, x, y)
            if i:  # the first allocates the optimizers' state
                for p in PHASES:
                    row.times[p].append(took[p])
        if session is not None:
            session.step()
            if i:
                trainer_s.append(session.step_s[-1])
    if session is not None:
        session.close()

    command = "python bench/step_parts.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"command: `{command}`",
        f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; 6 x 384, block 256, {BATCH} x {T} tokens, float32, eager; ours' loss: "
        f"{args.loss_impl}; median of {args.steps} steps, round-robin",
        "",
        "| row | " + " | ".join(f"{p} s" for p in PHASES) + " | step s | vs first row |",
        "|---|" + "---:|" * (len(PHASES) + 2),
    ]
    base = None
    for row in rows:
        med = [statistics.median(row.times[p]) for p in PHASES]
        total = sum(med)
        base = base or total
        cells = " | ".join(f"{m:.3f}" for m in med)
        lines.append(f"| {row.name} | {cells} | {total:.3f} | {total / base:.2f}x |")
    if session is not None:
        total = statistics.median(trainer_s)
        base = base or total
        name = f"the trainer's train_step (--preset speedrun, loss {session.decided.loss.impl})"
        lines.append(f"| {name} | - | - | - | {total:.3f} | {total / base:.2f}x |")
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
