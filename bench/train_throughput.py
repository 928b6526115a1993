"""Training throughput and MFU of the real trainer on a fixed CPU workload.

    python bench/train_throughput.py                 # a few minutes on an idle 2-core machine
    python bench/train_throughput.py --steps 6 --md /tmp/train_throughput.md

Workload: GPT-2 shape with 6 layers, 6 heads, width 384, block 256, vocab 50304, micro-batch 8,
4,096 tokens per optimizer step (2 micro-batches on one process, 1 on each of two), random tokens.
Rows, each timed after --warmup steps (compilation happens there) as the median of --steps steps:
  fp32 eager / fp32 compiled / bf16 compiled    in this process, through gpt2.train.session: start() and
                                                train_step() as the trainer runs them (chunked loss,
                                                fused AdamW), cores/1 threads (configure_backends);
                                                the in-process rows take one step each in turn
                                                (round-robin), so they share the same load
  fp32 compiled, --loss-impl full               the same with the full-logits loss: what
                                                --loss-impl auto takes where the logits fit
                                                comfortably; the rows above are built with the
                                                chunked loss (--loss-impl chunked in the workload)
  bf16 compiled, plain loss + for-loop AdamW    the trainer before its chunked loss and fused AdamW:
                                                the model's (B, T, V) logits and F.cross_entropy, and
                                                AdamW(foreach=False, fused=False)
  bf16 compiled, chunked loss + for-loop AdamW  the first change alone
  bf16 compiled, --optimizer muon               the default path with Muon on the blocks' matrices
                                                (gpt2/train/muon.py): its step-time cost against AdamW's row
  1 x N threads vs N x 1 thread                 real `python train_ddp.py` / `torchrun
                                                --nproc_per_node=N train_ddp.py` runs (gloo),
                                                tokens/s read from RUN/metrics.jsonl
  N x 1 thread, --optimizer muon                the same torchrun run with Muon, whose
                                                Newton-Schulz work is spread over the ranks
                                                (gpt2/train/muon.py): its cost against AdamW's N x 1
                                                The real-trainer rows run alternately --ddp-rounds
                                                times (A B C, C B A, ...)
  DDP and torch.compile orders                 2 gloo ranks x 1 thread (torch.multiprocessing),
                                                fp32, --ddp-bucket-cap-mb 4, through build() and
                                                train_step(): compile then DDP (the trainer), DDP
                                                then compile, each block compiled alone
                                                (torchtitan's way), and eager DDP; each in a fresh
                                                process group and inductor cache, --ddp-rounds
                                                times alternately: the compile time (the first
                                                step) and the median step beside the trainer's.
                                                --order-model small: a 2-layer 128-wide model at
                                                block 64 instead of the workload's shape
"bf16" in these names is the dtype --dtype auto picks on this CPU (gpt2/core/precision.py): where bf16
matmuls are not measured faster than fp32 (AVX2 only, where bf16 is emulated ~50x slower), those
rows run fp32 and are named so, the "fp32 compiled" row is not repeated, and no bf16 peak is taken.
DDP efficiency = (N processes x 1 thread tokens/s) / (1 process x N threads tokens/s).
MFU = model FLOPs (gpt2.plan.flops.flops_per_token: 6N + 12LhT) per second over the matmul peak
measured in this run (gpt2.plan.matmul_peak.matmul_rate on a fixed 2048^3 matmul, taken at the start and
after every round; the best of them, the least-disturbed measurement). On a shared machine the
wall-clock numbers move with the load, so the in-process rows also give MFU by CPU time: FLOPs per CPU-second over the
peak's FLOPs per
CPU-second (the same thread count), which load from other processes changes much less.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpt2.core import precision
from gpt2.core.config import GPT2_VOCAB_SIZE, RunConfig
from gpt2.data.shards import write_shard
from gpt2.distributed.group import Dist, WorldInfo, exit_after_group, single_process
from gpt2.plan import matmul_peak, precision_choice
from gpt2.plan.flops import flops_per_token
from gpt2.train.session import Session, param_groups, parse_config, read_metrics

ORDERS = {
    "compile, then DDP (the trainer)": "compile_ddp",
    "DDP, then compile": "ddp_compile",
    "each block compiled, then DDP": "blocks",
    "eager DDP": "eager",
}
SMALL_MODEL = ["--n-layer", "2", "--n-head", "2", "--n-embd", "128", "--block-size", "64", "--micro-batch-size", "4"]

REPO = Path(__file__).resolve().parent.parent
MICRO_BATCH, BLOCK, TOKENS_PER_STEP = 8, 256, 4096
WORKLOAD = (
    f"--device cpu --n-layer 6 --n-head 6 --n-embd 384 --block-size {BLOCK} --vocab-size 50304 "
    f"--micro-batch-size {MICRO_BATCH} --total-batch-size {TOKENS_PER_STEP} "
    "--loss-impl chunked "  # the rows' loss unless one names another: a Session decides auto as the trainer does
    "--eval-tokens 0 --sample-interval 0 --ckpt-interval 0 --keep-checkpoints 1 --plot false --log-interval 1 "
    "--warmup-steps 2 --lr 3e-4 --min-lr 3e-5 --seed 1337"
).split()


@dataclass(frozen=True)
class Row:
    name: str
    layout: str
    """processes x threads"""
    dtype: str
    step_s: float
    tokens_per_s: float
    cpu_s: float | None = None
    """CPU seconds per step, all threads (in-process rows only)."""
    first_loss: float | None = None


PEAK_N, PEAK_BUDGET_S = 2048, 1.0
"""The peak's matmul: 2048^3, timed for about a second (5-8 calls of fp32 on 2 cores) per measurement."""


