"""The acceleration ladder: one switch at a time, from plain fp32 to the fast configuration.

Each rung keeps every switch of the rung before it and adds one:
  base     fp32, eager, explicit masked attention (softmax(QK^T)V), vocab 50257
  tf32     TF32 tensor-core matmuls for fp32 (CUDA only)
  bf16     bf16 autocast
  compile  torch.compile
  flash    fused SDPA with is_causal (flash / memory-efficient kernels)
  vocab    vocab padded to 50304 (a multiple of 128)
A rung is a training run: its switches are the run's own settings (TrainConfig dtype, tf32, compile;
ModelConfig attn_impl, vocab_size), the trainer's start-up builds it (`gpt2.train.startup.start`: the
record, the plan, `build`, as a real run with those flags builds it, on synthetic shards in a temporary
directory), and each timed step is the trainer's own `train_step` on one fixed batch of random tokens:
GPT.forward with its chunked loss, backward, gradient clipping and the fused AdamW. Each is timed after
warm-up (compilation happens there) as the median of its timed steps, taken in rounds of one step of every
rung so that background load on a shared machine hits all rungs alike. Then, optionally, the model's
attention kernels alone (its CausalSelfAttention with attn_impl explicit, sdpa_mask and sdpa):
forward+backward, with a check that their outputs and gradients agree.

`bench/ladder.py` (Markdown tables and a chart) and `python -m gpt2.doctor` (a node check) run it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.core.config import GPT2_VOCAB_SIZE, PADDED_VOCAB_SIZE, ModelConfig, RunConfig, TrainConfig
from gpt2.distributed.group import single_process
from gpt2.doctor.train_runs import write_synthetic_shards
from gpt2.model.gpt import CausalSelfAttention
from gpt2.plan import matmul_peak
from gpt2.plan.flops import device_peak_flops, flops_per_token
from gpt2.plan.measure import measured_peak_bytes
from gpt2.train.run_log import RunLog
from gpt2.train.startup import start
from gpt2.train.trainer import close_run, train_step

# build-nanogpt's A100 measurements (GPT-2 124M, B=16, T=1024).
DOC_A100_TOKENS_PER_S = {
    "base": 16_000,
    "tf32": 49_000,
    "bf16": 54_500,
    "compile": 126_000,
    "flash": 170_000,
    "vocab": 175_000,
}
# ms per batch of the whole model; the docs' middle kernel is SDPA's math backend, ours SDPA with a mask.
DOC_A100_ATTENTION_MS = {"explicit": "154", "sdpa_mask": "147 (SDPA math)", "sdpa": "130 (mem-efficient, is_causal)"}


@dataclass(frozen=True)
class Rung:
    name: str
    switch: str
    tf32: bool
    bf16: bool
    compile: bool
    attn_impl: str
    vocab_size: int


LADDER = (
    Rung("base", "fp32, eager, explicit attention, vocab 50257", False, False, False, "explicit", GPT2_VOCAB_SIZE),
    Rung("tf32", "+ TF32 matmuls", True, False, False, "explicit", GPT2_VOCAB_SIZE),
    Rung("bf16", "+ bf16 autocast", True, True, False, "explicit", GPT2_VOCAB_SIZE),
    Rung("compile", "+ torch.compile", True, True, True, "explicit", GPT2_VOCAB_SIZE),
    Rung("flash", "+ SDPA is_causal (flash)", True, True, True, "sdpa", GPT2_VOCAB_SIZE),
    Rung("vocab", "+ vocab 50304", True, True, True, "sdpa", PADDED_VOCAB_SIZE),
)

TF32_OFF_CUDA = "n/a (CUDA only)"
"""The tf32 rung's note on any other device: TF32 is a mode of NVIDIA's tensor cores."""


def without_bf16(rungs: tuple[Rung, ...], why: str) -> tuple[tuple[Rung, ...], dict[str, str]]:
    """The ladder for a device whose fast dtype is not bf16 (gpt2.plan.precision_choice.fast_dtype: a CPU where bf16
    is emulated or slower than fp32, a GPU before Ampere): the bf16 rung skipped with `why`, the rungs
    after it in fp32. Returns the rungs and the skipped rungs' notes (run_ladder's `skip`)."""
    out = tuple(r if r.name == "bf16" else dataclasses.replace(r, bf16=False) for r in rungs)
    out = tuple(dataclasses.replace(r, switch=r.switch + " (fp32)") if r.compile else r for r in out)
    return out, {"bf16": why}


@dataclass(frozen=True)
class RungResult:
    rung: Rung
    ms_per_step: float | None = None
    """Median over the timed steps; tokens/s, MFU and speed-ups come from it. None when the rung did
    not run (note says why)."""
    best_ms_per_step: float | None = None
    """Fastest timed step: the least disturbed by other processes."""
    tokens_per_s: float | None = None
    mfu_bf16: float | None = None
    """Against the bf16 peak, for every rung: one yardstick for the whole ladder."""
    mfu_own: float | None = None
    """Against the peak of the rung's own matmul dtype (fp32, TF32 or bf16)."""
    own_peak_name: str = ""
    peak_memory_bytes: int | None = None
    first_loss: float | None = None
    note: str = ""
    """Why the rung did not run (e.g. TF32 on a CPU)."""


