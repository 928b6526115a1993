"""--micro-batch-size auto: the fastest micro-batch by a throughput model, among those that fit and divide.

The largest micro-batch that fits is not the fastest. What a larger micro-batch buys is fewer micro-steps,
and each micro-step costs a fixed time beyond its FLOPs: the kernels' launches and the host's work per
operation, about the same whatever its size. What it can cost: under torch.compile, the full-logits loss
(one fused cross-entropy) takes 1/FULL_LOSS_MEMORY_SHARE of the memory only up to some micro-batch, and
past it the chunked loss runs the LM head ~1.3x slower (gpt2/plan/loss_choice.py, bench/lm_head_loss.py).

The model (micro_step_seconds, a pure function): a micro-step of B sequences of T tokens takes
    layers x OVERHEAD_S_PER_LAYER  +  B x T x flops_per_token / (peak x MFU) x (1 + chunked-loss extra)
and auto takes the smallest micro-batch whose modelled tokens/s is within TIE of the best one's: below
that the model cannot tell them apart, and a smaller micro-batch leaves memory free. On CUDA the fixed cost is
measured: ~285 us per block and micro-step, 4.0 ms for GPT-2 124M's 12 blocks and 2 ends. Two runs of the
gpt2 preset on an H200 (2026-11-28, docs/performance.md), both with the full loss, took 1.032 s a step at
32 x 16 and 1.000 s at 64 x 8: a + 32 b = 64.4 ms and a + 64 b = 124.8 ms a micro-step give a = 4.0 ms;
the FP8 head's pair gave 3.6 ms, and an H100's B = 12 and 16 steps ~4 ms once its optimizer step is
taken out. (The estimate before, ~150 us from ~30 kernels at ~5 us each, chose 32 on the H200, which
left those 3.2% unused.) GPT-2 124M at 40% of an H100's bf16 peak then spends 10% of a 16-sequence
micro-step on it, 5.3% at 32, 2.7% at 64. For the gpt2 preset that makes 64 on an H200, 32 on an H100
(at 64 the full loss passes its share of 80 GB and the chunked one costs more than the micro-batch
gains), 16 on an A100-80GB or A100-40GB, whose lower peak makes the fixed cost a smaller share, and 8 on a
24 GB card (tests/test_batch_choice.py holds the table). On a CPU
each eager operation costs the host microseconds, ~250 us per block and micro-step, small beside a
CPU's compute per token, so the model takes a few sequences; but a CPU's micro-step also does work the
model does not hold (the dense (V, h) gradients of the tied embedding and LM head, every micro-step),
and 1 sequence ran 1.6-1.7x slower than 32 (issue 54). So on this machine's CPU, uncompiled, auto
measures a few candidates instead (gpt2/plan/batch_probe.py; the `measure` argument). Under --parallel
fsdp with several ranks every micro-step all-gathers the weights again, a cost this model does not hold,
so auto keeps the largest micro-batch there. `quick` in scripts/gpu_session.sh measures B = 12, this
choice and the sizes between, which checks the constants on the first GPU lease.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt2.core.config import ModelConfig, RunConfig
from gpt2.core.schedule import batch_warmup_problem, grad_accum_steps
from gpt2.plan.flops import flops_per_token
from gpt2.plan.hardware import Hardware
from gpt2.plan.loss_choice import choose_loss_impl
from gpt2.plan.memory import AUTO_HEADROOM, PLAN_ERROR, does_not_fit, max_micro_batch_size

OVERHEAD_S_PER_LAYER = {"cuda": 285e-6, "cpu": 250e-6}
"""Seconds per transformer block of a micro-step's fixed cost (the embedding and the LM head count as one
block each), by device type (module docstring: CUDA's measured on an H200 and an H100, the CPU's estimated)."""
ASSUMED_PEAK_FLOPS = {"cuda": 312e12, "cpu": 1e11}
"""Where the hardware has no peak (an unlisted GPU, a CPU whose probe failed): an A100's bf16 data-sheet
peak, and a CPU of a few cores."""
CHUNKED_LOSS_EXTRA = 0.3
"""The compiled chunked loss's LM head takes this much longer than the compiled full loss's (~1.3x,
bench/lm_head_loss.py, issue 23)."""
TIE = 0.02
"""Micro-batches whose modelled tokens/s is within this fraction of the best are equally fast to the model."""
MFU = 0.4
"""The share of the peak the compute runs at (the planner's default assumption, gpt2/plan/planner.py)."""


@dataclass(frozen=True)
class MicroBatchChoice:
    """The micro-batch a run takes and why, as the start-up line says it."""

    size: int
    reason: str
    probe_bytes: int | None = None
    """On a CPU, what the micro-batch probe (gpt2/plan/batch_probe.py) raised the resident peak by when it
    ran in this start; None from its cache or not probed (the plan line counts it)."""

    def describe(self) -> str:
        """The start-up line (its prefix is parsed by scripts: keep `micro-batch auto: N sequences`)."""
        return f"micro-batch auto: {self.size} sequences, {self.reason}"


def micro_step_seconds(
    cfg: ModelConfig,
    micro_batch_size: int,
    seq_len: int,
    *,
    device_type: str,
    peak_flops: float | None,
    chunked_compiled: bool = False,
) -> float:
    """The model's time of one micro-step (module docstring). chunked_compiled: the loss at this micro-batch
    is the chunked one under torch.compile, where the full one is the faster path."""
    peak = peak_flops or ASSUMED_PEAK_FLOPS[device_type]
    overhead = (cfg.n_layer + 2) * OVERHEAD_S_PER_LAYER[device_type]
    extra = CHUNKED_LOSS_EXTRA * lm_head_share(cfg, seq_len) if chunked_compiled else 0.0
    return overhead + micro_batch_size * seq_len * flops_per_token(cfg, seq_len) / (peak * MFU) * (1 + extra)


def lm_head_share(cfg: ModelConfig, seq_len: int) -> float:
    """The LM head's share of a token's training FLOPs (6 V h of flops_per_token)."""
    return 6.0 * cfg.vocab_size * cfg.n_embd / flops_per_token(cfg, seq_len)


def choose_micro_batch(cfg: RunConfig, hardware: Hardware, *, world_size: int, measure=None) -> MicroBatchChoice:
    """--micro-batch-size auto for cfg (its activation checkpointing already decided, none or full) at
    world_size: among the micro-batches that divide a rank's share of total_batch_size and fit
    with AUTO_HEADROOM (else, where none does, those that fit at all), the smallest within TIE of the fastest
    by the throughput model; under fsdp at world size > 1, the largest. A model that fits nowhere: the
    does_not_fit error. The loss each micro-batch would take is --loss-impl auto's whatever the run asks
    for, so that --loss-impl never changes the micro-batch (gpt2/plan/loss_choice.py: both paths then run
    the same batch maths). measure: on this machine's CPU, uncompiled, a callable taking candidate
    micro-batches and returning gpt2.plan.batch_probe.MicroBatchRates: the model's pick, the largest and
    one between are timed (at most PROBE_MAX_TOKENS a micro-step), and the largest is taken unless a smaller
    one runs more than MEASURED_TIE faster (MicroBatchRates.choose: by the paired timings where there are
    some)."""
    model, tc, seq_len = cfg.model, cfg.train, cfg.model.block_size
    grad_accum_steps(tc.batch.total_batch_size, 1, seq_len, world_size)  # some micro-batch divides: else its error
    fits = max_micro_batch_size(cfg, hardware, world_size=world_size, headroom=AUTO_HEADROOM)
    margin = f"fits with the plan's {PLAN_ERROR:.0%} margin up to {fits}"
    if not fits:
        fits = max_micro_batch_size(cfg, hardware, world_size=world_size)
        margin = f"none fits with the plan's {PLAN_ERROR:.0%} margin; without it up to {fits}"
    if not fits:
        raise ValueError(does_not_fit(cfg, hardware, world_size=world_size))
    seqs = tc.batch.total_batch_size // (seq_len * world_size)  # sequences per rank per optimizer step
    # A batch warmup steps the batch by 1/(stages + 1) of it, whole micro-steps each (BatchConfig).
    parts = tc.batch.batch_warmup_stages + 1 if tc.batch.batch_warmup_steps else 1
    sizes = [b for b in range(1, min(fits, seqs) + 1) if seqs % (b * parts) == 0]
    if not sizes:  # check_data refused the layouts where even 1 sequence does not divide
        raise ValueError(batch_warmup_problem(tc.batch.total_batch_size, 1, seq_len, world_size, parts - 1))
    if tc.distributed.parallel == "fsdp" and world_size > 1:
        return MicroBatchChoice(
            sizes[-1],
            f"the largest that {margin} and divides the global batch (fsdp: every "
            "micro-step gathers the weights again)",
        )

    def chunked(b: int) -> bool:
        if not tc.compute.compile or tc.compute.fp8_head:
            return False  # uncompiled, which loss is faster is measured at start-up, not modelled; FP8: full
        at_b = RunConfig(model, tc.replace(micro_batch_size=b, loss_impl="auto"))
        return choose_loss_impl(at_b, hardware, world_size=world_size).impl == "chunked"

    rate = {
        b: b
        / micro_step_seconds(
            model,
            b,
            seq_len,
            device_type=hardware.device_type,
            peak_flops=hardware.peak_flops,
            chunked_compiled=chunked(b),
        )
        for b in sizes
    }
    best = max(rate, key=rate.get)
    pick = min(b for b in sizes if rate[b] >= (1 - TIE) * rate[best])
    if measure is not None and len(sizes) > 1:
        from gpt2.plan.batch_probe import MEASURED_TIE, candidates

        measured = measure(candidates(sizes, pick, seq_len))
        chosen = measured.choose()
        if not measured.rates:  # the probe's budget: nothing timed
            return MicroBatchChoice(
                chosen,
                f"{measured.describe()} (the throughput model took {pick}); {margin} and divides the global batch",
                measured.peak_bytes,
            )
        return MicroBatchChoice(
            chosen,
            f"{measured.describe()}: the largest unless a smaller one runs more than {MEASURED_TIE:.0%} faster (the "
            f"throughput model, which does not know a CPU's per-micro-step work, took {pick}); {margin} and "
            "divides the global batch",
            measured.peak_bytes,
        )
    return MicroBatchChoice(
        pick, explain(model, pick, sizes[-1], rate, seq_len, hardware, margin, chunked(sizes[-1]) and not chunked(pick))
    )


def explain(
    cfg: ModelConfig,
    pick: int,
    largest: int,
    rate: dict[int, float],
    seq_len: int,
    hardware: Hardware,
    margin: str,
    loss_differs: bool,
) -> str:
    """Why the throughput model took `pick`, in one clause."""
    overhead = (cfg.n_layer + 2) * OVERHEAD_S_PER_LAYER[hardware.device_type]
    compute = (
        micro_step_seconds(cfg, pick, seq_len, device_type=hardware.device_type, peak_flops=hardware.peak_flops)
        - overhead
    )
    why = (
        f"the fastest by the throughput model ({overhead * 1e3:.1f} ms fixed per micro-step against "
        f"{compute * 1e3:,.1f} ms of compute"
    )
    gain = rate[largest] / rate[pick] - 1
    if pick != largest and gain < 0:
        why += f"; {largest} would run {-gain:.0%} slower" + (" with the chunked loss" if loss_differs else "")
    elif pick != largest:
        why += f"; {largest} would gain {gain:.1%}, within the {TIE:.0%} the model does not tell apart"
    return f"{why}); {margin} and divides the global batch"
