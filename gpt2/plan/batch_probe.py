"""--micro-batch-size auto on a CPU, uncompiled: a few micro-steps timed at a few micro-batches, then cached.

The throughput model (gpt2/plan/batch_choice.py) counts a micro-step's fixed cost as the host's launches, ~250 us
per block on a CPU, and so took 1 sequence for the debug preset; measured on a 2-core AVX2 CPU that ran 1.6-1.7x
slower than 32 (issue 54: 17.2 against 10.3 s a 4,096-token step). What it misses is work every micro-step does
whatever its size, which on a CPU is not small: the tied embedding's dense (V, h) gradient and the LM head's weight
gradient are each a pass over 50304 x h floats per micro-step, and the loss's chunk loop starts afresh. Rather than
model a CPU's memory system, this measures: the model's forward and backward (the run's dtype, the loss path the run
would take at that micro-batch: full logits at 2 sequences of 6 x 384 ran 2x the tokens/s of 8, where the chunked
loss ranks them the other way; gradients accumulating as in a step) at up to three candidates (the model's pick, the
largest that fits and divides, one between), after one untimed call at the smallest and one at the largest, in
PROBE_ROUNDS rounds, each round every candidate once, the order reversed every other round (gpt2/plan/paired.py).
The largest candidate is the hardware's rule on a CPU (issue 54's three shapes ran fastest at their largest, or
within 2%); the fastest of the others by its median time per token is compared with it pair by pair
(decide_micro_batch) and taken only where it runs more than MEASURED_TIE faster with the pairs agreeing. A tie, or
pairs that disagree (the machine too busy to tell), keep the largest. So does a probe that would outlast
paired.PROBE_BUDGET_S (GPT-2 124M on a 2-core CPU: ~130 s of timed calls, for a choice the rule makes within a few
percent), known as cheaply as it can be (time_micro_batches): from the FLOPs at the CPU's matmul peak measured now,
which no call beats, or an earlier call at the shape, or the untimed calls, the smallest first (on an AVX2-only CPU
one call at GPT-2 124M's largest, 4 x 1024 tokens, took over 450 s, and a dry run at several world sizes paid it at
each). Cached per machine (matmul_peak.peak_key: the CPU, its threads, torch), shape, dtype, loss path and
candidates, as the loss probe is (gpt2/plan/loss_probe.py), so a run measures once per shape; but only a measurement
that decided on a quiet machine (issue 73), re-checked every paired.RECHECK_RUNS-th run. The optimizer step is left
out: it runs once a step whatever the micro-batch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from gpt2.core import host_memory
from gpt2.core.config import ModelConfig
from gpt2.core.precision import Precision
from gpt2.plan import matmul_peak, paired
from gpt2.plan.flops import flops_per_token

PROBE_ROUNDS = 5
"""Rounds of timed calls, every candidate once a round: a decision between two needs paired.AGREE_SHARE of
the rounds (4 of 5) to agree."""
MEASURED_TIE = 0.05
"""auto leaves the largest candidate for a smaller one only where the smaller runs more than this fraction
faster (issue 73: within it, a tie, the hardware's rule holds: on a CPU the largest micro-step amortises the
per-micro-step work best; before, the smallest within it was taken, which flipped with a few percent of noise)."""


@dataclass(frozen=True)
class MicroBatchRates:
    """Measured tokens/s per candidate micro-batch, the one chosen from them and why; the cache file."""

    rates: dict[int, float]
    cache: str
    peak_bytes: int | None = None
    """Measured now: how far the probe raised the process's resident high-water mark above what it held
    (0: not above an earlier mark); None from the cache or off Linux (the plan line counts it)."""
    chosen: int | None = None
    """The paired decision (decide_micro_batch); None: rates given without pairs, where the same rule on the
    rates decides (choose)."""
    why: str = ""
    """The verdict that decided it (paired.Comparison.describe)."""
    source: str = ""
    """Where it is cached, or why it is not."""

    def choose(self) -> int:
        """The micro-batch auto takes: the paired decision, or, from rates alone, the largest unless the fastest
        runs more than MEASURED_TIE faster."""
        if self.chosen is not None:
            return self.chosen
        largest = max(self.rates)
        fastest = max(self.rates, key=self.rates.get)
        return fastest if self.rates[fastest] > (1 + MEASURED_TIE) * self.rates[largest] else largest

    def describe(self) -> str:
        if not self.rates:
            return f"not measured on this CPU: {self.why}"
        shown = ", ".join(f"{b}: {r:,.0f}" for b, r in sorted(self.rates.items()))
        if self.chosen is None:
            return f"measured on this CPU, tokens/s by micro-batch {shown} (cached in {self.cache})"
        return f"measured on this CPU, tokens/s by micro-batch (medians) {shown}: {self.why} ({self.source})"


_RATES: dict[str, MicroBatchRates] = {}
"""micro_batch_rates' per-process answers, by cache file (a dry run in the same process gets the same)."""


