"""Learning per step: AdamW (this project's defaults) against --optimizer muon, on the same tokens.

    python bench/optimizers.py                          # both shapes, ~1 hour on 2 cores
    python bench/optimizers.py --shapes small --steps 30 --eval-every 10   # a smoke run
    python bench/optimizers.py --results runs.json      # keep each run's curve; a rerun skips finished ones

Shapes (data: --corpus, default tests/data/tinyshakespeare.txt, through data_prep, one document per paragraph, the
first 30,000 tokens as val; fp32; seed 1337; warmup 20 steps, cosine to lr/10; clip 1.0; wd 0.1):
  small    4 layers, 4 heads, 128 wide, block 64, 16 sequences (1,024 tokens) per step, eager
           (bench/data_order.py's recipe, nanoGPT's small CPU one)
  medium   6 layers, 6 heads, 384 wide, block 256, 8 sequences (2,048 tokens) per step, compiled
Each shape runs AdamW at every --adamw-lrs value, then Muon at every --muon-lrs value with AdamW's
best lr for the parameters Muon does not take (embeddings, biases, LayerNorm): a small sweep for
both, so that neither optimizer is handicapped by one untuned lr; while a sweep's best lr is its
lowest or highest, it goes on past that end, doubling or halving (--extend runs at most). Every run goes through the
trainer's own build(), train_step() and evaluate(); the validation loss is over all val tokens every
--eval-every steps. Reported per shape: the val loss table, and the first evaluated step at which the
best Muon run reaches the best AdamW run's final val loss, as a fraction of AdamW's steps (goal: at
most 0.75), with each optimizer's step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from corpus import add_corpus_flag, prepare_by_paragraph, require_corpus  # bench/corpus.py
from curve import val_curve  # bench/curve.py
from emit import emit  # bench/emit.py (a script's directory is on sys.path)
from flags import NANOGPT_ADAMW, NANOGPT_SHAPE, NO_OUTPUTS, W1_SHAPE  # bench/flags.py

from gpt2.train.session import parse_config

COMMON = [*"--device cpu --dtype float32 --warmup-steps 20".split(), *NANOGPT_ADAMW, "--seed", "1337", *NO_OUTPUTS]
SHAPES = {"small": [*NANOGPT_SHAPE, "--compile", "false"], "medium": [*W1_SHAPE, "--compile", "true"]}
DEFAULT_ADAMW_LRS = {"small": "1e-3,2e-3,4e-3", "medium": "1e-3,2e-3"}
DEFAULT_MUON_LRS = {"small": "0.01,0.02,0.04", "medium": "0.02,0.04"}


def run_one(
    shape: str,
    optimizer: str,
    lr: float,
    muon_lr: float | None,
    data: Path,
    out: Path,
    steps: int,
    eval_every: int,
    eval_tokens: int,
) -> dict:
    flags = [
        *COMMON,
        *SHAPES[shape],
        "--max-steps",
        str(steps),
        "--lr",
        str(lr),
        "--min-lr",
        str(lr / 10),
        "--data-dir",
        str(data),
        "--out-dir",
        str(out),
        "--optimizer",
        optimizer,
        "--eval-tokens",
        str(eval_tokens),
    ]
    if muon_lr is not None:
        flags += ["--muon-lr", str(muon_lr)]
    cfg = parse_config(flags)
    torch._dynamo.reset()  # each run compiles its own model afresh
    label = f"{shape} {optimizer} lr {lr:g}{'' if muon_lr is None else f' muon-lr {muon_lr:g}'}"
    val, times = val_curve(cfg, label, eval_every)
    return {
        "shape": shape,
        "optimizer": optimizer,
        "lr": lr,
        "muon_lr": muon_lr,
        "steps": steps,
        "val": {str(k): v for k, v in val.items()},
        "step_s": statistics.median(times[5:] or times),
    }


def final_val(r: dict) -> float:
    return r["val"][str(r["steps"])]


def sweep(lrs: list[float], run, extend: int) -> float:
    """The lr of the lowest final val loss: every lr of lrs, then, while the best is at an end of
    the range tried, the lr twice past that end (at most `extend` more runs), so that no optimizer's
    best lr lies outside its sweep. run(lr) returns a finished run's record."""
    tried = {lr: final_val(run(lr)) for lr in sorted(lrs)}
    for _ in range(extend):
        best = min(tried, key=tried.get)
        if len(tried) > 1 and min(tried) < best < max(tried):
            break
        edge = best * 2 if best == max(tried) else best / 2
        tried[edge] = final_val(run(edge))
    return min(tried, key=tried.get)


def key(r: dict) -> str:
    return f"{r['shape']}/{r['optimizer']}/{r['lr']:g}/{r['muon_lr']}/{r['steps']}"


def steps_to_reach(val: dict[int, float], target: float) -> int | None:
    """First evaluated step whose val loss is at or below target."""
    return next((s for s in sorted(val) if val[s] <= target), None)


