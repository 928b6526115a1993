"""A requeued start against the first: how much of torch.compile's first compile the compile cache saves.

    python bench/compile_restart.py                    # debug preset and GPT-2 124M on a CPU, ~12 min on 2 busy cores
    python bench/compile_restart.py --models debug     # the debug preset alone

For each model, two real `python train_ddp.py` processes with the same flags and run directory, compiled,
with the default --compile-cache (auto: RUN/compile-cache, as the SLURM scripts and every requeue get it):
  first    a fresh run directory (an empty cache), --max-steps 1: it compiles, trains step 1, saves
  resumed  the same command but --max-steps 2: it resumes step 1's checkpoint (as a requeue does) and its
           first step is step 2
--eval-tokens 0: no validation set, so the first start does not compile the step-0 evaluation, which a
resumed start skips (both then compile, or load, the same training graphs).
The time is from the process's start to the end of its first step: the moment the step's record is in
RUN/metrics.jsonl (polled every 50 ms, a bench's resolution, not a test's). The ratio is resumed/first
(goal <= 0.5). The cache's size on disk is the keyed directory's after the first start.
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR are removed from the runs' environment (else auto keeps
them), and each model's run directory is new, so the first start compiles from scratch.
Models: debug (the debug preset, 4 layers x 128) and gpt2 (GPT-2 124M: 12 x 768, block 1024, one
sequence per step), both float32 (no bf16 emulation to vary with the CPU), no evaluation or samples.
Data: --corpus (default tests/data/tinyshakespeare.txt) through data_prep, one document per paragraph.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corpus import add_corpus_flag, prepare_by_paragraph, require_corpus  # bench/corpus.py
from emit import emit  # bench/emit.py (a script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent

MODELS = {
    "debug": ["--preset", "debug", "--micro-batch-size", "8", "--total-batch-size", "1024"],
    "gpt2": ["--preset", "gpt2", "--micro-batch-size", "1", "--total-batch-size", "1024"],
}
COMMON = [
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--compile",
    "true",
    "--eval-interval",
    "0",
    "--eval-tokens",
    "0",
    "--sample-interval",
    "0",
    "--plot",
    "false",
    "--log-interval",
    "1",
    "--ckpt-interval",
    "1000",
]


def first_step_s(args: list[str], run: Path, step: int) -> float:
    """Seconds from starting `python train_ddp.py args` to `step`'s record in run/metrics.jsonl; waits for exit."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train_ddp.py"), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = None
    while proc.poll() is None and seen is None:
        seen = time.monotonic() if _has_step(run / "metrics.jsonl", step) else None
        time.sleep(0.05)
    out = proc.communicate()[0]
    if proc.returncode != 0:
        raise SystemExit(f"train_ddp.py failed ({proc.returncode}):\n{out[-3000:]}")
    if seen is None:  # the step was recorded between two polls, then the process exited
        seen = time.monotonic()
    return seen - t0


def _has_step(path: Path, step: int) -> bool:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line being written
            continue
        if rec.get("step") == step and "loss" in rec:
            return True
    return False


def measure(model: str, data_dir: str, work: Path) -> dict:
    run = work / model
    args = [*MODELS[model], *COMMON, "--data-dir", data_dir, "--out-dir", str(run)]
    first = first_step_s([*args, "--max-steps", "1"], run, 1)
    size = sum(p.stat().st_size for p in (run / "compile-cache").rglob("*") if p.is_file())
    resumed = first_step_s([*args, "--max-steps", "2"], run, 2)
    return {"model": model, "first": first, "resumed": resumed, "size": size}


def table(rows: list[dict]) -> str:
    lines = [
        "| model | first start, s | resumed start, s | resumed/first | cache on disk |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['first']:.1f} | {r['resumed']:.1f} | {r['resumed'] / r['first']:.2f}x | "
            f"{r['size'] / 2**20:.1f} MiB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_corpus_flag(p)
    p.add_argument("--models", default="debug,gpt2", help="comma-separated: debug, gpt2")
    p.add_argument("--md", default=None, help="also write the table here")
    a = p.parse_args(argv)
    require_corpus(a.corpus, "compile_restart.py")
    work = Path(tempfile.mkdtemp(prefix="compile_restart_"))
    try:
        prepare_by_paragraph(a.corpus, work / "data", "compile_restart.py")
        rows = []
        for m in a.models.split(","):
            rows.append(measure(m, str(work / "data"), work))
            print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)  # a long run's progress
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(table(rows), a.md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