PROBE_MAX_TOKENS = 4096
"""The largest micro-step the probe times, in tokens: past a thousand or so tokens a CPU's throughput is flat
(the per-micro-step work is then a small share: the debug preset's 8 x 128 ran within 2% of 32 x 128,
bench/micro_batch_cpu.py, removed after a823994), while the time and memory of one timed call grow with it.
The gpt2 recipe's 524,288 tokens at the debug preset's 128 would otherwise time 4,096 sequences at once (a dry
run hung on it)."""


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
    cfg: ModelConfig,
    prec: Precision,
    losses: dict[int, str],
    *,
    refresh: bool | None = None,
    peak_flop_s: float | None = None,
) -> MicroBatchRates:
    """Each candidate micro-batch's tokens/s on this CPU with the loss path the run would take at it
    (`losses`: micro-batch -> full or chunked) and the one to take (decide_micro_batch), from the cache or
    measured (then cached atomically where nothing speaks against it: the load, the pairs' scatter, a
    disagreement). peak_flop_s: the CPU's matmul peak measured now (gpt2/plan/resolve.py probe_peak), or None;
    it only tells a probe over its budget before any call."""
    sizes = sorted(losses)
    key = batch_probe_key(cfg, prec, losses)
    path = batch_probe_path(key)
    if str(path) in _RATES:
        return _RATES[str(path)]
    if refresh is None:
        refresh = matmul_peak.refresh_requested()
    entry, due = (None, False) if refresh else matmul_peak.read_trusted_entry(path, key, ("rates", "chosen", "why"))
    cached = _cached_rates(entry, path, sizes) if entry is not None else None
    if cached is not None and not due:
        _RATES[str(path)] = cached
        return cached
    before, high = host_memory.resident_bytes(), host_memory.resident_peak_bytes()
    rounds = time_micro_batches(cfg, prec, losses, peak_flop_s=peak_flop_s)
    after = host_memory.resident_peak_bytes()
    peak = None
    if None not in (before, high, after):
        peak = after - before if after > high else 0
    if isinstance(rounds, paired.OverBudget):  # the rule, nothing timed and nothing cached
        why = (
            f"timing {len(sizes)} micro-batches in {PROBE_ROUNDS} rounds would take {rounds.how} (over the probe's "
            f"{paired.PROBE_BUDGET_S:.0f} s), so the largest, the CPU's rule"
        )
        _RATES[str(path)] = MicroBatchRates({}, str(path), peak, sizes[-1], why, "not cached")
        return _RATES[str(path)]
    chosen, why, load, doubt = decide_micro_batch(rounds, sizes, cfg.block_size)
    rates = {b: b * cfg.block_size / rounds.median_s(str(b)) for b in sizes}
    if doubt is None:
        values = {"rates": {str(b): r for b, r in rates.items()}, "chosen": chosen, "why": why}
        matmul_peak.write_trusted_entry(path, key, values, load)
        measured = MicroBatchRates(rates, str(path), peak, chosen, why, f"cached in {path}")
    elif cached is not None:  # a re-check on a busy machine keeps the quiet measurement
        matmul_peak.restart_recheck(path, key)
        recheck = f"{cached.source}; its re-check now was doubtful: {doubt}"
        measured = replace(cached, peak_bytes=peak, source=recheck)
    else:
        measured = MicroBatchRates(rates, str(path), peak, chosen, why, f"not cached: {doubt}")
    _RATES[str(path)] = measured
    return measured


