"""The node check's training runs: real `train_ddp.py` processes (or torchrun) on token shards the check
writes itself, and the comparisons made between them (the sections, gpt2/doctor/check_*.py, report them).

Nothing here downloads or tokenizes: the shards are synthetic, made of random "phrases" of GPT-2 token
ids repeated in a random order, so that the loss has something to learn and falls within a few steps
(uniform random tokens would keep every run at ln(50257) and make a broken update look like a working one).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2.ckpt.rundir import RUN_INFO
from gpt2.core.config import GPT2_VOCAB_SIZE, ModelConfig
from gpt2.data.shards import write_shard
from gpt2.train.compile_cache import chosen_by_environment
from gpt2.train.run_log import read_metrics

REPO = Path(__file__).resolve().parents[2]  # gpt2/doctor/train_runs.py -> the checkout
TRAIN_SCRIPT = REPO / "train_ddp.py"
"""The entry point the checks run, beside the package (a checkout or an editable install)."""

PHRASES = 512
PHRASE_TOKENS = 16


def write_synthetic_shards(data_dir: Path, tokens: int, *, val_tokens: int = 16_384, seed: int = 0) -> Path:
    """data_dir/synthetic_{train,val}_000000.bin: `tokens` (and val_tokens) tokens of PHRASES random phrases
    of PHRASE_TOKENS ids each, in a random order (another order for val). Once the phrases are learnt the
    loss is about ln(PHRASES)/PHRASE_TOKENS per token; a few steps already move it below ln(50257)."""
    rng = np.random.default_rng(seed)
    phrases = rng.integers(0, GPT2_VOCAB_SIZE, size=(PHRASES, PHRASE_TOKENS), dtype=np.int64)
    data_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", tokens), ("val", val_tokens)):
        picks = rng.integers(0, PHRASES, size=-(-n // PHRASE_TOKENS))
        write_shard(data_dir / f"synthetic_{split}_000000.bin", phrases[picks].reshape(-1)[:n])
    return data_dir


def model_flags(cfg: ModelConfig) -> list[str]:
    return [
        "--n-layer",
        str(cfg.n_layer),
        "--n-head",
        str(cfg.n_head),
        "--n-embd",
        str(cfg.n_embd),
        "--block-size",
        str(cfg.block_size),
    ]


QUIET_FLAGS = [
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
]
"""No validation, samples or plot: the runs are timed and compared by their step records."""
VAL_TOKENS = 8192
"""The reference run's fixed validation set (the whole val shard): evaluated at step 0 and at the end."""

REFERENCE_FLAGS = [
    "--dtype",
    "float32",
    "--compile",
    "false",
    "--attn-impl",
    "explicit",
    "--tf32",
    "false",
    "--loss-impl",
    "chunked",
]
"""The slow, plain path every fast one is compared with: fp32 without TF32, eager, softmax(QK^T)V."""
FAST_FLAGS = ["--dtype", "auto", "--compile", "true", "--attn-impl", "sdpa", "--tf32", "true", "--loss-impl", "auto"]
"""The defaults a real run takes: the device's fast dtype (bf16 on a GPU with native bf16; on a CPU what
gpt2.plan.precision_choice measures faster), torch.compile, SDPA (flash where the device has it), TF32."""


@dataclass(frozen=True)
class TrainRun:
    """One finished train_ddp.py process (or torchrun of several)."""

    name: str
    out_dir: Path
    returncode: int
    seconds: float
    log: Path
    """Its stdout and stderr."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def records(self) -> list[dict]:
        """metrics.jsonl's step records (those with a loss)."""
        return [r for r in read_metrics(self.out_dir / "metrics.jsonl", missing_ok=True) if "loss" in r]

    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records()}

    def val_losses(self) -> dict[int, float]:
        """Validation loss by step: the same tokens every time, so a change is the weights' alone."""
        return {
            r["step"]: r["val_loss"]
            for r in read_metrics(self.out_dir / "metrics.jsonl", missing_ok=True)
            if "val_loss" in r
        }

    def info(self) -> dict:
        """The run's config.json: resolved config, precision, versions, network measurement."""
        path = self.out_dir / RUN_INFO
        return json.loads(path.read_text()) if path.is_file() else {}

    def failure(self) -> str:
        """One line: why the process failed (its error line, or the last line of its traceback)."""
        return failure_line(self.log.read_text(errors="replace") if self.log.is_file() else "", self.returncode)

    def checkpoint(self, step: int) -> Path:
        return self.out_dir / "checkpoints" / f"step_{step:08d}.pt"