@dataclass(frozen=True)
class AttentionResult:
    impl: str
    dtype: torch.dtype
    ms: float
    max_diff: float
    """Largest |difference| from the explicit kernel over the output and the q, k, v gradients."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def matmul_precision(tf32: bool):
    """TF32 for fp32 matmuls on CUDA inside the block; restored afterwards."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


@dataclass
class PreparedRung:
    rung: Rung
    cfg: ModelConfig
    step: Callable[[], float]
    """One training step; returns the loss."""
    first_loss: float
    state_bytes: int
    """Parameters and AdamW moments: live before every step."""
    close: Callable[[], None]
    """The run's log and writer, once it is timed."""


class FixedBatch:
    """The trainer's loader interface (micro_batch, advance) over one batch: every step and every
    rung sees the same tokens, so their first losses are comparable."""

    problem: str | None = None  # the interface's out-of-vocabulary report: random ids below the vocab never have one

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def micro_batch(self, micro_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y

    def advance(self, tokens: int | None = None) -> None:
        pass

    def close(self) -> None:
        pass


def rung_config(rung: Rung, shape: ModelConfig, batch: int, device: torch.device, work_dir: Path) -> RunConfig:
    """The training run a rung is: its switches as the trainer's settings, one micro-batch per step, on
    work_dir/data's shards, in work_dir/<rung>. Pinned as the ladder has always measured: the chunked loss,
    no recomputation, no spike guard (a few small kernels a step); and nothing written that a timing does
    not need (no evaluation, samples, checkpoints, plot, compile cache of its own)."""
    model = shape.replace(attn_impl=rung.attn_impl, vocab_size=rung.vocab_size)
    train = TrainConfig.of(
        data_dir=str(work_dir / "data"),
        out_dir=str(work_dir / rung.name),
        device=device.type,
        dtype="bfloat16" if rung.bf16 else "float32",
        compile=rung.compile,
        tf32=rung.tf32,
        micro_batch_size=batch,
        total_batch_size=batch * shape.block_size,
        max_steps=LADDER_MAX_STEPS,
        lr=6e-4,
        warmup_steps=0,
        seed=0,
        loss_impl="chunked",
        activation_checkpointing="none",
        spike_guard=False,
        eval_interval=0,
        eval_tokens=batch * shape.block_size,
        sample_interval=0,
        ckpt_interval=0,
        async_ckpt=False,
        compile_cache="off",
        plot=False,
    )
    return RunConfig(model, train)


LADDER_MAX_STEPS = 100
"""A rung's --max-steps: only its schedule's length (the ladder times a few steps; the first loss is taken
before any update)."""


def write_ladder_shards(work_dir: Path, shape: ModelConfig, batch: int) -> None:
    """Synthetic shards the rungs' loaders open (each rung then steps on its one fixed batch): a tenth of
    LADDER_MAX_STEPS' batches (the start-up warns of a run of more than 10 epochs), and one evaluation's
    validation tokens."""
    window = batch * (shape.block_size + 1)
    steps = -(-LADDER_MAX_STEPS // 10) + 1
    write_synthetic_shards(work_dir / "data", steps * window, val_tokens=max(16_384, window), seed=0)


def prepare_rung(rung: Rung, shape: ModelConfig, batch: int, device: torch.device, *, warmup: int, work_dir: Path):
    """One rung as the trainer starts a run with its settings (start(): the record, the plan, build(),
    compiled as the trainer compiles), warmed up: a compiled rung compiles here. -> PreparedRung"""
    cfg = rung_config(rung, shape, batch, device, work_dir)
    dist = single_process(device)
    log = RunLog(dist, cfg.train.ckpt.out_dir, verbose=False, log_file=True, console=False)  # its train.log alone
    run = start(cfg, dist, log=log)
    parts, cfg = run.parts, run.cfg
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, GPT2_VOCAB_SIZE, (2, batch, shape.block_size), generator=gen).to(device)
    parts.loader.close()
    parts.loader, parts.prefetched = FixedBatch(x, y), None  # every rung the same tokens

    def step() -> float:
        # TF32 is set per step (the trainer sets it once, in configure_backends): rungs alternate.
        with matmul_precision(cfg.train.compute.tf32 and device.type == "cuda"):
            return train_step(parts, cfg.train, dist, False)["loss"]

    first_loss = step()  # same seed and tokens on every rung: these should agree closely
    for _ in range(max(warmup - 1, 1 if rung.compile else 0)):
        step()
    state = sum(p.numel() * p.element_size() for p in parts.model.parameters()) + sum(
        t.numel() * t.element_size()
        for s in parts.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return PreparedRung(rung, cfg.model, step, first_loss, state, lambda: close_run(parts, dist, log))


def time_interleaved(
    prepared: list[PreparedRung], device: torch.device, rounds: int, peaks: dict[str, float | None]
) -> dict[str, list[float]]:
    """Seconds per step of each rung, one step of every rung per round.

    Interleaving makes every rung see the same background load, so their ratios stay fair on a
    shared machine. On a CPU each round also measures the bf16 and fp32 matmul peaks
    (`cpu_peaks`), and `peaks` keeps the best rate seen: the peak is measured under the same
    conditions as the steps.
    """
    times: dict[str, list[float]] = {p.rung.name: [] for p in prepared}
    for _ in range(rounds):
        for p in prepared:
            sync(device)
            t0 = time.perf_counter()
            p.step()
            sync(device)
            times[p.rung.name].append(time.perf_counter() - t0)
        if device.type == "cpu":
            cpu_peaks(peaks)
    return times


PEAK_MEASUREMENT = dict(budget_s=1.0, min_time_s=0.05)
"""The CPU peak's matmul (gpt2.plan.matmul_peak.matmul_rate): the size doubles up to 2048 until one call
takes 50 ms, then it is timed for the rest of about a second. A fast fp32 or bf16 matmul reaches
2048^3 (under load too: a call of a small one can take 15 ms of thread wake-ups alone); an emulated
bf16 one stops at 256-512 instead of spending a minute per 2048^3 call."""


def cpu_peaks(peaks: dict[str, float | None]) -> None:
    """Raise peaks["fp32"] and peaks["bf16"] to a fresh measurement where it is higher. As in
    gpt2.plan.flops.device_peak_flops, the bf16 peak is never below fp32's: where bf16 is emulated, the
    compiled rungs can run fp32 kernels."""
    rate = {
        name: matmul_peak.matmul_rate("cpu", dtype, fresh=True, **PEAK_MEASUREMENT)
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
    }
    peaks["fp32"] = max(peaks["fp32"], rate["fp32"])
    peaks["bf16"] = max(peaks["bf16"], rate["bf16"], peaks["fp32"])


def initial_peaks(device: torch.device) -> dict[str, float | None]:
    """The MFU yardsticks before any step: a GPU's data-sheet peaks (bf16, fp32, tf32; None where the
    table does not list the GPU), a CPU's measured bf16 and fp32 matmul rates (raised again between
    the timed steps by time_interleaved)."""
    peaks = {
        "bf16": device_peak_flops(device, torch.bfloat16, tf32=False),
        "fp32": device_peak_flops(device, torch.float32, tf32=False),
    }
    if device.type == "cuda":
        peaks["tf32"] = device_peak_flops(device, torch.float32, tf32=True)
    else:
        cpu_peaks(peaks)
    return peaks


def rung_result(
    p: PreparedRung,
    times: list[float],
    batch: int,
    device: torch.device,
    peaks: dict[str, float | None],
    peak_memory: int,
) -> RungResult:
    seconds = statistics.median(times)
    tokens_per_s = batch * p.cfg.block_size / seconds
    own = "bf16" if p.rung.bf16 else ("tf32" if p.rung.tf32 and device.type == "cuda" else "fp32")
    achieved = tokens_per_s * flops_per_token(p.cfg)
    return RungResult(
        p.rung,
        ms_per_step=seconds * 1e3,
        best_ms_per_step=min(times) * 1e3,
        tokens_per_s=tokens_per_s,
        mfu_bf16=_ratio(achieved, peaks["bf16"]),
        mfu_own=_ratio(achieved, peaks[own]),
        own_peak_name=own,
        peak_memory_bytes=peak_memory,
        first_loss=p.first_loss,
    )


def _ratio(achieved: float, peak: float | None) -> float | None:
    """MFU, or None where the GPU has no data-sheet peak (see gpt2.plan.flops.device_peak_flops)."""
    return None if peak is None else achieved / peak


def run_ladder(
    rungs: list[Rung],
    shape: ModelConfig,
    batch: int,
    device: torch.device,
    *,
    steps: int,
    warmup: int,
    peaks: dict[str, float | None],
    skip: dict[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> list[RungResult]:
    """Every rung prepared, timed interleaved, then its step's peak memory measured alone.

    skip: rung name -> why it does not run here (its result carries the note); tf32 off CUDA is
    always skipped. progress: called with a line as each rung is ready (compilation can take a
    minute)."""
    skip = dict(skip or {})
    if device.type != "cuda":
        skip.setdefault("tf32", TF32_OFF_CUDA)
    prepared = {}
    with tempfile.TemporaryDirectory(prefix="ladder-") as work:
        write_ladder_shards(Path(work), shape, batch)
        try:
            for rung in rungs:
                if rung.name in skip:
                    continue
                t0 = time.perf_counter()
                prepared[rung.name] = prepare_rung(rung, shape, batch, device, warmup=warmup, work_dir=Path(work))
                if progress is not None:
                    progress(f"prepared {rung.name} in {time.perf_counter() - t0:.0f} s")
            times = time_interleaved(list(prepared.values()), device, steps, peaks)
            results = []
            for rung in rungs:
                if rung.name not in prepared:
                    results.append(RungResult(rung, note=skip[rung.name]))
                    continue
                p = prepared[rung.name]
                peak_memory = p.state_bytes + measured_peak_bytes(p.step, device)
                results.append(rung_result(p, times[rung.name], batch, device, peaks, peak_memory))
        finally:
            for p in prepared.values():
                p.close()
    return results


ATTENTION_IMPLS = ("explicit", "sdpa_mask", "sdpa")


def attention_modules(cfg: ModelConfig, device: torch.device) -> dict[str, CausalSelfAttention]:
    """The model's attention layer once per attn_impl. Only its kernel dispatch is run (`attend`,
    on q, k, v): the c_attn and c_proj matmuls around it are not part of the comparison."""
    return {
        impl: CausalSelfAttention(cfg.replace(attn_impl=impl, dropout=0.0), 0).to(device) for impl in ATTENTION_IMPLS
    }


def attention_fwd_bwd(
    attn: CausalSelfAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor
) -> list[torch.Tensor]:
    """Output and q, k, v gradients of one forward+backward, in fp32 for comparison."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn.attend(q, k, v)
    out.backward(grad_out)
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def attention_inputs(
    cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype, seed: int = 2
) -> tuple[torch.Tensor, ...]:
    """q, k, v and an output gradient at the model's attention shape (B, nh, T, hd), seeded."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.n_head, cfg.block_size, cfg.head_dim)
    return tuple(torch.randn(shape, generator=gen).to(device, dtype) for _ in range(4))


def max_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Largest |a - b| over pairs of tensors (attention_fwd_bwd's outputs and gradients)."""
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def run_attention(
    cfg: ModelConfig, batch: int, device: torch.device, dtype: torch.dtype, *, repeats: int
) -> list[AttentionResult]:
    """ms per forward+backward of attention alone (interleaved rounds, median), and the largest
    difference of each kernel's output and gradients from the explicit kernel's."""
    q, k, v, grad_out = attention_inputs(cfg, batch, device, dtype)
    modules = attention_modules(cfg, device)
    reference = attention_fwd_bwd(modules["explicit"], q, k, v, grad_out)
    diffs = {
        impl: max_difference(attention_fwd_bwd(modules[impl], q, k, v, grad_out), reference) for impl in ATTENTION_IMPLS
    }
    times: dict[str, list[float]] = {impl: [] for impl in ATTENTION_IMPLS}
    for _ in range(repeats):
        for impl in ATTENTION_IMPLS:
            sync(device)
            t0 = time.perf_counter()
            attention_fwd_bwd(modules[impl], q, k, v, grad_out)
            sync(device)
            times[impl].append(time.perf_counter() - t0)
    return [AttentionResult(impl, dtype, statistics.median(times[impl]) * 1e3, diffs[impl]) for impl in ATTENTION_IMPLS]


def attention_tolerance(dtype: torch.dtype) -> float:
    # bf16 keeps 8 mantissa bits: kernels that round in different places differ by ~1e-2.
    return 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4


def _fmt(x: float | None, spec: str, none: str = "n/a") -> str:
    return none if x is None else format(x, spec)


def ladder_table(results: list[RungResult], device: torch.device) -> str:
    rows = [
        "| rung | switch | ms/step (best) | tokens/s | MFU vs bf16 peak | MFU vs own dtype peak | peak memory MiB "
        "| x base | x previous | loss (step 1) | A100 (docs) tokens/s | A100 x previous |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = next((r.tokens_per_s for r in results if r.tokens_per_s), None)
    prev = None
    doc_prev = None
    for r in results:
        doc = DOC_A100_TOKENS_PER_S[r.rung.name]
        doc_x = f"{doc / doc_prev:.2f}" if doc_prev else "1.00"
        doc_prev = doc
        if r.tokens_per_s is None:
            rows.append(f"| {r.rung.name} | {r.rung.switch} | {r.note or 'n/a'} | | | | | | | | {doc:,} | {doc_x} |")
            continue
        x_prev = f"{r.tokens_per_s / prev:.2f}" if prev else "1.00"
        prev = r.tokens_per_s
        rows.append(
            f"| {r.rung.name} | {r.rung.switch} | {r.ms_per_step:.0f} ({r.best_ms_per_step:.0f}) | "
            f"{r.tokens_per_s:,.0f} | "
            f"{_fmt(r.mfu_bf16, '.1%')} | {_fmt(r.mfu_own, '.1%')} ({r.own_peak_name}) | "
            f"{r.peak_memory_bytes / 2**20:,.0f} | "
            f"{r.tokens_per_s / base:.2f} | {x_prev} | {r.first_loss:.4f} | {doc:,} | {doc_x} |"
        )
    if device.type != "cuda":
        rows.append('\nOn a CPU the TF32 rung is skipped, so the bf16 rung\'s "x previous" is against base.')
    return "\n".join(rows)


def attention_table(results: list[AttentionResult]) -> str:
    rows = [
        "| kernel | dtype | ms fwd+bwd | x explicit | max abs diff vs explicit | agrees | "
        "A100 (docs) ms/batch, whole model |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    explicit = {r.dtype: r.ms for r in results if r.impl == "explicit"}
    names = {"explicit": "explicit mask", "sdpa_mask": "SDPA attn_mask", "sdpa": "SDPA is_causal"}
    for r in results:
        ok = "yes" if r.max_diff <= attention_tolerance(r.dtype) else "NO"
        rows.append(
            f"| {names[r.impl]} | {str(r.dtype).removeprefix('torch.')} | {r.ms:.2f} | "
            f"{explicit[r.dtype] / r.ms:.2f} | {r.max_diff:.1e} | {ok} | {DOC_A100_ATTENTION_MS[r.impl]} |"
        )
    return "\n".join(rows)
