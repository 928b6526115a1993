"""Where a training step's device time goes: ours against nanoGPT, kernel by kernel, in one process.

    python bench/gpu_profile.py --nanogpt .gpu/nanogpt --data-dir .gpu/data --md prof.md   # on a GPU
    python bench/gpu_profile.py --shape tiny --device cpu --nanogpt none --data-dir DIR      # the smoke test

Rows, in this order (nanoGPT's first: our trainer sets backends a row after it would inherit), each
compiled, bf16 autocast on CUDA, one micro-step per optimizer step at nanoGPT's micro-batch (12 at gpt2):
  nanoGPT     nanoGPT's model.py GPT in nanoGPT's loop: train.py's step (forward with targets, backward,
              clip_grad_norm_, fused AdamW from its configure_optimizers, zero_grad, loss.item() each
              step) without its logging
  ours model  our GPT (gpt2/model/gpt.py, the loss path the planner picks) in that same loop: the model
              against nanoGPT's, with the loop held equal
  ours        our trainer's own step (gpt2.train.session.Session: train_step exactly), its numbers read
              one step late as the trainer's loop reads them: the loop against the loop above
Per row: s/step (wall time over --steps steps after --warmup, the device synchronized at both ends),
then torch.profiler over --profile-steps steps: device kernel time per step, kernels per step, the
device's idle share of the profiled span (gaps between kernels: the host not keeping up), the time by
kind of kernel, and the top kernels. The difference between two rows' tables is where one is slower.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from emit import emit  # bench/emit.py (a script's directory is on sys.path)
from vs_nanogpt import SHAPES, ours_batch_flags

from gpt2.plan.flops import flops_per_token, gpu_table_peak
from gpt2.plan.measure import KINETO_QUIET_LEVEL
from gpt2.train.session import Session, parse_config

KINDS = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "wgmma")),
    ("optimizer, clip (multi-tensor)", ("adam", "multi_tensor", "foreach")),
    ("triton (fused by inductor)", ("triton",)),
    ("copy / fill", ("memcpy", "memset", "copy", "fill")),
)
"""Kernel kinds by a substring of the kernel's name (lower case), first match wins; the rest is 'other'."""


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


@dataclass
class Profile:
    name: str
    step_s: list[float] = field(default_factory=list)
    """Each timed step's own wall time (the host's; on CUDA it may end before the device does)."""
    mean_s: float = 0.0
    """The timed steps' wall time, the device synchronized at both ends, over their count."""
    kernels: dict[str, list[float]] = field(default_factory=dict)
    """kernel name -> durations (us) over the profiled steps"""
    busy_us: float = 0.0
    span_us: float = 0.0
    cpu_top: list[tuple[str, float]] = field(default_factory=list)
    """Where there are no device kernels (a CPU): the top ops by self CPU time (us)."""
    note: str = ""


