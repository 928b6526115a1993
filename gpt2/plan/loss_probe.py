"""Which loss path is faster uncompiled on this CPU, at a run's shape: measured once, then cached.

Compiled, the full-logits loss is the faster path wherever its logits fit (gpt2/plan/
choose_loss_impl). Uncompiled it depends on the width and the dtype, not only on the memory: on a
2-core avx512_bf16 CPU (train_ddp.py, s/step, fp32 / bf16) the chunked loss was the faster one at the
quick start's shape (4 x 128 wide, 8 x 128 tokens: 0.84 vs 0.96 / 0.44 vs 0.76) and the slower one at
W1 (6 x 384 wide, 8 x 256 tokens: 2.90 vs 2.45 / 1.36 vs 1.20). At 128 wide the LM-head matmul is
cheap and the full path's passes over the (N, V) fp32 logits dominate, which the chunks keep in
cache; at 384 wide the matmuls dominate and the chunks' smaller matmuls, and the weight-gradient sum
they add to once per chunk, cost more. Where the crossover lies moves with the CPU's caches and its
bf16 support, so it is measured: the LM head and loss alone, forward and backward, both paths
alternating in PROBE_ROUNDS pairs (gpt2/plan/paired.py), on the run's micro-batch of tokens (at most
PROBE_MAX_TOKENS) and in its dtype. The full loss is taken where the pairs decide it is faster by more
than FULL_MARGIN; a tie or a disagreement keeps the chunked one, which holds less memory. Cached per
machine and shape only when the pairs decided on a quiet machine (issue 73), re-checked every
paired.RECHECK_RUNS-th run that reads it. A probe whose rounds would outlast paired.PROBE_BUDGET_S times
nothing and keeps the chunked loss (GPT-2's 768 x 50,304 head with 4 threads on an AVX2 CPU's 2 cores ran
15 s a full-loss call, and its rounds took 210 s of a dry run): their FLOPs at the CPU's matmul peak say it
before any call, else the untimed calls.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2.core import host_memory
from gpt2.core.precision import Precision
from gpt2.model.loss import linear_cross_entropy
from gpt2.plan import matmul_peak, paired

PROBE_MAX_TOKENS = 512
"""The probe's tokens at most (a run's micro-batch of tokens above it is timed at this many): eager's full
loss holds ~12 bytes per logit, 3.3 GiB at 32 x 128 tokens of GPT-2's vocabulary, a resident peak far above
a small run's own (issue 58: a first run of a new shape peaked at 3,516 MiB against a 357 MiB plan). At
512 tokens it is ~0.3 GiB, below the smallest run's own; both paths' times grow linearly in the tokens
past a few hundred (each is matmuls over the rows and passes over the logits), so the choice is the same."""

PROBE_ROUNDS = 6
"""Pairs of timed calls, full and chunked back to back in alternating order (after one untimed call of each):
a decision needs paired.AGREE_SHARE of them (5 of 6) to agree."""

FULL_MARGIN = 0.9
"""auto takes the full loss uncompiled only when it measured at most this fraction of the chunked
loss's time: near a tie the chunked loss, which holds less memory, stays, and a probe's noise does not
flip a shape's choice from one run to the next. The pairs' tie margin is its inverse (1/0.9: 11%)."""

LOSS_TIE = 1 / FULL_MARGIN - 1
"""paired.compare's margin for the loss paths: a ratio within 1 +- 11% is a tie (the chunked loss)."""


