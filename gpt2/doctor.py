"""Check a GPU node before queueing a long run: one command, one table, one JSON file.

    python -m gpt2.doctor                   # this node: the table on stdout, ./doctor.json
    python -m gpt2.doctor --out DIR         # DIR/doctor.json, DIR/doctor.txt (the table), DIR/work (every run)
    python -m gpt2.doctor --device cpu      # the same checks at a tiny shape (tests/test_doctor.py runs it)

No network and no `datasets`: torch, numpy and tiktoken, and token shards it writes itself
(gpt2/tools/doctor_runs.py). Each section runs guarded: one that raises (no C compiler, no Triton, out of
memory) is FAILED with its one-line reason and the rest still run. In order:

  environment  devices, driver, CUDA, cuDNN, torch, NCCL, native bf16, what --dtype auto picks
  attention    which SDPA backends run alone on the model's q/k/v (shape and dtype of the run), how far
               each is from fp32 softmax(QK^T)V, and which one the default dispatch runs (profiled)
  correctness  train_ddp.py for a few steps: fp32 eager (explicit attention, no TF32) against the fast
               defaults (the auto dtype, torch.compile, SDPA, TF32), losses within a stated tolerance
  resume       each of those continued from its mid-run checkpoint with --resume: fp32 eager bitwise
               (losses and every model/optimizer tensor), the fast one within a tenth of that tolerance
  training     `train_ddp.py --preset gpt2` (auto micro-batch, the trainer's own train_step) for a few
               dozen steps: tokens/s, MFU against the data-sheet peak, peak memory against the plan
  ranks        the same run under torchrun on every local GPU (DDP over NCCL; on a CPU 2 gloo ranks):
               its losses against one rank's, the start-up all-reduce bandwidth, the 1 -> N scaling
  ladder       bench/ladder.py's rungs (gpt2/tools/ladder.py) at the GPT-2 124M shape: base fp32 -> TF32 ->
               bf16 -> compile -> flash -> vocab 50304, tokens/s and MFU beside build-nanogpt's A100
The training processes run first (RUN_ORDER says why); the table keeps the order above.

Exit status: 0 every check passed; 1 a check failed (or a correctness/resume/attention section could not
run); 3 another section could not run; 2 bad arguments. The table is printed in every case.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from gpt2.ckpt.checkpoint import load_checkpoint
from gpt2.core import precision
from gpt2.core.args import OneLineParser
from gpt2.core.atomic import atomic_write_text
from gpt2.core.config import ModelConfig, RunConfig, TrainConfig, model_preset
from gpt2.dist.group import usable_cpus
from gpt2.plan.flops import flops_per_token, format_flops
from gpt2.plan.hardware import device_hardware
from gpt2.plan.memory import PLAN_ERROR
from gpt2.plan.measure import KINETO_QUIET_LEVEL
from gpt2.plan.planner import plan_run
from gpt2.tools.doctor_runs import (
    FAST_FLAGS,
    QUIET_FLAGS,
    REFERENCE_FLAGS,
    RESUME_TOLERANCE_SHARE,
    VAL_TOKENS,
    TrainRun,
    compare_losses,
    compare_states,
    loss_tolerance,
    median_after_warmup,
    model_flags,
    run_train,
    write_synthetic_shards,
)
from gpt2.tools.ladder import DOC_A100_TOKENS_PER_S, LADDER, initial_peaks, run_ladder, without_bf16
from gpt2.tools.sdpa_probe import first_line, probe


@dataclass(frozen=True)
class Scale:
    """The shapes and lengths of the checks on one kind of device."""
    check_model: ModelConfig
    """correctness and resume: small, so that compiling it takes seconds."""
    check_batch: int
    check_steps: int
    model: ModelConfig
    """What a run trains: the attention probe's and the ladder's shape."""
    ladder_batch: int
    ladder_steps: int
    ladder_warmup: int
    train_flags: tuple[str, ...]
    """training and ranks: flags after --preset gpt2 (none on a GPU: the preset itself)."""
    train_steps: int
    train_warmup: int
    """Steps left out of the medians: compilation, allocator and clock warm-up."""
    shard_tokens: int


TINY = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=64)
SCALES = {
    # 124M at build-nanogpt's B=16 for the ladder; the gpt2 preset's 524,288-token step for training.
    "cuda": Scale(check_model=ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=256), check_batch=8,
                  check_steps=8, model=model_preset("gpt2"), ladder_batch=16, ladder_steps=5, ladder_warmup=2,
                  train_flags=(), train_steps=20, train_warmup=5, shard_tokens=2 ** 21),
    # 512 tokens per step: 8 sequences on one rank, 4 on each of two.
    "cpu": Scale(check_model=TINY, check_batch=4, check_steps=8, model=TINY, ladder_batch=4, ladder_steps=3,
                 ladder_warmup=1, train_flags=(*model_flags(TINY), "--total-batch-size", "512"), train_steps=12,
                 train_warmup=3, shard_tokens=200_000),
}
CHECK_LR = ("--lr", "3e-3", "--min-lr", "3e-4", "--warmup-steps", "2")
"""High enough that the loss falls clearly within the check's steps (a lost update shows)."""

