"""Which of two ways is faster on this CPU, from interleaved, paired timings: the one rule by which the
start-up's probes decide (--dtype auto's bf16 against fp32, --loss-impl auto's full against chunked loss,
--micro-batch-size auto's candidates), and what makes such a measurement too doubtful to cache.

Why pairs and not "the best of N of each": on a shared machine another process takes the cores for a
while and gives them back. A best-of-N per way lets one lucky window decide: issue 73's fp32 probes were
17.7, 15.9, 15.7, 184.4 and 4.9 GFLOP/s beside bf16's 41.5-64.3 (load average 7.7 on 2 cores), so "the
best of five" said fp32 was faster, cached it, and every later run trained in the slower dtype. Timed
A, B, B, A, A, B, ... instead, each pair sees the same load, the ratio of the medians ignores the lucky
and the unlucky readings alike, and a decision needs most pairs to point the same way (AGREE_SHARE).

Which clock: the wall clock where this process had its cores; where its threads spent more than
MAX_WAIT_SHARE of their time waiting for a CPU (Linux's schedstat run_delay: runnable, not running), the
process's own CPU time, which counts what ran and not the waits (measured on 2 cores at load 5.5: bf16
and fp32 matmul rates by the wall clock fell 4x over a minute while by CPU time they moved 10%, their
ratio 2.1-2.7 by either). That holds for one large kernel a call (the matmul probes), not for a call of
many small ones: each one's worker threads wait for each other at its end, spinning on a CPU while a
descheduled peer is away, and that spin is CPU time. Under a competing load the chunked loss (a loop of
chunks) read slower than the full one in 10 of 10 trials where quiet trials took it in 9 of 10 (issue 73,
docs/training.md). So a comparison of many-kernel calls (the loss paths, the micro-batches) decides
nothing by the CPU clock (`cpu_clock_decides=False`): the caller's rule does, and nothing is cached.

What is never cached (`Comparison.doubt`): a measurement under a load average above the CPUs this process
may use or with its threads waiting for a CPU, one whose pairs scatter (SPREAD), and one that did not
decide (a tie: the ratio within the margin; or a disagreement: too few pairs agree). The caller then
falls back to a rule that needs no measurement and says so, and measures again at the next start. A
cached decision is measured again on every RECHECK_RUNS-th start that reads it (the first quiet one from then).
"""

from __future__ import annotations

import glob
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

AGREE_SHARE = 0.8
"""A decision needs at least this share of the pairs to point the way the ratio of the medians does, each
by more than the margin on its own (4 of 5, 5 of 6). Counting a pair that points the right way by less
would let a true ratio at the margin decide either way from run to run (issue 73's bench: the loss paths
at 1.05-1.20x against an 11% margin went full in 5 quiet trials and chunked in 5); beyond it on its own,
such a ratio is a tie in most runs and the rule decides, the same way every time."""
MAX_SPREAD = 0.15
"""A measurement whose pairs' ratios lie further than this (as a fraction, the median deviation from
their median) is not cached: quiet, a CPU's matmul or forward-and-backward repeats within a few percent."""
MAX_WAIT_SHARE = 0.10
"""Above this share of its threads' time spent waiting for a CPU, a measurement was contended: it is
decided by CPU time and not cached."""
RECHECK_RUNS = 10
"""A cached decision is measured again on every RECHECK_RUNS-th start that reads it, or the first quiet start
after (quiet_now: a re-check under load would only be doubtful; the new one replaces it where it may be cached;
a doubtful re-check keeps the cached one)."""


PROBE_BUDGET_S = 30.0
"""The longest a probe's timed rounds may take (gpt2/plan/batch_probe.py, loss_probe.py): past it the probe
times nothing and the run takes the choice it makes without a measurement (a dry run of the gpt2 preset on a
2-core CPU spent 130 s in the micro-batch probe; the debug preset's rounds take ~1 s)."""


@dataclass(frozen=True)
class OverBudget:
    """A probe's timed rounds would outlast PROBE_BUDGET_S: what it returns instead of them."""

    seconds: float
    how: str
    """'~130 s' (from an untimed call) or 'at least ~200 s (their FLOPs at the CPU's matmul peak)'."""