class Peaks:
    """The best of every peak measurement in the run, per dtype (fp32, and the auto dtype).

    Each measurement is gpt2.plan.matmul_peak.matmul_rate's fixed-size 2048^3 matmul, taken afresh (not
    its per-process cache) with wall-clock and process CPU-time rates from the same calls.
    """

    def __init__(self, low: str) -> None:
        self.low = low
        self.best: dict[str, matmul_peak.MatmulRate] = {}

    def measure(self) -> None:
        for name, dtype in {
            "fp32": torch.float32,
            self.low: precision.Precision.from_key(self.low).torch_dtype,
        }.items():
            p = matmul_peak.matmul_rate("cpu", dtype, n=PEAK_N, budget_s=PEAK_BUDGET_S, fresh=True, cpu_time=True)
            old = self.best.get(name)
            self.best[name] = (
                p if old is None else matmul_peak.MatmulRate(max(p.wall, old.wall), max(p.cpu, old.cpu), p.n)
            )


def write_random_shards(data_dir: Path, n_tokens: int) -> None:
    gen = np.random.default_rng(0)
    write_shard(data_dir / "bench_train_000000.bin", gen.integers(0, GPT2_VOCAB_SIZE, n_tokens, dtype=np.int64))


class PlainLossCall(torch.nn.Module):
    """Calls the wrapped model as the trainer did before the chunked loss: full logits, plain loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx, targets=None, return_logits=True):
        return self.model(idx, targets)


@dataclass
class Contender:
    """One in-process row: its own model, optimizer and loader, stepped in turn with the others."""

    name: str
    cfg: RunConfig
    session: Session
    times: list
    first_loss: float | None = None


def prepare(name: str, cfg: RunConfig, dist: Dist, *, plain_loss: bool, loop_adamw: bool) -> Contender:
    """The trainer's build (compiled as the trainer compiles) for one row (gpt2/train/session.py).

    plain_loss and loop_adamw undo the two changes of bench/NOTES.md (v1, v2) for the comparison
    rows: the model object the step calls, and the optimizer it steps, are swapped.
    """
    session = Session(cfg, dist)
    if plain_loss:
        session.train_model = PlainLossCall(session.train_model)
    if loop_adamw:
        tc = cfg.train
        session.optimizer = torch.optim.AdamW(
            param_groups(session.model, tc.optim.weight_decay),
            lr=tc.schedule.lr,
            betas=(tc.optim.beta1, tc.optim.beta2),
            eps=tc.optim.eps,
            foreach=False,
            fused=False,
        )
    return Contender(name, cfg, session, [])


def run_in_process(contenders: list[Contender], dist: Dist, peaks: Peaks, *, steps: int, warmup: int) -> list[Row]:
    """Time the trainer's step (Session.step) for every row, one step of each in turn.

    Round-robin, so that every row sees the same mix of load from other processes: on a shared
    machine the ratios between rows then hold even when the absolute numbers drift. The matmul
    peak is measured once per round too.
    """
    for i in range(warmup + steps):
        for c in contenders:
            t0, c0 = time.perf_counter(), time.process_time()
            out = c.session.step()
            if i >= warmup:
                c.times.append((time.perf_counter() - t0, time.process_time() - c0))
            c.first_loss = out["loss"] if c.first_loss is None else c.first_loss
        peaks.measure()
        print(
            f"  round {i + 1}/{warmup + steps}: "
            + ", ".join(f"{c.name} {c.times[-1][0]:.1f} s" for c in contenders if c.times),
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for c in contenders:
        step_s = statistics.median(t for t, _ in c.times)
        rows.append(
            Row(
                c.name,
                f"1 x {torch.get_num_threads()}",
                c.cfg.train.compute.dtype,
                step_s,
                TOKENS_PER_STEP / step_s,
                cpu_s=statistics.median(cpu for _, cpu in c.times),
                first_loss=c.first_loss,
            )
        )
    return rows


def run_trainer(
    data_dir: Path,
    out_dir: Path,
    *,
    processes: int,
    threads: int,
    steps: int,
    warmup: int,
    dtype: str,
    flags: tuple[str, ...] = (),
) -> tuple[list[float], float]:
    """A real train_ddp.py run (torchrun for more than one process): its timed step times and
    first loss, from RUN/metrics.jsonl."""
    args = [
        "train_ddp.py",
        *WORKLOAD,
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(out_dir),
        "--num-threads",
        str(threads),
        "--max-steps",
        str(warmup + steps),
        "--dtype",
        dtype,
        *flags,
    ]
    if processes == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", *args]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [r for r in read_metrics(out_dir / "metrics.jsonl") if "tok_per_s" in r]
    return [r["step_s"] for r in records if r["step"] > warmup], records[0]["loss"]


@dataclass(frozen=True)
class Layout:
    """One real-trainer row: processes x threads, and extra flags."""

    name: str
    processes: int
    threads: int
    flags: tuple[str, ...] = ()


def run_alternating(
    data_dir: Path, tmp: Path, layouts: list[Layout], *, steps: int, warmup: int, rounds: int, dtype: str
) -> tuple[list[Row], list[dict[str, float]]]:
    """Real train_ddp.py runs of every layout, alternately (A B C, C B A, A B C, ...).

    The machine's load drifts over minutes; alternating the order puts every layout under the same
    drift, and every timed step of every round goes into one median per layout. Also returns each
    round's medians, so the spread of any ratio is visible.
    """
    times: dict[str, list[float]] = {lay.name: [] for lay in layouts}
    losses, per_round = {}, []
    for i in range(rounds):
        round_s = {}
        for lay in layouts if i % 2 == 0 else layouts[::-1]:
            step_times, losses[lay.name] = run_trainer(
                data_dir,
                tmp / f"run_{i}_{len(round_s)}",
                processes=lay.processes,
                threads=lay.threads,
                steps=steps,
                warmup=warmup,
                dtype=dtype,
                flags=lay.flags,
            )
            times[lay.name] += step_times
            round_s[lay.name] = statistics.median(step_times)
        per_round.append(round_s)
        print(
            f"  real-trainer round {i + 1}/{rounds}: "
            + ", ".join(
                f"{lay.name} ({lay.processes} x {lay.threads}) {round_s[lay.name]:.2f} s/step" for lay in layouts
            ),
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for lay in layouts:
        step_s = statistics.median(times[lay.name])
        rows.append(
            Row(
                lay.name,
                f"{lay.processes} x {lay.threads}",
                dtype,
                step_s,
                TOKENS_PER_STEP / step_s,
                first_loss=losses[lay.name],
            )
        )
    return rows, per_round


def _order_rank(rank: int, order: str, args: list[str], steps: int, warmup: int, tmp: str) -> None:
    """One rank of an order row: build() as the trainer does, then the order's compile and DDP."""
    import json

    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    dist = Dist(rank=rank, local_rank=rank, world_size=2, local_world_size=2, device=torch.device("cpu"))
    session = Session(parse_config(args + ["--compile", str(order == "compile_ddp").lower()]), dist)
    if order == "ddp_compile":
        session.train_model = torch.compile(session.train_model)
    elif order == "blocks":  # in place: no _orig_mod. in the state dict; compiled at the first call
        for block in session.model.transformer.h:
            block.compile()
    times, losses = [], []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        losses.append(session.step()["loss"])
        times.append(time.perf_counter() - t0)
    if rank == 0:
        (Path(tmp) / "times.json").write_text(json.dumps({"times": times, "losses": losses}))
    tdist.barrier()
    tdist.destroy_process_group()
    # Past gloo's exit-time abort (a worker thread taking the GIL while Python finalizes: gpt2/distributed/group.py
    # exit_after_group), as the trainer's ranks leave.
    exit_after_group(0, WorldInfo(rank, rank, 2, 2))