OK, FAILED, NA, WARN, SKIPPED = "ok", "FAILED", "n/a", "WARN", "skipped"
CORRECTNESS_SECTIONS = ("attention", "correctness", "resume")
"""Sections whose failure to run at all also counts as a failed check (exit 1)."""


@dataclass
class Row:
    check: str
    result: str
    status: str = ""


@dataclass
class Section:
    name: str
    rows: list[Row] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    status: str = OK
    reason: str = ""
    """The first failed check, or the error the section stopped with."""
    failed_checks: int = 0
    error: bool = False
    seconds: float = 0.0

    def info(self, check: str, result: str) -> None:
        self.rows.append(Row(check, result))

    def note(self, check: str, result: str, status: str) -> None:
        self.rows.append(Row(check, result, status))

    def check(self, check: str, passed: bool, result: str) -> bool:
        self.rows.append(Row(check, result, OK if passed else FAILED))
        if not passed:
            self.failed_checks += 1
            self.status, self.reason = FAILED, self.reason or f"{check}: {result}"
        return passed

    def fail(self, reason: str) -> None:
        """The section could not finish."""
        self.error, self.status, self.reason = True, FAILED, reason


@dataclass
class Context:
    """What every section gets: the device, its scale, where runs go, and what earlier sections made."""
    device: torch.device
    scale: Scale
    work_dir: Path
    ranks: int
    timeout_s: float
    say: Callable[[str], None]
    fast_flags: tuple[str, ...] = tuple(FAST_FLAGS)
    """The settings checked against the reference (the trainer's defaults; tests pass a wrong one)."""
    runs: dict[str, TrainRun] = field(default_factory=dict)
    _prec: precision.Precision | None = None
    _data: Path | None = None

    def auto_precision(self) -> precision.Precision:
        """--dtype auto on this device, as the trainer resolves it (measured and cached on a CPU)."""
        if self._prec is None:
            self._prec = precision.resolve("auto", self.device)
        return self._prec

    def data_dir(self) -> Path:
        """The synthetic shards, written at first use."""
        if self._data is None:
            self._data = self.work_dir / "data"
            write_synthetic_shards(self._data, self.scale.shard_tokens)
        return self._data

    def train(self, name: str, flags: list[str], *, nproc: int = 1) -> TrainRun:
        self.say(f"running {name} ({'torchrun x' + str(nproc) if nproc > 1 else 'train_ddp.py'})")
        run = run_train(name, flags, self.work_dir, nproc=nproc, timeout_s=self.timeout_s)
        self.runs[name] = run
        self.say(f"{name}: exit {run.returncode} after {run.seconds:.0f} s")
        return run


# ---------------------------------------------------------------- environment


def environment(ctx: Context) -> Section:
    s = Section("environment")
    if ctx.device.type == "cuda":
        cuda_rows(s)
    else:
        cpu_rows(s)
    s.info("torch", torch.__version__)
    s.info("python, numpy, tiktoken", f"{platform.python_version()}, {package_version('numpy')}, "
                                      f"{package_version('tiktoken')}")
    prec = ctx.auto_precision()
    s.info("--dtype auto picks", f"{prec.dtype}: {prec.reason}")
    s.data.update(host=socket.gethostname(), torch=torch.__version__, python=platform.python_version(),
                  auto_dtype=prec.to_dict())
    return s


