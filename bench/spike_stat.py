"""The spike guard's rule before and after its loss-ratio part, on real runs: poisoned stretches caught, clean runs
left alone (issue 78 item 4; docs/spike_guard.md, "The first judged steps").

Each run trains with the guard off and logs every step (loss, gradient norm), so that both rules are replayed over
the same numbers, with the guard's statistic (gpt2/train/spike_guard.py: the window's median and MAD of the logs,
the spread at least 1%). Before: a spike is a loss z over --spike-loss-z, or a gradient-norm z over --spike-norm-z
with the loss z over half its limit. Now: also a loss LOSS_RATIO x the window's median with the loss z over a third
of its limit (RATIO_Z_SHARE). The replay keeps every step in the history (no skip), so both read the same windows.

Runs (the debug preset, the quick start's, on --corpus by paragraph, its first 20,000 tokens val):
  poisoned  --data-order sequential, steps FIRST..FIRST+4 of one repeated token (at 101-105: the guard's first judged
            steps, its window holding the whole early fall of the loss, where a doubled loss scored z 5.9; at
            111-115, as issue 78 tried it); each token id its own row (50000: ~2x the loss; 383: ~1.5x)
  clean     the debug preset shuffled and sequential (150 steps), and the learning-parity recipe against nanoGPT
            (bench/time_to_loss.py's, 200 steps): the largest z and ratio a healthy step reaches, and false alarms
Usage: python bench/spike_stat.py [--corpus FILE] [--md FILE] [--poisons 101:50000,...] [--no-clean]
       (~8 minutes on 2 CPU cores for all seven runs)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from corpus import REPO, add_corpus_flag, prepare_by_paragraph, require_corpus
from emit import emit
from flags import PARITY  # bench/flags.py

WINDOW, LOSS_Z, NORM_Z = 100, 6.0, 6.0  # the guard's defaults
MIN_SPREAD, MAD_TO_SIGMA = 0.01, 1.4826  # the guard's (gpt2/train/spike_guard.py)
LOSS_RATIO, RATIO_Z_SHARE = 1.5, 3.0  # the guard's (gpt2/train/spike_guard.py)
STEP_TOKENS = 2048  # the debug preset's global batch
POISONS = [(101, 50000), (101, 383), (111, 50000), (111, 383)]
QUIET = "--device cpu --sample-interval 0 --plot false --log-interval 1 --spike-guard false".split()


def lower_median(a: np.ndarray) -> float:
    return float(np.sort(a)[(len(a) - 1) // 2])


def level_rule(h: np.ndarray) -> tuple[float, float]:
    """The guard's statistic: the window's median and MAD."""
    c = lower_median(h)
    return c, max(MAD_TO_SIGMA * lower_median(np.abs(h - c)), MIN_SPREAD)


def replay(rows: list[dict], window: int = WINDOW) -> dict[int, tuple[float, float, float]]:
    """{step: (loss z, norm z, loss / the window's median loss)} of every judged step (a full window before it), the
    history every step."""
    history, out = [], {}
    for r in rows:
        x = np.log([max(r["loss"], 1e-30), max(r["grad_norm"], 1e-30)])
        if len(history) >= window:
            h = np.array(history[-window:])
            (c0, s0), (c1, s1) = level_rule(h[:, 0]), level_rule(h[:, 1])
            out[r["step"]] = ((x[0] - c0) / s0, (x[1] - c1) / s1, float(np.exp(x[0] - c0)))
        history.append(x)
    return out


def spike_before(z: tuple[float, float, float]) -> bool:
    return z[0] > LOSS_Z or (z[1] > NORM_Z and z[0] > LOSS_Z / 2)


def spike_now(z: tuple[float, float, float]) -> bool:
    return spike_before(z) or (z[2] > LOSS_RATIO and z[0] > LOSS_Z / RATIO_Z_SHARE)


def train(out: Path, args: list[str]) -> list[dict]:
    """One run of train_ddp.py (guard off, every step logged); its training rows."""
    cmd = [sys.executable, str(REPO / "train_ddp.py"), *args, *QUIET, "--out-dir", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"spike_stat: {' '.join(cmd[1:3])} ... failed:\n{done.stderr[-2000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r and "grad_norm" in r]


def poison(data: Path, dest: Path, first: int, token: int) -> Path:
    """data's shards with the 5 steps from `first` (sequential order) one repeated token."""
    from gpt2.data.shards import write_shard

    dest.mkdir()
    shutil.copy(data / "val_000000.bin", dest)
    tokens = np.concatenate([np.fromfile(p, dtype=np.uint16, offset=1024) for p in sorted(data.glob("train_*.bin"))])
    tokens[(first - 1) * STEP_TOKENS : (first + 4) * STEP_TOKENS + 1] = token
    write_shard(dest / "train_000000.bin", tokens)
    return dest


def poisoned_row(rows: list[dict], first: int, token: int) -> str:
    z = replay(rows)
    caught = [sum(rule(z[s]) for s in range(first, first + 5)) for rule in (spike_before, spike_now)]
    loss, zf = {r["step"]: r["loss"] for r in rows}[first], z[first]
    return (
        f"| steps {first}-{first + 4}, token {token} | {loss:.2f}: {zf[2]:.2f}x, z {zf[0]:.1f} / {zf[1]:.1f} | "
        f"{caught[0]} of 5 | {caught[1]} of 5 |"
    )


def clean_row(name: str, rows: list[dict]) -> str:
    zs = list(replay(rows).values())
    top = f"{max(z[2] for z in zs):.2f}x, z {max(z[0] for z in zs):.2f} / {max(z[1] for z in zs):.2f}"
    alarms = [sum(rule(z) for z in zs) for rule in (spike_before, spike_now)]
    return f"| {name} ({len(rows)} steps) | largest: {top} | {alarms[0]} false | {alarms[1]} false |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_corpus_flag(ap)
    ap.add_argument("--md", type=Path, help="also write the table here")
    ap.add_argument(
        "--poisons",
        default=",".join(f"{f}:{t}" for f, t in POISONS),
        help="the poisoned runs, FIRST_STEP:TOKEN,... (default: %(default)s)",
    )
    ap.add_argument("--no-clean", action="store_true", help="leave out the clean runs")
    args = ap.parse_args(argv)
    require_corpus(args.corpus, "spike_stat.py")
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory(prefix="spike_stat-") as tmp:
        work = Path(tmp)
        prepare_by_paragraph(args.corpus, work / "data", "spike_stat.py", val_tokens=20_000)
        debug = ["--preset", "debug", "--data-order", "sequential"]
        lines = [
            f"window {WINDOW}, limits z {LOSS_Z:g} (loss) / {NORM_Z:g} (norm, with the loss over half its limit); "
            f"now also a loss {LOSS_RATIO:g}x the window's median with the loss over 1/{RATIO_Z_SHARE:g} of its limit",
            "",
            "| run | first step: loss, x the window's median, loss z / norm z | caught before | caught now |",
            "|---|---|---:|---:|",
        ]
        for first, token in (tuple(int(v) for v in item.split(":")) for item in args.poisons.split(",")):
            data = poison(work / "data", work / f"data-{first}-{token}", first, token)
            rows = train(work / f"poison-{first}-{token}", [*debug, "--data-dir", str(data), "--max-steps", "120"])
            lines.append(poisoned_row(rows, first, token))
        clean = [
            ("clean, debug preset, sequential", debug),
            ("clean, debug preset, shuffled", ["--preset", "debug"]),
            ("clean, learning-parity recipe", PARITY),
        ]
        for name, extra in [] if args.no_clean else clean:
            lines.append(
                clean_row(name, train(work / name.replace(" ", "_"), [*extra, "--data-dir", str(work / "data")]))
            )
    emit("\n".join(lines), args.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