def failure_line(output: str, returncode: int) -> str:
    """The line that says why a train_ddp.py process failed: its own "train_ddp.py: error: ..." line,
    else the exception at the end of a traceback, else its exit status."""
    lines = [s.strip() for s in output.splitlines() if s.strip()]
    errors = [s for s in lines if s.startswith("train_ddp.py: error:")]
    if errors:
        return errors[-1].removeprefix("train_ddp.py: error: ")
    exceptions = [
        s
        for s in lines
        if not s.startswith(("File ", "^", "~")) and ("Error" in s.split(":")[0] or "Exception" in s.split(":")[0])
    ]
    if exceptions:
        return exceptions[-1][:300]
    return f"exit status {returncode}" + (f": {lines[-1][:300]}" if lines else "")


def run_train(name: str, flags: list[str], work_dir: Path, *, nproc: int = 1, timeout_s: float = 900) -> TrainRun:
    """`python train_ddp.py FLAGS --out-dir WORK/name` (torchrun --standalone with nproc > 1), its output
    in WORK/name.log. A run that outlives timeout_s is killed and reported as failed (exit 124).
    WORK/name is emptied first: a run left there by an earlier check would otherwise be resumed."""
    out_dir = work_dir / name
    log = work_dir / f"{name}.log"
    shutil.rmtree(out_dir, ignore_errors=True)
    if nproc == 1:
        cmd = [sys.executable, str(TRAIN_SCRIPT)]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(TRAIN_SCRIPT),
        ]
    # Every run's RUN is new: one compile cache for all of them, as inductor's /tmp one was before runs
    # kept theirs in RUN/compile-cache (gpt2/train/compile_cache.py); a run's own flag, or the directory
    # the environment names (which --compile-cache auto keeps), wins.
    own = any(f.startswith("--compile-cache") for f in flags) or bool(chosen_by_environment(os.environ))
    cache = [] if own else ["--compile-cache", str(work_dir / "compile-cache")]
    cmd += [*flags, *cache, "--out-dir", str(out_dir)]
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        # Its own session: a timeout or an interrupt ends torchrun's workers too, not torchrun alone.
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            f.write(f"\ndoctor: killed after {timeout_s:g} s (--timeout-s)\n")
            code = 124
        except BaseException:
            _kill_group(proc)
            raise
    return TrainRun(name, out_dir, code, time.perf_counter() - t0, log)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group this module started for one run (its leader's pid), and reap the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# Tolerances (absolute, in nats, on the per-step training loss). Measured on this project's 2-core CPU
# (AVX512-BF16) with the doctor's own CPU check (2 layers, 64 wide, block 64, micro-batch 4, lr 3e-3,
# 8 steps on these synthetic shards), against fp32 eager with explicit attention:
#   fp32 + torch.compile + SDPA     largest difference 1.9e-6   (reassociation only)
#   bf16 + torch.compile + SDPA     4.4e-4 (1.1e-3 at lr 1e-2)  (8-bit mantissas in every matmul)
#   the reference with --seed 1     2e-2 at most steps, 0.15 at step 8: another init and data order, what
#                                   a silently different computation (a wrong kernel, a lost update) is like
# GPU numbers: not measured yet (the doctor prints its own measurement beside the tolerance).
LOSS_TOLERANCE_FP32 = 1e-4
"""fp32 fast path (a CPU where bf16 is not faster): 50x the measured compile difference, far below the seed's."""
LOSS_TOLERANCE_16BIT = 2e-2
"""bf16/fp16 autocast or TF32 matmuls: 45x the measured bf16 difference, 7x below the seed's largest.
A wrong mask, scale or gradient moves the loss by tenths of a nat within the check's steps."""
RESUME_TOLERANCE_SHARE = 0.1
"""A compiled run continued from its checkpoint is compared with the run itself within this share of
its precision tolerance (2e-3 for bf16): the same program on the same device, so only non-deterministic
kernels (atomics in CUDA backward passes, e.g. the embedding's) may differ, in the last bits of a sum,
which 16-bit roundings amplify to at most about the bf16 noise above; a wrong restore (moments, lr step,
data position, RNG) is another run, >= 1e-2. On this CPU a compiled resume is bitwise, fp32 or bf16."""


def loss_tolerance(dtype: str, tf32: bool) -> float:
    """The precision check's tolerance for a fast run of dtype (float32/bfloat16/float16), tf32: whether
    its fp32 matmuls ran on TF32 tensor cores (CUDA)."""
    return LOSS_TOLERANCE_FP32 if dtype == "float32" and not tf32 else LOSS_TOLERANCE_16BIT


@dataclass(frozen=True)
class LossComparison:
    steps: list[int]
    """The steps both runs logged, compared."""
    max_abs_diff: float
    worst_step: int | None
    tolerance: float
    bitwise: bool
    """Every compared loss identical."""
    missing: list[int]
    """Steps the reference has and the other run does not."""

    @property
    def ok(self) -> bool:
        return bool(self.steps) and not self.missing and self.max_abs_diff <= self.tolerance

    def describe(self) -> str:
        if not self.steps:
            return "no common steps to compare"
        span = f"steps {self.steps[0]}-{self.steps[-1]}"
        if self.missing:
            return f"{span}: steps {self.missing} missing from the compared run"
        if self.bitwise:
            return f"{span}: identical losses (bitwise)"
        return (
            f"{span}: largest loss difference {self.max_abs_diff:.1e} (step {self.worst_step}) "
            f"{'<=' if self.ok else '>'} tolerance {self.tolerance:.0e}"
        )


def compare_losses(
    reference: dict[int, float], other: dict[int, float], tolerance: float, *, steps: range | None = None
) -> LossComparison:
    """Per-step |loss difference| over `steps` (default: every step of the reference). A non-finite
    loss on either side counts as an infinite difference."""
    wanted = sorted(reference if steps is None else [s for s in steps if s in reference])
    common = [s for s in wanted if s in other]
    missing = [s for s in wanted if s not in other]
    diffs = {
        s: abs(reference[s] - other[s]) if math.isfinite(reference[s]) and math.isfinite(other[s]) else math.inf
        for s in common
    }
    worst = max(diffs, key=diffs.get) if diffs else None
    return LossComparison(
        common,
        diffs[worst] if diffs else math.inf,
        worst,
        tolerance,
        bool(common) and all(reference[s] == other[s] for s in common),
        missing,
    )


@dataclass(frozen=True)
class StateComparison:
    """Two checkpoints' model and optimizer tensors, pairwise by name."""

    tensors: int
    identical: int
    max_abs_diff: float
    mismatched: list[str]
    """Names present in one only, or of another shape or dtype."""

    @property
    def bitwise(self) -> bool:
        return not self.mismatched and self.identical == self.tensors > 0

    def describe(self) -> str:
        if self.mismatched:
            return f"{len(self.mismatched)} tensors differ in name/shape/dtype (e.g. {self.mismatched[0]})"
        if self.bitwise:
            return f"all {self.tensors} model and optimizer tensors identical"
        return f"{self.identical}/{self.tensors} tensors identical, largest difference {self.max_abs_diff:.1e}"


def flatten_tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in nested dicts/lists, by its path ("model/transformer.wte.weight", "optimizer/state/0/exp_avg")."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out = {}
    for key, value in items:
        out.update(flatten_tensors(value, f"{prefix}/{key}" if prefix else str(key)))
    return out


def compare_states(a: dict, b: dict) -> StateComparison:
    """Tensors of two state trees (checkpoints' "model" and "optimizer"), compared exactly and by max |diff|."""
    ta, tb = flatten_tensors(a), flatten_tensors(b)
    mismatched = sorted(set(ta) ^ set(tb))
    identical, worst = 0, 0.0
    for name in sorted(set(ta) & set(tb)):
        x, y = ta[name], tb[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            mismatched.append(name)
        elif torch.equal(x, y):
            identical += 1
        elif x.is_floating_point():
            worst = max(worst, (x.double() - y.double()).abs().max().item())
        else:
            worst = math.inf  # integer state (e.g. a step counter) that differs
    return StateComparison(len(set(ta) | set(tb)), identical, worst, mismatched)


def median_after_warmup(records: list[dict], key: str, warmup: int) -> float | None:
    """The median of records[key] after the first `warmup` steps (compilation, allocator and clock
    warm-up), or None when no such record carries a number."""
    values = [r[key] for r in records if r["step"] > warmup and isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None