@dataclass(frozen=True)
class EagerLossTimes:
    """Seconds of one forward + backward of the LM head and loss, per path; where they came from."""

    full_s: float
    chunked_s: float
    cache: str  # the cache file that holds them
    peak_bytes: int | None = None
    """Measured now: how far the probe raised the process's resident high-water mark above the resident set
    it started from (0 when it stayed below an earlier mark: it added nothing to the peak a user reads);
    None when the times came from the cache or the memory cannot be read (off Linux)."""
    verdict: paired.Comparison | None = None
    """The paired comparison (A: full, B: chunked) that decides; None: times given without one (the
    FULL_MARGIN rule on the two times decides)."""
    source: str = ""
    """Cached, or why not."""
    over_budget: str = ""
    """Not timed: how long the rounds would take (the times are then the untimed calls', or the floor's)."""

    @property
    def full_is_faster(self) -> bool:
        if self.over_budget:
            return False
        if self.verdict is not None:
            return self.verdict.winner == "a"
        return self.full_s <= FULL_MARGIN * self.chunked_s

    def describe(self) -> str:
        if self.over_budget:
            return (
                f"not measured at this shape: timing both paths in {PROBE_ROUNDS} pairs would take "
                f"{self.over_budget} (over the probe's {paired.PROBE_BUDGET_S:.0f} s), so the chunked loss (it "
                "holds less memory)"
            )
        times = f"full {self.full_s * 1e3:,.0f} ms vs chunked {self.chunked_s * 1e3:,.0f} ms"
        if self.verdict is None:
            return f"measured at this shape: {times} per micro-step's LM head + loss (cached in {self.cache})"
        undecided = "" if self.verdict.winner else ": undecided, so the chunked loss (it holds less memory)"
        return (
            f"measured at this shape: {times} per micro-step's LM head + loss (medians): "
            f"{self.verdict.describe('full', 'chunked')}{undecided}; {self.source}"
        )


_TIMES: dict[str, EagerLossTimes] = {}
"""eager_loss_times' per-process answers, by cache file: one start asks once per shape (the micro-batch
probe asks for each candidate, the loss choice again), and a dry run in the same process gets the same."""


def loss_probe_key(device: str, prec: Precision, tokens: int, n_embd: int, vocab_size: int) -> dict:
    """The machine (matmul_peak.peak_key: CPU, threads, torch) and the shape the times depend on."""
    return {
        **matmul_peak.peak_key(device, prec.torch_dtype),
        "probe": "eager-loss",
        "tokens": tokens,
        "n_embd": n_embd,
        "vocab_size": vocab_size,
    }


def loss_probe_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return matmul_peak.peak_cache_dir() / f"eager-loss-{digest}.json"


def eager_loss_times(
    device: str,
    prec: Precision,
    tokens: int,
    n_embd: int,
    vocab_size: int,
    *,
    refresh: bool | None = None,
    peak_flop_s: float | None = None,
) -> EagerLossTimes:
    """Both paths' times at this shape on this CPU and the pairs' verdict, from the cache or measured (then
    cached atomically where paired.Comparison.doubt finds nothing against it). refresh=None reads
    matmul_peak.REFRESH_PEAK_ENV, as the matmul peaks do. peak_flop_s: the CPU's matmul peak measured now,
    which tells a probe over its budget before any call (time_loss_paths)."""
    tokens = min(tokens, PROBE_MAX_TOKENS)
    key = loss_probe_key(device, prec, tokens, n_embd, vocab_size)
    path = loss_probe_path(key)
    if str(path) in _TIMES:
        return _TIMES[str(path)]
    if refresh is None:
        refresh = matmul_peak.refresh_requested()
    fields = ("full_s", "chunked_s", "verdict")
    entry, due = (None, False) if refresh else matmul_peak.read_trusted_entry(path, key, fields)
    if entry is not None and not due:
        times = _cached_times(entry, path)
    else:
        before, high = host_memory.resident_bytes(), host_memory.resident_peak_bytes()
        rounds = time_loss_paths(device, prec, tokens, n_embd, vocab_size, peak_flop_s=peak_flop_s)
        after = host_memory.resident_peak_bytes()
        peak = None
        if None not in (before, high, after):  # what it raised the process's peak to, above what it held
            peak = after - before if after > high else 0
        if isinstance(rounds, paired.OverBudget):  # the chunked loss, nothing timed and nothing cached
            over = EagerLossTimes(0.0, 0.0, str(path), peak, None, "not cached", over_budget=rounds.how)
            _TIMES[str(path)] = over
            return over
        verdict = rounds.verdict("full", "chunked", margin=LOSS_TIE, cpu_clock_decides=False)  # a loop of chunks
        full_s, chunked_s = rounds.median_s("full"), rounds.median_s("chunked")
        if (doubt := verdict.doubt()) is None:
            values = {"full_s": full_s, "chunked_s": chunked_s, "verdict": verdict.to_dict()}
            matmul_peak.write_trusted_entry(path, key, values, verdict.load)
            times = EagerLossTimes(full_s, chunked_s, str(path), peak, verdict, f"cached in {path}")
        elif entry is not None:  # a re-check on a busy machine keeps the quiet measurement
            matmul_peak.restart_recheck(path, key)
            kept = _cached_times(entry, path)
            times = replace(kept, peak_bytes=peak, source=f"{kept.source}; its re-check now was doubtful: {doubt}")
        else:
            times = EagerLossTimes(full_s, chunked_s, str(path), peak, verdict, f"not cached: {doubt}")
    _TIMES[str(path)] = times
    return times