def union_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: kernels that overlap (streams) counted once."""
    busy, cur = 0.0, None
    for s0, s1 in sorted(spans):
        if cur is None or s0 > cur[1]:
            busy += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s0, s1]
        else:
            cur[1] = max(cur[1], s1)
    return busy + (0.0 if cur is None else cur[1] - cur[0])


def kernel_profile(prof, row: Profile) -> None:
    """The device kernels of a finished torch.profiler run: durations by name, busy time and span."""
    from torch.autograd import DeviceType

    spans = []
    for e in prof.events():
        # A user annotation on the device's timeline (record_function's range, e.g. Optimizer.step) spans
        # kernels listed on their own: counting it too would count their time twice.
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        t0, t1 = e.time_range.start, e.time_range.end
        if t1 <= t0:
            continue
        row.kernels.setdefault(e.name, []).append(t1 - t0)
        spans.append((t0, t1))
    if spans:
        row.busy_us = union_us(spans)
        row.span_us = max(t1 for _, t1 in spans) - min(t0 for t0, _ in spans)
    else:
        ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]
        row.cpu_top = sorted(ops, key=lambda kv: -kv[1])[:10]


def measure(name: str, step, sync, *, warmup: int, steps: int, profile_steps: int) -> Profile:
    """warmup steps (compilation), `steps` timed (wall over all of them, synchronized at both ends, as
    their mean; each step's own time too), then `profile_steps` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    row = Profile(name)
    for _ in range(warmup):
        step()
    sync()
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        row.step_s.append(time.perf_counter() - t0)
    sync()
    row.note = f"wall {time.perf_counter() - t_start:.4f} s over {steps} steps"
    row.mean_s = (time.perf_counter() - t_start) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        for _ in range(profile_steps):
            step()
        sync()
    try:
        kernel_profile(prof, row)
    except Exception as e:  # a profiler whose events differ: the timings above still stand
        row.note += f"; kernel profile failed: {type(e).__name__}: {e}"
    return row


def token_batches(data_dir: Path, batch: int, block: int, device: torch.device, seed: int = 1337):
    """nanoGPT's get_batch over our train shard (llm.c format: a 256-int32 header, then uint16 tokens):
    random windows, pinned and copied without blocking."""
    shard = sorted(data_dir.glob("*train*.bin"))[0]
    tokens = np.memmap(shard, dtype=np.uint16, mode="r", offset=256 * 4)
    rng = np.random.default_rng(seed)

    def get():
        ix = rng.integers(0, len(tokens) - block - 1, size=batch)
        x = torch.from_numpy(np.stack([tokens[i : i + block].astype(np.int64) for i in ix]))
        y = torch.from_numpy(np.stack([tokens[i + 1 : i + 1 + block].astype(np.int64) for i in ix]))
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    return get


def nano_loop(model, optimizer, get_batch, autocast, *, ours: bool):
    """train.py's step: forward with targets (the next batch read behind it), backward, clip at 1.0,
    update, zero_grad, loss.item() (train.py logs every step at log_interval=1, as the benchmarks run it)."""
    state = {"batch": get_batch()}

    def step():
        x, y = state["batch"]
        with autocast:
            _, loss = model(x, y, return_logits=False) if ours else model(x, y)
        state["batch"] = get_batch()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def load_nanogpt(tree: Path):
    spec = importlib.util.spec_from_file_location("nanogpt_model", tree / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_rows(args, done) -> list[Profile]:
    """The rows, in order; done(rows) after each (the report so far is written: a killed run keeps it)."""
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    batch, block = shape.nano["batch_size"], shape.nano["block_size"]
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    autocast = torch.autocast(device.type, dtype=dtype) if cuda else contextlib.nullcontext()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw = dict(warmup=args.warmup, steps=args.steps, profile_steps=args.profile_steps)
    compiled = torch.compile if args.compile else (lambda m: m)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        flags = ours_batch_flags(
            shape,
            batch,
            device=args.device,
            data=args.data_dir,
            out=Path(tmp) / "ours",
            steps=10_000,
            compile=args.compile,
        )
        cfg = parse_config(flags)
        if args.nanogpt is not None:
            torch._dynamo.reset()
            torch.manual_seed(1337)
            nano = load_nanogpt(args.nanogpt)
            conf = nano.GPTConfig(
                n_layer=cfg.model.n_layer,
                n_head=cfg.model.n_head,
                n_embd=cfg.model.n_embd,
                block_size=block,
                vocab_size=cfg.model.vocab_size,
                bias=True,
                dropout=0.0,
            )
            model = nano.GPT(conf).to(device)
            with contextlib.redirect_stdout(sys.stderr):  # its configure_optimizers prints
                opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), device.type)
            step = nano_loop(
                compiled(model), opt, token_batches(args.data_dir, batch, block, device), autocast, ours=False
            )
            rows.append(measure("nanoGPT", step, sync, **kw))
            done(rows)
            del model, opt, step
        session = Session(cfg, single(args.device))
        try:
            torch._dynamo.reset()
            from gpt2.model.gpt import GPT

            torch.manual_seed(1337)
            model = GPT(session.cfg.model, loss_impl=session.cfg.train.compute.loss_impl).to(device)
            opt = torch.optim.AdamW(
                model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda or None
            )
            step = nano_loop(
                compiled(model), opt, token_batches(args.data_dir, batch, block, device), autocast, ours=True
            )
            rows.append(measure(f"ours model (loss {session.cfg.train.compute.loss_impl})", step, sync, **kw))
            done(rows)
            del model, opt, step
            torch._dynamo.reset()
            pending = []

            def ours_step():
                pending.append(session.step())
                if len(pending) > 1:  # the trainer's loop reads a step's numbers one step later on CUDA
                    pending.pop(0).read()

            rows.append(measure("ours", ours_step, sync, **kw))
            done(rows)
            if args.no_bias_row:  # ours model without the padded vocab's -inf logit bias (nanoGPT has none)
                torch._dynamo.reset()
                torch.manual_seed(1337)
                model = GPT(session.cfg.model, loss_impl=session.cfg.train.compute.loss_impl).to(device)
                model.logit_bias = None
                opt = torch.optim.AdamW(
                    model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda or None
                )
                batches = token_batches(args.data_dir, batch, block, device)
                step = nano_loop(compiled(model), opt, batches, autocast, ours=True)
                rows.append(measure("ours model, no logit bias", step, sync, **kw))
                done(rows)
        finally:
            session.close()
    return rows