def _cached_rates(entry: dict, path: Path, sizes: list[int]) -> MicroBatchRates | None:
    try:
        rates = {int(b): float(r) for b, r in entry["rates"].items()}
        chosen = int(entry["chosen"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    if sorted(rates) != sizes or chosen not in rates or not all(r > 0 for r in rates.values()):
        return None
    source = f"measured {entry['measured']}, cached in {path}"
    return MicroBatchRates(rates, str(path), None, chosen, entry["why"], source)


def decide_micro_batch(
    rounds: paired.Rounds, sizes: list[int], seq_len: int
) -> tuple[int, str, paired.Load, str | None]:
    """(micro-batch, why, load, doubt) from the rounds (named by str(size)), a pure function of them: the largest
    candidate (the hardware's rule on a CPU: issue 54's three shapes ran fastest at their largest, or within
    2%), unless the fastest of the others by median time per token runs faster than it by more than
    MEASURED_TIE with paired.AGREE_SHARE of their pairs agreeing; then that one. A tie keeps the largest (a
    decision: cached); a disagreement keeps it too, but the measurement is doubtful. why: the verdict of that
    candidate against the largest (paired.Comparison.describe); doubt: why it may not be cached, or None."""
    largest = sizes[-1]
    if len(sizes) == 1:
        return largest, f"one candidate, {rounds.load.describe()}", rounds.load, rounds.load.busy()
    per = {b: float(b * seq_len) for b in sizes}
    rival = min(sizes[:-1], key=lambda b: rounds.median_s(str(b), per[b]))
    v = rounds.verdict(
        str(rival), str(largest), margin=MEASURED_TIE, per_a=per[rival], per_b=per[largest], cpu_clock_decides=False
    )
    chosen = rival if v.winner == "a" else largest
    why = v.describe(str(rival), str(largest)) + ("" if v.winner or v.tie else ", so the largest")
    doubt = rounds.load.busy()
    if doubt is None and v.spread > paired.MAX_SPREAD:
        doubt = f"its pairs scatter by {v.spread:.0%} (more than {paired.MAX_SPREAD:.0%})"
    if doubt is None and v.winner is None and not v.tie:
        doubt = v.doubt()
    return chosen, why, rounds.load, doubt


_TOKEN_S: dict[tuple, float] = {}
"""Seconds per token of the fastest untimed call so far, by shape (model, dtype, threads), in this process: a
dry run at several world sizes (each its own candidates) calls a shape too large for the budget once."""


def rounds_estimate_s(call_s: float, at: int, sizes: list[int]) -> float:
    """The timed rounds' seconds, from one call at micro-batch `at`: each call costs its share of that one's
    tokens (an over-estimate where `at` is the smallest, or the first call, which also allocates: a CPU's
    throughput per token rises with the micro-batch, if at all)."""
    return call_s * PROBE_ROUNDS * sum(sizes) / at


def rounds_floor_s(cfg: ModelConfig, sizes: list[int], peak_flop_s: float) -> float:
    """The least the timed rounds could take: their training FLOPs at the CPU's matmul peak."""
    return PROBE_ROUNDS * sum(sizes) * cfg.block_size * flops_per_token(cfg) / peak_flop_s


def time_micro_batches(
    cfg: ModelConfig, prec: Precision, losses: dict[int, str], *, peak_flop_s: float | None = None
) -> paired.Rounds | paired.OverBudget:
    """resh model's forward + backward at each micro-batch of `losses`, with its loss path, in PROBE_ROUNDS
    rounds (paired.measure_rounds, each named by str(size)) after one untimed call at the smallest and one at
    the largest; or, where the rounds would outlast paired.PROBE_BUDGET_S, paired.OverBudget, known before any
    call from their FLOPs at peak_flop_s where given, else from an earlier call at this shape (_TOKEN_S), else
    from the untimed calls, each checked as soon as it returns (the smallest first: a shape too large for the
    budget costs one small call)."""
    from gpt2.model.gpt import GPT

    T, sizes = cfg.block_size, sorted(losses)
    if peak_flop_s:
        floor = rounds_floor_s(cfg, sizes, peak_flop_s)
        if floor > paired.PROBE_BUDGET_S:
            return paired.OverBudget(floor, f"at least ~{floor:.0f} s (their FLOPs at the CPU's matmul peak)")
    shape = (cfg, str(prec.torch_dtype), torch.get_num_threads())
    if shape in _TOKEN_S:  # another candidate set of a shape already called (a dry run's next world size)
        estimate = _TOKEN_S[shape] * T * PROBE_ROUNDS * sum(sizes)
        if estimate > paired.PROBE_BUDGET_S:
            return paired.OverBudget(estimate, f"~{estimate:.0f} s")
    gen = torch.Generator().manual_seed(0)
    torch_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = GPT(cfg)
    finally:
        torch.random.set_rng_state(torch_state)  # the run's own draws are not moved by the probe
    batches = {b: torch.randint(0, 50257, (2, b, T), generator=gen) for b in sizes}

    def micro_step(b: int):
        def run() -> None:
            x, y = batches[b]
            model.loss_impl = losses[b]  # a plain attribute, read at each forward (uncompiled)
            _, loss = model(x, y, return_logits=False)
            loss.backward()  # accumulating into .grad, as a step's micro-steps do

        return run

    with prec.autocast("cpu"):
        for b in dict.fromkeys((sizes[0], sizes[-1])):  # untimed: allocations, lazy initialisation, the gradients
            started = time.perf_counter()
            micro_step(b)()
            call_s = time.perf_counter() - started
            _TOKEN_S[shape] = min(_TOKEN_S.get(shape, float("inf")), call_s / (b * T))
            estimate = rounds_estimate_s(call_s, b, sizes)
            if estimate > paired.PROBE_BUDGET_S:
                return paired.OverBudget(estimate, f"~{estimate:.0f} s")
        return paired.measure_rounds({str(b): micro_step(b) for b in sizes}, PROBE_ROUNDS)