def _cached_times(entry: dict, path: Path) -> EagerLossTimes:
    verdict = paired.Comparison.from_dict(entry["verdict"])
    source = f"measured {entry['measured']}, cached in {path}"
    return EagerLossTimes(float(entry["full_s"]), float(entry["chunked_s"]), str(path), None, verdict, source)


def time_loss_paths(
    device: str, prec: Precision, tokens: int, n_embd: int, vocab_size: int, *, peak_flop_s: float | None = None
) -> paired.Rounds | paired.OverBudget:
    """GPT.forward's two loss paths ('full', 'chunked') timed in PROBE_ROUNDS alternating pairs after one
    untimed call each, on random activations and a GPT-2-scale weight, under the run's autocast, the padded
    vocabulary rows masked as the model masks them; or paired.OverBudget where the rounds would outlast
    paired.PROBE_BUDGET_S: from their FLOPs (each call the head's forward and backward, 6 x tokens x n_embd x
    vocabulary) at peak_flop_s before any call, else from the untimed calls."""
    from gpt2.model.gpt import GPT2_VOCAB_SIZE

    if peak_flop_s:
        floor = PROBE_ROUNDS * 2 * 6.0 * tokens * n_embd * vocab_size / peak_flop_s
        if floor > paired.PROBE_BUDGET_S:
            return paired.OverBudget(floor, f"at least ~{floor:.0f} s (their FLOPs at the CPU's matmul peak)")

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n_embd, generator=gen).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab_size, n_embd, generator=gen)).to(device).requires_grad_()
    bias = None
    if vocab_size > GPT2_VOCAB_SIZE:
        bias = torch.zeros(vocab_size, device=device)
        bias[GPT2_VOCAB_SIZE:] = float("-inf")
    targets = torch.randint(0, min(vocab_size, GPT2_VOCAB_SIZE), (tokens,), generator=gen).to(device)

    def full() -> None:
        x.grad = weight.grad = None
        logits = F.linear(x, weight, bias)
        F.cross_entropy(logits.float(), targets, ignore_index=-1).backward()

    def chunked() -> None:
        x.grad = weight.grad = None
        linear_cross_entropy(x, weight, bias, targets).backward()

    with prec.autocast(device):
        started = time.perf_counter()
        full(), chunked()  # untimed: allocations, lazy initialisation
        estimate = PROBE_ROUNDS * (time.perf_counter() - started)  # an over-estimate: the first calls allocate
        if estimate > paired.PROBE_BUDGET_S:
            return paired.OverBudget(estimate, f"~{estimate:.0f} s")
        return paired.measure_rounds({"full": full, "chunked": chunked}, PROBE_ROUNDS)