def cuda_rows(s: Section) -> None:
    n = torch.cuda.device_count()
    lines = [cuda_device_line(i) for i in range(n)]
    s.info("devices", "; ".join(f"{lines.count(x)} x {x}" for x in dict.fromkeys(lines)))
    driver = nvidia_driver_version()
    s.info("driver", driver or "unknown (no /proc/driver/nvidia/version, no nvidia-smi)")
    s.info("CUDA (torch build), cuDNN", f"{torch.version.cuda}, {torch.backends.cudnn.version()}")
    s.info("NCCL", nccl_version())
    native = [precision.cuda_native_bf16(torch.device("cuda", i)) for i in range(n)]
    if all(native):
        s.info("native bf16", "yes")
    else:  # a working node, but not for the bf16 recipe: say so without failing it
        s.note("native bf16", f"no on {native.count(False)} of {n}: runs pick fp16 with a loss scaler", WARN)
    triton = triton_version()
    s.check("Triton (torch.compile's GPU kernels)", triton is not None, triton or "not importable")
    s.data.update(devices=lines, driver=driver, cuda=torch.version.cuda,
                  cudnn=torch.backends.cudnn.version(), nccl=nccl_version(), native_bf16=native, triton=triton)


def cpu_rows(s: Section) -> None:
    cpu = precision.peak_key("cpu", torch.float32)["cpu"]
    s.info("devices", f"cpu: {cpu}, {usable_cpus()} usable core(s); no CUDA device")
    flags = precision.cpu_bf16_instructions()
    s.info("bf16 instructions", {True: "yes (avx512_bf16 / amx_bf16 / bf16 in /proc/cpuinfo)",
                                 False: "no: bf16 would be emulated", None: "unknown"}[flags])
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    s.check("C++ compiler (torch.compile's CPU kernels)", compiler is not None, compiler or "none on PATH")
    s.data.update(devices=[f"cpu: {cpu}"], usable_cpus=usable_cpus(), bf16_instructions=flags, cxx=compiler)


def cuda_device_line(index: int) -> str:
    p = torch.cuda.get_device_properties(index)
    return f"{p.name} (sm_{p.major}{p.minor}, {p.total_memory / 2**30:.1f} GiB)"


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def triton_version() -> str | None:
    """Triton's version, or None where it cannot be imported (its wheel is `triton` or `pytorch-triton`)."""
    try:
        import triton
    except ImportError:
        return None
    return getattr(triton, "__version__", "unknown version")


def nccl_version() -> str:
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return "not in this torch build"
    try:
        return ".".join(str(x) for x in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError) as e:
        return f"unknown ({first_line(e)})"


DRIVER_VERSION = re.compile(r"\b(\d{3,}\.\d+(?:\.\d+)?)\b")


def parse_driver_version(text: str) -> str | None:
    """The driver's version from /proc/driver/nvidia/version ("NVRM version: NVIDIA UNIX x86_64 Kernel
    Module  550.54.15  ...") or nvidia-smi's csv output ("550.54.15")."""
    line = next((s for s in text.splitlines() if "NVRM" in s), text.strip().splitlines()[0] if text.strip() else "")
    m = DRIVER_VERSION.search(line)
    return m.group(1) if m else None