def run_orders(
    data_dir: Path, tmp: Path, *, steps: int, warmup: int, small: bool, rounds: int, skip: set[str] = frozenset()
) -> list[str]:
    """The DDP/compile order rows: the lines of their own table (first step, s/step, ratio).

    Each order runs `rounds` times, alternately (A B C D, D C B A, ...) as the real-trainer rows do:
    compile times especially move with the machine's load. First steps: the median of the rounds';
    s/step: the median of every round's timed steps.
    """
    tokens = 2 * 4 * 64 if small else TOKENS_PER_STEP
    orders = {name: order for name, order in ORDERS.items() if order == "compile_ddp" or order not in skip}
    results = {name: {"first": [], "times": [], "losses": []} for name in orders}
    for i in range(rounds):
        for name in list(orders) if i % 2 == 0 else list(orders)[::-1]:
            results[name] = _merge(
                results[name],
                _run_order(
                    data_dir,
                    tmp / f"order_{orders[name]}_{i}",
                    orders[name],
                    steps=steps,
                    warmup=warmup,
                    tokens=tokens,
                    small=small,
                ),
            )
            print(
                f"  order round {i + 1}/{rounds}, {name}: first step {results[name]['first'][-1]:.1f} s",
                file=sys.stderr,
                flush=True,
            )
    base = statistics.median(results["compile, then DDP (the trainer)"]["times"])
    lines = [
        "| DDP / compile order (2 x 1, gloo) | first step (compiles), s | s/step | step vs the trainer's "
        "| loss (last step) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        step_s = statistics.median(r["times"])
        lines.append(
            f"| {name} | {statistics.median(r['first']):.1f} | {step_s:.3f} | {step_s / base:.2f}x | "
            f"{r['losses'][-1]:.4f} |"
        )
    return lines


def _merge(pooled: dict, run: dict) -> dict:
    return {k: pooled[k] + run[k] for k in pooled}


def _run_order(data_dir: Path, run: Path, order: str, *, steps: int, warmup: int, tokens: int, small: bool) -> dict:
    """One order's 2-rank run in a fresh process group and inductor cache: first step, timed steps, losses."""
    import json

    import torch.multiprocessing as mp

    run.mkdir()
    args = [
        *WORKLOAD,
        *(SMALL_MODEL if small else []),
        *"--dtype float32 --num-threads 1".split(),
        "--total-batch-size",
        str(tokens),
        "--ddp-bucket-cap-mb",
        "4",
        "--max-steps",
        str(warmup + steps),
        "--data-dir",
        str(data_dir),
        "--out-dir",
        str(run / "out"),
    ]
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(run / "inductor")  # every order compiles from scratch
    try:
        mp.spawn(_order_rank, args=(order, args, steps, warmup, str(run)), nprocs=2, join=True)
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
    r = json.loads((run / "times.json").read_text())
    return {"first": [r["times"][0]], "times": r["times"][warmup:], "losses": r["losses"]}


def table(rows: list[Row], cfg: RunConfig, peaks: Peaks) -> str:
    flops_step = flops_per_token(cfg.model) * TOKENS_PER_STEP
    own, low = precision.SHORT_NAMES, peaks.low
    out = [
        f"| configuration | processes x threads | s/step | tokens/s | MFU vs {low} peak | MFU vs own dtype peak "
        f"| MFU vs {low} peak, CPU time | loss (step 1) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        achieved = flops_step / r.step_s
        by_cpu = "" if r.cpu_s is None else f"{flops_step / r.cpu_s / peaks.best[low].cpu:.1%}"
        out.append(
            f"| {r.name} | {r.layout} | {r.step_s:.2f} | {r.tokens_per_s:,.0f} | "
            f"{achieved / peaks.best[low].wall:.1%} | {achieved / peaks.best[own[r.dtype]].wall:.1%} "
            f"({own[r.dtype]}) | {by_cpu} | {r.first_loss:.4f} |"
        )
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per row (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    ap.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="cores to use: 1 process x THREADS vs THREADS processes x 1",
    )
    ap.add_argument(
        "--ddp-rounds",
        type=int,
        default=2,
        help="alternating runs of each DDP layout (A B, B A, ...): the load drifts between runs",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated rows to leave out: fp32,fp32c,full,v0,v1,bf16c,muon,ddp,muon-ddp, and order "
        "(the DDP/compile order rows) or single order rows: ddp_compile,blocks,eager",
    )
    ap.add_argument(
        "--order-model",
        choices=("workload", "small"),
        default="workload",
        help="the model of the DDP/compile order rows: the workload's, or a 2-layer 128-wide one",
    )
    ap.add_argument("--md", type=Path, help="also write the Markdown report here")
    return ap


def header_lines(command: str, cfg, peaks, args, start_load: float) -> list[str]:
    """The report's first lines: the command, the machine, the workload, the matmul peaks, the load."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return [
        f"command: `{command.strip()}`",
        f"date: {now:%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        f"workload: n_layer=6 n_head=6 n_embd=384 block=256 vocab=50304, micro-batch {MICRO_BATCH}, "
        f"{TOKENS_PER_STEP:,} tokens/step; {flops_per_token(cfg.model) / 1e6:.1f} MFLOP/token; "
        f"median of {args.steps} steps after {args.warmup} warm-up",
        f"matmul peaks ({args.threads} threads, best 2048^3 of the run): "
        + ", ".join(
            f"{k} {p.wall / 1e9:,.0f} GFLOP/s ({p.cpu / 1e9:,.0f} per CPU-second)" for k, p in peaks.best.items()
        ),
        f"load average (other processes on the cores): {start_load:.1f} at start, {os.getloadavg()[0]:.1f} at end",
    ]


def layout_names(low: str) -> tuple[str, str, str]:
    """The DDP rows' names: one process, torchrun, torchrun with Muon (low: the compiled rows' dtype)."""
    return (
        f"train_ddp.py, {low} compiled",
        f"torchrun train_ddp.py, {low} compiled",
        f"torchrun train_ddp.py, {low} compiled, --optimizer muon",
    )


def goal_lines(rows: list, cfg, peaks, low: str, args, per_round: list) -> list[str]:
    """The goals' lines under the table: MFU, Muon's cost, the loss paths' ratio, DDP's efficiency."""
    goals = []
    one, many, many_muon = layout_names(low)
    for r in rows:
        if r.name == f"{low} compiled":  # the trainer's default path here (the other rows are history)
            m = flops_per_token(cfg.model) * r.tokens_per_s / peaks.best[low].wall
            goals.append(f"{r.name}: MFU {m:.1%} (goal >= 60%)")
    by_name = {r.name: r for r in rows}
    adamw_row = by_name.get(f"{low} compiled") or by_name.get("fp32 compiled")
    if adamw_row is not None and f"{low} compiled, --optimizer muon" in by_name:
        cost = by_name[f"{low} compiled, --optimizer muon"].step_s / adamw_row.step_s - 1
        goals.append(f"--optimizer muon: {cost:+.1%} step time against AdamW's {adamw_row.name} row (goal < 10%)")
    if "fp32 compiled" in by_name and "fp32 compiled, --loss-impl full" in by_name:
        ratio = by_name["fp32 compiled"].step_s / by_name["fp32 compiled, --loss-impl full"].step_s
        goals.append(f"fp32 compiled step time, chunked loss / full logits: {ratio:.2f}x (round-robin, same load)")
    timed = (
        f"median of all {args.ddp_rounds * args.steps} timed steps of each over {args.ddp_rounds} alternating rounds"
    )
    if one in by_name and many in by_name:
        ddp = by_name[many].tokens_per_s / by_name[one].tokens_per_s
        goals.append(
            f"DDP efficiency {args.threads} x 1 / 1 x {args.threads}: {ddp:.1%} (goal >= 90%); {timed} "
            "(per round: " + ", ".join(f"{r[one] / r[many]:.1%}" for r in per_round) + ")"
        )
    if many_muon in by_name:
        cost = by_name[many_muon].step_s / by_name[many].step_s - 1
        goals.append(
            f"--optimizer muon under torchrun ({args.threads} x 1, the orthogonalisation spread over "
            f"ranks): {cost:+.1%} step time against AdamW's (goal < 10%); {timed} (per round: "
            + ", ".join(f"{r[many_muon] / r[many] - 1:+.1%}" for r in per_round)
            + ")"
        )
    return goals


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.steps, args.warmup, args.threads, args.ddp_rounds) < 1:
        print("error: --steps, --warmup, --threads and --ddp-rounds must be at least 1", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    base = WORKLOAD + ["--num-threads", str(args.threads), "--max-steps", str(args.warmup + args.steps)]
    command = "python bench/train_throughput.py " + " ".join(sys.argv[1:] if argv is None else argv)
    start_load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    auto = precision_choice.resolve_precision("auto", "cpu")  # the dtype of the "bf16" rows, where bf16 is fast here
    low = auto.short
    peaks, rows = Peaks(low), []
    peaks.measure()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        data.mkdir()
        write_random_shards(data, TOKENS_PER_STEP * (args.warmup + args.steps + 2) + 1)
        lowc = ["--dtype", auto.dtype, "--compile", "true"]
        plan = [
            ("fp32", "fp32 eager", ["--dtype", "float32", "--compile", "false"]),
            ("fp32c", "fp32 compiled", ["--dtype", "float32", "--compile", "true"]),
            (
                "full",
                "fp32 compiled, --loss-impl full",
                ["--dtype", "float32", "--compile", "true", "--loss-impl", "full"],
            ),
            ("v0", f"{low} compiled, plain loss + for-loop AdamW", lowc),
            ("v1", f"{low} compiled, chunked loss + for-loop AdamW", lowc),
        ]
        if low != "fp32":
            plan.append(("bf16c", f"{low} compiled", lowc))
        plan.append(("muon", f"{low} compiled, --optimizer muon", lowc + ["--optimizer", "muon"]))
        dist = single_process("cpu")
        contenders = []
        for key, name, flags in plan:
            if key in skip:
                continue
            cfg = parse_config(base + ["--data-dir", str(data), "--out-dir", str(Path(tmp) / key)] + flags)
            contenders.append(prepare(name, cfg, dist, plain_loss=key == "v0", loop_adamw=key in ("v0", "v1")))
        if contenders:
            rows += run_in_process(contenders, dist, peaks, steps=args.steps, warmup=args.warmup)
        del contenders
        torch._dynamo.reset()
        layouts = []
        one, many, many_muon = layout_names(low)
        if "ddp" not in skip and args.threads > 1:
            layouts += [Layout(one, 1, args.threads), Layout(many, args.threads, 1)]
        if "muon-ddp" not in skip and args.threads > 1:
            layouts += [lay for lay in [Layout(many, args.threads, 1)] if lay not in layouts]
            layouts.append(Layout(many_muon, args.threads, 1, ("--optimizer", "muon")))
        per_round = []
        if layouts:
            real, per_round = run_alternating(
                data, Path(tmp), layouts, steps=args.steps, warmup=args.warmup, rounds=args.ddp_rounds, dtype=auto.dtype
            )
            rows += real
            peaks.measure()
        order_lines = []
        if "order" not in skip:
            order_lines = run_orders(
                data,
                Path(tmp),
                steps=args.steps,
                warmup=args.warmup,
                small=args.order_model == "small",
                rounds=args.ddp_rounds,
                skip=skip,
            )
    cfg = parse_config(base + ["--data-dir", "unused", "--out-dir", "unused"])
    header = header_lines(command, cfg, peaks, args, start_load)
    report = "\n".join(header) + ("\n\n" + table(rows, cfg, peaks) if rows else "")
    goals = goal_lines(rows, cfg, peaks, low, args, per_round)
    if goals:
        report += "\n\n" + "\n".join(f"- {g}" for g in goals)
    if order_lines:
        report += (
            "\n\nDDP and torch.compile orders ("
            + ("2-layer 128-wide model, block 64, 512 tokens/step" if args.order_model == "small" else "the workload")
            + f", fp32, 4 MiB buckets; median of "
            f"all {args.ddp_rounds * args.steps} timed steps of {args.ddp_rounds} alternating rounds, each run "
            f"after {args.warmup} untimed and with a fresh inductor cache):\n\n" + "\n".join(order_lines)
        )
    print(report)
    if args.md:
        args.md.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
