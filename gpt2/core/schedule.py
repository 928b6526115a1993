"""Pure functions for the learning-rate schedule and batch maths."""

from __future__ import annotations

import math
from dataclasses import dataclass


def lr_at(step: int, *, max_lr: float, min_lr: float, warmup_steps: int, max_steps: int, decay_steps: int = 0) -> float:
    """Linear warmup to max_lr over warmup_steps, then cosine decay to min_lr at max_steps; or, with
    decay_steps > 0, warmup-stable-decay: max_lr until max_steps - decay_steps, then linear to min_lr.

    step counts from 0. Warmup reaches max_lr at step warmup_steps-1, decay starts from max_lr at
    warmup_steps (WSD: at max_steps - decay_steps), so the curve is continuous; past max_steps the
    rate stays at min_lr.
    """
    if step < warmup_steps:
        return max_lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    if decay_steps:  # WSD: a high lr for longer, then a short anneal (the loss drops most there)
        start = max(warmup_steps, max_steps - decay_steps)
        if step < start:
            return max_lr
        return max_lr + (min_lr - max_lr) * (step - start) / max(1, max_steps - start)
    ratio = (step - warmup_steps) / max(1, max_steps - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (max_lr - min_lr)


def momentum_at(step: int, *, start: float, end: float, warmup_steps: int) -> float:
    """Muon's momentum for step (from 0): linear from start at step 0 to end at warmup_steps, then end; end
    throughout without a warmup. modded-nanogpt's (its record of 2024-11-06: 0.85 to 0.95 over 500 steps):
    a short memory while the early gradients change fast, the long one after."""
    if warmup_steps <= 0:
        return end
    frac = min(step / warmup_steps, 1.0)
    return (1 - frac) * start + frac * end


def grad_accum_steps(total_tokens: int, micro_batch: int, seq_len: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that all ranks together see total_tokens per step."""
    per_step = micro_batch * seq_len * world_size
    if total_tokens < seq_len * world_size:  # e.g. 524,288 tokens over 1024 ranks of 1024-token sequences
        most = total_tokens // seq_len
        raise ValueError(
            f"total_batch_size={total_tokens} is less than one sequence per rank (block_size*world_size = "
            f"{seq_len}*{world_size} = {seq_len * world_size}); raise --total-batch-size to a multiple of "
            f"{seq_len * world_size}" + (f", or use at most {most} ranks" if most else "")
        )
    if total_tokens % per_step:
        raise ValueError(
            f"total_batch_size={total_tokens} is not a multiple of micro_batch_size*block_size*world_size"
            f" = {micro_batch}*{seq_len}*{world_size} = {per_step}; sizes that would divide: "
            + dividing_sizes(total_tokens, micro_batch, seq_len, world_size)
        )
    return total_tokens // per_step


@dataclass(frozen=True)
class BatchLayout:
    """One optimizer step's tokens across the ranks: micro_batch_size sequences of seq_len tokens in each
    micro-step of each of world_size ranks, total_batch_size tokens in all."""

    micro_batch_size: int
    seq_len: int
    total_batch_size: int
    world_size: int = 1

    @property
    def accum_steps(self) -> int:
        """Micro-steps per optimizer step (grad_accum_steps: a ValueError naming the fix when they do not divide)."""
        return grad_accum_steps(self.total_batch_size, self.micro_batch_size, self.seq_len, self.world_size)


def dividing_sizes(total_tokens: int, micro_batch: int, seq_len: int, world_size: int) -> str:
    """The nearest --total-batch-size values that divide, and the largest smaller --micro-batch-size values.

    There is always a total that works (a multiple of per_step), so the message is never empty; a
    micro-batch only exists when total_tokens is a multiple of block_size * world_size.
    """
    per_step = micro_batch * seq_len * world_size
    below, above = (total_tokens // per_step) * per_step, (total_tokens // per_step + 1) * per_step
    totals = " or ".join(str(t) for t in (below, above) if t > 0)
    micro = [m for m in range(1, micro_batch) if total_tokens % (m * seq_len * world_size) == 0]
    if micro:
        sizes = ", ".join(map(str, micro[-4:]))
        return f"--total-batch-size {totals} (multiples of {per_step}), or --micro-batch-size {sizes}"
    return (
        f"--total-batch-size {totals} (multiples of {per_step}); no smaller --micro-batch-size would, as "
        f"{total_tokens} is not a multiple of block_size*world_size = {seq_len * world_size}"
    )


def batch_tokens_at(step: int, *, total: int, warmup_steps: int, stages: int) -> int:
    """Tokens optimizer step `step` (from 0) takes under --batch-warmup-steps: in stage j of `stages` equal
    stretches of the first warmup_steps steps (j = step * stages // warmup_steps), (j + 1) / (stages + 1) of
    total; total from warmup_steps on, and throughout without a warmup. modded-nanogpt's record of
    2026-07-17 grows its batch in thirds over its run (8, 16, 24 x 2048 x 8 tokens): small, cheap steps
    while the early gradients point the same way, the whole batch once they need averaging. total is a
    multiple of stages + 1 (BatchConfig checks it), so every stage is a whole number of tokens."""
    if step >= warmup_steps:
        return total
    return total * (step * stages // warmup_steps + 1) // (stages + 1)


def tokens_before(step: int, *, total: int, warmup_steps: int, stages: int) -> int:
    """Tokens steps 0 .. step - 1 take (batch_tokens_at summed), in O(stages): stage j holds the steps s
    with j * warmup_steps <= s * stages < (j + 1) * warmup_steps."""
    done, warm = 0, min(step, warmup_steps)
    for j in range(stages if warm else 0):
        first = -(-j * warmup_steps // stages)  # ceil(j * warmup_steps / stages)
        end = min(warm, -(-(j + 1) * warmup_steps // stages))
        if end > first:
            done += (end - first) * (total * (j + 1) // (stages + 1))
    return done + (step - warm) * total


def warmup_micro_steps(accum_steps: int, tokens: int, total: int) -> int:
    """Micro-steps per rank of a step that takes `tokens` of the total's: its prefix of the layout (micro-step
    m of rank r reads global rows (m * world + r) * B ...: the first k micro-steps of every rank are the
    global batch's first k * world * B rows, whatever the world size). A ValueError when it is not whole."""
    k, rest = divmod(accum_steps * tokens, total)
    if rest or k < 1:
        raise ValueError(f"a step of {tokens} tokens is not a whole number of the {accum_steps} micro-steps of {total}")
    return k


def batch_warmup_problem(total_tokens: int, micro_batch: int, seq_len: int, world_size: int, stages: int) -> str:
    """Why --batch-warmup-stages cannot step this layout's batch in whole micro-steps ("" when it can): its
    smallest stage, total_tokens / (stages + 1), must itself be micro_batch sequences on every rank, k times."""
    parts, accum = stages + 1, grad_accum_steps(total_tokens, micro_batch, seq_len, world_size)
    if accum % parts == 0:
        return ""
    seqs = total_tokens // (seq_len * world_size)  # sequences per rank per step
    sizes = [b for b in range(1, micro_batch) if seqs % b == 0 and (seqs // b) % parts == 0]
    alts = [d - 1 for d in range(2, accum + 1) if accum % d == 0]
    fixes = [f"--micro-batch-size {' or '.join(map(str, sizes[-3:]))}"] if sizes else []
    fixes += [f"--batch-warmup-stages {' or '.join(map(str, alts[:3]))}"] if alts else []
    return (
        f"--batch-warmup-stages {stages} steps the batch by 1/{parts} of it, whole micro-steps each, but a step is "
        f"{accum} micro-step(s) per rank (micro_batch_size={micro_batch}, {world_size} rank(s)), which does not "
        f"divide by {parts}: pass " + (" or ".join(fixes) if fixes else "a larger --total-batch-size")
    )