def nvidia_driver_version() -> str | None:
    """The kernel module's version file (no process started), else nvidia-smi; None if neither says."""
    with contextlib.suppress(OSError):
        found = parse_driver_version(Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found
    if shutil.which("nvidia-smi") is None:
        return None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return parse_driver_version(out)
    return None


# ---------------------------------------------------------------- attention


def attention(ctx: Context) -> Section:
    s = Section("attention")
    dtype = precision.torch_dtype(ctx.auto_precision().dtype)
    report = probe(ctx.scale.model, ctx.scale.ladder_batch, ctx.device, dtype)
    b, nh, t, hd = report.shape
    s.info("shape", f"q, k, v ({b}, {nh}, {t}, {hd}) {report.dtype}, causal: the model's CausalSelfAttention")
    for trial in report.trials:
        if trial.runs:
            s.check(f"{trial.name} alone", trial.agrees, f"runs; vs fp32 explicit: max rel diff {trial.rel_diff:.1e} "
                                                         f"(tolerance {report.tolerance:.0e})")
        else:
            s.note(f"{trial.name} alone", f"does not run here: {trial.reason}", NA)
    picked = ", ".join(report.dispatched) or "none recognised"
    s.check("default dispatch (profiled)", bool(report.dispatched), f"{picked} ({', '.join(report.ops)})")
    if ctx.device.type == "cuda":
        s.info("CUDA kernels", ", ".join(k[:60] for k in report.kernels[:3]) or "none seen")
        if "math" in report.dispatched:  # not wrong, but slow and (B, nh, T, T) memory: say it loudly
            s.note("fused kernel", "the model's attention runs SDPA's math path on this GPU", WARN)
    s.data = report.to_dict()
    return s


# ---------------------------------------------------------------- correctness and resume


def check_flags(ctx: Context, kind: str) -> list[str]:
    """A correctness run: the small check model, one micro-batch per step, a checkpoint halfway."""
    sc = ctx.scale
    m = sc.check_model
    return [*model_flags(m), "--device", ctx.device.type, "--data-dir", str(ctx.data_dir()),
            "--micro-batch-size", str(sc.check_batch), "--total-batch-size", str(sc.check_batch * m.block_size),
            "--max-steps", str(sc.check_steps), "--ckpt-interval", str(sc.check_steps // 2), *CHECK_LR,
            *QUIET_FLAGS, *(REFERENCE_FLAGS + REFERENCE_EVAL if kind == "reference" else ctx.fast_flags)]


REFERENCE_EVAL = ["--eval-interval", "0", "--eval-tokens", str(VAL_TOKENS)]
"""The reference evaluates the fixed val set at step 0 and at its last step (interval 0: only then): its
change is learning alone, where step losses also move with each batch's tokens (about 0.02 nats at the
CPU shape, as large as 8 steps of learning there). The fast run skips it: eval would compile again."""
LEARNS_MARGIN = 0.01
"""The reference's val loss must fall by more than this over the check (3e-3 lr, 8 steps): a lost update
(lr 1e-9) moves it by ~1e-7; learning at the CPU shape by ~0.05-0.1."""


def fast_settings(run: TrainRun, device: torch.device) -> tuple[str, bool]:
    """(dtype, whether TF32 matmuls ran) of a finished run, from its config.json."""
    info = run.info()
    return info["precision"]["dtype"], bool(info["config"]["train"]["tf32"]) and device.type == "cuda"


def settings_line(info: dict, tf32: bool) -> str:
    """What a finished run computed with, from its config.json: dtype, compile, attention, TF32, loss."""
    train, model = info["config"]["train"], info["config"]["model"]
    return (f"{info['precision']['dtype']}, {'torch.compile' if train['compile'] else 'eager'}, "
            f"attention {model['attn_impl']}, TF32 {'on' if tf32 else 'off'}, {info['loss']['impl']} loss")


def loss_span(run: TrainRun) -> tuple[float, float]:
    losses = run.losses()
    return losses[min(losses)], losses[max(losses)]


def correctness(ctx: Context) -> Section:
    s = Section("correctness")
    ref = ctx.train("check-reference", check_flags(ctx, "reference"))
    fast = ctx.train("check-fast", check_flags(ctx, "fast"))
    for name, run in (("reference run", ref), ("fast run", fast)):
        if not run.ok:
            s.check(name, False, f"train_ddp.py failed: {run.failure()} (log: {run.log})")
    if not (ref.ok and fast.ok):
        return s
    dtype, tf32 = fast_settings(fast, ctx.device)
    first, last = loss_span(ref)
    s.info("reference", f"fp32, eager, explicit attention, no TF32: loss {first:.4f} -> {last:.4f} "
                        f"({ctx.scale.check_steps} steps, {ref.seconds:.0f} s)")
    s.info("fast", f"{settings_line(fast.info(), tf32)} ({fast.seconds:.0f} s with compilation)")
    val = ref.val_losses()
    v0, v1 = val.get(0, math.nan), val.get(max(val, default=0), math.nan)
    s.check("training learns", v0 - v1 > LEARNS_MARGIN, f"reference val loss {v0:.4f} -> {v1:.4f} on the same "
                                                        f"{VAL_TOKENS:,} tokens (must fall > {LEARNS_MARGIN})")
    cmp = compare_losses(ref.losses(), fast.losses(), loss_tolerance(dtype, tf32))
    s.check("fast = reference", cmp.ok, cmp.describe())
    s.data = {"reference": ref.losses(), "fast": fast.losses(), "reference_val": val, "fast_dtype": dtype,
              "tf32": tf32, "comparison": dataclasses.asdict(cmp),
              "seconds": {"reference": ref.seconds, "fast": fast.seconds}}
    return s


def resume(ctx: Context) -> Section:
    s = Section("resume")
    half, steps = ctx.scale.check_steps // 2, ctx.scale.check_steps
    for kind in ("reference", "fast"):
        run = ctx.runs.get(f"check-{kind}")
        if run is None or not run.ok:
            s.check(kind, False, "needs the correctness section's run, which did not finish")
            continue
        flags = check_flags(ctx, kind)
        if kind == "fast":  # the dtype the run resolved, not auto again: the same program must continue
            flags[flags.index("--dtype") + 1] = fast_settings(run, ctx.device)[0]
        resumed = ctx.train(f"check-{kind}-resumed", [*flags, "--resume", str(run.checkpoint(half))])
        if not resumed.ok:
            s.check(kind, False, f"train_ddp.py --resume failed: {resumed.failure()} (log: {resumed.log})")
            continue
        s.data[kind] = resume_rows(s, kind, run, resumed, ctx.device, range(half + 1, steps + 1))
    return s


def resume_rows(s: Section, kind: str, run: TrainRun, resumed: TrainRun, device: torch.device,
                steps: range) -> dict:
    """Compare a resumed run's steps and final checkpoint with the uninterrupted run's."""
    last = steps[-1]
    states = compare_states(*(state_of(r.checkpoint(last)) for r in (run, resumed)))
    if kind == "reference":
        losses = compare_losses(run.losses(), resumed.losses(), 0.0, steps=steps)
        val = [r.val_losses().get(last) for r in (run, resumed)]
        same = losses.bitwise and states.bitwise and val[0] == val[1]
        s.check("reference (fp32 eager) continues bitwise", same,
                f"from step {steps[0] - 1}: {losses.describe()}; step {last}: {states.describe()}, val loss "
                f"{'identical' if val[0] == val[1] else f'{val[0]} vs {val[1]}'}")
    else:
        dtype, tf32 = fast_settings(run, device)
        tolerance = loss_tolerance(dtype, tf32) * RESUME_TOLERANCE_SHARE
        losses = compare_losses(run.losses(), resumed.losses(), tolerance, steps=steps)
        s.check(f"fast ({dtype}, compiled) continues", losses.ok,
                f"from step {steps[0] - 1}: {losses.describe()}; step {last}: {states.describe()}")
    return {"losses": dataclasses.asdict(losses), "states": dataclasses.asdict(states)}


def state_of(path: Path) -> dict:
    """A checkpoint's model and optimizer tensors (verified against its sidecar's sha256)."""
    ckpt = load_checkpoint(path)
    return {"model": ckpt["model"], "optimizer": ckpt["optimizer"]}


# ---------------------------------------------------------------- training and ranks


def train_flags(ctx: Context) -> list[str]:
    sc = ctx.scale
    return ["--preset", "gpt2", *sc.train_flags, "--device", ctx.device.type, "--data-dir", str(ctx.data_dir()),
            "--max-steps", str(sc.train_steps), "--ckpt-interval", "0", "--keep-checkpoints", "1", *QUIET_FLAGS]


def one_rank_run(ctx: Context) -> TrainRun:
    """The gpt2 preset on one device (training's run; ranks' baseline), run once."""
    return ctx.runs.get("train-1rank") or ctx.train("train-1rank", train_flags(ctx))


def run_config(run: TrainRun) -> RunConfig:
    """The config a finished run resolved (auto micro-batch, dtype and loss path made concrete)."""
    cfg = run.info()["config"]
    return RunConfig(ModelConfig(**cfg["model"]), TrainConfig(**cfg["train"]))


def training(ctx: Context) -> Section:
    s = Section("training")
    run = one_rank_run(ctx)
    if not run.ok:
        s.fail(f"train_ddp.py --preset gpt2 failed: {run.failure()} (log: {run.log})")
        return s
    cfg, info, records = run_config(run), run.info(), run.records()
    tc, warm = cfg.train, ctx.scale.train_warmup
    tok_s = median_after_warmup(records, "tok_per_s", warm)
    s.info("run", f"--preset gpt2{' (tiny shape)' if ctx.device.type == 'cpu' else ''}: micro-batch "
                  f"{tc.micro_batch_size} (auto) x {cfg.model.block_size}, {info['accum_steps']} micro-step(s), "
                  f"{tc.dtype}, compile {tc.compile}, {tc.loss_impl} loss; {len(records)} steps in {run.seconds:.0f} s")
    s.info("tokens/s", f"{tok_s:,.0f} (median of steps {warm + 1}-{len(records)})")
    peak = info.get("peak_flops_per_rank")
    mfu = tok_s * flops_per_token(cfg.model) / peak if peak else None
    source = "the data sheet's" if ctx.device.type == "cuda" else "the measured matmul"
    s.info("MFU", f"{mfu:.1%} of {source} {format_flops(peak)}" if mfu else "n/a: no peak for this device")
    s.data = {"tokens_per_s": tok_s, "mfu": mfu, "peak_flops": peak, "seconds": run.seconds,
              "micro_batch_size": tc.micro_batch_size, "accum_steps": info["accum_steps"], "dtype": tc.dtype,
              "losses": run.losses(), **memory_rows(s, ctx, cfg, records, peak)}
    first, last = loss_span(run)
    s.check("losses finite", all(map(math.isfinite, run.losses().values())), f"{first:.4f} -> {last:.4f}")
    return s


def memory_rows(s: Section, ctx: Context, cfg: RunConfig, records: list[dict], peak: float | None) -> dict:
    """CUDA: the trainer's logged torch.cuda.max_memory_allocated against the planner's total for this run,
    which is held within PLAN_ERROR of the measured peak (gpt2/plan/memory.py): the check allows that much
    over it. A CPU run logs its RSS over the whole process: not the same quantity."""
    planned = plan_run(cfg, device_hardware(ctx.device, peak), world_size=1).memory.total
    measured = max(r["mem_mb"] for r in records) * 2**20
    if ctx.device.type != "cuda":
        s.note("peak memory", f"n/a on cpu: the trainer logs RSS ({measured / 2**30:.2f} GiB, the whole process), "
                              f"not the allocator's peak; the plan's tensors: {planned / 2**30:.2f} GiB", NA)
        return {"planned_bytes": planned, "rss_bytes": measured}
    s.check(f"peak memory <= plan + {PLAN_ERROR:.0%}", measured <= planned * (1 + PLAN_ERROR),
            f"max_memory_allocated {measured / 2**30:.2f} GiB vs planned {planned / 2**30:.2f} GiB "
            f"({measured / planned:.0%})")
    return {"planned_bytes": planned, "max_memory_allocated_bytes": measured}


def ranks(ctx: Context) -> Section:
    s = Section("ranks")
    n = ctx.ranks
    if n < 2:
        s.status, s.reason = NA, f"one {ctx.device.type} rank: nothing to all-reduce (--ranks; default every GPU)"
        s.note("DDP", s.reason, NA)
        return s
    one = one_rank_run(ctx)
    many = ctx.train(f"train-{n}ranks", train_flags(ctx), nproc=n)
    if not (one.ok and many.ok):
        bad = many if not many.ok else one
        s.fail(f"{bad.name} failed: {bad.failure()} (log: {bad.log})")
        return s
    info = many.info()
    backend = info.get("network", {}).get("backend", "?")
    s.info("run", f"torchrun --nproc_per_node={n}: {n} x {ctx.device.type} over {backend}, "
                  f"{len(many.records())} steps in {many.seconds:.0f} s")
    s.data = {"world_size": n, "network": info.get("network"), **scaling_rows(s, ctx, one, many)}
    dtype, tf32 = fast_settings(many, ctx.device)
    cmp = compare_losses(one.losses(), many.losses(), loss_tolerance(dtype, tf32))
    s.check(f"{n} ranks = 1 rank", cmp.ok, f"the same global batch: {cmp.describe()}")
    s.data["comparison"] = dataclasses.asdict(cmp)
    return s


def scaling_rows(s: Section, ctx: Context, one: TrainRun, many: TrainRun) -> dict:
    n, warm = ctx.ranks, ctx.scale.train_warmup
    net = many.info().get("network")
    if net:
        s.info("all-reduce", f"{net['bucket_bytes'] / 2**20:.1f} MiB: {net['allreduce_s'] * 1e3:.2f} ms, busbw "
                             f"{net['busbw_bytes_per_s'] / 1e9:.2f} GB/s, algbw {net['algbw_bytes_per_s'] / 1e9:.2f} "
                             f"GB/s; a step's gradients ~{net['step_comm_s']:.3g} s")
    tok_1 = median_after_warmup(one.records(), "tok_per_s", warm)
    tok_n = median_after_warmup(many.records(), "tok_per_s", warm)
    speedup = tok_n / tok_1
    where = "" if ctx.device.type == "cuda" else "; the ranks share this CPU's cores, so this is no network measure"
    s.info("scaling", f"{tok_n:,.0f} tokens/s on {n} vs {tok_1:,.0f} on 1: {speedup:.2f}x, "
                      f"{speedup / n:.0%} of linear{where}")
    return {"tokens_per_s_1": tok_1, "tokens_per_s_n": tok_n, "speedup": speedup, "efficiency": speedup / n}


# ---------------------------------------------------------------- ladder


def ladder(ctx: Context) -> Section:
    s = Section("ladder")
    prec, device, sc = ctx.auto_precision(), ctx.device, ctx.scale
    rungs, skip = LADDER, {}
    if prec.dtype != "bfloat16":  # e.g. a CPU whose bf16 is slower than fp32: the rungs after it in fp32
        rungs, skip = without_bf16(LADDER, f"n/a: --dtype auto picks {prec.dtype} here")
    if device.type != "cuda":
        skip["tf32"] = f"n/a on {device.type} (a mode of NVIDIA's tensor cores)"
    peaks = initial_peaks(device)
    results = run_ladder(list(rungs), sc.model, sc.ladder_batch, device, steps=sc.ladder_steps,
                         warmup=sc.ladder_warmup, peaks=peaks, skip=skip, progress=lambda m: ctx.say("ladder: " + m))
    m = sc.model
    s.info("shape", f"{m.n_layer} layers x {m.n_embd}, block {m.block_size}, micro-batch {sc.ladder_batch}; "
                    f"median of {sc.ladder_steps} interleaved steps; A100: build-nanogpt's (124M, 16 x 1024)")
    prev = None
    for r in results:
        doc = DOC_A100_TOKENS_PER_S[r.rung.name]
        label = f"{r.rung.name}: {r.rung.switch}"
        if r.tokens_per_s is None:
            s.note(label, f"{r.note}; A100 {doc:,} tokens/s", NA)
            continue
        step_up = f" ({r.tokens_per_s / prev:.2f}x)" if prev else ""
        prev = r.tokens_per_s
        mfu = "n/a" if r.mfu_own is None else f"{r.mfu_own:.1%}"
        s.check(label, math.isfinite(r.first_loss),
                f"{r.tokens_per_s:,.0f} tokens/s{step_up}, MFU {mfu} ({r.own_peak_name}), {r.ms_per_step:.0f} ms/step; "
                f"A100 {doc:,} tokens/s")
    s.data = {"peaks": peaks, "rungs": [{**dataclasses.asdict(r), "a100_tokens_per_s": DOC_A100_TOKENS_PER_S[name]}
                                        for r in results if (name := r.rung.name)]}
    return s


# ---------------------------------------------------------------- running and reporting


SECTIONS: tuple[tuple[str, Callable[[Context], Section]], ...] = (
    ("environment", environment), ("attention", attention), ("correctness", correctness), ("resume", resume),
    ("training", training), ("ranks", ranks), ("ladder", ladder))
"""In the table's order."""
RUN_ORDER = ("environment", "correctness", "resume", "training", "ranks", "attention", "ladder")
"""The training processes first, while this process has allocated nothing on the GPU: its memory would
be missing from theirs (the ladder's compiled models stay cached here), and a GPU in exclusive-process
mode admits one process with a context at a time."""


def run_section(name: str, fn: Callable[[Context], Section], ctx: Context) -> Section:
    """fn(ctx), or a FAILED section with the error's one line (its traceback in the JSON)."""
    ctx.say(f"{name} ...")
    t0 = time.perf_counter()
    try:
        section = fn(ctx)
    except Exception as e:  # one broken section (no compiler, out of memory) must not hide the others
        section = Section(name)
        section.fail(f"{type(e).__name__}: {first_line(e)}")
        section.data["traceback"] = traceback.format_exc()
    finally:
        release_memory(ctx.device)
    section.seconds = time.perf_counter() - t0
    ctx.say(f"{name}: {section.status} ({section.seconds:.0f} s){': ' + section.reason if section.reason else ''}")
    return section


def release_memory(device: torch.device) -> None:
    """Give cached device memory back between sections: the training runs are other processes on this GPU."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def exit_status(sections: list[Section]) -> int:
    if any(s.failed_checks or (s.error and s.name in CORRECTNESS_SECTIONS) for s in sections):
        return 1
    return 3 if any(s.error for s in sections) else 0


def format_table(sections: list[Section], header: str) -> str:
    lines = [header, "", "| section | check | result | status |", "|---|---|---|---|"]
    for s in sections:
        rows = s.rows + ([Row("section", s.reason, FAILED)] if s.error else [])
        rows = rows or [Row("section", s.reason or s.status, s.status)]
        for i, r in enumerate(rows):
            name = f"{s.name} ({s.seconds:.0f} s)" if i == 0 else ""
            lines.append(f"| {name} | {r.check} | {_cell(r.result)} | {r.status} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def header_line(device: torch.device, sections: list[Section], wall_s: float, status: int) -> str:
    env = next((s for s in sections if s.name == "environment"), Section("environment"))
    what = next((r.result for r in env.rows if r.check == "devices"), str(device))
    verdict = {0: "all checks passed", 1: "a CHECK FAILED", 3: "a section could not run"}[status]
    return f"gpt2 doctor: {what} | torch {torch.__version__} | {wall_s:.0f} s | exit {status}: {verdict}"


def report_json(sections: list[Section], *, device: torch.device, argv: list[str], wall_s: float, status: int) -> dict:
    return {"doctor": 1, "command": "python -m gpt2.doctor " + " ".join(argv), "device": device.type,
            "host": socket.gethostname(), "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "wall_s": wall_s, "exit_status": status,
            "sections": {s.name: {"status": s.status, "reason": s.reason, "seconds": s.seconds,
                                  "failed_checks": s.failed_checks, "error": s.error,
                                  "rows": [dataclasses.asdict(r) for r in s.rows], "data": s.data}
                         for s in sections}}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineParser(prog="python -m gpt2.doctor", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                    help="auto: CUDA when present (then every local GPU), else the CPU at a tiny shape")
    ap.add_argument("--out", type=Path, help="write DIR/doctor.json, DIR/doctor.txt and keep the runs in DIR/work")
    ap.add_argument("--json", type=Path,
                    help="the JSON report (default: DIR/doctor.json with --out, else ./doctor.json)")
    ap.add_argument("--work-dir", type=Path, help="shards and runs (default: DIR/work with --out, else a temp "
                                                   "directory removed at the end)")
    ap.add_argument("--skip", default="",
                    help="comma-separated sections to leave out: " + ",".join(n for n, _ in SECTIONS))
    ap.add_argument("--ranks", type=int,
                    help="processes for the ranks section (default: the local GPUs; 2 on a CPU)")
    ap.add_argument("--timeout-s", type=float, default=900, help="longest one training process may run (default 900)")
    return ap


def resolve_args(args: argparse.Namespace) -> tuple[torch.device, set[str]]:
    """The device and the sections to skip; ValueError with the fix for what a user got wrong."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    skip = {x for x in args.skip.split(",") if x}
    unknown = sorted(skip - {n for n, _ in SECTIONS})
    if unknown:
        raise ValueError(f"--skip {','.join(unknown)}: no such section; choose from {[n for n, _ in SECTIONS]}")
    if args.ranks is not None and args.ranks < 1:
        raise ValueError(f"--ranks {args.ranks} must be >= 1")
    return device, skip


@contextlib.contextmanager
def work_dir(args: argparse.Namespace):
    if args.work_dir or args.out:
        path = args.work_dir or args.out / "work"
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="gpt2-doctor-") as tmp:
        yield Path(tmp)


def say(message: str) -> None:
    print(f"doctor: {message}", file=sys.stderr, flush=True)


def run_all(device: torch.device, skip: set[str], work: Path, args: argparse.Namespace) -> list[Section]:
    n = args.ranks or (torch.cuda.device_count() if device.type == "cuda" else 2)
    ctx = Context(device, SCALES[device.type], work, n, args.timeout_s, say)
    functions = dict(SECTIONS)
    done = {name: Section(name, status=SKIPPED, reason="--skip") if name in skip else
            run_section(name, functions[name], ctx) for name in RUN_ORDER}
    return [done[name] for name, _ in SECTIONS]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        device, skip = resolve_args(args)
    except ValueError as e:
        print(f"python -m gpt2.doctor: error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)  # before the first profile: no USDT lines
    t0 = time.perf_counter()
    with work_dir(args) as work:
        sections = run_all(device, skip, work, args)
    wall = time.perf_counter() - t0
    status = exit_status(sections)
    table = format_table(sections, header_line(device, sections, wall, status))
    print(table, flush=True)
    json_path = args.json or (args.out / "doctor.json" if args.out else Path("doctor.json"))
    json_path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(json_path, json.dumps(report_json(sections, device=device, argv=argv, wall_s=wall,
                                                        status=status), indent=1, default=str) + "\n")
    if args.out:
        atomic_write_text(args.out / "doctor.txt", table + "\n")
    say(f"wrote {json_path}" + (f" and {args.out / 'doctor.txt'}" if args.out else ""))
    return status


if __name__ == "__main__":
    sys.exit(main())
