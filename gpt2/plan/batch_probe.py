"""--micro-batch-size auto on a CPU, uncompiled: a few micro-steps timed at a few micro-batches, then cached.

The throughput model (gpt2/plan/batch_choice.py) counts a micro-step's fixed cost as the host's launches,
~250 us per block on a CPU, and so took 1 sequence for the debug preset; measured on a 2-core AVX2 CPU
that ran 1.6-1.7x slower than 32 (issue 54: 17.2 against 10.3 s a 4,096-token step). What it misses is
work every micro-step does whatever its size, which on a CPU is not small: the tied embedding's dense
(V, h) gradient and the LM head's weight gradient are each a pass over 50304 x h floats per micro-step,
and the loss's chunk loop starts afresh. Rather than model a CPU's memory system, this measures: the
model's forward and backward (the run's dtype, the loss path the run would take at that micro-batch:
full logits at 2 sequences of 6 x 384 ran 2x the tokens/s of 8, where the chunked loss ranks them the other
way; gradients accumulating as in a step) at up to three candidates (the model's pick, the largest that
fits and divides, one between), after one untimed call, each timed twice (in one order, then the other)
and those within CLOSE of the fastest a third time; each candidate's tokens/s is its fastest (a single
reading at 2 sequences of 6 x 384, taken while another job ran, was 3x slow and decided wrongly).
Cached per machine (matmul_peak.peak_key: the CPU, its threads, torch), shape, dtype, loss path and
candidates, as the loss probe is (gpt2/plan/loss_probe.py), so a run measures once per shape. The
optimizer step is left out: it runs once a step whatever the micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from gpt2.core import host_memory
from gpt2.core.config import ModelConfig
from gpt2.core.precision import Precision
from gpt2.plan import matmul_peak

CLOSE = 0.10
"""Candidates within this fraction of the fastest after two timed calls each are timed a third time, each
keeping its fastest: a close call gets one more reading."""
MEASURED_TIE = 0.05
"""auto takes the smallest candidate within this fraction of the fastest measured one: a CPU's timings move
by a few percent from run to run, and the smaller micro-batch holds less memory."""


@dataclass(frozen=True)
class MicroBatchRates:
    """Measured tokens/s per candidate micro-batch; the cache file that holds them."""

    rates: dict[int, float]
    cache: str
    peak_bytes: int | None = None
    """Measured now: how far the probe raised the process's resident high-water mark above what it held
    (0: not above an earlier mark); None from the cache or off Linux (the plan line counts it)."""

    def describe(self) -> str:
        shown = ", ".join(f"{b}: {r:,.0f}" for b, r in sorted(self.rates.items()))
        return f"measured on this CPU, tokens/s by micro-batch {shown} (cached in {self.cache})"


PROBE_MAX_TOKENS = 4096
"""The largest micro-step the probe times, in tokens: past a thousand or so tokens a CPU's throughput is flat
(the per-micro-step work is then a small share: the debug preset's 8 x 128 ran within 2% of 32 x 128,
bench/micro_batch_cpu.py), while the time and memory of one timed call grow with it. The gpt2 recipe's
524,288 tokens at the debug preset's 128 would otherwise time 4,096 sequences at once (a dry run hung on it)."""


def candidates(sizes: list[int], modelled: int, seq_len: int) -> list[int]:
    """Up to three of `sizes` (ascending, those that fit and divide) no larger than PROBE_MAX_TOKENS (the
    smallest whatever its size): the model's pick, the largest, and the one nearest their geometric mean."""
    small = [b for b in sizes if b * seq_len <= PROBE_MAX_TOKENS] or sizes[:1]
    largest, modelled = small[-1], min(modelled, small[-1])
    middle = min(small, key=lambda b: abs(b - (modelled * largest) ** 0.5))
    return sorted({modelled, middle, largest})


def batch_probe_key(cfg: ModelConfig, prec: Precision, losses: dict[int, str]) -> dict:
    return {
        **matmul_peak.peak_key("cpu", prec.torch_dtype),
        "probe": "micro-batch",
        "model": {
            k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "block_size", "vocab_size", "bias")
        },
        "attn_impl": cfg.attn_impl,
        "candidates": {str(b): loss for b, loss in sorted(losses.items())},  # micro-batch: its loss path
    }


def batch_probe_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return matmul_peak.peak_cache_dir() / f"micro-batch-{digest}.json"


def micro_batch_rates(
    cfg: ModelConfig, prec: Precision, losses: dict[int, str], *, refresh: bool | None = None
) -> MicroBatchRates:
    """Each candidate micro-batch's tokens/s on this CPU with the loss path the run would take at it
    (`losses`: micro-batch -> full or chunked), from the cache or measured (then cached atomically)."""
    sizes = sorted(losses)
    key = batch_probe_key(cfg, prec, losses)
    path = batch_probe_path(key)
    if refresh is None:
        refresh = matmul_peak.refresh_requested()
    entry = None if refresh else matmul_peak.read_cache_entry(path, key)
    peak = None
    rates = None
    if entry is not None:
        try:
            rates = {int(b): float(r) for b, r in entry["rates"].items()}
        except (KeyError, TypeError, ValueError, AttributeError):
            rates = None
        if rates is not None and (sorted(rates) != sorted(sizes) or not all(r > 0 for r in rates.values())):
            rates = None
    if rates is None:
        before, high = host_memory.resident_bytes(), host_memory.resident_peak_bytes()
        rates = time_micro_batches(cfg, prec, losses)
        after = host_memory.resident_peak_bytes()
        if None not in (before, high, after):
            peak = after - before if after > high else 0
        matmul_peak.write_cache_entry(path, key, {"rates": {str(b): r for b, r in rates.items()}})
    return MicroBatchRates(rates, str(path), peak)


def time_micro_batches(cfg: ModelConfig, prec: Precision, losses: dict[int, str]) -> dict[int, float]:
    """tokens/s of a fresh model's forward + backward at each micro-batch of `losses`, with its loss path
    (module docstring)."""
    from gpt2.model.gpt import GPT

    gen = torch.Generator().manual_seed(0)
    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
    finally:
        torch.random.set_rng_state(torch_state)  # the run's own draws are not moved by the probe
    T, sizes = cfg.block_size, sorted(losses)
    batches = {b: torch.randint(0, 50257, (2, b, T), generator=gen) for b in sizes}
    best = {b: float("inf") for b in sizes}

    def micro_step(b: int) -> float:
        x, y = batches[b]
        model.loss_impl = losses[b]  # a plain attribute, read at each forward (uncompiled)
        t0 = time.perf_counter()
        _, loss = model(x, y, return_logits=False)
        loss.backward()  # accumulating into .grad, as a step's micro-steps do
        return time.perf_counter() - t0

    with prec.autocast("cpu"):
        micro_step(sizes[0])  # untimed: first-call allocations, lazy initialisation, the gradients made
        for b in sizes:
            best[b] = micro_step(b)
        for b in reversed(sizes):  # a second reading each, in the other order: one busy moment is not a verdict
            best[b] = min(best[b], micro_step(b))
        fastest = min(best[b] / b for b in sizes)
        for b in [b for b in sizes if best[b] / b <= (1 + CLOSE) * fastest]:
            best[b] = min(best[b], micro_step(b))
    return {b: b * T / best[b] for b in sizes}
