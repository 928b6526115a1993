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
alternating, on the run's micro-batch of tokens (at most PROBE_MAX_TOKENS) and in its dtype.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt2.core import host_memory
from gpt2.core.precision import Precision
from gpt2.model.loss import linear_cross_entropy
from gpt2.plan import matmul_peak

PROBE_MAX_TOKENS = 512
"""The probe's tokens at most (a run's micro-batch of tokens above it is timed at this many): eager's full
loss holds ~12 bytes per logit, 3.3 GiB at 32 x 128 tokens of GPT-2's vocabulary, a resident peak far above
a small run's own (issue 58: a first run of a new shape peaked at 3,516 MiB against a 357 MiB plan). At
512 tokens it is ~0.3 GiB, below the smallest run's own; both paths' times grow linearly in the tokens
past a few hundred (each is matmuls over the rows and passes over the logits), so the choice is the same."""

PROBE_ROUNDS = 2
"""Timed calls of each path (after one untimed call each), alternating; each path's time is its fastest."""

FULL_MARGIN = 0.9
"""auto takes the full loss uncompiled only when it measured at most this fraction of the chunked
loss's time: near a tie the chunked loss, which holds less memory, stays, and a probe's noise does not
flip a shape's choice from one run to the next."""


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

    @property
    def full_is_faster(self) -> bool:
        return self.full_s <= FULL_MARGIN * self.chunked_s

    def describe(self) -> str:
        return (
            f"measured at this shape: full {self.full_s * 1e3:,.0f} ms vs chunked "
            f"{self.chunked_s * 1e3:,.0f} ms per micro-step's LM head + loss (cached in {self.cache})"
        )


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
    device: str, prec: Precision, tokens: int, n_embd: int, vocab_size: int, *, refresh: bool | None = None
) -> EagerLossTimes:
    """Both paths' times at this shape on this CPU, from the cache or measured (then cached atomically).
    refresh=None reads matmul_peak.REFRESH_PEAK_ENV, as the matmul peaks do."""
    tokens = min(tokens, PROBE_MAX_TOKENS)
    key = loss_probe_key(device, prec, tokens, n_embd, vocab_size)
    path = loss_probe_path(key)
    if refresh is None:
        refresh = matmul_peak.refresh_requested()
    entry = None if refresh else matmul_peak.read_cache_entry(path, key)
    peak = None
    if entry is None or not all(isinstance(entry.get(k), float) and entry[k] > 0 for k in ("full_s", "chunked_s")):
        before, high = host_memory.resident_bytes(), host_memory.resident_peak_bytes()
        full_s, chunked_s = time_loss_paths(device, prec, tokens, n_embd, vocab_size)
        after = host_memory.resident_peak_bytes()
        if None not in (before, high, after):  # what it raised the process's peak to, above what it held
            peak = after - before if after > high else 0
        entry = {"full_s": full_s, "chunked_s": chunked_s}
        matmul_peak.write_cache_entry(path, key, entry)
    return EagerLossTimes(entry["full_s"], entry["chunked_s"], str(path), peak)


def time_loss_paths(device: str, prec: Precision, tokens: int, n_embd: int, vocab_size: int) -> tuple[float, float]:
    """(full, chunked) seconds: GPT.forward's two loss paths on random activations and a GPT-2-scale
    weight, under the run's autocast, the padded vocabulary rows masked as the model masks them."""
    from gpt2.model.gpt import GPT2_VOCAB_SIZE

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, n_embd, generator=gen).to(device).requires_grad_()
    weight = (0.02 * torch.randn(vocab_size, n_embd, generator=gen)).to(device).requires_grad_()
    bias = None
    if vocab_size > GPT2_VOCAB_SIZE:
        bias = torch.zeros(vocab_size, device=device)
        bias[GPT2_VOCAB_SIZE:] = float("-inf")
    targets = torch.randint(0, min(vocab_size, GPT2_VOCAB_SIZE), (tokens,), generator=gen).to(device)

    def full() -> None:
        logits = F.linear(x, weight, bias)
        F.cross_entropy(logits.float(), targets, ignore_index=-1).backward()

    def chunked() -> None:
        linear_cross_entropy(x, weight, bias, targets).backward()

    paths = {"full": full, "chunked": chunked}
    best = {name: float("inf") for name in paths}
    with prec.autocast(device):
        for i in range(1 + PROBE_ROUNDS):
            for name in list(paths) if i % 2 == 0 else list(paths)[::-1]:
                x.grad = weight.grad = None
                t0 = time.perf_counter()
                paths[name]()
                if i:  # the first round is untimed: allocations, lazy initialisation
                    best[name] = min(best[name], time.perf_counter() - t0)
    return best["full"], best["chunked"]