@dataclass(frozen=True)
class Load:
    """What else ran while a measurement did."""

    load_average: float | None
    """The 1-minute load average, the larger of its readings before and after (None off Unix)."""
    cores: int
    """CPUs this process may run on (its affinity mask)."""
    wait_share: float | None = None
    """The share of this process's threads' time (wall time x threads) spent runnable but waiting for a
    CPU (Linux schedstat); None where it cannot be read."""

    @property
    def contended(self) -> bool:
        """Its threads waited for a CPU more than MAX_WAIT_SHARE of the time: CPU time decides."""
        return self.wait_share is not None and self.wait_share > MAX_WAIT_SHARE

    def busy(self) -> str | None:
        """Why a measurement under this load may not be cached, or None."""
        if self.load_average is not None and self.load_average > self.cores:
            return f"load average {self.load_average:.1f} above the {self.cores} CPU(s)"
        if self.contended:
            return f"its threads waited for a CPU {self.wait_share:.0%} of the time"
        return None

    def describe(self) -> str:
        """'load 0.4 on 2 cores' (and the waits where there were any)."""
        avg = "n/a" if self.load_average is None else f"{self.load_average:.1f}"
        waits = f", {self.wait_share:.0%} of the time waiting for a CPU" if self.wait_share else ""
        return f"load {avg} on {self.cores} CPU(s){waits}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Load:
        return cls(d["load_average"], int(d["cores"]), d.get("wait_share"))


@dataclass(frozen=True)
class Comparison:
    """Which of A and B was faster, and how sure: the paired comparison's result."""

    winner: str | None
    """'a' or 'b' when the pairs decided; None for a tie or a disagreement."""
    ratio: float
    """How many times A's speed B's is: the median of B's times over the median of A's (> 1: A faster)."""
    agree: int
    """Pairs whose own ratio points the way `ratio` does by more than the margin (AGREE_SHARE)."""
    pairs: int
    spread: float
    """The pairs' median deviation from their median ratio, as a fraction."""
    margin: float
    """A ratio within 1 + margin either way is a tie."""
    clock: str
    """'wall' or 'cpu' (the process's CPU time, where the measurement was contended)."""
    load: Load
    undecided: str = ""
    """Why the pairs decide nothing although they agree (a many-kernel comparison by the CPU clock); '' else."""

    @property
    def tie(self) -> bool:
        return abs(math.log(self.ratio)) < math.log1p(self.margin)

    @property
    def needed(self) -> int:
        """Pairs that must agree for a decision."""
        return math.ceil(AGREE_SHARE * self.pairs - 1e-9)

    def doubt(self) -> str | None:
        """Why this measurement may not be cached, or None."""
        if busy := self.load.busy():
            return busy
        if self.spread > MAX_SPREAD:
            return f"its pairs scatter by {self.spread:.0%} (more than {MAX_SPREAD:.0%})"
        if self.tie:
            return f"a tie (within {self.margin:.0%})"
        if self.undecided:
            return f"undecided {self.undecided}"
        if self.winner is None:
            return f"only {self.agree} of {self.pairs} pairs agree ({self.needed} needed)"
        return None

    def describe(self, a: str, b: str) -> str:
        """'bf16 2.40x fp32's speed, 5 of 5 pairs agree (wall clock), load 0.4 on 2 CPU(s)'."""
        fast, slow, r = (a, b, self.ratio) if self.ratio >= 1 else (b, a, 1 / self.ratio)
        verdict = f"{fast} {r:.2f}x {slow}'s speed, {self.agree} of {self.pairs} pairs agree"
        if self.tie:
            verdict += f", within the {self.margin:.0%} tie"
        elif self.undecided:
            verdict += f" (undecided: {self.undecided})"
        elif self.winner is None:
            verdict += f" ({self.needed} needed: undecided)"
        return f"{verdict} ({self.clock} clock), {self.load.describe()}"

    def to_dict(self) -> dict:
        return {**asdict(self), "load": self.load.to_dict()}

    @classmethod
    def from_dict(cls, d: dict) -> Comparison:
        fields = ("winner", "ratio", "agree", "pairs", "spread", "margin", "clock")
        return cls(**{k: d[k] for k in fields}, load=Load.from_dict(d["load"]), undecided=d.get("undecided", ""))


CPU_CLOCK_UNDECIDED = "by the CPU clock, which counts a many-kernel call's spinning threads"
"""What a comparison says when the CPU clock may not decide it (the module docstring)."""


def compare(
    pairs: list[tuple[float, float]],
    *,
    load: Load,
    margin: float,
    clock: str = "wall",
    cpu_clock_decides: bool = True,
) -> Comparison:
    """The verdict on (a_seconds, b_seconds) pairs, each pair timed back to back: A wins when the ratio of
    the medians (B's over A's) is beyond 1 + margin and at least AGREE_SHARE of the pairs say A was faster
    by more than the margin too;
    B likewise; otherwise None (a tie, or a disagreement; or, by the CPU clock where cpu_clock_decides is
    False, undecided whatever the pairs say). A pure function."""
    if not pairs or any(a <= 0 or b <= 0 for a, b in pairs):
        raise ValueError(f"pairs must be non-empty positive seconds, got {pairs}")
    ratio = statistics.median(b for _, b in pairs) / statistics.median(a for a, _ in pairs)
    own = [b / a for a, b in pairs]
    beyond = 1 + margin
    agree = sum(r > beyond for r in own) if ratio >= 1 else sum(r * beyond < 1 for r in own)
    v = Comparison(None, ratio, agree, len(pairs), spread(own), margin, clock, load)
    if not v.tie and agree >= v.needed and clock == "cpu" and not cpu_clock_decides:
        return Comparison(None, ratio, agree, len(pairs), v.spread, margin, clock, load, CPU_CLOCK_UNDECIDED)
    if not v.tie and agree >= v.needed:
        return Comparison("a" if ratio > 1 else "b", ratio, agree, len(pairs), v.spread, margin, clock, load)
    return v