def single(device: str):
    from gpt2.distributed.group import single_process

    return single_process(device)


def report(rows: list[Profile], args, tokens_per_step: int, mflop_per_token: float) -> list[str]:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = gpu_table_peak(dev, torch.bfloat16) if torch.cuda.is_available() else None
    lines = [
        f"command: `python bench/gpu_profile.py {' '.join(sys.argv[1:])}`",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; {dev}",
        f"shape {args.shape}, {tokens_per_step:,} tokens per step (one micro-step); {args.warmup} warm-up, "
        f"{args.steps} timed, {args.profile_steps} profiled steps per row",
        "",
        "| row | s/step (median) | s/step (synced mean) | tokens/s | MFU | kernel ms/step | kernels/step "
        "| device idle in span |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        med, mean = statistics.median(r.step_s), r.mean_s
        tps = tokens_per_step / mean
        mfu = f"{100 * tps * mflop_per_token * 1e6 / peak:.1f}%" if peak else "-"
        n = sum(len(v) for v in r.kernels.values())
        busy = sum(sum(v) for v in r.kernels.values())
        idle = f"{100 * (1 - r.busy_us / r.span_us):.1f}%" if r.span_us else "-"
        lines.append(
            f"| {r.name} | {med:.4f} | {mean:.4f} | {tps:,.0f} | {mfu} | {busy / 1e3 / args.profile_steps:.2f} "
            f"| {n / args.profile_steps:.0f} | {idle} |"
        )
    for r in rows:
        lines += ["", f"**{r.name}** ({r.note})", ""]
        if not r.kernels:
            lines += ["no device kernels (a CPU run): top ops by self CPU time, us"]
            lines += [f"- {name}: {us:,.0f}" for name, us in r.cpu_top]
            continue
        by_kind: dict[str, list[float]] = {}
        for name, durs in r.kernels.items():
            by_kind.setdefault(kind_of(name), []).extend(durs)
        lines += ["| kind | ms/step | kernels/step |", "|---|---:|---:|"]
        for kind, durs in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
            lines.append(
                f"| {kind} | {sum(durs) / 1e3 / args.profile_steps:.3f} | {len(durs) / args.profile_steps:.0f} |"
            )
        lines += ["", f"top {args.top} kernels:", "", "| kernel | ms/step | calls/step |", "|---|---:|---:|"]
        top = sorted(r.kernels.items(), key=lambda kv: -sum(kv[1]))[: args.top]
        for name, durs in top:
            short = name if len(name) <= 110 else name[:107] + "..."
            short = short.replace("|", "/")
            lines.append(
                f"| `{short}` | {sum(durs) / 1e3 / args.profile_steps:.3f} | {len(durs) / args.profile_steps:g} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gpt2", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--nanogpt", default=None, help="nanoGPT's tree (its model.py); none: no nanoGPT row")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--md", type=Path)
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager rows (the CPU smoke test)")
    ap.add_argument("--no-bias-row", action="store_true", help="last, ours model without the -inf logit bias")
    args = ap.parse_args(argv)
    args.nanogpt = None if args.nanogpt in (None, "none") else Path(args.nanogpt)
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        raise SystemExit(f"--nanogpt {args.nanogpt}: no model.py there; pass nanoGPT's tree or --nanogpt none")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here; --device cpu for the smoke run")
    torch.backends.cuda.matmul.allow_tf32 = True  # as nanoGPT's train.py and our trainer's default
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)  # before the first profile: no USDT lines
    shape = SHAPES[args.shape]
    cfg = parse_config([*shape.ours, "--data-dir", "unused", "--out-dir", "unused"])
    tokens = shape.nano["batch_size"] * shape.nano["block_size"]

    def done(rows: list[Profile]) -> None:
        text = "\n".join(report(rows, args, tokens, flops_per_token(cfg.model) / 1e6))
        print(f"[gpu_profile] {rows[-1].name}: {statistics.median(rows[-1].step_s):.4f} s/step", flush=True)
        if args.md:
            args.md.write_text(text + "\n")

    rows = run_rows(args, done)
    emit("\n".join(report(rows, args, tokens, flops_per_token(cfg.model) / 1e6)), args.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
