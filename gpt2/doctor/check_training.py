"""The node check's training and ranks sections: `train_ddp.py --preset gpt2` on one device (tokens/s,
MFU, peak memory against the plan) and under torchrun on every local device (losses, bandwidth, scaling)."""

from __future__ import annotations

import dataclasses
import math

from gpt2.core.config import RunConfig
from gpt2.doctor.check_correctness import fast_settings, loss_span
from gpt2.doctor.context import Context
from gpt2.doctor.results import NA, Section
from gpt2.doctor.train_runs import QUIET_FLAGS, TrainRun, compare_losses, loss_tolerance, median_after_warmup
from gpt2.plan.flops import flops_per_token, format_flops
from gpt2.plan.hardware import device_hardware
from gpt2.plan.memory import PLAN_ERROR
from gpt2.plan.resolve import Target, resolve_choices


def train_flags(ctx: Context) -> list[str]:
    sc = ctx.scale
    return [
        "--preset",
        "gpt2",
        *sc.train_flags,
        "--device",
        ctx.device.type,
        "--data-dir",
        str(ctx.data_dir()),
        "--max-steps",
        str(sc.train_steps),
        "--ckpt-interval",
        "0",
        "--keep-checkpoints",
        "1",
        *QUIET_FLAGS,
    ]


def one_rank_run(ctx: Context) -> TrainRun:
    """The gpt2 preset on one device (training's run; ranks' baseline), run once."""
    return ctx.runs.get("train-1rank") or ctx.train("train-1rank", train_flags(ctx))


def train_run_config(run: TrainRun) -> RunConfig:
    """The config a finished run resolved (auto micro-batch, dtype and loss path made concrete)."""
    return RunConfig.from_dict(run.info()["config"])


def training(ctx: Context) -> Section:
    s = Section("training")
    run = one_rank_run(ctx)
    if not run.ok:
        s.fail(f"train_ddp.py --preset gpt2 failed: {run.failure()} (log: {run.log})")
        return s
    cfg, info, records = train_run_config(run), run.info(), run.records()
    tc, warm = cfg.train, ctx.scale.train_warmup
    tok_s = median_after_warmup(records, "tok_per_s", warm)
    s.info(
        "run",
        f"--preset gpt2{' (tiny shape)' if ctx.device.type == 'cpu' else ''}: micro-batch "
        f"{tc.batch.micro_batch_size} (auto) x {cfg.model.block_size}, {info['accum_steps']} micro-step(s), "
        f"{tc.compute.dtype}, compile {tc.compute.compile}, {tc.compute.loss_impl} loss; {len(records)} steps in "
        f"{run.seconds:.0f} s",
    )
    s.info("tokens/s", f"{tok_s:,.0f} (median of steps {warm + 1}-{len(records)})")
    peak = info.get("peak_flops_per_rank")
    mfu = tok_s * flops_per_token(cfg.model) / peak if peak else None
    source = "the data sheet's" if ctx.device.type == "cuda" else "the measured matmul"
    s.info("MFU", f"{mfu:.1%} of {source} {format_flops(peak)}" if mfu else "n/a: no peak for this device")
    planned = resolve_choices(cfg, Target(hardware=device_hardware(ctx.device, peak))).plan.memory.total
    s.data = {
        "tokens_per_s": tok_s,
        "mfu": mfu,
        "peak_flops": peak,
        "seconds": run.seconds,
        "micro_batch_size": tc.batch.micro_batch_size,
        "accum_steps": info["accum_steps"],
        "dtype": tc.compute.dtype,
        "losses": run.losses(),
        **memory_rows(s, ctx, planned, records),
    }
    first, last = loss_span(run)
    s.check("losses finite", all(map(math.isfinite, run.losses().values())), f"{first:.4f} -> {last:.4f}")
    return s


def memory_rows(s: Section, ctx: Context, planned: int, records: list[dict]) -> dict:
    """CUDA: the trainer's logged torch.cuda.max_memory_allocated against the planner's total for this run
    (`planned`), which is held within PLAN_ERROR of the measured peak (gpt2/plan/memory.py): the check allows
    that much over it. A CPU run logs its RSS over the whole process: not the same quantity."""
    measured = max(r["mem_mb"] for r in records) * 2**20
    if ctx.device.type != "cuda":
        s.note(
            "peak memory",
            f"n/a on cpu: the trainer logs RSS ({measured / 2**30:.2f} GiB, the whole process), "
            f"not the allocator's peak; the plan's tensors: {planned / 2**30:.2f} GiB",
            NA,
        )
        return {"planned_bytes": planned, "rss_bytes": measured}
    s.check(
        f"peak memory <= plan + {PLAN_ERROR:.0%}",
        measured <= planned * (1 + PLAN_ERROR),
        f"max_memory_allocated {measured / 2**30:.2f} GiB vs planned {planned / 2**30:.2f} GiB "
        f"({measured / planned:.0%})",
    )
    return {"planned_bytes": planned, "max_memory_allocated_bytes": measured}


def ranks(ctx: Context) -> Section:
    s = Section("ranks")
    n = ctx.ranks
    if n < 2:
        s.status, s.reason = (
            NA,
            (f"one {ctx.device.type} rank: nothing to all-reduce (--ranks N; default every GPU, one on a CPU)"),
        )
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
    s.info(
        "run",
        f"torchrun --nproc_per_node={n}: {n} x {ctx.device.type} over {backend}, "
        f"{len(many.records())} steps in {many.seconds:.0f} s",
    )
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
        s.info(
            "all-reduce",
            f"{net['bucket_bytes'] / 2**20:.1f} MiB: {net['allreduce_s'] * 1e3:.2f} ms, busbw "
            f"{net['busbw_bytes_per_s'] / 1e9:.2f} GB/s, algbw {net['algbw_bytes_per_s'] / 1e9:.2f} "
            f"GB/s; a step's gradients ~{net['step_comm_s']:.3g} s",
        )
    tok_1 = median_after_warmup(one.records(), "tok_per_s", warm)
    tok_n = median_after_warmup(many.records(), "tok_per_s", warm)
    speedup = tok_n / tok_1
    where = "" if ctx.device.type == "cuda" else "; the ranks share this CPU's cores, so this is no network measure"
    s.info(
        "scaling",
        f"{tok_n:,.0f} tokens/s on {n} vs {tok_1:,.0f} on 1: {speedup:.2f}x, {speedup / n:.0%} of linear{where}",
    )
    return {"tokens_per_s_1": tok_1, "tokens_per_s_n": tok_n, "speedup": speedup, "efficiency": speedup / n}
