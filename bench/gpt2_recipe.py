"""The GPT-2-size recipe against GPT-2's, per token, at a width a CPU trains: --preset gpt2-speedrun beside
--preset gpt2 on the same tokens (issue 76's sanity table).

    python bench/gpt2_recipe.py                 # ~10 min on 2 cores: 200 steps of each, 12 layers x 128
    python bench/gpt2_recipe.py --steps 20 --eval-every 10      # a smoke run

Both presets as they are (gpt2/core/config.py) but for the size: 12 layers (GPT-2's depth), 4 heads x 32 = 128
wide, block 128, 8 x 128 tokens a step; fp32, eager, on this CPU; seed 1337 for both. Each preset's schedule keeps
its shape over --steps: gpt2's warmup (715 of 19,073 steps) and gpt2-speedrun's linear decay (the last 1,308 of
4,578) and Muon momentum warmup (500) become the same shares of the run. Their learning rates are the presets',
tuned for 524,288-token steps at full width, not for this size: the table is a sanity check that the recipe wins
per token here too, not a tuned comparison. Both step round-robin in one process; one validation estimator for
both (bench/time_to_loss.py's: the first --val-tokens val tokens of Shakespeare in block-size windows), every
--eval-every steps. Columns: each run's val loss at each evaluated step; below, the step at which gpt2-speedrun
first reaches gpt2's final val loss (its tokens over gpt2's), and each run's median s/step. Exit status 0 when it
reaches it, 1 when not within the run (the sanity check failed; a few-step smoke run may read either).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from corpus import add_corpus_flag, prepare_by_paragraph, require_corpus  # bench/corpus.py
from emit import emit  # bench/emit.py
from time_to_loss import first_reach, make_contender, run_ours, val_windows  # bench/time_to_loss.py

from gpt2.core.config import TRAIN_PRESETS
from gpt2.distributed.group import single_process

SIZE = [
    *("--n-layer", "12", "--n-head", "4", "--n-embd", "128", "--block-size", "128"),
    *("--micro-batch-size", "8", "--total-batch-size", "1024"),
    *("--dtype", "float32", "--compile", "false", "--seed", "1337"),
]
"""GPT-2's depth at 128 wide, 1,024 tokens a step: both presets at this size."""
PRESETS = ("gpt2", "gpt2-speedrun")


def scaled_schedule(preset: str, steps: int) -> list[str]:
    """The preset's schedule over `steps` instead of its own max_steps: each of its step counts (warmup, decay,
    Muon momentum warmup) the same share of the run, rounded, at least 1 where the preset has one."""
    p = TRAIN_PRESETS[preset]
    flags = ["--max-steps", str(steps)]
    for key in ("warmup_steps", "decay_steps", "muon_momentum_warmup"):
        if p.get(key):
            flags += ["--" + key.replace("_", "-"), str(max(1, round(p[key] * steps / p["max_steps"])))]
    return flags


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="steps of each run (default 200)")
    ap.add_argument("--eval-every", type=int, default=20, help="steps between evaluations (default 20)")
    ap.add_argument("--val-tokens", type=int, default=16_384, help="val tokens of the shared estimator's windows")
    add_corpus_flag(ap)
    ap.add_argument("--md", type=Path, help="also write the report here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = "gpt2_recipe.py"
    if min(args.steps, args.eval_every, args.val_tokens) < 1:
        print(f"{prog}: error: --steps, --eval-every and --val-tokens must be at least 1", file=sys.stderr)
        return 2
    require_corpus(args.corpus, prog)
    command = "python bench/gpt2_recipe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    load0 = os.getloadavg()[0]
    torch.set_num_threads(os.cpu_count() or 1)
    rows = [(p, ["--preset", p, *SIZE, *scaled_schedule(p, args.steps)]) for p in PRESETS]
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shakespeare"
        prepare_by_paragraph(args.corpus, data, prog)
        windows = val_windows(data, args.val_tokens, 128)
        dist = single_process("cpu")
        contenders = [make_contender(p, flags, data, Path(tmp) / p, dist) for p, flags in rows]
        run_ours(contenders, windows, None, args.eval_every)
    gpt2, recipe = contenders
    final = gpt2.val[max(gpt2.val)]
    reached = first_reach(recipe.val, final)
    med = [statistics.median(c.times) for c in contenders]
    lines = [
        f"# `{command}`",
        "",
        f"{datetime.date.today()}, {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}, load average {load0:.1f} at the start. Both at 12 layers x 128, block 128, 1,024 "
        "tokens a step, fp32, eager, seed 1337; schedules scaled to the run:",
        "",
        *(f"- `{' '.join(flags)}`" for _, flags in rows),
        "",
        "| step | tokens | `--preset gpt2` val | `--preset gpt2-speedrun` val |",
        "|---:|---:|---:|---:|",
        *(
            f"| {s} | {s * 1024:,} | {gpt2.val[s]:.4f} | {recipe.val[s]:.4f} |"
            for s in sorted(gpt2.val)
            if s in recipe.val
        ),
        "",
        f"- gpt2's final val loss {final:.4f} (step {max(gpt2.val)}); gpt2-speedrun reaches it "
        + (
            f"at step {reached}: **{reached / max(gpt2.val):.2f}x** its tokens"
            if reached is not None
            else "**not** within the run"
        ),
        f"- median s/step: gpt2 {med[0]:.3f}, gpt2-speedrun {med[1]:.3f} ({med[1] / med[0]:.2f}x; eager fp32 here)",
    ]
    emit("\n".join(lines), args.md)
    return 0 if reached is not None else 1


if __name__ == "__main__":
    sys.exit(main())
