"""Scoring a model, for the trainer and for `python -m gpt2.eval`: the mean loss over an evaluation
loader, and HellaSwag accuracy.

A library: it loads nothing (no checkpoint, no Hugging Face conversion, no download: those belong to
gpt2/ckpt/load.py, gpt2/data/hellaswag.py and the CLI in gpt2/eval.py), so training imports only what it runs.

HellaSwag is scored completion-style, as in the GPT-2/GPT-3 papers and build-nanogpt: each of the
4 endings is appended to the context (" " + ending, so the ending starts a new word) and the model's
log-likelihood of the ending tokens alone is summed. acc takes the ending with the largest sum,
acc_norm the largest mean per token (which does not favour short endings). On the 10,042
validation examples, OpenAI's GPT-2 124M gets acc_norm 0.2955 and GPT-2 XL (1.5B) 0.4893.

Under torchrun, rank r scores examples r, r+W, r+2W, ...; each example is computed exactly as on one
rank (same rows, same padding), so the counts summed over ranks do not depend on the world size.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from gpt2.core.config import EOT_TOKEN
from gpt2.core.precision import FLOAT32, Precision
from gpt2.data.hellaswag import N_ENDINGS, Example
from gpt2.distributed.group import Dist, all_reduce_sum
from gpt2.model.gpt import GPT, unwrap
from gpt2.model.tokenizer import encode


@torch.no_grad()
def loader_loss(model: torch.nn.Module, loader, prec: Precision, dist: Dist, *, progress: bool = False) -> float:
    """Mean loss per token over an EvalLoader's fixed set, reduced over ranks (the trainer's evaluation).

    Runs the model (plain, compiled or DDP-wrapped: DDP's own wrapper is skipped) in eval mode and
    puts it back in the mode it was in. Padded rows of a short last batch have targets -1 and do not count.
    progress: a bar of rank 0's batches on stderr (`python -m gpt2.eval loss`: minutes on a CPU are not silent).
    """
    model = getattr(model, "module", model)  # DDP: no gradient hooks, no buffer sync for an evaluation
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, device=dist.device, dtype=torch.float64)
    try:
        with prec.autocast(dist.device):
            batches = (
                loader
                if not (progress and dist.is_main)
                else _progress(
                    loader,
                    enabled=True,
                    total=len(loader),
                    unit="batch",
                    desc=f"val loss, {loader.tokens:,} tokens (rank 0 of {dist.world_size})",
                )
            )
            for x, y in batches:
                _, loss = model(x, y, return_logits=False)
                n = (y != -1).sum()
                # A batch of padding only (a rank with one sequence fewer, see EvalLoader) has a NaN
                # mean loss over no tokens: it adds nothing (torch.where, no host sync).
                totals += torch.stack([torch.where(n > 0, loss.double() * n, 0.0), n.double()])
    finally:
        model.train(was_training)
    all_reduce_sum(totals, dist)
    return (totals[0] / totals[1]).item()


def example_rows(ex: Example, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(4, T) token rows context+ending, right-padded, and a (4, T) mask of the ending tokens.

    A row longer than block_size loses tokens from the start of its context (the ending is what is
    scored); an ending that leaves no context token to predict its first token is an error.
    """
    ctx = encode(ex.ctx) or [EOT_TOKEN]  # an empty context still needs a token to predict the ending from
    rows, masks = [], []
    for ending in ex.endings:
        end = encode(" " + ending)  # GPT-2's BPE attaches the space to the following word
        if len(end) + 1 > block_size:
            raise ValueError(f"an ending of {len(end)} tokens does not fit block_size={block_size} with context")
        row = (ctx + end)[-block_size:]
        rows.append(row)
        masks.append([0] * (len(row) - len(end)) + [1] * len(end))
    width = max(len(r) for r in rows)
    tokens = torch.zeros(N_ENDINGS, width, dtype=torch.long)
    mask = torch.zeros(N_ENDINGS, width, dtype=torch.bool)
    for i, (row, m) in enumerate(zip(rows, masks)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return tokens, mask


@torch.no_grad()
def score_endings(model: GPT, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum and mean log-likelihood of the masked (ending) tokens of each row: two (4,) tensors."""
    logits, _ = model(tokens)
    # The logit at position t predicts token t+1: score positions 1.. with the logits before them.
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    token_logp = logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    m = mask[:, 1:].float()
    total = (token_logp * m).sum(dim=1)
    return total, total / m.sum(dim=1)


def hellaswag_eval(
    model: GPT,
    examples: list[Example],
    dist: Dist,
    device: torch.device,
    *,
    prec: Precision = FLOAT32,
    progress: bool = True,
) -> dict:
    """acc and acc_norm over examples, this rank scoring examples rank, rank+W, ...; counts all-reduced.

    Collective under torchrun (every rank must call it). Pass the plain or DDP/compiled model: it is
    unwrapped, run in eval mode and put back in its previous mode. Returns acc, acc_norm, correct,
    correct_norm and n (the number of examples).
    """
    if not examples:
        raise ValueError("no HellaSwag examples to evaluate")
    model = unwrap(model)
    was_training = model.training
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # correct, correct_norm, n
    share = rank_share(len(examples), dist)
    bar = _progress(
        share,
        enabled=progress and dist.is_main,
        total=len(share),
        unit="ex",
        desc=f"hellaswag (rank 0 of {dist.world_size})",
    )
    try:
        with prec.autocast(device):
            for i, counted in bar:
                ex = examples[i]
                tokens, mask = example_rows(ex, model.config.block_size)
                total, mean = score_endings(model, tokens.to(device), mask.to(device))
                if counted:  # compared and counted on the device: no host round trip per example
                    counts += torch.stack(
                        [
                            total.argmax() == ex.label,
                            mean.argmax() == ex.label,
                            torch.ones((), dtype=torch.bool, device=device),
                        ]
                    ).double()
    finally:
        model.train(was_training)
    correct, correct_norm, n = (int(v) for v in all_reduce_sum(counts, dist).tolist())
    return {"acc": correct / n, "acc_norm": correct_norm / n, "correct": correct, "correct_norm": correct_norm, "n": n}


def rank_share(n: int, dist: Dist) -> list[tuple[int, bool]]:
    """(example index, counted) for this rank: examples rank, rank+W, ..., then, on the ranks that
    have one fewer, one more forward of example 0 that is not counted. Every rank runs the same
    number of forwards: under FSDP each forward is a collective (its blocks all-gather weights), and
    a rank that stopped one example early would leave the others waiting in their last gather."""
    mine = [(i, True) for i in range(dist.rank, n, dist.world_size)]
    rounds = -(-n // dist.world_size)
    return mine + [(0, False)] * (rounds - len(mine))


def _progress(items, *, enabled: bool, total: int, unit: str, desc: str):
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, mininterval=1.0)