def report(runs: list[dict], shape: str) -> list[str]:
    mine = [r for r in runs if r["shape"] == shape]
    adamw = sorted((r for r in mine if r["optimizer"] == "adamw"), key=lambda r: r["lr"])
    if not adamw:
        return []
    final = {id(r): r["val"][str(r["steps"])] for r in mine}
    best_a = min(adamw, key=lambda r: final[id(r)])
    muon = sorted(
        (r for r in mine if r["optimizer"] == "muon" and r["lr"] == best_a["lr"]),  # beside AdamW's best
        key=lambda r: r["muon_lr"],
    )
    best_m = min(muon, key=lambda r: final[id(r)]) if muon else None
    names = [f"AdamW lr {r['lr']:g}" for r in adamw] + [f"Muon {r['muon_lr']:g} (AdamW part {r['lr']:g})" for r in muon]
    cols = adamw + muon
    steps = sorted({int(s) for r in cols for s in r["val"]})
    lines = [
        f"**{shape}** ("
        + " ".join(SHAPES[shape][:12:2][i] + "=" + SHAPES[shape][1:12:2][i] for i in range(6)).replace("--", "")
        + ")",
        "",
        "| step | " + " | ".join(names) + " |",
        "|---:|" + "---:|" * len(cols),
    ]
    for s in steps:
        cells = []
        for r in cols:
            v = r["val"].get(str(s))
            text = "" if v is None else f"{v:.4f}"
            cells.append(f"**{text}**" if r in (best_a, best_m) and s == r["steps"] else text)
        lines.append(f"| {s} | " + " | ".join(cells) + " |")
    if best_m is not None:
        target = final[id(best_a)]
        reached = steps_to_reach({int(k): v for k, v in best_m["val"].items()}, target)
        ratio = None if reached is None else reached / best_a["steps"]
        cost = best_m["step_s"] / best_a["step_s"] - 1
        lines += [
            "",
            f"- best AdamW: lr {best_a['lr']:g}, final val {target:.4f} at step {best_a['steps']}; "
            f"{best_a['step_s']:.3f} s/step",
            f"- best Muon: muon-lr {best_m['muon_lr']:g}, final val {final[id(best_m)]:.4f}; "
            f"{best_m['step_s']:.3f} s/step ({cost:+.1%}; runs at different moments, so only rough: "
            "bench/train_throughput.py measures the cost side by side)",
            "- steps for Muon to reach AdamW's final val loss: "
            + (
                f"{reached} of {best_a['steps']} = **{ratio:.2f}x** (goal <= 0.75x)"
                if reached is not None
                else f"not reached within {best_m['steps']} steps"
            ),
        ]
    return lines


def plot(runs: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = sorted({r["shape"] for r in runs}, key=list(SHAPES).index)
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for r in sorted(
            (r for r in runs if r["shape"] == shape), key=lambda r: (r["optimizer"], r["lr"], r["muon_lr"] or 0)
        ):
            xs = sorted(int(s) for s in r["val"])
            label = f"AdamW {r['lr']:g}" if r["optimizer"] == "adamw" else f"Muon {r['muon_lr']:g}"
            ax.plot(
                xs, [r["val"][str(x)] for x in xs], label=label, linestyle="-" if r["optimizer"] == "muon" else "--"
            )
        ax.set(title=shape, xlabel="step", ylabel="val loss", ylim=(None, 7.5))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="small,medium")
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument(
        "--adamw-lrs", default=None, help="comma-separated (default per shape: " + str(DEFAULT_ADAMW_LRS) + ")"
    )
    ap.add_argument(
        "--muon-lrs", default=None, help="comma-separated (default per shape: " + str(DEFAULT_MUON_LRS) + ")"
    )
    ap.add_argument(
        "--eval-tokens", type=int, default=10_000_000, help="val tokens per evaluation (default: all of them, 30,016)"
    )
    ap.add_argument(
        "--extend",
        type=int,
        default=2,
        help="extra runs per sweep allowed to move past its lowest or highest lr while the best is there",
    )
    ap.add_argument("--results", type=Path, default=None, help="JSON file of finished runs: read, extended, rewritten")
    ap.add_argument("--md", type=Path, default=None, help="also write the report here")
    ap.add_argument("--plot", type=Path, default=None, help="write the val-loss curves here (needs matplotlib)")
    add_corpus_flag(ap)
    args = ap.parse_args(argv)
    require_corpus(args.corpus, "optimizers.py")
    shapes = [s for s in args.shapes.split(",") if s]
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"unknown shape(s) {unknown}; choose from {list(SHAPES)}")
    runs = json.loads(args.results.read_text()) if args.results and args.results.is_file() else []

    def remember(r: dict) -> None:
        runs.append(r)
        if args.results:
            args.results.write_text(json.dumps(runs, indent=1))

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shakespeare"
        prepare_by_paragraph(args.corpus, data, "optimizers.py")
        for shape in shapes:
            adamw_lrs = [float(x) for x in (args.adamw_lrs or DEFAULT_ADAMW_LRS[shape]).split(",")]
            muon_lrs = [float(x) for x in (args.muon_lrs or DEFAULT_MUON_LRS[shape]).split(",")]

            def result(optimizer: str, lr: float, muon_lr: float | None, shape: str = shape) -> dict:
                probe = {"shape": shape, "optimizer": optimizer, "lr": lr, "muon_lr": muon_lr, "steps": args.steps}
                found = [r for r in runs if key(r) == key(probe)]
                if not found:
                    remember(
                        run_one(
                            shape,
                            optimizer,
                            lr,
                            muon_lr,
                            data,
                            Path(tmp) / key(probe).replace("/", "_"),
                            args.steps,
                            args.eval_every,
                            args.eval_tokens,
                        )
                    )
                    found = [runs[-1]]
                return found[0]

            best_lr = sweep(adamw_lrs, lambda lr: result("adamw", lr, None), args.extend)
            sweep(muon_lrs, lambda m, best_lr=best_lr: result("muon", best_lr, m), args.extend)
    selected = [r for r in runs if r["steps"] == args.steps and r["shape"] in shapes]
    lines = [
        f"validation loss by step (tinyshakespeare by paragraph, fp32, torch {torch.__version__}); "
        f"command: python bench/optimizers.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "",
    ]
    for shape in shapes:
        table = report(selected, shape)
        lines += table + [""]
    emit("\n".join(lines).rstrip(), args.md)
    if args.plot:
        print(f"plot: {args.plot}" if plot(selected, args.plot) else "plot skipped: matplotlib is not installed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