def spread(values: list[float]) -> float:
    """How far positive values scatter: their median deviation from their median, in log terms, as a
    fraction (0.1: a typical value is 10% off the median). One outlier among five does not move it."""
    logs = [math.log(v) for v in values]
    centre = statistics.median(logs)
    return math.expm1(statistics.median(abs(x - centre) for x in logs))


@dataclass(frozen=True)
class Timing:
    """One timed call."""

    wall_s: float
    cpu_s: float
    """This process's CPU time (all threads) over the call, divided by the threads it ran on: comparable
    with the wall time when it had its cores."""


class Clock:
    """The clocks and the load of this machine. Tests pass a fake with the same methods."""

    def time(self, name: str, fn: Callable[[], object]) -> Timing:
        """Run fn and time it; a fn that returns a Timing times itself (a matmul probe's best call)."""
        threads = self.threads()
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        if isinstance(out, Timing):
            return out
        return Timing(time.perf_counter() - w0, (time.process_time() - c0) / threads)

    def threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def waited_s(self) -> float | None:
        """Seconds this process's threads have spent runnable but waiting for a CPU (schedstat run_delay)."""
        paths = glob.glob(f"/proc/{os.getpid()}/task/*/schedstat")
        if not paths:
            return None
        total = 0
        for path in paths:
            try:
                with open(path) as f:
                    total += int(f.read().split()[1])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended between the listing and the read
        return total / 1e9

    def load_average(self) -> float | None:
        return os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def cores(self) -> int:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def monotonic(self) -> float:
        return time.perf_counter()


CLOCK = Clock()
"""The clock every probe measures with (tests replace it with a fake)."""


def quiet_now(clock: Clock | None = None) -> bool:
    """Whether a measurement now could be cached as far as the load average says: at most the CPUs this process
    may use (where it cannot be read, yes: the measurement's own checks still apply)."""
    clock = clock or CLOCK
    load = clock.load_average()
    return load is None or load <= clock.cores()


@dataclass(frozen=True)
class Rounds:
    """Several ways timed in rounds, each round every way once: what measure_rounds returns."""

    times: dict[str, list[Timing]]
    load: Load

    @property
    def clock(self) -> str:
        return "cpu" if self.load.contended else "wall"

    def seconds(self, name: str, per: float = 1.0) -> list[float]:
        """name's times on the deciding clock, per unit of work."""
        return [(t.cpu_s if self.clock == "cpu" else t.wall_s) / per for t in self.times[name]]

    def verdict(
        self,
        a: str,
        b: str,
        *,
        margin: float,
        per_a: float = 1.0,
        per_b: float = 1.0,
        cpu_clock_decides: bool = True,
    ) -> Comparison:
        """a against b, paired by round, per unit of work (per_a, per_b: each call's tokens, FLOPs).
        cpu_clock_decides: False for calls of many kernels (the module docstring)."""
        pairs = list(zip(self.seconds(a, per_a), self.seconds(b, per_b)))
        return compare(pairs, load=self.load, margin=margin, clock=self.clock, cpu_clock_decides=cpu_clock_decides)

    def median_s(self, name: str, per: float = 1.0) -> float:
        return statistics.median(self.seconds(name, per))


def measure_rounds(fns: dict[str, Callable[[], object]], rounds: int, *, clock: Clock | None = None) -> Rounds:
    """Each of fns timed once a round for `rounds` rounds, the order reversed every other round (A, B, B,
    A, ...: a load that rises or falls during the measurement falls on both alike), with the load around it."""
    clock = clock or CLOCK
    names = list(fns)
    before_avg, waited0, start = clock.load_average(), clock.waited_s(), clock.monotonic()
    times: dict[str, list[Timing]] = {n: [] for n in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(clock.time(name, fns[name]))
    elapsed, waited1, after_avg = clock.monotonic() - start, clock.waited_s(), clock.load_average()
    share = None
    if waited0 is not None and waited1 is not None and elapsed > 0:
        share = max(0.0, waited1 - waited0) / (elapsed * clock.threads())
    avgs = [x for x in (before_avg, after_avg) if x is not None]
    return Rounds(times, Load(max(avgs) if avgs else None, clock.cores(), share))
